"""PyTorch DCP checkpoints (``.metadata`` + ``*.distcp``) read in place.

``.metadata`` is a pickle. It is parsed by the allow-list unpickler
(``safepickle``), which maps the few globals DCP writes (its metadata dataclasses,
``torch.Size``, dtypes, a path class, ``OrderedDict``) onto inert stand-ins defined
here; any other global is a ``CorruptCheckpointError`` raised before it could be
resolved, so a hostile file never runs code.

Each tensor chunk is one ``torch.save`` record (a ZIP with STORED entries) at a
byte range of a ``.distcp`` file. Instead of loading items whole (DCP's own
reader does), the item's central directory, its small ``data.pkl`` (read with a
second allow-list unpickler that builds no tensor) and the storage record's local
header are fetched with small range reads; the tensor's raw bytes then have an
exact file address and any slice of a chunk is a range read. Small reads of
neighbouring items are coalesced: an item's tail and the next item's head are
one request, so locating N items costs about N requests of a few KiB.
``read_dcp_manifest(speculative=True)`` (what ``sc.load`` asks for) locates one
item this way and predicts the others' offsets (``dcpguess``); such a manifest
says so in ``metadata[SPECULATION_KEY]``, and the load verifies every predicted
item head it relies on, read with the tensor bytes, before returning, or
locates every item exactly and loads again (``streamckpt.speculation``).
Non-tensor entries (``torch.save`` of Python objects: optimizer ``param_groups``
leaves, step counters, scheduler state) are read whole, unpickled with builtins
only, and kept when made of dicts, lists, tuples and scalars
(``values.unrestorable``); the rest are reported as unloadable, with a reason.
"""

from __future__ import annotations

import bisect
import io
import json
import logging
import math
import posixpath
import struct
import zipfile
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .. import dtypes
from ..errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from ..manifest import MAX_NDIM, Manifest, Shard, TensorMeta, check_relative_name, validate
from ..storage import RangeRead, Storage
from ..values import RESTORABLE, unrestorable
from .safepickle import Inert, Record, safe_unpickle
from .zipdir import central_directory

log = logging.getLogger(__name__)

KIND = "dcp"
METADATA_NAME = ".metadata"
MAX_METADATA_BYTES = 512 << 20
MAX_PICKLE_BYTES = 1 << 20  # an item's data.pkl: a few hundred bytes in practice
MAX_VALUE_ITEM_BYTES = 16 << 20  # non-tensor entries larger than this are not restored
HEAD_BYTES = 2048  # local headers and data.pkl up to the storage record (~700 bytes as torch 2.x writes items)
TAIL_BYTES = 2048  # the last records, the central directory and the end records (~900 bytes)
MAX_GAP = 64 << 10  # coalesce locating reads closer than this
MAX_WINDOW = 8 << 20
SPECULATION_KEY = "dcp_predicted_layout"  # manifest metadata: the template a load verifies against

_MDI = "torch.distributed.checkpoint.metadata"


# --------------------------------------------------------------- inert stand-ins


class _Metadata(Record):
    fields = ("state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version")


class _TensorStorageMetadata(Record):
    fields = ("properties", "size", "chunks")


class _ChunkStorageMetadata(Record):
    fields = ("offsets", "sizes")


class _BytesStorageMetadata(Record):
    pass


class _TensorProperties(Record):
    fields = ("dtype", "layout", "requires_grad", "memory_format", "pin_memory")

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple):  # DCP pickles a tuple (its __getstate__)
            self.__dict__.update(zip(self.fields, state))
        else:
            super().__setstate__(state)


class _MetadataIndex(Record):
    fields = ("fqn", "offset", "index")


class _StorageInfo(Record):
    fields = ("relative_path", "offset", "length", "transform_descriptors")


class _StorageMeta(Record):
    fields = ("checkpoint_id", "save_id", "load_id", "modules")


