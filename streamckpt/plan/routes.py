"""Routes of a read's bytes to the ranks that need them: sent directly by the reader, or
relayed over a grid (or a tree) of the holders, and what each rank pays for them.

Pure integers over a plan's reads and targets (``plan.data``): no I/O, no ranks. The
planner packs rounds by these costs; the executor follows the same hops.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .data import ALIGN, Copy, Read, Target, holders_of, is_packed, message_layout, messages_of, read_cost, wire_length


def hops_of(r: Read, targets: Sequence[Target]) -> list[tuple[int, int, int, list[Copy]]]:
    """(depth, sender, receiver, copies) of every message of read ``r``: the round is
    ``r.round + depth``. Sent directly, every receiver gets its copies from the reader
    at depth 0; relayed (``r.relay``), a rank that holds the read's message sends the
    same message on at later depths."""
    if not r.relay:
        return [(0, r.reader, rank, copies) for rank, copies in sorted(messages_of(r, targets).items())]
    copies = r.copies
    return [(d, s, x, copies) for d, s, x in read_hops(r, targets)]


def read_hops(r: Read, targets: Sequence[Target]) -> list[tuple[int, int, int]]:
    """(depth, sender, receiver) of a relayed read's hops (its grid's or its tree's)."""
    holders = holders_of(r, targets)
    if r.grid:
        return grid_hops(holders, r.reader, r.grid, r.round, r.grid_nodes)
    return relay_hops(holders, r.reader, r.relay)


def read_links(r: Read, targets: Sequence[Target], rank: int
               ) -> tuple[tuple[int, int] | None, list[tuple[int, list[int]]]]:
    """One rank's part of a relayed read: (depth, sender) it receives from (None for the
    reader) and [(depth, receivers)] it sends to, depth ascending."""
    holders = holders_of(r, targets)
    if r.grid:
        return grid_links(holders, r.reader, r.grid, r.round, rank, r.grid_nodes)
    got, send = relay_links(holders, r.reader, r.relay, rank)
    return got, [send] if send is not None else []


# A relay grid: the holders (rank order) as the points of a grid of sizes k_0, k_1, ...
# (their product is the holder count, each k_j <= max_peers + 1). In round t every
# relayed piece moves along dimension t mod D: each rank holding it sends it to the
# other k_j - 1 points of its line. So in any round a rank exchanges only with the
# k_j - 1 ranks of its line along that round's dimension, however many pieces the round
# carries (a tree per piece would give each rank other peers for every piece, and the
# rounds could hold only a piece or two), and after D rounds every holder has the piece.
# Readers spread over the holders, and the grid looks alike from every point, so every
# rank sends about what an all-gather asks of it.


def grid_shape(holders: int, max_peers: int) -> tuple[int, ...]:
    """Sizes of a grid of exactly ``holders`` points with every size at most
    ``max_peers + 1`` and as few dimensions as first-fit-decreasing packing of the
    prime factors finds; () when a prime factor is larger (a tree relays those)."""
    n, primes, f = holders, [], 2
    while f * f <= n:
        while n % f == 0:
            primes.append(f)
            n //= f
        f += 1
    if n > 1:
        primes.append(n)
    cap = max_peers + 1
    if not primes or primes[-1] > cap:
        return ()
    bins: list[int] = []
    for q in sorted(primes, reverse=True):
        fits = [i for i, b in enumerate(bins) if b * q <= cap]
        if fits:
            best = max(fits, key=lambda i: (bins[i], -i))
            bins[best] *= q
        else:
            bins.append(q)
    return tuple(sorted(bins, reverse=True))


def relay_over(r: Read, holders: Sequence[int], options: Any) -> None:
    """Relay ``r`` over ``holders`` (``options``: the plan's ``PlanOptions``): along a grid whose
    first dimension is each node's holders when they spread evenly over nodes (``node_grid``),
    else a plain grid, else (``grid_shape`` found none) a tree."""
    r.relay = max(2, options.max_peers)
    r.grid = node_grid(holders, r.relay, options.ranks_per_node)
    r.grid_nodes = bool(r.grid)
    r.grid = r.grid or grid_shape(len(holders), r.relay)


def node_grid(holders: Sequence[int], max_peers: int, ranks_per_node: int) -> tuple[int, ...]:
    """A grid whose first dimension is each node's holders (``g`` of them on every node
    they span, consecutive in rank order), crossed last by every piece: a piece then
    enters each node once, over its NIC, and fans out inside it. In a round a rank
    exchanges with its node's other holders and its line along one other dimension, so
    those lines are at most ``max_peers - (g - 1) + 1`` long. () when the holders are not
    spread evenly over nodes or no such grid fits."""
    if ranks_per_node < 2 or len(holders) < 2:
        return ()
    counts: list[int] = []  # holders per node, in rank order (holders ascending)
    node = -1
    for x in holders:
        if x // ranks_per_node != node:
            node = x // ranks_per_node
            counts.append(0)
        counts[-1] += 1
    g = counts[0]
    if any(c != g for c in counts):
        return ()
    nodes = len(holders) // g
    if g < 2 or nodes < 2 or g - 1 > max_peers - 1:
        return ()
    rest = grid_shape(nodes, max_peers - (g - 1))
    return (g, *rest) if rest else ()


