"""Hugging Face safetensors checkpoints read in place, by range reads only.

A prefix holds ``model.safetensors``, or ``*.safetensors.index.json`` with the
shard files it names, or plain ``*.safetensors`` files. Each file's 8-byte header
length and its JSON header are fetched with range reads (one speculative read
covers both for ordinary headers) and checked hard before anything trusts them:
a stranger's header can claim 2^60 bytes, offsets past the end of the object,
overlapping tensors or a shape that disagrees with its byte count. The result is
a ``Manifest`` where every tensor is one raw shard; the planner then fetches only
the slices a target needs.
"""

from __future__ import annotations

import json
import logging
import posixpath
import struct
from dataclasses import dataclass
from typing import Any

from ..core import dtypes
from ..core.manifest import MAX_NDIM, MAX_TENSOR_BYTES, Manifest, Shard, TensorMeta, check_relative_name, validate
from ..errors import CorruptCheckpointError
from ..storage import RangeRead, Storage

log = logging.getLogger(__name__)

KIND = "safetensors"
SINGLE_FILE = "model.safetensors"
DEFAULT_INDEX = "model.safetensors.index.json"
INDEX_SUFFIX = ".safetensors.index.json"
FILE_SUFFIX = ".safetensors"
MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own limit
MAX_INDEX_BYTES = 64 << 20
FIRST_READ_BYTES = 64 << 10  # one request fetches length + header for ordinary files


