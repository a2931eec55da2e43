"""Predicting where a DCP item's tensor bytes start, from one item read exactly.

``torch.save`` writes every tensor record the same way: a few small members
(``data.pkl``, ``.format_version``, ``.storage_alignment``, ``byteorder``), each
a local header with a data descriptor and a ``FB`` padding field aligning its
data, then the storage member's local header; the tensor's bytes follow. Only
``data.pkl`` (dtype, shape, numel) and so the padding differ between tensors.
A ``Template`` learnt from one item read exactly regenerates any other item's
head — every byte before its tensor data — for a given dtype and shape. The
prediction is a guess: the loader reads the predicted head with the tensor
bytes and compares before returning (``streamckpt.formats.speculation``).

Pure: no I/O. The pickle is written by ``pickle.Pickler`` over stand-ins that
name torch's globals; no tensor is built and nothing is unpickled.
"""

from __future__ import annotations

import base64
import collections
import io
import math
import pickle
import struct
import zlib
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch._utils

from ..core import dtypes
from .zipdir import central_directory

LOCAL = b"PK\x03\x04"
LOCAL_LEN = 30
DESCRIPTOR = b"PK\x07\x08"
DESCRIPTOR_LEN = 16
PAD_ID = b"FB"
_DATA_DESCRIPTOR_FLAG = 0x08
_ZIP64_LIMIT = 0xFFFFFFFF
MAX_HEAD = 1 << 16  # torch's heads are ~700 bytes

_LEGACY_CLASSES: dict[torch.dtype, str] = {
    torch.float64: "DoubleStorage", torch.float32: "FloatStorage", torch.float16: "HalfStorage",
    torch.bfloat16: "BFloat16Storage", torch.int64: "LongStorage", torch.int32: "IntStorage",
    torch.int16: "ShortStorage", torch.int8: "CharStorage", torch.uint8: "ByteStorage",
    torch.bool: "BoolStorage", torch.complex64: "ComplexFloatStorage", torch.complex128: "ComplexDoubleStorage",
}


# ------------------------------------------------------------------ data.pkl


class _Storage:
    """The one storage a tensor pickle references (by persistent id)."""


class _Tensor:
    """Reduces the way ``torch.Tensor`` does for a contiguous CPU tensor without grad."""

    def __init__(self, dtype: torch.dtype, shape: tuple[int, ...], storage: _Storage) -> None:
        self.dtype, self.shape, self.storage = dtype, shape, storage

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, tuple[Any, ...]]:
        stride = tuple(contiguous_strides(self.shape))
        hooks: collections.OrderedDict[Any, Any] = collections.OrderedDict()
        if self.dtype in _LEGACY_CLASSES:
            return torch._utils._rebuild_tensor_v2, (self.storage, 0, tuple(self.shape), stride, False, hooks)
        return torch._utils._rebuild_tensor_v3, (self.storage, 0, tuple(self.shape), stride, False, hooks, self.dtype)


class _Pickler(pickle.Pickler):
    """torch.save's pickler, for one tensor: the storage becomes its persistent id."""

    def __init__(self, buf: io.BytesIO, pid: tuple[Any, ...], storage: _Storage) -> None:
        super().__init__(buf, protocol=2)
        self._pid, self._storage = pid, storage

    def persistent_id(self, obj: Any) -> Any:
        return self._pid if obj is self._storage else None


def contiguous_strides(shape: Sequence[int]) -> list[int]:
    """Row-major strides as torch reports them (a size-0 or size-1 dim still counts)."""
    out, step = [], 1
    for d in reversed(shape):
        out.append(step)
        step *= max(d, 1)
    return out[::-1]


def tensor_pickle(dtype: torch.dtype, shape: tuple[int, ...], key: str = "0") -> bytes:
    """The data.pkl ``torch.save`` writes for a contiguous CPU tensor of ``dtype`` and
    ``shape`` whose storage is exactly its elements (what DCP saves per chunk)."""
    numel = math.prod(shape)
    if dtype in _LEGACY_CLASSES:
        cls: Any = getattr(torch, _LEGACY_CLASSES[dtype])
        count = numel
    else:
        cls, count = torch.storage.UntypedStorage, numel * dtype.itemsize
    storage = _Storage()
    buf = io.BytesIO()
    _Pickler(buf, ("storage", cls, key, "cpu", count), storage).dump(_Tensor(dtype, shape, storage))
    return buf.getvalue()


# ------------------------------------------------------------------ the template


@dataclass(frozen=True, slots=True)
class Member:
    """One small member before the tensor data: its name, the 10 local-header bytes
    after the signature (version, flags, method, time, date), and its content
    (None for data.pkl, which is per tensor)."""

    name: bytes
    fixed: bytes
    content: bytes | None


