"""Greedy round packing of shared and private reads, alike on every rank.

A read goes to the earliest round (at or after each involved rank's current
one) where every rank it involves still has room for what it costs that rank
(``routes.costs_of``). Pure integers: no I/O, no ranks.

Each rank's state is one integer, ``round << 64 | bytes used in that round``,
and placing a read with cost ``c`` on a rank is ``state = max(state, base) + c``
where ``base = round << 64``. That makes a replicated read cheap: the round a
set of ranks taking the same cost needs is the one the greatest of their states
needs (a later round wins, and in the same round the fuller rank); and a run of
reads over one set of ranks (a DP group reading one tensor after another)
updates the whole set lazily, since ``max(max(s, B) + A, base) + c`` is again
``max(s, B') + A'``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from .data import Read, Target, holders_of, is_packed, message_layout, read_cost
from .routes import costs_of, grid_entries, relay_costs
from .needs import Group
from .ranksets import RankSets

SHIFT = 64  # a rank's round sits above its bytes used (used < 2**63)
# a grid read of D dimensions (it holds bytes for D rounds) that first fits in a round that
# is not a multiple of D goes to the next multiple, where every grid of its size starts its
# pieces, when that is at most this much later
PHASE_SLACK = 2
USED = (1 << SHIFT) - 1


@dataclass(slots=True)
class _Run:
    """Reads over one set of ranks in a row: rank x's state is ``max(s0[x], low) + add``."""

    ranks: list[int]
    s0: dict[int, int]
    top: int  # max(s0.values())
    low: int = -1
    add: int = 0


