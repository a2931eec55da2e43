"""DCP's ``.metadata``, read without running pickle code: its globals' stand-ins and typed records.

``.metadata`` is a pickle. It is parsed by the allow-list unpickler (``safepickle``),
which maps the few globals DCP writes (its metadata dataclasses, ``torch.Size``,
dtypes, a path class, ``OrderedDict``) onto the inert stand-ins defined here; any
other global is a ``CorruptCheckpointError`` raised before it could be resolved, so
a hostile file never runs code. ``parse_metadata`` then checks every field's type
and bounds and returns plain dataclasses: which item (file, offset, length) holds
each tensor chunk and each non-tensor entry.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core import dtypes
from ..core.manifest import MAX_NDIM, check_relative_name
from ..errors import CorruptCheckpointError
from .safepickle import Inert, Record, safe_unpickle

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
    paths: dict[str, tuple[str | int, ...]] = field(default_factory=dict)  # fqn -> the state's nesting




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
    return DcpMetadata(tensors=tensors, values=values, version=version if isinstance(version, str) else None,
                       paths=_paths(md.get("planner_data"), set(tensors) | set(values)))


def _paths(planner_data: Any, fqns: set[str]) -> dict[str, tuple[str | int, ...]]:
    """DCP's default planner records how it flattened the state (``fqn -> path``, path
    components str or int); anything else there (a custom planner's data) is not a nesting."""
    if not isinstance(planner_data, dict):
        return {}
    out: dict[str, tuple[str | int, ...]] = {}
    for fqn, path in planner_data.items():
        if not (fqn in fqns and isinstance(path, tuple) and path and len(path) <= MAX_NDIM * 2 and all(
                isinstance(c, str) or (isinstance(c, int) and not isinstance(c, bool) and 0 <= c < 1 << 20)
                for c in path)):
            return {}
        out[fqn] = path
    return out if set(out) == fqns else {}


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