@dataclass(frozen=True, slots=True)
class Template:
    members: tuple[Member, ...]
    data_name: bytes
    data_fixed: bytes
    alignment: int

    def to_json(self) -> dict[str, Any]:
        def b64(b: bytes | None) -> str | None:
            return None if b is None else base64.b64encode(b).decode("ascii")
        return {
            "members": [[b64(m.name), b64(m.fixed), b64(m.content)] for m in self.members],
            "data": [b64(self.data_name), b64(self.data_fixed)],
            "alignment": self.alignment,
        }

    @staticmethod
    def from_json(doc: Any) -> "Template | None":
        """None when ``doc`` is not a template (the caller then reads precisely)."""
        try:
            def raw(s: Any) -> bytes:
                if not isinstance(s, str):
                    raise TypeError("not a string")
                return base64.b64decode(s.encode("ascii"), validate=True)
            members = tuple(Member(raw(n), raw(f), None if c is None else raw(c)) for n, f, c in doc["members"])
            name, fixed = doc["data"]
            align = doc["alignment"]
            if not isinstance(align, int) or isinstance(align, bool) or not 0 < align <= 4096:
                return None
            t = Template(members, raw(name), raw(fixed), align)
        except (KeyError, TypeError, ValueError):
            return None
        if sum(m.content is None for m in t.members) != 1 or any(len(m.fixed) != 10 for m in t.members) \
                or len(t.data_fixed) != 10:
            return None
        return t


def _local(name: bytes, fixed: bytes, cursor: int, alignment: int) -> bytes:
    """A local header as torch's ZIP writer pads it: the data starts on a multiple of
    ``alignment`` from the record's start."""
    start = cursor + LOCAL_LEN + len(name) + 4
    pad = -start % alignment
    return (LOCAL + fixed + b"\0" * 12 + struct.pack("<HH", len(name), pad + 4) + name
            + PAD_ID + struct.pack("<H", pad) + b"Z" * pad)


def render(t: Template, pkl: bytes, *, empty: bool = False) -> bytes:
    """Every byte of a record before its tensor data, ``pkl`` being its data.pkl;
    ``empty``: the data member is empty (then torch's writer sets no data descriptor flag)."""
    return _rendered(t, pkl, empty)[0]


def _rendered(t: Template, pkl: bytes, empty: bool) -> tuple[bytes, list[tuple[bytes, int, bytes]], int]:
    """The head, each small member's (name, local header offset, content), and the
    data member's local header offset."""
    out = bytearray()
    members = []
    for m in t.members:
        content = pkl if m.content is None else m.content
        members.append((m.name, len(out), content))
        out += _local(m.name, m.fixed, len(out), t.alignment)
        out += content
        out += DESCRIPTOR + struct.pack("<III", zlib.crc32(content), len(content), len(content))
    fixed = t.data_fixed
    if empty:
        (flags,) = struct.unpack("<H", fixed[2:4])
        fixed = fixed[:2] + struct.pack("<H", flags & ~_DATA_DESCRIPTOR_FLAG) + fixed[4:]
    data_at = len(out)
    out += _local(t.data_name, fixed, len(out), t.alignment)
    return bytes(out), members, data_at


@dataclass(frozen=True, slots=True)
class TailLayout:
    """What the ZIP directory after a record's (non-empty) tensor data must say: each
    small member's (local header offset, size, CRC-32) by name, and the data member's
    offset and size. ``data_end``: where the tensor data ends in the record."""

    members: dict[str, tuple[int, int, int]]
    data_name: str
    data_at: int
    nbytes: int
    data_end: int

    def matches(self, tail: bytes) -> bool:
        """Whether ``tail`` — every byte of the record after its tensor data — shows this
        layout, so the record's head need not be read to trust its offset.

        Its central directory must list each small member at its predicted offset with
        its predicted size and CRC-32 (data.pkl's CRC covers dtype, shape and strides),
        and the data member at its predicted offset with the tensor's size; the tensor's
        data descriptor must open ``tail`` and the next member start right after it.
        Together these pin where the tensor bytes start and end. The data's own CRC is
        not known."""
        if tail[:4] != DESCRIPTOR or len(tail) < DESCRIPTOR_LEN:
            return False
        if struct.unpack_from("<II", tail, 8) != (self.nbytes, self.nbytes):
            return False
        entries = central_directory(tail, self.data_end)
        if entries is None:
            return False
        by_name = {e.filename: e for e in entries}
        if len(by_name) != len(entries):
            return False
        for name, want in self.members.items():
            e = by_name.pop(name, None)
            if e is None or (e.header_offset, e.file_size, e.CRC) != want:
                return False
        data = by_name.pop(self.data_name, None)
        if data is None or (data.header_offset, data.file_size) != (self.data_at, self.nbytes):
            return False
        after = [e.header_offset for e in by_name.values()]
        return bool(after) and min(after) == self.data_end + DESCRIPTOR_LEN


