"""One DCP item (a ``torch.save`` ZIP record inside a ``.distcp`` file), read by byte ranges.

Instead of loading items whole (DCP's own reader does), the item's central
directory, its small ``data.pkl`` (read with an allow-list unpickler that builds no
tensor) and the storage record's local header are fetched with small range reads;
the tensor's raw bytes then have an exact file address (``locate_tensor``) and any
slice of a chunk is a range read. Small reads of neighbouring items are coalesced
(``RangeCache``): an item's tail and the next item's head are one request, so
locating N items costs about N requests of a few KiB. Non-tensor items are read
whole and unpickled with builtins only (``read_value``).
"""

from __future__ import annotations

import bisect
import io
import math
import struct
import zipfile
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..core import dtypes
from ..core.manifest import Shard
from ..errors import CheckpointError, CorruptCheckpointError
from ..storage import RangeRead, Storage
from .dcpmeta import _CODES, DcpMetadata, DcpTensor, ItemInfo, _inert_size, _nonneg, _size
from .safepickle import Inert, safe_unpickle
from .zipdir import central_directory

MAX_PICKLE_BYTES = 1 << 20  # an item's data.pkl: a few hundred bytes in practice
MAX_VALUE_ITEM_BYTES = 16 << 20  # non-tensor entries larger than this are not restored
HEAD_BYTES = 2048  # local headers and data.pkl up to the storage record (~700 bytes as torch 2.x writes items)
TAIL_BYTES = 2048  # the last records, the central directory and the end records (~900 bytes)
MAX_GAP = 64 << 10  # coalesce locating reads closer than this
MAX_WINDOW = 8 << 20


# ------------------------------------------------------------- item data.pkl


@dataclass(frozen=True, slots=True)
class _StorageRef:
    key: str
    dtype: torch.dtype | None  # None: an UntypedStorage (bytes); the tensor carries the dtype
    numel: int


@dataclass(frozen=True, slots=True)
class TensorRef:
    """What an item's data.pkl says: which storage record, where, what shape."""

    storage_key: str
    storage_numel: int  # in elements of ``dtype``
    dtype: torch.dtype
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


class _StorageType(Inert):
    """A storage class named in a data.pkl; ``value`` is its dtype (None: untyped bytes)."""

    __slots__ = ()


_LEGACY_STORAGES = {
    "DoubleStorage": torch.float64, "FloatStorage": torch.float32, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool, "ComplexFloatStorage": torch.complex64, "ComplexDoubleStorage": torch.complex128,
}


def _rebuild_v2(storage: Any, storage_offset: Any, size: Any, stride: Any, *_rest: Any) -> "_Rebuilt":
    return _Rebuilt(storage, storage_offset, size, stride, None)


def _rebuild_v3(storage: Any, storage_offset: Any, size: Any, stride: Any, _rg: Any, _hooks: Any,
                dtype: Any, *_rest: Any) -> "_Rebuilt":
    return _Rebuilt(storage, storage_offset, size, stride, dtype)


@dataclass(frozen=True, slots=True)
class _Rebuilt:
    storage: Any
    storage_offset: Any
    size: Any
    stride: Any
    dtype: Any


_ITEM_GLOBALS: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): Inert(_rebuild_v2),
    ("torch._utils", "_rebuild_tensor_v3"): Inert(_rebuild_v3),
    ("torch.storage", "UntypedStorage"): _StorageType(value=None),
    ("collections", "OrderedDict"): dict,
    ("torch", "Size"): _inert_size,
    **{("torch", n): _StorageType(value=dt) for n, dt in _LEGACY_STORAGES.items()},
}