@dataclass(frozen=True, slots=True)
class HeaderEntry:
    """One tensor of one safetensors file: dtype, shape and absolute byte range."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute offset in the file
    stop: int


@dataclass(frozen=True, slots=True)
class ParsedHeader:
    """A validated safetensors header."""

    header_len: int
    entries: tuple[HeaderEntry, ...]
    metadata: dict[str, str]

    @property
    def data_start(self) -> int:
        return 8 + self.header_len


# ----------------------------------------------------------------------- parsing


def header_length(prefix: bytes, file_size: int, *, where: str) -> int:
    """The JSON header's length from the file's first 8 bytes, bounded before use."""
    if file_size < 8 or len(prefix) < 8:
        raise CorruptCheckpointError(f"{where}: {file_size} bytes is too short for a safetensors file")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > MAX_HEADER_BYTES:
        raise CorruptCheckpointError(
            f"{where}: header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit (hostile or not safetensors)"
        )
    if 8 + n > file_size:
        raise CorruptCheckpointError(f"{where}: header length {n} runs past the end of the {file_size}-byte file")
    if n < 2:
        raise CorruptCheckpointError(f"{where}: header length {n} is too short for a JSON object")
    return n


def parse_header(raw: bytes, file_size: int, *, where: str) -> ParsedHeader:
    """Validate a JSON header (the bytes after the length) against the file size."""
    n = len(raw)
    if not raw.lstrip(b" ").startswith(b"{"):
        raise CorruptCheckpointError(f"{where}: header does not start with a JSON object")
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{where}: header is not valid UTF-8 JSON ({e})") from None
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(f"{where}: header is not a JSON object")
    data_start = 8 + n
    data_len = file_size - data_start
    metadata = _metadata(doc.pop("__metadata__", None), where)
    entries = [_entry(name, spec, data_start, data_len, where) for name, spec in doc.items()]
    _check_no_overlap(entries, where)
    return ParsedHeader(header_len=n, entries=tuple(entries), metadata=metadata)


def _metadata(md: Any, where: str) -> dict[str, str]:
    if md is None:
        return {}
    if not isinstance(md, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in md.items()):
        raise CorruptCheckpointError(f"{where}: '__metadata__' must map strings to strings")
    return dict(md)


def _entry(name: str, spec: Any, data_start: int, data_len: int, where: str) -> HeaderEntry:
    at = f"{where}: tensor {name!r}"
    if not isinstance(spec, dict):
        raise CorruptCheckpointError(f"{at}: entry must be an object")
    code = spec.get("dtype")
    if not isinstance(code, str):
        raise CorruptCheckpointError(f"{at}: missing or non-string 'dtype'")
    size = dtypes.to_torch(code, where=at).itemsize
    shape = _ints(spec.get("shape"), f"{at}: 'shape'", max_len=MAX_NDIM)
    offsets = _ints(spec.get("data_offsets"), f"{at}: 'data_offsets'", max_len=2)
    if len(offsets) != 2:
        raise CorruptCheckpointError(f"{at}: 'data_offsets' must be [begin, end]")
    begin, end = offsets
    numel = 1
    for d in shape:
        numel *= d
        if numel * size > MAX_TENSOR_BYTES:
            raise CorruptCheckpointError(f"{at}: shape {list(shape)} is absurdly large")
    if begin > end:
        raise CorruptCheckpointError(f"{at}: data_offsets [{begin}, {end}) are reversed")
    if end > data_len:
        raise CorruptCheckpointError(
            f"{at}: data_offsets [{begin}, {end}) run past the end of the data ({data_len} bytes after the header)"
        )
    if end - begin != numel * size:
        raise CorruptCheckpointError(
            f"{at}: shape {list(shape)} of {code} takes {numel * size} bytes, data_offsets span {end - begin}"
        )
    return HeaderEntry(name, code, shape, data_start + begin, data_start + end)


def _ints(v: Any, what: str, *, max_len: int) -> tuple[int, ...]:
    if not isinstance(v, list) or len(v) > max_len:
        raise CorruptCheckpointError(f"{what} must be a list of at most {max_len} integers")
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v):
        raise CorruptCheckpointError(f"{what} must hold non-negative integers, got {v!r:.80}")
    return tuple(v)


def _check_no_overlap(entries: list[HeaderEntry], where: str) -> None:
    spans = sorted((e for e in entries if e.stop > e.start), key=lambda e: e.start)
    for a, b in zip(spans, spans[1:]):
        if b.start < a.stop:
            raise CorruptCheckpointError(
                f"{where}: tensors {a.name!r} [{a.start}, {a.stop}) and {b.name!r} [{b.start}, {b.stop}) overlap"
            )


# -------------------------------------------------------------------- discovery


def _layout(storage: Storage, entry: str | None = None) -> tuple[list[str], dict[str, str] | None]:
    """(safetensors files to read, weight_map or None) for a prefix, or for the one file or
    index ``entry`` names; ([], None) if none."""
    names = [n for n in storage.list("") if "/" not in n]
    if entry is not None:
        if entry not in names:
            return [], None
        if not entry.endswith(INDEX_SUFFIX):
            return [entry], None
        return _indexed(storage, [entry])
    indexes = sorted(n for n in names if n.endswith(INDEX_SUFFIX))
    if DEFAULT_INDEX in indexes:
        indexes = [DEFAULT_INDEX]
    elif SINGLE_FILE in names:
        return [SINGLE_FILE], None
    if indexes:
        return _indexed(storage, indexes)
    return sorted(n for n in names if n.endswith(FILE_SUFFIX)), None


def _indexed(storage: Storage, indexes: list[str]) -> tuple[list[str], dict[str, str]]:
    weight_map: dict[str, str] = {}
    for idx in indexes:
        for key, file in _read_index(storage, idx).items():
            if key in weight_map and weight_map[key] != file:
                raise CorruptCheckpointError(
                    f"{storage.describe(idx)}: tensor {key!r} is mapped to {file!r} and {weight_map[key]!r}"
                )
            weight_map[key] = file
    return sorted(set(weight_map.values())), weight_map


def _read_index(storage: Storage, name: str) -> dict[str, str]:
    where = storage.describe(name)
    try:  # one GET, refused over the limit before its body is read
        doc = json.loads(storage.read_bytes(name, max_bytes=MAX_INDEX_BYTES).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{where}: not valid UTF-8 JSON ({e})") from None
    wm = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
        raise CorruptCheckpointError(f"{where}: 'weight_map' must map tensor names to file names")
    base = posixpath.dirname(name)
    out = {}
    for key, file in wm.items():
        check_relative_name(file, where=f"{where}: weight_map[{key!r}]")
        out[key] = posixpath.join(base, file) if base else file
    return out


# ----------------------------------------------------------------------- reading


def read_headers(storage: Storage, files: list[str]) -> dict[str, tuple[int, ParsedHeader]]:
    """Fetch and validate every file's header: one range read per file when the
    header fits ``FIRST_READ_BYTES``, a second for larger headers. Never a
    read or allocation sized by an unchecked length."""
    sizes = storage.sizes(files)
    first = [RangeRead(f, 0, min(sizes[f], FIRST_READ_BYTES)) for f in files]
    heads = _fetch(storage, first)
    lengths = {f: header_length(heads[f], sizes[f], where=storage.describe(f)) for f in files}
    more = [RangeRead(f, len(heads[f]), 8 + lengths[f]) for f in files if 8 + lengths[f] > len(heads[f])]
    rest = _fetch(storage, more)
    out = {}
    for f in files:
        raw = (heads[f] + rest.get(f, b""))[8:8 + lengths[f]]
        out[f] = (sizes[f], parse_header(raw, sizes[f], where=storage.describe(f)))
    return out


def _fetch(storage: Storage, reads: list[RangeRead]) -> dict[str, bytes]:
    bufs = [bytearray(r.length) for r in reads]
    if reads:
        storage.read_into(reads, [memoryview(b) for b in bufs]).result()
    return {r.name: bytes(b) for r, b in zip(reads, bufs)}


def read_hf_manifest(storage: Storage, *, entry: str | None = None) -> Manifest | None:
    """The Manifest of a safetensors checkpoint at ``storage``'s prefix (or of the one file
    or index ``entry`` there), or None if there are no such safetensors files."""
    files, weight_map = _layout(storage, entry)
    if not files:
        return None
    headers = read_headers(storage, files)
    tensors: dict[str, TensorMeta] = {}
    owner: dict[str, str] = {}
    metadata: dict[str, Any] = {}
    for f in files:
        size, header = headers[f]
        if header.metadata:
            metadata[f] = header.metadata
        for e in header.entries:
            if e.name in tensors:
                raise CorruptCheckpointError(
                    f"{storage.describe(f)}: tensor {e.name!r} also appears in {storage.describe(owner[e.name])}"
                )
            owner[e.name] = f
            shard = Shard(
                offset=(0,) * len(e.shape), shape=e.shape, file=f,
                byte_offset=e.start, byte_length=e.stop - e.start, codec="raw", chunk_size=0,
            )
            tensors[e.name] = TensorMeta(dtype=e.dtype, shape=e.shape, shards=(shard,))
    if weight_map is not None:
        _check_weight_map(storage, weight_map, owner)
    manifest = Manifest(
        tensors=tensors, files={f: headers[f][0] for f in files}, metadata=_flatten_metadata(metadata), kind=KIND
    )
    validate(manifest, where=storage.describe(""))
    log.debug("safetensors manifest: %d files, %d tensors", len(files), len(tensors))
    return manifest


def _check_weight_map(storage: Storage, weight_map: dict[str, str], owner: dict[str, str]) -> None:
    for key, file in weight_map.items():
        if owner.get(key) != file:
            raise CorruptCheckpointError(
                f"{storage.describe(file)}: the index lists tensor {key!r} in this file, but its header "
                f"{'does not hold it' if key not in owner else 'does not; ' + owner[key] + ' does'}"
            )


def _flatten_metadata(per_file: dict[str, dict[str, str]]) -> dict[str, Any]:
    """One file's ``__metadata__`` as is; several files' keyed by file name."""
    if len(per_file) == 1:
        return dict(next(iter(per_file.values())))
    return {"files": per_file} if per_file else {}
