"""Every rank's target specs on the wire: compact, and each distinct piece sent once.

A load plans from every rank's ``TargetSpec`` list. Sent as JSON, each rank
receives and parses ranks × specs objects, although most ranks repeat what
others hold: DP replicas hold the same boxes, TP peers the same names, and
ZeRO slices differ only in their flat ranges. So a rank's list is encoded as
three binary *sections*, each a blob of narrow integer arrays:

* ``names``: keys, dtypes, global shapes (shared by every rank of a PP stage);
* ``boxes``: offsets, local shapes, which specs have a flat range (shared by
  DP replicas);
* ``flats``: the flat ranges (ZeRO slices; empty without them).

Two all-gathers move them. First a fixed-size header per rank: each
section's digest and length. From the headers every rank derives the same
routing: each distinct blob is cut into as many pieces as it has holders and
each holder sends one piece, so the second all-gather carries every distinct
blob once, spread over its holders. A rank then decodes each distinct blob
once and keeps the lists as those pieces (``gathered.GatheredSpecs``), from
which the planner numbers the distinct specs without a Python step per spec.

What a rank receives is ``world × (header + widest payload)``: about the sum of
the distinct blobs when holders spread evenly, and never more than a padded
all-gather of the encoded lists. Pure: no torch.distributed (the all-gather is
a callable), no pickle. Decoding is deterministic over bytes every rank
receives alike, so a malformed blob raises on every rank.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import struct
from dataclasses import dataclass
from itertools import repeat
from typing import Callable, Iterator, NamedTuple, Sequence

import numpy as np

from ..core.targets import TargetSpec
from ..errors import CheckpointError, IncompatibleStateDictError
from .gathered import GatheredSpecs, Layout

VERSION = 1
DIGEST = 16  # blake2b-128: distinct blobs collide with probability ~n²/2¹²⁹
SECTIONS = 3  # names, boxes, flats
_HEAD = struct.Struct(f"<cB{SECTIONS * (DIGEST + 4)}s")
_REF = struct.Struct(f"<{DIGEST}sI")
_COUNT = struct.Struct("<BI")  # version, number of specs (or flat ranges)
_INTS = {b"B": np.dtype("u1"), b"H": np.dtype("<u2"), b"I": np.dtype("<u4"), b"q": np.dtype("<i8")}
_U32 = struct.Struct("<I")

Ref = tuple[bytes, int]  # a blob's digest and length


class SpecWireError(CheckpointError):
    """Target metadata from a peer rank could not be decoded (a version mismatch or a bug)."""


def digest(blob: bytes) -> bytes:
    return hashlib.blake2b(blob, digest_size=DIGEST).digest()


# ----------------------------------------------------------------------------- integer arrays

def _pack_ints(values: Sequence[int]) -> bytes:
    """The narrowest little-endian array that holds ``values``: code, count, items."""
    arr = np.asarray(values) if len(values) else np.zeros(0, dtype=np.uint8)
    if arr.dtype.kind not in "iub":
        raise IncompatibleStateDictError(f"target spec fields must be integers within 64 bits, got {list(values)[:8]}")
    code = b"B"
    if arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        if hi >= 1 << 63:
            raise IncompatibleStateDictError(f"target spec integer {hi} does not fit in 64 bits")
        code = b"q" if lo < 0 else b"B" if hi < 1 << 8 else b"H" if hi < 1 << 16 else b"I" if hi < 1 << 32 else b"q"
    return code + _U32.pack(arr.size) + arr.astype(_INTS[code]).tobytes()


class _Reader:
    """Bounds-checked reads over one blob; every failure names the blob."""

    def __init__(self, blob: bytes, what: str) -> None:
        self.blob, self.pos, self.what = blob, 0, what

    def fail(self, why: str) -> SpecWireError:
        return SpecWireError(
            f"target metadata {self.what} is malformed ({why}); are all ranks running the same streamckpt version?"
        )

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.blob):
            raise self.fail(f"truncated at byte {self.pos}, wanted {n} more of {len(self.blob)}")
        out = self.blob[self.pos:self.pos + n]
        self.pos += n
        return out

    def start(self, tag: bytes) -> int:
        got = self.take(1)
        if got != tag:
            raise self.fail(f"section tag {got!r}, expected {tag!r}")
        version, n = _COUNT.unpack(self.take(_COUNT.size))
        if version != VERSION:
            raise self.fail(f"wire version {version}, this rank reads {VERSION}")
        return n

    def ints(self, count: int | None = None) -> list[int]:
        code = self.take(1)
        dtype = _INTS.get(code)
        if dtype is None:
            raise self.fail(f"integer array code {code!r}")
        (n,) = _U32.unpack(self.take(4))
        if count is not None and n != count:
            raise self.fail(f"{n} integers where {count} were expected")
        return np.frombuffer(self.take(n * dtype.itemsize), dtype=dtype).tolist()

    def strs(self, count: int) -> list[str]:
        lens = self.ints(count)
        if any(n < 0 for n in lens):
            raise self.fail("negative string length")
        raw = self.take(sum(lens))
        out, pos = [], 0
        for n in lens:
            try:
                out.append(raw[pos:pos + n].decode("utf-8", "surrogatepass"))
            except UnicodeDecodeError as e:
                raise self.fail(f"bad UTF-8 in a key ({e.reason})") from None
            pos += n
        return out

    def end(self) -> None:
        if self.pos != len(self.blob):
            raise self.fail(f"{len(self.blob) - self.pos} trailing bytes")


def _pack_strs(values: Sequence[str]) -> bytes:
    raw = [v.encode("utf-8", "surrogatepass") for v in values]
    return _pack_ints([len(r) for r in raw]) + b"".join(raw)


# ----------------------------------------------------------------------------- one rank's sections

@dataclass(frozen=True, slots=True)
class Encoded:
    """One rank's spec list as its three sections."""

    sections: tuple[bytes, ...]

    @property
    def refs(self) -> tuple[Ref, ...]:
        return tuple((digest(s), len(s)) for s in self.sections)

    def header(self) -> bytes:
        """Fixed size: version and each section's digest and length."""
        return _HEAD.pack(b"S", VERSION, b"".join(_REF.pack(d, n) for d, n in self.refs))

    @property
    def size(self) -> int:
        return sum(map(len, self.sections))