def _latin1(text: Any, encoding: Any = "latin1") -> bytes:
    """Protocol-2 pickles spell ``bytes`` as ``_codecs.encode(text, "latin1")``."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise TypeError("only _codecs.encode(str, 'latin1') is allowed")
    return text.encode("latin1")


_VALUE_GLOBALS: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): dict,
    ("_codecs", "encode"): Inert(_latin1),
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("__builtin__", "set"): set,  # protocol-2 pickles spell builtins the Python 2 way
    ("__builtin__", "frozenset"): frozenset,
}


def _storage_pid(where: str) -> Callable[[Any], _StorageRef]:
    def load(pid: Any) -> _StorageRef:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise CorruptCheckpointError(f"{where}: unexpected persistent id {pid!r:.80}")
        _, stype, key, _location, numel = pid
        if not isinstance(stype, _StorageType) or not isinstance(key, str) or not _nonneg(numel):
            raise CorruptCheckpointError(f"{where}: malformed storage reference {pid!r:.80}")
        return _StorageRef(key, stype.value, numel)
    return load


def parse_tensor_pickle(data: bytes, *, where: str) -> TensorRef:
    """Read a ``torch.save``'d tensor's data.pkl without building a tensor."""
    r = safe_unpickle(data, allowed=_ITEM_GLOBALS, where=where, persistent=_storage_pid(where))
    if not isinstance(r, _Rebuilt) or not isinstance(r.storage, _StorageRef):
        raise CorruptCheckpointError(f"{where}: the item is not a single plain tensor")
    st = r.storage
    dtype = st.dtype if st.dtype is not None else r.dtype
    if not isinstance(dtype, torch.dtype):
        raise CorruptCheckpointError(f"{where}: the item's tensor has no dtype")
    numel = st.numel if st.dtype is not None else st.numel // max(1, dtype.itemsize)
    try:
        size, stride = _size(r.size), _size(r.stride)
    except TypeError:
        raise CorruptCheckpointError(f"{where}: malformed size/stride in the item") from None
    if not _nonneg(r.storage_offset) or len(size) != len(stride):
        raise CorruptCheckpointError(f"{where}: malformed storage offset or stride in the item")
    return TensorRef(st.key, numel, dtype, r.storage_offset, size, stride)


def is_row_major(size: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    expected = 1
    for d, s in zip(reversed(size), reversed(stride)):
        if d != 1 and s != expected:
            return False
        expected *= d
    return True


# -------------------------------------------------------- ranged item access


class RangeCache:
    """Bytes of a few windows of several files, fetched in one concurrent batch;
    a request outside them costs one more range read."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self._starts: dict[str, list[int]] = {}  # per file, sorted; the windows' bytes alongside
        self._data: dict[str, list[bytes]] = {}
        self.requests = 0
        self.bytes_read = 0

    def prefetch(self, wanted: list[tuple[str, int, int]], meanwhile: Callable[[], None] | None = None) -> None:
        """Fetch the windows ``wanted`` (coalesced) in one batch; ``meanwhile`` runs while
        it is in flight, and its error, if any, is the one raised. Windows already held cost nothing."""
        reads = _coalesce([w for w in wanted if not self._held(*w)])
        bufs = [bytearray(r.length) for r in reads]
        fut = self.storage.read_into(reads, [memoryview(b) for b in bufs]) if reads else None
        first: CheckpointError | None = None
        try:
            if meanwhile is not None:
                meanwhile()
        except CheckpointError as e:
            first = e
        try:
            self.requests += fut.result() if fut is not None else 0
        except CheckpointError:
            if first is None:
                raise
        if first is not None:
            raise first
        for r, b in zip(reads, bufs):
            self._keep(r.name, r.start, bytes(b))
            self.bytes_read += r.length

    def _held(self, name: str, start: int, stop: int) -> bool:
        starts = self._starts.get(name, [])
        i = bisect.bisect_right(starts, start) - 1
        return i >= 0 and stop <= starts[i] + len(self._data[name][i])

    def get(self, name: str, start: int, stop: int) -> bytes:
        if self._held(name, start, stop):
            starts = self._starts[name]
            i = bisect.bisect_right(starts, start) - 1
            return self._data[name][i][start - starts[i]:stop - starts[i]]
        data = self.storage.read_bytes(name, start, stop)
        self.requests += 1
        self.bytes_read += stop - start
        self._keep(name, start, data)
        return data

    def _keep(self, name: str, start: int, data: bytes) -> None:
        starts = self._starts.setdefault(name, [])
        i = bisect.bisect_right(starts, start)
        starts.insert(i, start)
        self._data.setdefault(name, []).insert(i, data)


def _coalesce(wanted: list[tuple[str, int, int]]) -> list[RangeRead]:
    out: list[RangeRead] = []
    for name, start, stop in sorted(wanted):
        last = out[-1] if out else None
        if last is not None and last.name == name and start <= last.stop + MAX_GAP and \
                max(stop, last.stop) - last.start <= MAX_WINDOW:
            out[-1] = RangeRead(name, last.start, max(stop, last.stop))
        elif stop > start:
            out.append(RangeRead(name, start, stop))
    return out


class _ItemFile(io.RawIOBase):
    """A seekable read-only view of one item, served from a ``RangeCache``."""

    def __init__(self, cache: RangeCache, item: ItemInfo) -> None:
        self._cache, self._item, self._pos = cache, item, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._item.length}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def read(self, n: int = -1) -> bytes:
        stop = self._item.length if n is None or n < 0 else min(self._item.length, self._pos + n)
        if stop <= self._pos:
            return b""
        if stop - self._pos > MAX_VALUE_ITEM_BYTES:  # a hostile central directory size, say
            raise CorruptCheckpointError(
                f"{self._cache.storage.describe(self._item.file)}: a {stop - self._pos}-byte read of ZIP "
                f"metadata inside the item at {self._item.offset}; refusing"
            )
        data = self._cache.get(self._item.file, self._item.offset + self._pos, self._item.offset + stop)
        self._pos = stop
        return data

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        b[:len(data)] = data
        return len(data)


