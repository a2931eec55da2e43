"""The checkpoint description every format is turned into, and format v1's JSON.

A ``Manifest`` lists each tensor's dtype, global shape and stored shards, and
each shard's exact byte address (file, offset, length, codec, checksums). The
loader never parses data files: everything it needs to fetch any slice is here.
Pure: no I/O. ``validate`` is run on every manifest before any data is read.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..errors import CorruptCheckpointError, UnsupportedVersionError
from . import dtypes, tree as trees, values as vals
from .regions import Box, flat_range_boxes, intersect

FORMAT_NAME = "streamckpt"
FORMAT_VERSION = 1  # a self-contained checkpoint
REFERENCES_VERSION = 2  # a manifest whose shards may lie in sibling checkpoints (``bases``)
SUPPORTED_VERSIONS = (FORMAT_VERSION, REFERENCES_VERSION)
DIGEST_HEX = 32  # a shard's content digest: xxh3-128 of its raw bytes, lowercase hex
MANIFEST_NAME = "manifest.json"
MAX_MANIFEST_BYTES = 256 << 20  # ~20M chunk checksums: a multi-TB checkpoint
MAX_TENSOR_BYTES = 1 << 50  # 1 PiB: anything larger is a hostile shape
MAX_NDIM = 64
_INT_ONLY = {int}  # the element types of a valid list of integers (bool is not int here)
CODECS = ("raw", "zstd")


@dataclass(frozen=True, slots=True)
class Shard:
    """One stored piece of a tensor: a box (maybe a flat range of it) and its bytes.

    ``chunk_size`` > 0 means the shard's raw bytes are cut into chunks of that
    many bytes (the last may be shorter), each with a CRC32C in ``crc32c``; for
    codec ``zstd`` each chunk is one independent frame of ``frame_lengths[i]``
    stored bytes, frames back to back from ``byte_offset``. ``chunk_size`` 0
    means no checksums (foreign formats) and raw bytes only.
    """

    offset: tuple[int, ...]
    shape: tuple[int, ...]
    file: str
    byte_offset: int
    byte_length: int
    flat_range: tuple[int, int] | None = None
    codec: str = "raw"
    chunk_size: int = 0
    crc32c: tuple[int, ...] | None = None
    frame_lengths: tuple[int, ...] | None = None
    digest: str | None = None  # xxh3-128 of the raw (uncompressed) bytes; None: not recorded

    @property
    def box(self) -> Box:
        return tuple.__new__(Box, (self.offset, self.shape))  # Box(...) at C speed: planners ask often

    @property
    def numel(self) -> int:
        if self.flat_range is not None:
            return self.flat_range[1] - self.flat_range[0]
        return math.prod(self.shape)

    def frame_offsets(self) -> list[int]:
        """Absolute file offset of each chunk/frame (compressed for zstd)."""
        if self.frame_lengths is None:
            n = len(self.crc32c or ())
            return [self.byte_offset + i * self.chunk_size for i in range(n)]
        out, pos = [], self.byte_offset
        for length in self.frame_lengths:
            out.append(pos)
            pos += length
        return out


@dataclass(frozen=True, slots=True)
class TensorMeta:
    dtype: str
    shape: tuple[int, ...]
    shards: tuple[Shard, ...]

    @property
    def itemsize(self) -> int:
        return dtypes.itemsize(self.dtype)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


@dataclass(slots=True)
class Manifest:
    """A checkpoint's full description. ``kind`` says which format it came from."""

    tensors: dict[str, TensorMeta]
    files: dict[str, int]  # file name (relative to the checkpoint) -> size in bytes
    values: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    kind: str = FORMAT_NAME
    version: int = FORMAT_VERSION
    tree: dict[str, Any] | None = None  # the saved state's structure (core.tree); None: a flat dict
    committed_ns: int | None = None  # when the save committed (ns since the epoch, the committing rank's clock)
    bases: tuple[str, ...] = ()  # sibling checkpoints (names under the same root) whose files shards reference

    @property
    def tagged_values(self) -> bool:
        """Values are tagged JSON (``values.encode``) in DCP manifests and in every manifest
        with a tree; older native manifests hold plain JSON values."""
        return self.kind == "dcp" or self.tree is not None

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