def encode(specs: Sequence[TargetSpec]) -> Encoded:
    """Encode one rank's specs; raises ``IncompatibleStateDictError`` for a spec no
    plan could use (box dims disagreeing, integers beyond 64 bits)."""
    ndims: list[int] = []
    for s in specs:
        n = len(s.global_shape)
        if len(s.offset) != n or len(s.shape) != n:
            raise IncompatibleStateDictError(
                f"{s.key}: global shape {list(s.global_shape)}, offset {list(s.offset)} and shape "
                f"{list(s.shape)} must have the same number of dimensions"
            )
        if s.flat_range is not None and len(s.flat_range) != 2:
            raise IncompatibleStateDictError(f"{s.key}: flat_range {s.flat_range!r} is not a (start, stop) pair")
        ndims.append(n)
    dtype_names = list(dict.fromkeys(s.dtype for s in specs))
    dtype_ids = {d: i for i, d in enumerate(dtype_names)}
    count = _COUNT.pack(VERSION, len(specs))
    names = b"".join([
        b"N", count, _U32.pack(len(dtype_names)), _pack_strs(dtype_names), _pack_strs([s.key for s in specs]),
        _pack_ints([dtype_ids[s.dtype] for s in specs]), _pack_ints(ndims),
        _pack_ints([d for s in specs for d in s.global_shape]),
    ])
    boxes = b"".join([
        b"B", count, _pack_ints([s.flat_range is not None for s in specs]),
        _pack_ints([d for s in specs for d in s.offset]), _pack_ints([d for s in specs for d in s.shape]),
    ])
    ranges = [v for s in specs if s.flat_range is not None for v in s.flat_range]
    flats = b"".join([b"F", _COUNT.pack(VERSION, len(ranges) // 2), _pack_ints(ranges)])
    return Encoded((names, boxes, flats))


def parse_header(blob: bytes, rank: int) -> tuple[Ref, ...]:
    """A peer's header: its sections' (digest, length)."""
    if len(blob) != _HEAD.size:
        raise _Reader(blob, f"header of rank {rank}").fail(f"{len(blob)} bytes, expected {_HEAD.size}")
    tag, version, refs = _HEAD.unpack(blob)
    if tag != b"S" or version != VERSION:
        raise _Reader(blob, f"header of rank {rank}").fail(f"tag {tag!r}, version {version}; expected b'S', {VERSION}")
    return tuple(_REF.unpack_from(refs, i * _REF.size) for i in range(SECTIONS))


# ----------------------------------------------------------------------------- who sends which bytes

class Part(NamedTuple):
    """Bytes ``[start, stop)`` of distinct blob ``blob``, sent by ``rank`` at ``pos`` of its
    payload (a tuple: there is one per rank and section, so thousands at scale)."""

    blob: int
    start: int
    stop: int
    rank: int
    pos: int


@dataclass(slots=True)
class Routing:
    """The same on every rank: the distinct blobs, who holds each, who sends which part."""

    blobs: list[Ref]  # distinct (digest, length), first-seen order (rank-major)
    of_rank: list[tuple[int, ...]]  # per rank: its sections' blob indexes
    parts: list[list[Part]]  # per blob, in byte order
    sends: list[list[Part]]  # per rank, in payload order

    @property
    def width(self) -> int:
        """The widest payload: what the padded all-gather moves per rank."""
        return max((p[-1].pos + p[-1].stop - p[-1].start for p in self.sends if p), default=0)


def route(heads: Sequence[Sequence[Ref]]) -> Routing:
    """Cut each distinct blob into one part per holder (holders in rank order)."""
    index: dict[Ref, int] = {}
    holders: list[list[int]] = []
    of_rank: list[tuple[int, ...]] = []
    for r, head in enumerate(heads):
        ids = []
        for ref in head:
            i = index.setdefault(ref, len(holders))
            if i == len(holders):
                holders.append([])
            if not holders[i] or holders[i][-1] != r:
                holders[i].append(r)
            ids.append(i)
        of_rank.append(tuple(ids))
    blobs = list(index)
    fill = [0] * len(heads)
    new = tuple.__new__
    parts: list[list[Part]] = []
    sends: list[list[Part]] = [[] for _ in heads]
    for i, ((_, length), hs) in enumerate(zip(blobs, holders)):
        step = -(-length // len(hs))
        mine = []
        for j, r in enumerate(hs):
            start, stop = min(length, j * step), min(length, (j + 1) * step)
            if stop > start:
                p = new(Part, (i, start, stop, r, fill[r]))  # Part(...) at C speed: one per rank and section
                fill[r] += stop - start
                mine.append(p)
                sends[r].append(p)
        parts.append(mine)
    return Routing(blobs, of_rank, parts, sends)


def route_headers(heads: Sequence[bytes]) -> Routing:
    """``route([parse_header(h, r) for r, h in enumerate(heads)])``, with numpy.

    Every rank routes every rank's header: at 16,384 ranks the two Python loops
    over ranks × sections cost 0.3 s of each rank's metadata path. Here only the
    distinct refs are numbered in Python (one dict look-up per section); holders,
    parts and payload positions are array operations. A header that does not parse
    goes through ``parse_header``, which raises naming the rank.
    """
    with _gc_paused():
        return _route_headers(heads)


def _route_headers(heads: Sequence[bytes]) -> Routing:
    world = len(heads)
    size = _HEAD.size
    if not world or any(len(h) != size for h in heads):
        return route([parse_header(h, r) for r, h in enumerate(heads)])
    raw = np.frombuffer(b"".join(heads), dtype=np.uint8).reshape(world, size)
    if ((raw[:, 0] != b"S"[0]) | (raw[:, 1] != VERSION)).any():
        return route([parse_header(h, r) for r, h in enumerate(heads)])
    width = DIGEST + 4
    keys = raw[:, 2:].reshape(-1).view(np.dtype((np.void, width))).tolist()  # rank-major: entry r * SECTIONS + s
    index: dict[bytes, int] = {}
    seen = index.setdefault
    ids = np.array([seen(k, len(index)) for k in keys], dtype=np.int64)
    blobs: list[Ref] = [(k[:DIGEST], int.from_bytes(k[DIGEST:], "little")) for k in index]
    by_rank = ids.reshape(world, SECTIONS)
    of_rank = list(map(tuple, by_rank.tolist()))
    keep = np.ones((world, SECTIONS), dtype=bool)  # a rank holds a blob once, however many sections carry it
    for s in range(1, SECTIONS):
        keep[:, s] = ~(by_rank[:, :s] == by_rank[:, s:s + 1]).any(axis=1)
    blob = ids[keep.reshape(-1)]
    rank = np.repeat(np.arange(world, dtype=np.int64), SECTIONS)[keep.reshape(-1)]
    order = np.argsort(blob, kind="stable")  # by blob, holders in rank order
    blob, rank = blob[order], rank[order]
    count = np.bincount(blob, minlength=len(blobs))
    first = np.zeros(len(blobs) + 1, dtype=np.int64)
    np.cumsum(count, out=first[1:])
    j = np.arange(len(blob), dtype=np.int64) - first[blob]  # holder index within its blob
    length = np.array([n for _, n in blobs], dtype=np.int64)
    step = -(-length // np.maximum(count, 1))
    start = np.minimum(length[blob], j * step[blob])
    stop = np.minimum(length[blob], (j + 1) * step[blob])
    some = stop > start
    blob, rank, start, stop = blob[some], rank[some], start[some], stop[some]
    by_sender = np.argsort(rank, kind="stable")  # each rank's parts in blob order: its payload
    sizes = (stop - start)[by_sender]
    ends = np.cumsum(sizes)
    sent = np.bincount(rank, minlength=world)
    rank_first = np.zeros(world + 1, dtype=np.int64)
    np.cumsum(sent, out=rank_first[1:])
    before = ends - sizes  # bytes before each part in all payloads back to back
    senders = sent > 0
    pos = np.empty(len(blob), dtype=np.int64)
    pos[by_sender] = before - np.repeat(before[rank_first[:-1][senders]], sent[senders])
    made = np.empty(len(blob), dtype=object)
    made[:] = list(map(tuple.__new__, repeat(Part), zip(blob.tolist(), start.tolist(), stop.tolist(),
                                                          rank.tolist(), pos.tolist())))
    parts = _split(made.tolist(), np.bincount(blob, minlength=len(blobs)))
    sends = _split(made[by_sender].tolist(), sent)
    return Routing(blobs, of_rank, parts, sends)


def _split(items: list[Part], counts: np.ndarray) -> list[list[Part]]:
    """``items`` cut into consecutive lists of ``counts`` items."""
    bounds = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=bounds[1:])
    b = bounds.tolist()
    return [items[x:y] for x, y in zip(b, b[1:])]


def payload(routing: Routing, rank: int, enc: Encoded) -> bytes:
    """What ``rank`` sends in the second all-gather: its parts, back to back."""
    mine = {i: s for i, s in zip(routing.of_rank[rank], enc.sections)}
    return b"".join(mine[p.blob][p.start:p.stop] for p in routing.sends[rank])


def assemble(routing: Routing, payloads: Sequence[bytes]) -> list[bytes]:
    """Every distinct blob from the gathered payloads, each checked against its digest.

    The collector is paused, as in ``decode_all``: the tens of thousands of
    memoryview slices would trigger collections that cost 8× the copying.
    """
    with _gc_paused():
        return _assemble(routing, payloads)


def _assemble(routing: Routing, payloads: Sequence[bytes]) -> list[bytes]:
    views = [memoryview(p) for p in payloads]
    out = []
    for i, ((want, length), parts) in enumerate(zip(routing.blobs, routing.parts)):
        blob = b"".join(views[p.rank][p.pos:p.pos + p.stop - p.start] for p in parts)
        if len(blob) != length or digest(blob) != want:
            owner = parts[0].rank if parts else "?"
            raise _Reader(blob, f"blob {i} (first held by rank {owner})").fail(
                f"{len(blob)} bytes whose digest differs from the header's ({length} bytes)"
            )
        out.append(blob)
    return out


# ----------------------------------------------------------------------------- decoding

@dataclass(frozen=True, slots=True)
class _Names:
    keys: list[str]
    dtypes: list[str]
    ndims: list[int]
    shapes: list[tuple[int, ...]]


def _cut(flat: list[int], ndims: Sequence[int]) -> list[tuple[int, ...]]:
    out, pos = [], 0
    for n in ndims:
        out.append(tuple(flat[pos:pos + n]))
        pos += n
    return out


def _names(blob: bytes, what: str) -> _Names:
    rd = _Reader(blob, what)
    n = rd.start(b"N")
    (k,) = _U32.unpack(rd.take(4))
    table = rd.strs(k)
    keys = rd.strs(n)
    ids = rd.ints(n)
    ndims = rd.ints(n)
    if any(not 0 <= i < k for i in ids) or any(d < 0 for d in ndims):
        raise rd.fail("dtype index or dimension count out of range")
    shapes = _cut(rd.ints(sum(ndims)), ndims)
    rd.end()
    return _Names(keys, [table[i] for i in ids], ndims, shapes)


def _layout(names: _Names, blob: bytes, what: str) -> Layout:
    rd = _Reader(blob, what)
    n = rd.start(b"B")
    if n != len(names.keys):
        raise rd.fail(f"{n} boxes for {len(names.keys)} names")
    has_flat = rd.ints(n)
    total = sum(names.ndims)
    offsets = _cut(rd.ints(total), names.ndims)
    shapes = _cut(rd.ints(total), names.ndims)
    rd.end()
    specs = list(map(TargetSpec, names.keys, names.dtypes, names.shapes, offsets, shapes))
    where = [i for i, f in enumerate(has_flat) if f]
    columns = tuple([col[i] for i in where] for col in (names.keys, names.dtypes, names.shapes, offsets, shapes))
    return Layout(specs, where, columns)


def _flats(blob: bytes, what: str) -> list[tuple[int, int]]:
    rd = _Reader(blob, what)
    m = rd.start(b"F")
    v = rd.ints(2 * m)
    rd.end()
    return list(zip(v[0::2], v[1::2]))


def decode_all(routing: Routing, blobs: Sequence[bytes]) -> GatheredSpecs:
    """Every rank's spec list, each distinct blob (and pairing) decoded once.

    The lists stay as their distinct pieces (``gathered.GatheredSpecs``): a
    rank's list is built when asked for, and the planner numbers the distinct
    specs from the pieces without building the ranks × specs objects.
    """
    names: dict[int, _Names] = {}
    layouts: dict[tuple[int, int], int] = {}
    flats: dict[int, int] = {}
    lay_list: list[Layout] = []
    flat_list: list[list[tuple[int, int]]] = []
    of_rank: list[tuple[int, int]] = []
    with _gc_paused():
        for r, (ni, bi, fi) in enumerate(routing.of_rank):
            if ni not in names:
                names[ni] = _names(blobs[ni], f"names of rank {r}")
            li = layouts.get((ni, bi))
            if li is None:
                li = layouts[ni, bi] = len(lay_list)
                lay_list.append(_layout(names[ni], blobs[bi], f"boxes of rank {r}"))
            if fi not in flats:
                flats[fi] = len(flat_list)
                flat_list.append(_flats(blobs[fi], f"flat ranges of rank {r}"))
            lay, ranges = lay_list[li], flat_list[flats[fi]]
            if len(ranges) != len(lay.where):
                raise _Reader(blobs[fi], f"flat ranges of rank {r}").fail(
                    f"{len(ranges)} flat ranges for {len(lay.where)} specs that take one"
                )
            of_rank.append((li, flats[fi]))
    return GatheredSpecs(lay_list, flat_list, of_rank)


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Like the planner: hundreds of thousands of acyclic tuples would trigger
    collections that cost more than building them."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def exchange(enc: Encoded, heads: Sequence[bytes], rank: int,
             all_gather: Callable[[bytes], list[bytes]]) -> GatheredSpecs:
    """The second half of the gather, after the headers: route, send, assemble, decode."""
    routing = route_headers(heads)
    return decode_all(routing, assemble(routing, all_gather(payload(routing, rank, enc))))