def _size(dims: Any = ()) -> tuple[int, ...]:
    """torch.Size stand-in: a tuple of non-negative ints."""
    out = tuple(dims)
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in out):
        raise TypeError("torch.Size of non-integers")
    return out


def _name(*parts: Any) -> str:
    """Stand-in for layouts, memory-format enums and paths (pickled as their
    parts): kept as text only."""
    return posixpath.join(*(str(p) for p in parts)) if parts else ""


_inert_name = Inert(_name)
_inert_size = Inert(_size)

_METADATA_GLOBALS: dict[tuple[str, str], Any] = {
    (_MDI, "Metadata"): _Metadata,
    (_MDI, "TensorStorageMetadata"): _TensorStorageMetadata,
    (_MDI, "ChunkStorageMetadata"): _ChunkStorageMetadata,
    (_MDI, "BytesStorageMetadata"): _BytesStorageMetadata,
    (_MDI, "TensorProperties"): _TensorProperties,
    ("torch.distributed._shard.sharded_tensor.metadata", "TensorProperties"): _TensorProperties,
    (_MDI, "MetadataIndex"): _MetadataIndex,
    (_MDI, "StorageMeta"): _StorageMeta,
    (_MDI, "_MEM_FORMAT_ENCODING"): _inert_name,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch.serialization", "_get_layout"): _inert_name,
    ("torch", "Size"): _inert_size,
    ("pathlib", "PosixPath"): _inert_name,
    ("pathlib", "WindowsPath"): _inert_name,
    ("pathlib", "PurePosixPath"): _inert_name,
    ("pathlib", "PureWindowsPath"): _inert_name,
    ("pathlib", "Path"): _inert_name,
    ("collections", "OrderedDict"): dict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
}


# ---------------------------------------------------------------- typed metadata


@dataclass(frozen=True, slots=True)
class ItemInfo:
    """Where one DCP item's ``torch.save`` record lives."""

    file: str
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class DcpTensor:
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[tuple[tuple[int, ...], tuple[int, ...], ItemInfo], ...]  # (offsets, sizes, item)


@dataclass(frozen=True, slots=True)
class DcpMetadata:
    tensors: dict[str, DcpTensor]
    values: dict[str, ItemInfo]  # non-tensor (bytes) entries
    version: str | None


def parse_metadata(data: bytes, *, where: str) -> DcpMetadata:
    """Unpickle ``.metadata`` safely and check every field's type and bounds."""
    md = safe_unpickle(data, allowed=_METADATA_GLOBALS, where=where)
    if not isinstance(md, _Metadata):
        raise CorruptCheckpointError(f"{where}: not a DCP Metadata object")
    sdm = md.get("state_dict_metadata")
    storage = md.get("storage_data")
    if not isinstance(sdm, dict) or not isinstance(storage, dict):
        raise CorruptCheckpointError(f"{where}: state_dict_metadata and storage_data must be dicts")
    infos = _storage_infos(storage, where)
    tensors: dict[str, DcpTensor] = {}
    values: dict[str, ItemInfo] = {}
    for fqn, entry in sdm.items():
        if not isinstance(fqn, str):
            raise CorruptCheckpointError(f"{where}: state_dict_metadata key {fqn!r} is not a string")
        if isinstance(entry, _BytesStorageMetadata):
            values[fqn] = _item(infos, fqn, None, where)
        elif isinstance(entry, _TensorStorageMetadata):
            tensors[fqn] = _tensor(fqn, entry, infos, where)
        else:
            raise CorruptCheckpointError(f"{where}: entry {fqn!r} has unknown type {type(entry).__name__}")
    version = md.get("version")
    return DcpMetadata(tensors=tensors, values=values, version=version if isinstance(version, str) else None)


