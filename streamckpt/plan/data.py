"""The plan's plain data: options, the name view, targets, reads, copies, messages.

``build_plan`` (in ``planner``) makes a ``LoadPlan``; ``loading.pipeline`` executes one. The
message helpers here fix how a read's pieces travel to the ranks that need them
(their layout in one message and what they cost in a round), so that the
planner and the executor size every buffer alike. No I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, NamedTuple, Protocol, Sequence

import numpy as np

from ..core import dtypes
from ..core.manifest import Manifest, Shard
from ..core.regions import Box, row_major_strides
from ..core.targets import TargetSpec

ALIGN = 64  # staging and message layouts place every piece at a multiple of this


@dataclass(frozen=True, slots=True)
class PlanOptions:
    memory_budget: int = 256 << 20
    max_gap_bytes: int = 1 << 20
    max_request_bytes: int = 16 << 20
    read_once: bool = True
    max_round_bytes: int = 32 << 20
    max_peers: int = 8  # ranks one rank exchanges with per round for one holder set's relayed reads
    min_split_bytes: int = 1 << 20  # smallest piece a relayed holder set's reads are split into
    ranks_per_node: int = 0  # ranks r // ranks_per_node share a node (its NIC); 0: unknown
    # a contiguous piece of a message at least this large goes as a message of its own
    # (loading.schedule.split_message); the executor's, not the planner's: costs are unchanged
    direct_message_bytes: int = 256 << 10

    @property
    def relay_above(self) -> int:
        """Holders a shared read may have and still go straight from its reader to each of
        them (``max_peers`` receivers); a read with more is relayed along a tree."""
        return max(2, self.max_peers) + 1

    @property
    def fanout(self) -> int:
        """Children of a relay tree's node: with its parent, ``max_peers`` peers."""
        return max(1, self.max_peers - 1)

    @property
    def round_cap(self) -> int:
        """Bytes one round may stage per rank: two rounds are alive at once, and a
        round stays small (``max_round_bytes``) even under a large budget, so that
        fetching, exchanging and scattering overlap and the arenas stay cheap to fault in.
        One ``ALIGN`` is kept back for the tail the executor's arena layout adds to a round."""
        return max(1, min(self.memory_budget // 2, self.max_round_bytes) - ALIGN)

    @property
    def max_piece_bytes(self) -> int:
        """Largest span one piece of a need covers: half a round, so that a read and
        what it sends (or a zstd read and its decoded bytes) fit in one."""
        return max(4096, min(self.max_request_bytes, self.round_cap // 2))


# ------------------------------------------------------------------ the view


@dataclass(frozen=True, slots=True)
class Segment:
    """Part of a target box that comes from one source tensor box."""

    source_key: str
    source_box: Box
    target_box: Box
    perm: tuple[int, ...] | None = None


class ViewLike(Protocol):
    tensors: Mapping[str, Any]  # name -> object with .shape, .dtype, .source_dtype

    def map_box(self, name: str, box: Box) -> Sequence[Any]: ...


@dataclass(frozen=True, slots=True)
class _IdentityTensor:
    shape: tuple[int, ...]
    dtype: str
    source_dtype: str


class IdentityView:
    """Checkpoint names as they are: every target box maps to itself."""

    def __init__(self, manifest: Manifest) -> None:
        self.tensors = {k: _IdentityTensor(t.shape, t.dtype, t.dtype) for k, t in manifest.tensors.items()}
        self.transformed = False

    def map_box(self, name: str, box: Box) -> list[Segment]:
        return [Segment(name, box, box, None)]


# ------------------------------------------------------------------ plan data


class Target(NamedTuple):
    """A distinct target region and the ranks that hold it (a tuple: a plan at
    scale makes hundreds of thousands, and tuples are built at C speed)."""

    spec: TargetSpec
    needers: list[int]


class Targets(Sequence[Target]):
    """A plan's targets by id, each ``Target`` built when first used.

    A one-rank plan at scale uses a small part of the distinct targets (its PP
    stage's shared ones, its own, their ZeRO neighbours); the rest stay unbuilt,
    and so do their specs when ``specs`` is lazy (``gathered.LazySpecs``).
    Iterating builds them all.
    """

    __slots__ = ("_specs", "_needers", "_built")

    def __init__(self, specs: Sequence[TargetSpec], needers: Sequence[list[int]]) -> None:
        self._specs = specs
        self._needers = needers
        self._built: list[Target | None] = [None] * len(needers)

    def __len__(self) -> int:
        return len(self._built)

    def __getitem__(self, u: Any) -> Any:
        if isinstance(u, slice):
            return [self[i] for i in range(*u.indices(len(self)))]
        got = self._built[u]
        if got is None:
            got = self._built[u] = tuple.__new__(Target, (self._specs[u], self._needers[u]))
        return got

    def __iter__(self) -> Any:
        return (self[u] for u in range(len(self)))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]


@dataclass(slots=True, eq=False)
class Copy:
    """One strided copy from a staged byte span into one target.

    Source: ``length`` bytes at ``offset`` of the read's staging buffer, viewed as
    ``src_dtype`` with ``src_shape``/``src_strides`` (elements). Destination: the
    box ``dst_box`` (relative to the destination frame) of target ``target``; the
    frame is the target's local tensor itself when ``dst_base`` is None, else the
    contiguous sub-box ``dst_frame`` at element ``dst_base`` of a 1-D local tensor.
    ``perm`` permutes source dims into target order.
    """

    target: int
    offset: int
    length: int
    src_dtype: str
    src_shape: tuple[int, ...]
    src_strides: tuple[int, ...]
    dst_box: Box
    dst_base: int | None = None
    dst_frame: tuple[int, ...] | None = None
    perm: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class ChunkRun:
    """Chunks ``[lo, hi)`` of one stored shard inside a read (checked, maybe decoded)."""

    shard: Shard
    raw_total: int  # raw bytes of the whole shard
    lo: int
    hi: int
    file_start: int  # file offset of chunk ``lo``
    out_start: int  # decoded offset of chunk ``lo`` in the staging buffer (zstd)

    def raw_len(self, c: int) -> int:
        return min(self.shard.chunk_size, self.raw_total - c * self.shard.chunk_size)


@dataclass(slots=True)
class Read:
    """One range request and what its bytes are for.

    Checksums and zstd frames are kept as chunk runs and expanded only by the
    rank that performs the read, so planning stays O(pieces), not O(chunks).
    """

    file: str
    start: int
    stop: int
    reader: int
    runs: tuple[ChunkRun, ...]
    zstd: bool
    staging: int  # bytes of the decoded staging buffer
    copies: list[Copy]
    private: bool = False  # serves only its reader (no messages)
    round: int = 0
    tag: int = 0  # message tag, the same on every rank that plans this read
    relay: int = 0  # relayed among its holders within this many peers per round (``max_peers``); 0: sent directly
    grid: tuple[int, ...] = ()  # relayed over its holders as a grid of these sizes (``grid_hops``), not a tree
    grid_nodes: bool = False  # the grid's first dimension is each node's holders, crossed last
    root: bool = False  # relayed from a reader that needs none of it (a tier's holder): one more holder

    @property
    def length(self) -> int:
        return self.stop - self.start

    @property
    def checks(self) -> tuple[tuple[int, int, int], ...]:
        """(offset from ``start``, stored length, CRC32C) of every covered chunk."""
        out: list[tuple[int, int, int]] = []
        for run in self.runs:
            s = run.shard
            pos = run.file_start - self.start
            crcs = s.crc32c
            if s.frame_lengths is None:  # raw: whole chunks but maybe the shard's last (a read has thousands)
                size, lo = s.chunk_size, run.lo
                whole = min(run.hi, run.raw_total // size)
                out += [(pos + (c - lo) * size, size, crcs[c]) for c in range(lo, whole)]  # type: ignore[index]
                if whole < run.hi:
                    out.append((pos + (whole - lo) * size, run.raw_len(whole), crcs[whole]))  # type: ignore[index]
                continue
            for c in range(run.lo, run.hi):
                n = s.frame_lengths[c]
                out.append((pos, n, crcs[c]))  # type: ignore[index]
                pos += n
        return tuple(out)

    @property
    def frames(self) -> tuple[tuple[int, int, int, int], ...] | None:
        """zstd: (in_off, in_len, out_off, out_len) of every frame to decode; None for raw."""
        if not self.zstd:
            return None
        out = []
        for run in self.runs:
            s = run.shard
            pos = run.file_start - self.start
            dst = run.out_start
            for c in range(run.lo, run.hi):
                n = s.frame_lengths[c]  # type: ignore[index]
                raw = run.raw_len(c)
                out.append((pos, n, dst, raw))
                pos += n
                dst += raw
        return tuple(out)


@dataclass(slots=True)
class LoadPlan:
    """The reads a rank takes part in (every rank's with ``rank=None``) and their rounds.

    A plan made for one rank is complete only after ``settle_rounds``: the
    rounds of reads shared between ranks that planned them apart depend on two
    maxima over all ranks (see ``settle_rounds``).
    """

    world_size: int
    targets: Sequence[Target]  # a list, or ``Targets`` built on use (a one-rank plan from gathered pieces)
    reads: list[Read]
    num_rounds: int
    rank_targets: list[list[int]]  # per rank: target id of each of its specs, -1 if missing
    missing: list[list[str]]  # per rank
    unexpected: list[str]
    options: PlanOptions = field(default_factory=PlanOptions)
    rank: int | None = None  # None: planned for every rank
    base_rounds: int = 0  # rounds before the edge rounds (this plan's own claim until settled)
    edge_degree: int = 0  # distinct rank groups this plan's edge reads serve (the max over ranks once settled)
    edge_reads: list[Read] = field(default_factory=list)
    settled: bool = False

    def needers_of(self, copy: Copy) -> list[int]:
        return self.targets[copy.target].needers

    def round_claim(self) -> list[int]:
        """What this rank contributes to the two maxima that place edge reads."""
        return [self.base_rounds, self.edge_degree]

    def place_edges(self, base_rounds: int, degree: int) -> int:
        """Give edge reads their rounds after ``base_rounds``; returns the edge rounds this plan uses.

        Reads shared between private targets of different ranks (a checksum
        chunk at the seam of two ZeRO slices) are planned by each rank that
        needs them, each seeing the same reads in the same order. Every group
        of ranks packs its edge reads greedily into ``round_cap / degree``
        bytes per round, so that a rank in at most ``degree`` groups stays
        within its budget in every edge round.
        """
        from .routes import costs_of  # routes builds on this module's reads and targets

        self.base_rounds = base_rounds
        self.edge_degree = degree
        share = max(1, self.options.round_cap // max(1, degree))
        groups: dict[tuple[int, ...], list[Read]] = {}
        for r in self.edge_reads:
            groups.setdefault(ranks_of(r, self.targets), []).append(r)
        used_rounds = 0
        for reads in groups.values():
            j, used = 0, 0
            for r in reads:
                cost = max(costs_of(r, self.targets).values())
                if used > 0 and used + cost > share:
                    j, used = j + 1, 0
                used += cost
                r.round = base_rounds + j
            used_rounds = max(used_rounds, j + 1)
        return used_rounds

    def finish(self, edge_rounds: int) -> None:
        self.num_rounds = self.base_rounds + edge_rounds
        self.settled = True


def settle_rounds(plan: LoadPlan, reduce_max: Callable[[list[int]], list[int]]) -> LoadPlan:
    """Complete a one-rank plan: ``reduce_max`` is an element-wise max over all ranks' lists."""
    if plan.settled:
        return plan
    base, degree = reduce_max(plan.round_claim())
    (edge_rounds,) = reduce_max([plan.place_edges(base, degree)])
    plan.finish(edge_rounds)
    return plan


def settle_all(plans: Sequence[LoadPlan]) -> None:
    """``settle_rounds`` for one-rank plans held side by side (simulations, benchmarks)."""
    claims = [p.round_claim() for p in plans]
    base, degree = (max(c[i] for c in claims) for i in range(2))
    edge_rounds = max(p.place_edges(base, degree) for p in plans)
    for p in plans:
        p.finish(edge_rounds)



# ------------------------------------------------------------------ messages and costs


def wire_length(c: Copy) -> int:
    """Bytes of a copy's elements alone: what a message carries for it (a strided
    copy is packed, not sent with the bytes between its rows)."""
    return math.prod(c.src_shape) * dtypes.itemsize(c.src_dtype)


def is_packed(copies: Sequence[Copy]) -> bool:
    """Whether a message is built in a pack buffer (else it is a slice of the staged read)."""
    return len(copies) > 1 or wire_length(copies[0]) != copies[0].length


def message_layout(copies: Sequence[Copy]) -> tuple[list[int], int]:
    """Offsets of copies' elements packed back to back (aligned) in one message, and its size."""
    offs = []
    pos = 0
    for c in copies:
        offs.append(pos)
        pos += -(-wire_length(c) // ALIGN) * ALIGN
    return offs, pos


def message_size(copies: Sequence[Copy]) -> int:
    """Bytes a message occupies on the wire and in its receive buffer."""
    return message_layout(copies)[1] if is_packed(copies) else copies[0].length


def packed_copy(c: Copy) -> Copy:
    """The copy as its receiver applies it from a packed message: contiguous elements."""
    return Copy(c.target, 0, wire_length(c), c.src_dtype, c.src_shape, row_major_strides(c.src_shape),
                c.dst_box, c.dst_base, c.dst_frame, c.perm)


def read_cost(r: Read) -> int:
    """Staging bytes a read takes on its reader: fetch buffer (+ decode buffer)."""
    fetch = -(-r.length // ALIGN) * ALIGN + ALIGN
    return fetch + (-(-r.staging // ALIGN) * ALIGN if r.zstd else 0)


def messages_of(r: Read, targets: Sequence[Target]) -> dict[int, list[Copy]]:
    """Receiver rank -> the copies of read ``r`` it needs (none for private reads)."""
    out: dict[int, list[Copy]] = {}
    if r.private:
        return out
    for c in r.copies:
        for rank in targets[c.target].needers:
            if rank != r.reader:
                out.setdefault(rank, []).append(c)
    return out


def holders_of(r: Read, targets: Sequence[Target]) -> list[int]:
    """The ranks of a relayed read's tree or grid, ascending: its copies' one holder set, and
    with ``r.root`` its reader too (which sends the piece on and keeps none of it)."""
    needers = targets[r.copies[0].target].needers
    if not r.root:
        return needers
    return sorted([r.reader, *needers])


def ranks_of(r: Read, targets: Sequence[Target]) -> tuple[int, ...]:
    return tuple(sorted({n for c in r.copies for n in targets[c.target].needers}))