# ----------------------------------------------------------------------------- JSON


def to_json(m: Manifest) -> bytes:
    """Serialize a manifest as JSON (UTF-8, keys in stable order): format version 1, or 2
    when it references files of sibling checkpoints (``bases``)."""
    doc = {
        "format": FORMAT_NAME,
        "version": REFERENCES_VERSION if m.bases else FORMAT_VERSION,
        # first, so that ``latest`` finds it in a manifest's first bytes
        **({"committed_ns": m.committed_ns} if m.committed_ns is not None else {}),
        **({"kind": m.kind} if m.kind != FORMAT_NAME else {}),
        **({"bases": list(m.bases)} if m.bases else {}),
        "files": {name: {"size": size} for name, size in m.files.items()},
        "tensors": {
            name: {
                "dtype": t.dtype,
                "shape": list(t.shape),
                "shards": [_shard_doc(s) for s in t.shards],
            }
            for name, t in m.tensors.items()
        },
        "values": {k: vals.encode(v) for k, v in m.values.items()} if m.tagged_values else m.values,
        **({"tree": m.tree} if m.tree is not None else {}),
        "metadata": m.metadata,
    }
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode("utf-8")


def _shard_doc(s: Shard) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "offset": list(s.offset),
        "shape": list(s.shape),
        "file": s.file,
        "byte_offset": s.byte_offset,
        "byte_length": s.byte_length,
        "codec": s.codec,
        "chunk_size": s.chunk_size,
    }
    if s.flat_range is not None:
        doc["flat_range"] = list(s.flat_range)
    if s.crc32c is not None:
        doc["crc32c"] = list(s.crc32c)
    if s.frame_lengths is not None:
        doc["frame_lengths"] = list(s.frame_lengths)
    if s.digest is not None:
        doc["digest"] = s.digest
    return doc