def _dim(start: int, d: int, dims: int, nodes: bool) -> int:
    """The dimension a piece read in round ``start`` moves along at depth ``d``: the round's
    (``(start + d) % dims``), or with ``nodes`` the round's among the dimensions across
    nodes and, at the last depth, the node's own."""
    if not nodes:
        return (start + d) % dims
    if d == dims - 1:
        return 0
    return 1 + (start + d) % (dims - 1)


def _strides(sizes: tuple[int, ...]) -> list[int]:
    out, step = [], 1
    for k in sizes:
        out.append(step)
        step *= k
    return out


def grid_hops(holders: Sequence[int], reader: int, sizes: tuple[int, ...], start: int, nodes: bool = False,
              ) -> list[tuple[int, int, int]]:
    """(depth, sender, receiver) of every hop of a piece read in round ``start``."""
    dims = len(sizes)
    strides = _strides(sizes)
    have = [holders.index(reader)]
    out: list[tuple[int, int, int]] = []
    for d in range(dims):
        j = _dim(start, d, dims, nodes)
        k, step = sizes[j], strides[j]
        new = []
        for p in have:
            digit = (p // step) % k
            base = p - digit * step
            for v in range(k):
                if v != digit:
                    q = base + v * step
                    out.append((d, holders[p], holders[q]))
                    new.append(q)
        have += new
    return out


def grid_links(holders: Sequence[int], reader: int, sizes: tuple[int, ...], start: int, rank: int,
               nodes: bool = False) -> tuple[tuple[int, int] | None, list[tuple[int, list[int]]]]:
    """``grid_hops`` seen from one rank, without building them: it receives at the depth of
    the last dimension (in this piece's order) where it differs from the reader, from the
    point of that line that matches the reader there, and sends at every depth after."""
    dims = len(sizes)
    strides = _strides(sizes)
    r0, p = holders.index(reader), holders.index(rank)
    got: tuple[int, int] | None = None
    first_send = 0
    for d in range(dims):
        j = _dim(start, d, dims, nodes)
        k, step = sizes[j], strides[j]
        a, b = (r0 // step) % k, (p // step) % k
        if a != b:
            got = (d, holders[p + (a - b) * step])
            first_send = d + 1
    sends = []
    for d in range(first_send, dims):
        j = _dim(start, d, dims, nodes)
        k, step = sizes[j], strides[j]
        digit = (p // step) % k
        sends.append((d, [holders[p + (v - digit) * step] for v in range(k) if v != digit]))
    return got, sends


# A relay tree over a read's holders, listed from the reader on (wrapping around): the
# root (position 0) sends to positions 1..fan, every other node p to the next ``fan - 1``
# positions after those of p - 1 (breadth-first). With its parent no node has more than
# ``fan`` peers. Readers of a holder set's pieces are spread over its ranks, so each rank
# is an inner node about as often, and sends about what an all-gather asks of it. A node
# at level L receives at depth L - 1 and sends at depth L.


def _parent(q: int, fan: int) -> int:
    return 0 if q <= fan else (q - fan - 1) // max(1, fan - 1) + 1


def _children(p: int, fan: int, n: int) -> range:
    if p == 0:
        return range(1, min(n, fan + 1))
    f = max(1, fan - 1)
    first = fan + 1 + (p - 1) * f
    return range(min(n, first), min(n, first + f))


def _level(p: int, fan: int) -> int:
    level = 0
    while p:
        p = _parent(p, fan)
        level += 1
    return level


def relay_hops(holders: Sequence[int], reader: int, fan: int) -> list[tuple[int, int, int]]:
    """(depth, sender, receiver) of every hop of the relay tree, by depth then position."""
    n = len(holders)
    i = holders.index(reader)
    at = lambda p: holders[(i + p) % n]  # noqa: E731
    out: list[tuple[int, int, int]] = []
    level = [0] * n
    for q in range(1, n):
        p = _parent(q, fan)
        level[q] = level[p] + 1
        out.append((level[p], at(p), at(q)))
    return out


def relay_links(holders: Sequence[int], reader: int, fan: int, rank: int
                ) -> tuple[tuple[int, int] | None, tuple[int, list[int]] | None]:
    """One rank's part of a relay tree, without building it: (depth, sender) it receives
    from (None for the reader) and (depth, receivers) it sends to (None for a leaf)."""
    n = len(holders)
    i = holders.index(reader)
    p = (holders.index(rank) - i) % n
    kids = _children(p, fan, n)
    level = _level(p, fan)
    got = (level - 1, holders[(i + _parent(p, fan)) % n]) if p else None
    send = (level, [holders[(i + q) % n] for q in kids]) if len(kids) else None
    return got, send


def relay_costs(r: Read, targets: Sequence[Target]) -> dict[int, list[tuple[int, int, list[int]]]]:
    """A relayed read's staging and peers per rank and depth: rank -> [(depth, bytes,
    peers)], depth ascending. The reader stages the read (and one pack buffer, which its
    receivers share, when the message is packed); a receiver its receive buffer; a rank that sends the
    piece on, in each later round it sends in, one relay buffer it sends from."""
    size = message_layout(r.copies)[1]
    packed = is_packed(r.copies)
    reader = r.reader
    if r.grid:
        return _grid_costs(r, holders_of(r, targets), size, packed)
    # the reader packs once for all its receivers
    cells: dict[int, dict[int, list[Any]]] = {reader: {0: [read_cost(r) + (size if packed else 0), []]}}
    for d, s, x in read_hops(r, targets):
        sc = cells.setdefault(s, {})
        cell = sc.get(d)
        if cell is None:
            cell = sc[d] = [size, []]
        cell[1].append(x)
        xc = cells.setdefault(x, {}).setdefault(d, [0, []])
        xc[0] += size
        xc[1].append(s)
    return {rank: [(d, c[0], c[1]) for d, c in sorted(by_depth.items())] for rank, by_depth in cells.items()}


def grid_entries(r: Read, holders: Sequence[int], size: int, packed: bool) -> tuple[list[int], list[int], int]:
    """Where a grid read lays its bytes, per holder (in holder order): the depth it first
    holds the piece at (the reader 0; any other rank the depth of the last dimension where
    it differs from the reader, when it receives), after which it holds ``size`` bytes (a
    receive, then a relay buffer) at every depth to the last; and what the reader takes at
    depth 0 (the read, and one pack buffer when the message is packed)."""
    sizes, nodes, start = r.grid, r.grid_nodes, r.round
    dims = len(sizes)
    strides = _strides(sizes)
    order = [_dim(start, d, dims, nodes) for d in range(dims)]
    n = len(holders)
    r0 = holders.index(r.reader)
    pos = np.arange(n)
    got = np.zeros(n, dtype=np.int64)
    for d, j in enumerate(order):
        k, step = sizes[j], strides[j]
        got[(pos // step) % k != (r0 // step) % k] = d
    first = read_cost(r) + (size if packed else 0)  # one pack buffer all its receivers share
    return got.tolist(), [r0], first


def _grid_costs(r: Read, holders: Sequence[int], size: int, packed: bool
                ) -> dict[int, list[tuple[int, int, list[int]]]]:
    """``relay_costs`` of a grid read from ``grid_entries`` (peers not listed: a grid bounds
    them by its shape)."""
    got, (r0,), first = grid_entries(r, holders, size, packed)
    dims = len(r.grid)
    empty: list[int] = []
    out: dict[int, list[tuple[int, int, list[int]]]] = {}
    for p, g in enumerate(got):
        if p == r0:
            out[holders[p]] = [(0, first, empty)] + [(d, size, empty) for d in range(1, dims)]
        else:
            out[holders[p]] = [(d, size, empty) for d in range(g, dims)]
    return out


def costs_of(r: Read, targets: Sequence[Target]) -> dict[int, int]:
    """Staging bytes read ``r`` takes on each rank it involves in its round (for a relayed
    read, in its first round: ``relay_costs`` has every round's)."""
    reader = r.reader
    costs = {reader: read_cost(r)}
    if r.private:
        return costs
    if r.relay:
        return {rank: cells[0][1] for rank, cells in relay_costs(r, targets).items() if cells[0][0] == 0}
    needers = [targets[c.target].needers for c in r.copies]
    first = needers[0]
    if all(n is first for n in needers):  # one target set (a replicated box): one message shape
        size = message_layout(r.copies)[1]
        packed = is_packed(r.copies)
        for rank in first:
            if rank != reader:
                costs[rank] = size
                if packed:
                    costs[reader] += size
        return costs
    # each receiver's message: the copies it needs, in order (``messages_of``), sized
    # as ``message_layout`` does, without building the lists
    sizes: dict[int, int] = {}
    packed: dict[int, bool] = {}
    for c, held in zip(r.copies, needers):
        wire = wire_length(c)
        aligned = -(-wire // ALIGN) * ALIGN
        for rank in held:
            if rank != reader:
                if rank in sizes:
                    sizes[rank] += aligned
                    packed[rank] = True
                else:
                    sizes[rank] = aligned
                    packed[rank] = wire != c.length
    extra = 0
    for rank, size in sizes.items():
        costs[rank] = size
        if packed[rank]:
            extra += size
    costs[reader] += extra
    return costs