def _storage_infos(storage: dict[Any, Any], where: str) -> dict[tuple[str, tuple[int, ...] | None], ItemInfo]:
    out: dict[tuple[str, tuple[int, ...] | None], ItemInfo] = {}
    for idx, info in storage.items():
        if not isinstance(idx, _MetadataIndex) or not isinstance(info, _StorageInfo):
            raise CorruptCheckpointError(f"{where}: storage_data entries must be MetadataIndex -> _StorageInfo")
        fqn, offset = idx.get("fqn"), idx.get("offset")
        path, start, length = info.get("relative_path"), info.get("offset"), info.get("length")
        if not isinstance(fqn, str) or not (offset is None or isinstance(offset, tuple)):
            raise CorruptCheckpointError(f"{where}: malformed MetadataIndex {fqn!r}")
        if not isinstance(path, str) or not _nonneg(start) or not _nonneg(length):
            raise CorruptCheckpointError(f"{where}: storage info of {fqn!r} is malformed")
        check_relative_name(path, where=f"{where}: storage info of {fqn!r}")
        if info.get("transform_descriptors"):
            raise CorruptCheckpointError(
                f"{where}: item {fqn!r} was written through DCP stream transforms "
                f"{info.get('transform_descriptors')!r} (e.g. compression); streamckpt cannot range-read those"
            )
        out[(fqn, offset)] = ItemInfo(path, start, length)
    return out


