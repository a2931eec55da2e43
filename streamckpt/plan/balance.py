"""Which holder reads each relayed piece: an order over a holder set that spreads egress.

A relayed piece (``routes.grid_hops``) moves over a fixed grid of its holders, one dimension
per round, and which ranks send it at each depth follows from its reader alone: at the
last depth, the ranks that share the reader's digit along the last dimension; one depth
before, those sharing its last two digits; and so on. Every rank sends about what an
all-gather asks of it only when the readers' digits are spread evenly over every such
suffix of dimensions, whichever dimension the piece's round starts on. The least-loaded
rule alone picked readers by rank among ties: a 256 MiB model in 256 pieces on 4,096
ranks was read by ranks 0-255, one corner of the grid whose last digits never vary, so
those ranks sent 9× an all-gather's share.

Readers are still the least loaded by bytes, but ties go by ``reader_order``: the holder
at position ``n · M mod H`` comes n-th, with ``M`` coprime to ``H`` and close to
``H / φ`` (φ the golden ratio). Any ``s`` consecutive picks then cover every residue
modulo ``s`` when ``M`` is coprime to it (the grid's low digits, dimension 0 first, are
each residue's), and the high digits follow the golden-ratio sequence ``n / φ mod 1``,
the most evenly spread of its kind on every prefix. A relay tree (a holder count with a
prime factor above ``max_peers + 1``) lists holders from its reader on, and its inner
nodes are the positions just after the reader: readers spread evenly around the holder
list spread that work too. Pure integers, no I/O.
"""

from __future__ import annotations

import math

PHI = (1 + 5 ** 0.5) / 2


def multiplier(n: int) -> int:
    """The step ``M`` of ``reader_order``: coprime to ``n``, near ``n / φ``, and among those
    within ``n / 16`` of it the one whose ratio ``M / n`` has the smallest continued-fraction
    quotients (the nearest among equals). Large quotients make the sequence ``k · M / n mod 1``
    bunch on some prefixes (``n`` = 512: ``M`` = 315 left 25 to 39 readers in each of the
    eighths of the top digit; the golden ratio's quotients are all 1)."""
    if n <= 2:
        return 1
    mid = n / PHI
    reach = max(2, n // 16)
    best: tuple[int, float, int] | None = None
    for m in range(max(1, int(mid) - reach), min(n - 1, int(mid) + reach) + 1):
        if math.gcd(m, n) != 1:
            continue
        score = (_largest_quotient(m, n), abs(m - mid), m)
        if best is None or score < best:
            best = score
    return best[2] if best is not None else 1


def _largest_quotient(m: int, n: int) -> int:
    """The largest partial quotient of the continued fraction of ``m / n`` past the first."""
    top = 0
    a, b = n, m
    while b:
        q, r = divmod(a, b)
        top = max(top, q)
        a, b = b, r
    return top


def reader_order(n: int) -> list[int]:
    """Tie-break key of each holder position 0..n-1: position ``i · M mod n`` gets key ``i``
    (``M`` = ``multiplier(n)``)."""
    m = multiplier(n)
    key = [0] * n
    p = 0
    for i in range(n):
        key[p] = i
        p += m
        if p >= n:
            p -= n
    return key