def from_json(data: bytes, *, where: str = MANIFEST_NAME) -> Manifest:
    """Parse and validate format v1 or v2 JSON; any defect is a ``CorruptCheckpointError``, a
    version this streamckpt does not know an ``UnsupportedVersionError``."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise CorruptCheckpointError(f"{where}: {len(data)} bytes exceeds the {MAX_MANIFEST_BYTES}-byte limit")
    if not data.strip():
        raise CorruptCheckpointError(f"{where}: empty manifest")
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{where}: not valid UTF-8 JSON ({e})") from None
    p = _Parser(where)
    obj = p.mapping(doc, "")
    fmt = obj.get("format")
    if fmt != FORMAT_NAME:
        raise CorruptCheckpointError(f"{where}: field 'format' is {fmt!r}, expected {FORMAT_NAME!r}")
    version = obj.get("version")
    if type(version) is not int or version not in SUPPORTED_VERSIONS:
        raise UnsupportedVersionError(
            f"{where}: format version {version!r} is not supported (this streamckpt reads "
            f"versions {', '.join(map(str, SUPPORTED_VERSIONS))}); upgrade streamckpt to read it"
        )
    raw_bases = obj.get("bases", [])
    if not isinstance(raw_bases, list):
        raise p.fail("bases", "must be a list of sibling checkpoint names")
    bases = tuple(p.string(b, f"bases[{i}]") for i, b in enumerate(raw_bases))
    if bases and version != REFERENCES_VERSION:
        raise CorruptCheckpointError(f"{where}: field 'bases' needs format version {REFERENCES_VERSION}, "
                                     f"the manifest says {version}")
    files = {
        p.string(name, f"files.{name}"): p.int_(p.mapping(v, f"files.{name}").get("size"), f"files.{name}.size")
        for name, v in p.mapping(obj.get("files"), "files").items()
    }
    tensors = {}
    for name, t in p.mapping(obj.get("tensors"), "tensors").items():
        tensors[name] = p.tensor(t, f"tensors.{name}")
    values = obj.get("values", {})
    metadata = obj.get("metadata", {})
    p.mapping(values, "values")
    p.mapping(metadata, "metadata")
    kind = obj.get("kind", FORMAT_NAME)
    if kind not in (FORMAT_NAME, "safetensors", "dcp"):
        raise CorruptCheckpointError(f"{where}: field 'kind' is {kind!r}")
    tree = obj.get("tree")
    committed = obj.get("committed_ns")
    if committed is not None:
        committed = p.int_(committed, "committed_ns")
    m = Manifest(tensors=tensors, files=files, values=values, metadata=metadata, kind=kind,
                 tree=None if tree is None else p.mapping(tree, "tree"), committed_ns=committed,  # type: ignore[arg-type]
                 bases=bases)
    if m.tagged_values:  # tuples, infinities and int-keyed dicts are tagged
        m.values = {k: vals.decode(v, where=f"{where}: values.{k}") for k, v in values.items()}
    validate(m, where=where)
    return m


class _Parser:
    """Typed field extraction with errors that name the field path."""

    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, path: str, msg: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{self.where}: field '{path}' {msg}")

    def mapping(self, v: Any, path: str) -> Mapping[str, Any]:
        if not isinstance(v, dict):
            raise self.fail(path or "<root>", f"must be an object, got {type(v).__name__}")
        return v

    def string(self, v: Any, path: str) -> str:
        if not isinstance(v, str):
            raise self.fail(path, f"must be a string, got {type(v).__name__}")
        return v

    def int_(self, v: Any, path: str) -> int:
        if not isinstance(v, int) or isinstance(v, bool):
            raise self.fail(path, f"must be an integer, got {v!r:.40}")
        if v < 0:
            raise self.fail(path, f"must be >= 0, got {v}")
        return v

    def ints(self, v: Any, path: str, *, max_len: int | None = None) -> tuple[int, ...]:
        if not isinstance(v, list):
            raise self.fail(path, f"must be a list of integers, got {type(v).__name__}")
        if max_len is not None and len(v) > max_len:
            raise self.fail(path, f"has {len(v)} entries, more than {max_len}")
        if not v or (set(map(type, v)) == _INT_ONLY and min(v) >= 0):  # the common case, in C loops
            return tuple(v)
        return tuple(self.int_(x, f"{path}[{i}]") for i, x in enumerate(v))

    def tensor(self, t: Any, path: str) -> TensorMeta:
        t = self.mapping(t, path)
        dtype = self.string(t.get("dtype"), f"{path}.dtype")
        dtypes.to_torch(dtype, where=f"{self.where}: {path}.dtype")
        shape = self.ints(t.get("shape"), f"{path}.shape", max_len=MAX_NDIM)
        raw_shards = t.get("shards")
        if not isinstance(raw_shards, list):
            raise self.fail(f"{path}.shards", "must be a list")
        shards = tuple(self.shard(s, f"{path}.shards[{i}]", len(shape)) for i, s in enumerate(raw_shards))
        return TensorMeta(dtype=dtype, shape=shape, shards=shards)

    def shard(self, s: Any, path: str, ndim: int) -> Shard:
        s = self.mapping(s, path)
        fr = s.get("flat_range")
        flat = None
        if fr is not None:
            flat_t = self.ints(fr, f"{path}.flat_range", max_len=2)
            if len(flat_t) != 2:
                raise self.fail(f"{path}.flat_range", "must be [start, stop]")
            flat = (flat_t[0], flat_t[1])
        crc = s.get("crc32c")
        frames = s.get("frame_lengths")
        digest = s.get("digest")
        return Shard(
            offset=self.ints(s.get("offset"), f"{path}.offset", max_len=ndim),
            shape=self.ints(s.get("shape"), f"{path}.shape", max_len=ndim),
            file=self.string(s.get("file"), f"{path}.file"),
            byte_offset=self.int_(s.get("byte_offset"), f"{path}.byte_offset"),
            byte_length=self.int_(s.get("byte_length"), f"{path}.byte_length"),
            flat_range=flat,
            codec=self.string(s.get("codec", "raw"), f"{path}.codec"),
            chunk_size=self.int_(s.get("chunk_size", 0), f"{path}.chunk_size"),
            crc32c=None if crc is None else self.ints(crc, f"{path}.crc32c"),
            frame_lengths=None if frames is None else self.ints(frames, f"{path}.frame_lengths"),
            digest=None if digest is None else self.string(digest, f"{path}.digest"),
        )


# ----------------------------------------------------------------------- validation

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def check_relative_name(name: str, *, where: str) -> None:
    """A data-file name must stay inside the checkpoint prefix."""
    bad = (
        not name
        or len(name) > 1024
        or name.startswith(("/", "\\", "~"))
        or "\\" in name
        or "\x00" in name
        or _SCHEME.match(name) is not None
        or any(part in ("", ".", "..") for part in name.split("/"))
    )
    if bad:
        raise CorruptCheckpointError(
            f"{where}: file name {name!r} is not a plain relative path inside the checkpoint"
        )


_DIGEST = re.compile(f"^[0-9a-f]{{{DIGEST_HEX}}}$")


def split_reference(name: str) -> tuple[str, str] | None:
    """``("step-1", "data/x")`` for a reference ``../step-1/data/x``; None for a file of the checkpoint itself."""
    if not name.startswith("../"):
        return None
    sibling, _, rest = name[3:].partition("/")
    return sibling, rest


def check_file_name(name: str, bases: tuple[str, ...], *, where: str) -> None:
    """A file is either inside the checkpoint, or (a reference) inside a sibling checkpoint
    listed in ``bases``: ``../<sibling>/<plain relative path>``, one level, nothing further up."""
    ref = split_reference(name)
    if ref is None:
        check_relative_name(name, where=where)
        return
    sibling, rest = ref
    if sibling not in bases:
        raise CorruptCheckpointError(
            f"{where}: file {name!r} references {sibling!r}, which is not a sibling checkpoint listed in 'bases' "
            f"({list(bases)}); a referenced file must lie in a listed sibling under the same root")
    check_relative_name(rest, where=f"{where}: file {name!r} in sibling {sibling!r}")


def validate(m: Manifest, *, where: str = MANIFEST_NAME) -> None:
    """Check every invariant of docs/FORMAT.md; raise ``CorruptCheckpointError`` on the first defect."""
    for b in m.bases:
        if "/" in b:
            raise CorruptCheckpointError(f"{where}: base {b!r} is not one sibling name (it has a '/')")
        check_relative_name(b, where=f"{where}: bases")
    for name, size in m.files.items():
        check_file_name(name, m.bases, where=where)
    for key, t in m.tensors.items():
        _validate_tensor(m, key, t, where)
    if m.tree is not None:
        trees.check(m.tree, m.tensors, m.values, where=where)


def _validate_tensor(m: Manifest, key: str, t: TensorMeta, where: str) -> None:
    path = f"tensors.{key}"
    itemsize = dtypes.itemsize(t.dtype)
    if len(t.shape) > MAX_NDIM:
        raise CorruptCheckpointError(f"{where}: {path}.shape has {len(t.shape)} dims")
    numel = 1
    for d in t.shape:
        numel *= d
        if numel * itemsize > MAX_TENSOR_BYTES:
            raise CorruptCheckpointError(f"{where}: {path}.shape {list(t.shape)} is absurdly large")
    whole_box = Box((0,) * len(t.shape), t.shape)
    for i, s in enumerate(t.shards):
        sp = f"{path}.shards[{i}]"
        if len(s.offset) != len(t.shape) or len(s.shape) != len(t.shape):
            raise CorruptCheckpointError(f"{where}: {sp} has {len(s.shape)} dims, tensor has {len(t.shape)}")
        if not whole_box.contains(s.box) and not s.box.is_empty():
            raise CorruptCheckpointError(
                f"{where}: {sp} box offset={list(s.offset)} shape={list(s.shape)} lies outside "
                f"tensor shape {list(t.shape)}"
            )
        if s.flat_range is not None:
            a, b = s.flat_range
            box_numel = math.prod(s.shape)
            if not a <= b <= box_numel:
                raise CorruptCheckpointError(f"{where}: {sp}.flat_range [{a}, {b}) outside its box of {box_numel} elements")
        _validate_bytes(m, s, s.numel * itemsize, sp, where)
    check_tiling(t.shape, [(s.box, s.flat_range) for s in t.shards], f"{where}: {path}")


def check_tiling(shape: tuple[int, ...], regions: list[tuple[Box, tuple[int, int] | None]], what: str) -> None:
    """Regions (boxes, maybe flat ranges of them) must cover a tensor exactly once."""
    numel = math.prod(shape)
    covered = 0
    pieces: list[Box] = []
    for box, flat in regions:
        if flat is not None:
            covered += flat[1] - flat[0]
            pieces.extend(bx for _, bx in flat_range_boxes(box, *flat))
        elif not box.is_empty():
            covered += box.numel
            pieces.append(box)
    if covered != numel:
        raise CorruptCheckpointError(
            f"{what} shards cover {covered} elements, tensor has {numel} "
            f"({'holes' if covered < numel else 'overlaps'})"
        )
    _check_no_overlap(pieces, what)


def _validate_bytes(m: Manifest, s: Shard, raw: int, sp: str, where: str) -> None:
    if s.codec not in CODECS:
        raise CorruptCheckpointError(f"{where}: {sp}.codec {s.codec!r} unknown (known: {', '.join(CODECS)})")
    check_file_name(s.file, m.bases, where=f"{where}: {sp}.file")
    if s.digest is not None and not _DIGEST.match(s.digest):
        raise CorruptCheckpointError(f"{where}: {sp}.digest {s.digest[:40]!r} is not {DIGEST_HEX} lowercase hex digits")
    if s.file not in m.files:
        raise CorruptCheckpointError(f"{where}: {sp}.file {s.file!r} is not listed in 'files'")
    size = m.files[s.file]
    if s.byte_offset + s.byte_length > size:
        raise CorruptCheckpointError(
            f"{where}: {sp} bytes [{s.byte_offset}, {s.byte_offset + s.byte_length}) run past "
            f"the end of {s.file!r} ({size} bytes)"
        )
    if s.codec == "raw" and s.byte_length != raw:
        raise CorruptCheckpointError(
            f"{where}: {sp}.byte_length is {s.byte_length}, but {s.numel} elements of its dtype take {raw}"
        )
    if s.chunk_size == 0:
        if s.codec != "raw" or s.crc32c is not None or s.frame_lengths is not None:
            raise CorruptCheckpointError(f"{where}: {sp} has checksums or frames but chunk_size 0")
        return
    nchunks = -(-raw // s.chunk_size)
    if s.crc32c is None or len(s.crc32c) != nchunks:
        raise CorruptCheckpointError(
            f"{where}: {sp}.crc32c must list {nchunks} checksums "
            f"({raw} bytes in chunks of {s.chunk_size}), got {len(s.crc32c or ())}"
        )
    if s.crc32c and max(s.crc32c) >= 1 << 32:
        raise CorruptCheckpointError(f"{where}: {sp}.crc32c holds a value wider than 32 bits")
    if s.codec == "zstd":
        if s.frame_lengths is None or len(s.frame_lengths) != nchunks:
            raise CorruptCheckpointError(f"{where}: {sp}.frame_lengths must list {nchunks} frames")
        if sum(s.frame_lengths) != s.byte_length:
            raise CorruptCheckpointError(
                f"{where}: {sp}.frame_lengths sum to {sum(s.frame_lengths)}, byte_length is {s.byte_length}"
            )
    elif s.frame_lengths is not None:
        raise CorruptCheckpointError(f"{where}: {sp}.frame_lengths given for codec 'raw'")


def _check_no_overlap(boxes: list[Box], what: str) -> None:
    """Sweep along the dim where shards start at the most distinct offsets (rows for
    row shards, columns for column shards): only boxes whose intervals there meet
    are compared, so a tiling costs about O(n log n)."""
    if len(boxes) < 2 or not boxes[0].ndim:
        if len(boxes) >= 2:
            raise CorruptCheckpointError(f"{what} has overlapping shards")
        return
    d = max(range(boxes[0].ndim), key=lambda k: len({b.offset[k] for b in boxes}))
    order = sorted(boxes, key=lambda b: b.offset[d])
    active: list[Box] = []
    for b in order:
        start = b.offset[d]
        active = [a for a in active if a.offset[d] + a.shape[d] > start]
        for a in active:
            hit = intersect(a, b)
            if hit is not None:
                raise CorruptCheckpointError(f"{what} shards overlap at offset {list(hit.offset)}")
        active.append(b)