def _nonneg(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _item(infos: dict[Any, ItemInfo], fqn: str, offset: tuple[int, ...] | None, where: str) -> ItemInfo:
    try:
        return infos[(fqn, offset)]
    except KeyError:
        at = "" if offset is None else f" chunk at offset {list(offset)}"
        raise CorruptCheckpointError(f"{where}: no storage info for {fqn!r}{at}") from None


def _tensor(fqn: str, entry: _TensorStorageMetadata, infos: dict[Any, ItemInfo], where: str) -> DcpTensor:
    props, size, chunks = entry.get("properties"), entry.get("size"), entry.get("chunks")
    dtype = props.get("dtype") if isinstance(props, _TensorProperties) else None
    if not isinstance(dtype, torch.dtype):
        raise CorruptCheckpointError(f"{where}: tensor {fqn!r} has no dtype")
    code = dtypes.to_code(dtype, where=fqn) if dtype in _CODES else None
    if code is None:
        raise CorruptCheckpointError(f"{where}: tensor {fqn!r} has dtype {dtype}, which streamckpt cannot store")
    if not isinstance(size, tuple) or len(size) > MAX_NDIM or not isinstance(chunks, list):
        raise CorruptCheckpointError(f"{where}: tensor {fqn!r} has a malformed size or chunk list")
    out = []
    for c in chunks:
        offs, sizes = (c.get("offsets"), c.get("sizes")) if isinstance(c, _ChunkStorageMetadata) else (None, None)
        if not isinstance(offs, tuple) or not isinstance(sizes, tuple) or len(offs) != len(size) or len(sizes) != len(size):
            raise CorruptCheckpointError(f"{where}: tensor {fqn!r} has a malformed chunk")
        out.append((offs, sizes, _item(infos, fqn, offs, where)))
    return DcpTensor(dtype=code, shape=size, chunks=tuple(out))


_CODES = {dtypes.to_torch(c) for c in dtypes.SUPPORTED_CODES}


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
        it is in flight, and its error, if any, is the one raised."""
        reads = _coalesce(wanted)
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

    def get(self, name: str, start: int, stop: int) -> bytes:
        starts = self._starts.get(name, [])
        i = bisect.bisect_right(starts, start) - 1
        if i >= 0:
            data = self._data[name][i]
            if stop <= starts[i] + len(data):
                return data[start - starts[i]:stop - starts[i]]
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


def json_safe(value: Any) -> bool:
    """True for values that survive a JSON round trip unchanged."""
    try:
        return json.loads(json.dumps(value, allow_nan=False)) == value and _plain(value)
    except (TypeError, ValueError, RecursionError):
        return False


def _plain(v: Any) -> bool:
    if v is None or isinstance(v, (bool, int, float, str)):
        return True
    if isinstance(v, list):
        return all(_plain(x) for x in v)
    if isinstance(v, dict):
        return all(isinstance(k, str) and _plain(x) for k, x in v.items())
    return False


# ----------------------------------------------------------------- the reader


def read_dcp_manifest(storage: Storage, *, speculative: bool = False) -> Manifest | None:
    """The Manifest of a DCP checkpoint at ``storage``'s prefix, or None when the
    prefix has no ``.metadata``.

    ``speculative``: locate one item exactly and predict where the others' tensor
    bytes start (``dcpguess``); the manifest then says so in its metadata and a load
    must verify every predicted item it reads (``streamckpt.speculation``)."""
    where = storage.describe(METADATA_NAME)
    try:  # one GET (its size is checked before the body is read), no HEAD first
        raw = storage.read_bytes(METADATA_NAME, max_bytes=MAX_METADATA_BYTES)
    except CheckpointNotFoundError:
        return None
    md = parse_metadata(raw, where=where)
    items = [c[2] for t in md.tensors.values() for c in t.chunks] + list(md.values.values())
    files: dict[str, int] = {}

    def sizes() -> None:  # while the locating reads are in flight
        files.update({name: storage.size(name) for name in sorted({i.file for i in items})})
        for item in items:
            if item.offset + item.length > files[item.file]:
                raise CorruptCheckpointError(
                    f"{storage.describe(item.file)}: item [{item.offset}, {item.offset + item.length}) runs past "
                    f"the end of the {files[item.file]}-byte file"
                )

    cache = RangeCache(storage)
    parsed: dict[bytes, TensorRef] = {}
    metadata: dict[str, Any] = {"dcp_version": md.version}
    guessed = None
    if speculative:
        from .dcpguess import guess_tensors  # imports this module

        guessed = guess_tensors(cache, storage, md, parsed, meanwhile=sizes)
    if guessed is None:
        cache.prefetch(_locating_windows(md), meanwhile=None if files else sizes)
        tensors = {fqn: _tensor_meta(cache, storage, fqn, t, parsed) for fqn, t in md.tensors.items()}
    else:
        tensors, metadata[SPECULATION_KEY] = guessed
    values, unloadable = _values(cache, storage, md)
    if unloadable:
        metadata["unloadable_keys"] = sorted(unloadable)
        metadata["unloadable_reasons"] = unloadable
    log.debug("DCP manifest: %d tensors, %d values; locating cost %d requests, %d bytes",
              len(tensors), len(values), cache.requests, cache.bytes_read)
    manifest = Manifest(tensors=tensors, files=files, values=values, metadata=metadata, kind=KIND)
    validate(manifest, where=where)
    return manifest


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


def _tensor_meta(cache: RangeCache, storage: Storage, fqn: str, t: DcpTensor,
                 parsed: dict[bytes, TensorRef]) -> TensorMeta:
    shards = [located_shard(cache, storage, fqn, t, offs, sizes, item, parsed)[0] for offs, sizes, item in t.chunks]
    return TensorMeta(dtype=t.dtype, shape=t.shape, shards=tuple(shards))


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


def _values(cache: RangeCache, storage: Storage, md: DcpMetadata) -> tuple[dict[str, Any], dict[str, str]]:
    values: dict[str, Any] = {}
    unloadable: dict[str, str] = {}
    for fqn, item in md.values.items():
        where = f"{storage.describe(item.file)} [{item.offset}, {item.offset + item.length}) ({fqn!r})"
        if item.length > MAX_VALUE_ITEM_BYTES:
            unloadable[fqn] = f"{item.length}-byte value is larger than the {MAX_VALUE_ITEM_BYTES}-byte limit"
            continue
        try:
            value = read_value(cache, item, where=where)
        except CorruptCheckpointError as e:
            unloadable[fqn] = f"not restorable without running pickle code: {e}"
            continue
        why = unrestorable(value)
        if why is None:
            values[fqn] = value
        else:
            unloadable[fqn] = f"{why} is not JSON-safe nor made of restorable types ({RESTORABLE})"
    return values, unloadable