@dataclass(frozen=True, slots=True)
class LocatedTensor:
    """A chunk's raw bytes: absolute offset in its file, and what they hold."""

    byte_offset: int
    ref: TensorRef


def locate_tensor(cache: RangeCache, item: ItemInfo, *, where: str,
                  parsed: dict[bytes, TensorRef] | None = None) -> LocatedTensor:
    """Find the raw bytes of the tensor inside one ``torch.save`` item.

    ``parsed``: data.pkl bytes already parsed while reading this checkpoint (items
    of one dtype and shape have identical pickles), filled as items are read.
    """
    infos = _directory(cache, item, where)
    pkl = _one(infos, lambda n: n.endswith("/data.pkl") or n == "data.pkl", "data.pkl", where)
    root = pkl.filename[: -len("data.pkl")]
    for zi in infos:
        if zi.filename.endswith("byteorder") and zi.file_size <= 16:
            if _member(cache, item, zi, where).strip() not in (b"little", b""):
                raise CorruptCheckpointError(f"{where}: big-endian torch.save records are not supported")
    if pkl.file_size > MAX_PICKLE_BYTES:
        raise CorruptCheckpointError(f"{where}: data.pkl of {pkl.file_size} bytes is too large for one tensor")
    raw = _member(cache, item, pkl, where)
    ref = parsed.get(raw) if parsed is not None else None
    if ref is None:
        ref = parse_tensor_pickle(raw, where=where)
        if parsed is not None:
            parsed[raw] = ref
    rec = _one(infos, lambda n: n == f"{root}data/{ref.storage_key}", f"data/{ref.storage_key}", where)
    itemsize = ref.dtype.itemsize
    if rec.compress_type != zipfile.ZIP_STORED or rec.file_size != ref.storage_numel * itemsize:
        raise CorruptCheckpointError(
            f"{where}: storage record of {rec.file_size} bytes (method {rec.compress_type}) does not hold "
            f"{ref.storage_numel} elements of {ref.dtype}"
        )
    numel = math.prod(ref.size)
    if ref.storage_offset + numel > ref.storage_numel or (numel and not is_row_major(ref.size, ref.stride)):
        raise CorruptCheckpointError(
            f"{where}: tensor view (offset {ref.storage_offset}, size {list(ref.size)}, stride {list(ref.stride)}) "
            f"is not a row-major range of its {ref.storage_numel}-element storage"
        )
    start = _data_start(cache, item, rec, where)
    if start + rec.file_size > item.length:
        raise CorruptCheckpointError(f"{where}: storage record runs past the end of the item")
    return LocatedTensor(item.offset + start + ref.storage_offset * itemsize, ref)


def _directory(cache: RangeCache, item: ItemInfo, where: str) -> list[Any]:
    """The record's members (``ZipEntry`` or ``zipfile.ZipInfo``): parsed directly from
    its last bytes when torch's plain layout is there, else through ``zipfile``."""
    tail_start = max(0, item.length - TAIL_BYTES)
    tail = cache.get(item.file, item.offset + tail_start, item.offset + item.length)
    entries = central_directory(tail, tail_start)
    if entries is not None:
        return entries
    try:
        return zipfile.ZipFile(_ItemFile(cache, item)).infolist()
    except (zipfile.BadZipFile, ValueError, EOFError, struct.error) as e:
        raise CorruptCheckpointError(f"{where}: not a torch.save ZIP record ({e})") from None


def _one(infos: list[Any], match: Callable[[str], bool], what: str, where: str) -> Any:
    found = [zi for zi in infos if match(zi.filename)]
    if len(found) != 1:
        raise CorruptCheckpointError(f"{where}: expected one {what} in the torch.save record, found {len(found)}")
    return found[0]


def _data_start(cache: RangeCache, item: ItemInfo, zi: Any, where: str) -> int:
    """Offset (in the item) of a member's data: after its local header."""
    lo = item.offset + min(max(0, zi.header_offset), item.length)
    fixed = cache.get(item.file, lo, min(lo + 30, item.offset + item.length))
    if len(fixed) != 30 or fixed[:4] != b"PK\x03\x04":
        raise CorruptCheckpointError(f"{where}: bad local header for {zi.filename!r}")
    name_len, extra_len = struct.unpack("<HH", fixed[26:30])
    return zi.header_offset + 30 + name_len + extra_len