class RoundPacker:
    """Places reads one after another into rounds within ``cap`` bytes per rank."""

    def __init__(self, world: int, cap: int, max_peers: int = 0) -> None:
        self.cap = cap
        self.state = [0] * world
        self.touched: set[int] = set()
        self._run: _Run | None = None
        self.max_peers = max_peers  # relayed reads: distinct peers per rank and round (0: no limit)
        self.peers: dict[int, dict[int, set[int]]] = {}  # rank -> round -> its tree-relay peers there
        # bytes a relayed read takes from a rank in rounds after the one its state is in
        # (the later depths of a relay): the rank still takes reads in its current round
        self.future: dict[int, dict[int, int]] = {}
        self.last: dict[tuple[int, ...], int] = {}  # holder set -> round of its last relayed read

    def _needs(self, state: int, cost: int) -> int:
        """The earliest round a rank in ``state`` can take ``cost`` more bytes in."""
        used = state & USED
        return (state >> SHIFT) + (1 if used and used + cost > self.cap else 0)

    def place(self, r: Read, targets: Sequence[Target]) -> None:
        """Give ``r`` its round and charge every rank it involves."""
        if r.private:
            self._flush()
            self._charge(r, {r.reader: read_cost(r)})
            return
        if r.relay:
            self._flush()
            self._charge_relay(r, targets)
            return
        uniform = uniform_costs(r, targets)
        if uniform is not None and self.future and (self._run is None or self._run.ranks is not uniform[0]) \
                and any(x in self.future for x in uniform[0]):
            uniform = None  # a rank with later relay rounds booked: placed read by read
        if uniform is None or r.reader not in uniform[0]:
            self._flush()
            self._charge(r, costs_of(r, targets))
            return
        ranks, size, reader_cost = uniform
        run = self._run
        if run is None or (run.ranks is not ranks and run.ranks != ranks):
            self._flush()
            run = self._run = _Run(ranks, {x: self.state[x] for x in ranks}, max(self.state[x] for x in ranks))
            self.touched.update(ranks)
        reader = r.reader
        low, add = run.low, run.add
        mine = max(run.s0[reader], low) + add
        rnd = max(self._needs(mine, reader_cost), self._needs(max(run.top, low) + add, size))
        base = rnd << SHIFT
        run.low = max(low, base - add)
        run.add = add + size
        # the reader takes more than the others: fold its own state back into the run
        s0 = max(mine, base) + reader_cost - run.add
        run.s0[reader] = s0
        if s0 > run.top:
            run.top = s0
        r.round = rnd

    def _charge(self, r: Read, costs: dict[int, int]) -> None:
        state = self.state
        rnd = max(self._needs(state[rank], c) for rank, c in costs.items())
        if self.future and any(rank in self.future for rank in costs):
            rnd = self._first_fit({rank: [(0, c, ())] for rank, c in costs.items()}, rnd, 0)
            for rank, c in costs.items():
                self._take(rank, rnd, c, ())
        else:
            base = rnd << SHIFT
            for rank, c in costs.items():
                s = state[rank]
                state[rank] = (s if s >= base else base) + c
        self.touched.update(costs)
        r.round = rnd

    def _fits(self, rank: int, t: int, c: int, new: Sequence[int], limit: int) -> bool:
        """Whether ``rank`` can take ``c`` bytes (and ``new`` relay peers) in round ``t``."""
        s = self.state[rank]
        cur = s >> SHIFT
        if t < cur:
            return False
        if t == cur:
            used = s & USED
        else:
            fut = self.future.get(rank)
            used = fut.get(t, 0) if fut is not None else 0
        if used and used + c > self.cap:
            return False
        if limit and new:
            seen = self.peers.get(rank, {}).get(t)
            if seen is not None and len(seen.union(new)) > limit:
                return False
        return True

    def _first_fit(self, cells: Mapping[int, Sequence[tuple[int, int, Sequence[int]]]], low: int, limit: int) -> int:
        """The first round from ``low`` where every rank fits at every depth: each pass moves
        the round to the latest of each entry's next fitting round, until none moves it."""
        rnd = low
        while True:
            need = rnd
            state = self.state
            for rank, per in cells.items():
                cur = state[rank] >> SHIFT
                for d, c, new in per:
                    t = rnd + d
                    if t < cur:
                        t = cur
                    while not self._fits(rank, t, c, new, limit):
                        t += 1
                    if t - d > need:
                        need = t - d
            if need == rnd:
                return rnd
            rnd = need

    def _take(self, rank: int, t: int, c: int, new: Sequence[int]) -> None:
        """Charge ``rank`` ``c`` bytes in round ``t``: its current round, a later one it moves
        to (taking what relays booked there), or, for a relay's later depths, a booking."""
        s = self.state[rank]
        cur = s >> SHIFT
        fut = self.future.get(rank)
        if t == cur:
            self.state[rank] = s + c
        else:
            booked = fut.pop(t, 0) if fut is not None else 0
            self.state[rank] = (t << SHIFT) + booked + c
            if fut is not None:
                for x in [x for x in fut if x < t]:
                    del fut[x]
                if not fut:
                    del self.future[rank]
            mine = self.peers.get(rank)
            if mine is not None:  # rounds behind the rank's current one take nothing more
                for x in [x for x in mine if x < t]:
                    del mine[x]
        if new:
            self.peers.setdefault(rank, {}).setdefault(t, set()).update(new)

    def _book(self, rank: int, t: int, c: int, new: Sequence[int]) -> None:
        """A relay's later depth: bytes in round ``t`` after the rank's current one."""
        fut = self.future.setdefault(rank, {})
        fut[t] = fut.get(t, 0) + c
        if new:
            self.peers.setdefault(rank, {}).setdefault(t, set()).update(new)

    def _charge_relay(self, r: Read, targets: Sequence[Target]) -> None:
        """Place a relayed read: the earliest first round where, at every depth, each rank has
        room for its bytes and stays within ``max_peers`` distinct relay peers. A rank's
        first depth decides (its later depths fall in rounds after its current one)."""
        key = tuple(holders_of(r, targets))
        # a holder set's pieces come in file order and take rounds about in that order: the
        # search starts at the last one's (not at round 0, past every booked round)
        low = self.last.get(key, 0)
        if r.grid:
            self._charge_grid(r, targets, key, low)
            return
        else:
            cells = relay_costs(r, targets)
            rnd = self._first_fit(cells, low, self.max_peers)
        self.last[key] = rnd
        tree = not r.grid  # a grid bounds each round's peers by its shape: only trees are counted
        for rank, per in cells.items():  # rounds after a rank's current one are booked: it still fills its current one
            cur = self.state[rank] >> SHIFT
            for d, c, new in per:
                if rnd + d == cur:
                    self._take(rank, cur, c, new if tree else ())
                else:
                    self._book(rank, rnd + d, c, new if tree else ())
        self.touched.update(cells)
        r.round = rnd

    def _charge_grid(self, r: Read, targets: Sequence[Target], key: tuple[int, ...], low: int) -> None:
        """``_charge_relay`` for a grid read, in one pass per candidate round over its holders:
        each holds ``size`` bytes from the depth it first holds the piece at to the last
        (``routes.grid_entries``), the reader its read at depth 0. Its hops depend on its
        round's place among the grid's dimensions, so the layout is redone per phase. A first
        fit off a multiple of the grid's dimension count moves to the next multiple when that
        fits within ``PHASE_SLACK`` rounds: grids of one size start their pieces together, and
        a holder set does not drift into rounds that fetch for it alone."""
        holders = holders_of(r, targets)
        size = message_layout(r.copies)[1]
        packed = is_packed(r.copies)
        dims = len(r.grid)
        period = max(1, dims - (1 if r.grid_nodes else 0))
        variants: dict[int, tuple[list[int], list[int], int]] = {}
        rnd = self._grid_fit(r, holders, size, packed, variants, low, 1)
        if rnd % dims:  # off the rounds where grids of its size start their pieces: there, if that is near
            aligned = self._grid_fit(r, holders, size, packed, variants, rnd + dims - rnd % dims, dims)
            if aligned - rnd <= PHASE_SLACK:
                rnd = aligned
        r.round = rnd
        got, (r0,), first = variants[rnd % period]
        state, future = self.state, self.future
        self.last[key] = rnd
        for p, rank in enumerate(holders):  # rounds after a rank's current one are booked
            s = state[rank]
            cur = s >> SHIFT
            d = 0 if p == r0 else got[p]
            c = first if p == r0 else size
            while d < dims:
                t = rnd + d
                if t == cur:
                    self._take(rank, cur, c, ())
                else:
                    fut = future.get(rank)
                    if fut is None:
                        fut = future[rank] = {}
                    fut[t] = fut.get(t, 0) + c
                d += 1
                c = size
        self.touched.update(holders)
        r.round = rnd

    def _grid_fit(self, r: Read, holders: Sequence[int], size: int, packed: bool,
                  variants: dict[int, tuple[list[int], list[int], int]], low: int, step: int) -> int:
        """The first round from ``low``, a multiple of ``step`` (``low`` is one), where every
        holder of grid read ``r`` has room at every depth; ``variants`` caches the layout of
        each phase (``routes.grid_entries``)."""
        dims = len(r.grid)
        period = max(1, dims - (1 if r.grid_nodes else 0))
        state, future, cap = self.state, self.future, self.cap
        rnd = low
        while True:
            r.round = rnd
            phase = rnd % period
            entry = variants.get(phase)
            if entry is None:
                entry = variants[phase] = grid_entries(r, holders, size, packed)
            got, (r0,), first = entry
            need = rnd
            for p, rank in enumerate(holders):
                s = state[rank]
                cur = s >> SHIFT
                fut = future.get(rank)
                d = 0 if p == r0 else got[p]
                c = first if p == r0 else size
                while d < dims:
                    t = rnd + d
                    if t < cur:
                        t = cur
                    while True:
                        u = (s & USED) if t == cur else (fut.get(t, 0) if fut is not None else 0)
                        if not u or u + c <= cap:
                            break
                        t += 1
                    if t - d > need:
                        need = t - d
                    d += 1
                    c = size
            if need == rnd:
                return rnd
            rnd = -(-need // step) * step

    def _flush(self) -> None:
        """Write the current run's states out."""
        run = self._run
        if run is None:
            return
        state, low, add = self.state, run.low, run.add
        for x, s in run.s0.items():
            state[x] = (s if s >= low else low) + add
        self._run = None

    def count(self, ranks: Iterable[int]) -> int:
        """Rounds used by the busiest of ``ranks`` so far."""
        self._flush()
        last = [(self.state[r] >> SHIFT) + 1 for r in ranks if r in self.touched]
        last += [max(self.future[r]) + 1 for r in ranks if r in self.future]
        return max(last, default=0)


def uniform_costs(r: Read, targets: Sequence[Target]) -> tuple[list[int], int, int] | None:
    """``costs_of`` for a read whose copies all go to one set of ranks (a replicated
    box), as (those ranks, what each but the reader takes, what the reader takes);
    None when the copies' ranks differ, or when the reader would take less than the
    others (the packer bounds the reader by the others' maximum)."""
    copies = r.copies
    first = targets[copies[0].target].needers
    for c in copies:
        if targets[c.target].needers is not first:
            return None
    reader = r.reader
    others = len(first) - (1 if reader in first else 0)
    if not others:
        return first, 0, read_cost(r)
    size = message_layout(copies)[1]
    reader_cost = read_cost(r) + (size * others if is_packed(copies) else 0)
    if reader_cost < size:
        return None
    return first, size, reader_cost


def reachable(groups: list[Group], rank: int, world: int, targets: Sequence[Target]) -> list[bool]:
    """Which shared reads (as ``needs.group_needs`` groups them) one rank's plan must
    place: those whose ranks connect to ``rank`` through other shared reads.

    Readers and rounds of shared reads are decided read by read from per-rank loads
    and states, and a read changes only its own ranks'. So the reads of ranks that
    share no read with this rank's connected set, directly or through others, never
    change what this rank's reads get (a PP stage's DP groups, at scale, never meet
    another stage's files). Holder lists are compared by identity: ``gathered.distinct`` gives
    equal lists of several ranks one object.
    """
    sets = RankSets(world)
    heads = [sets.join_holders(targets[n.copy.target].needers for n in members) for _, _, _, members, _ in groups]
    mine = sets.find(rank)
    return [sets.find(h) == mine for h in heads]