def tail_layout(t: Template, dtype: str, shape: tuple[int, ...]) -> TailLayout | None:
    """The ``TailLayout`` of a record holding a contiguous tensor of ``dtype`` and
    ``shape``; None when it cannot be predicted or the tensor is empty (no descriptor)."""
    if not predictable(dtype, shape):
        return None
    nbytes = math.prod(shape) * itemsize(dtype)
    if nbytes == 0:
        return None
    head, members, data_at = _rendered(t, tensor_pickle(dtypes.to_torch(dtype), tuple(shape)), False)
    return TailLayout(
        members={name.decode("utf-8", "replace"): (at, len(c), zlib.crc32(c)) for name, at, c in members},
        data_name=t.data_name.decode("utf-8", "replace"), data_at=data_at, nbytes=nbytes,
        data_end=len(head) + nbytes,
    )


def tail_matches(t: Template, dtype: str, shape: tuple[int, ...], tail: bytes) -> bool:
    """``tail_layout(t, dtype, shape).matches(tail)``; False when nothing is predicted."""
    layout = tail_layout(t, dtype, shape)
    return layout is not None and layout.matches(tail)


def learn(head: bytes, sizes: dict[str, int], pkl_name: str, data_name: str,
          dtype: torch.dtype, shape: tuple[int, ...]) -> Template | None:
    """The template of the record whose bytes before its tensor data are ``head``
    (``sizes``: member sizes from its central directory), or None when anything in it
    is not what this module reproduces exactly — then nothing is predicted."""
    if len(head) > MAX_HEAD:
        return None
    members: list[Member] = []
    pos = 0
    while True:
        if head[pos:pos + 4] != LOCAL or pos + LOCAL_LEN > len(head):
            return None
        fixed = head[pos + 4:pos + 14]
        (flags,) = struct.unpack("<H", fixed[2:4])
        name_len, extra_len = struct.unpack("<HH", head[pos + 26:pos + 30])
        raw = head[pos + 30:pos + 30 + name_len]
        stop = pos + 30 + name_len + extra_len
        if not flags & _DATA_DESCRIPTOR_FLAG or head[pos + 14:pos + 26] != b"\0" * 12 or stop > len(head):
            return None
        try:
            name = raw.decode("utf-8")
        except UnicodeDecodeError:
            return None
        if name == data_name:
            if stop != len(head):
                return None
            data = (raw, fixed)
            break
        size = sizes.get(name)
        if size is None or stop + size + DESCRIPTOR_LEN > len(head):
            return None
        content = head[stop:stop + size]
        members.append(Member(raw, fixed, None if name == pkl_name else content))
        if name == pkl_name:
            pkl = content
        pos = stop + size + DESCRIPTOR_LEN
    if sum(m.content is None for m in members) != 1 or pkl != tensor_pickle(dtype, shape):
        return None
    for align in _alignments(members):
        t = Template(tuple(members), data[0], data[1], align)
        if render(t, pkl) == head:
            return t
    return None


def _alignments(members: list[Member]) -> list[int]:
    """64 (torch's default), or what the record's ``.storage_alignment`` says."""
    out = [64]
    for m in members:
        if m.name.endswith(b".storage_alignment") and m.content is not None and m.content.isdigit():
            value = int(m.content)
            if 0 < value <= 4096 and value not in out:
                out.insert(0, value)
    return out


def itemsize(dtype: str) -> int:
    return dtypes.itemsize(dtype)


def predictable(dtype: str, shape: tuple[int, ...]) -> bool:
    """Whether ``predict`` writes this tensor's head: a member of 4 GiB or more gets
    ZIP64 fields this module does not write."""
    return dtype in dtypes.SUPPORTED_CODES and math.prod(shape) * dtypes.itemsize(dtype) < _ZIP64_LIMIT


def predict(t: Template, dtype: str, shape: tuple[int, ...]) -> bytes | None:
    """The head of a record holding one contiguous tensor of ``dtype`` (a manifest dtype
    code) and ``shape``, or None when the template cannot say."""
    if not predictable(dtype, shape):
        return None
    numel = math.prod(shape)
    return render(t, tensor_pickle(dtypes.to_torch(dtype), tuple(shape)), empty=numel == 0)