def _member(cache: RangeCache, item: ItemInfo, zi: Any, where: str) -> bytes:
    """A small member's bytes (callers bound ``file_size`` first)."""
    if zi.compress_type != zipfile.ZIP_STORED:
        raise CorruptCheckpointError(f"{where}: {zi.filename!r} is compressed; torch.save stores members")
    start = _data_start(cache, item, zi, where)
    if start + zi.file_size > item.length:
        raise CorruptCheckpointError(f"{where}: {zi.filename!r} runs past the end of the item")
    return cache.get(item.file, item.offset + start, item.offset + start + zi.file_size)


def read_value(cache: RangeCache, item: ItemInfo, *, where: str) -> Any:
    """A non-tensor entry's Python value (builtins only), or raise ``CorruptCheckpointError``."""
    try:
        infos = _directory(cache, item, where)
    except CorruptCheckpointError:
        raise CorruptCheckpointError(f"{where}: raw bytes, not a torch.save record") from None
    pkl = _one(infos, lambda n: n.endswith("/data.pkl") or n == "data.pkl", "data.pkl", where)
    if pkl.file_size > MAX_VALUE_ITEM_BYTES:
        raise CorruptCheckpointError(f"{where}: value of {pkl.file_size} bytes is too large to restore")
    return safe_unpickle(_member(cache, item, pkl, where), allowed=_VALUE_GLOBALS, where=where, dtypes_ok=False)


def value_from_record(data: bytes, *, where: str) -> Any:
    """A non-tensor value from a whole ``torch.save`` record held in memory (builtins
    only, as ``read_value``): what DCP hands a storage writer for a ``BYTE_IO`` item."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            names = [n for n in z.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
            if len(names) != 1:
                raise CorruptCheckpointError(f"{where}: {len(names)} data.pkl members in a torch.save record")
            if z.getinfo(names[0]).file_size > MAX_VALUE_ITEM_BYTES:
                raise CorruptCheckpointError(f"{where}: value larger than {MAX_VALUE_ITEM_BYTES} bytes")
            pkl = z.read(names[0])
    except (zipfile.BadZipFile, OSError, ValueError) as e:
        raise CorruptCheckpointError(f"{where}: not a torch.save record ({e})") from None
    return safe_unpickle(pkl, allowed=_VALUE_GLOBALS, where=where, dtypes_ok=False)


def _locating_windows(md: DcpMetadata) -> list[tuple[str, int, int]]:
    out = [w for t in md.tensors.values() for _, _, it in t.chunks for w in item_windows(it)]
    return out + value_windows(md)


def item_windows(it: ItemInfo) -> list[tuple[str, int, int]]:
    """The bytes that locate an item's tensor: its first and last few KiB."""
    end = it.offset + it.length
    return [(it.file, it.offset, min(end, it.offset + HEAD_BYTES)), (it.file, max(it.offset, end - TAIL_BYTES), end)]


def value_windows(md: DcpMetadata) -> list[tuple[str, int, int]]:
    """Non-tensor items small enough to restore: read whole."""
    return [(it.file, it.offset, it.offset + it.length) for it in md.values.values() if it.length <= MAX_VALUE_ITEM_BYTES]



def located_shard(cache: RangeCache, storage: Storage, fqn: str, t: DcpTensor, offs: tuple[int, ...],
                  sizes: tuple[int, ...], item: ItemInfo, parsed: dict[bytes, TensorRef]) -> tuple[Shard, LocatedTensor]:
    """One chunk located exactly from its item's ZIP directory and headers."""
    where = item_where(storage, fqn, offs, item)
    loc = locate_tensor(cache, item, where=where, parsed=parsed)
    code = dtypes.to_code(loc.ref.dtype, where=where) if loc.ref.dtype in _CODES else None
    if code != t.dtype or loc.ref.size != sizes:
        raise CorruptCheckpointError(
            f"{where}: item holds {loc.ref.dtype} {list(loc.ref.size)}, metadata says {t.dtype} {list(sizes)}"
        )
    shard = Shard(
        offset=offs, shape=sizes, file=item.file, byte_offset=loc.byte_offset,
        byte_length=math.prod(sizes) * loc.ref.dtype.itemsize, codec="raw", chunk_size=0,
    )
    return shard, loc


def item_where(storage: Storage, fqn: str, offs: tuple[int, ...], item: ItemInfo) -> str:
    return f"{storage.describe(item.file)} [{item.offset}, {item.offset + item.length}) ({fqn!r} chunk {list(offs)})"
