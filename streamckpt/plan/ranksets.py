"""Disjoint sets of ranks: which ranks are joined through the holder lists of shared reads.

Pure (no I/O, no ranks). Both the planner's components and ``rounds.reachable`` ask the
same question of holder lists, so they share this one union-find.
"""

from __future__ import annotations

from typing import Iterable


class RankSets:
    """Union-find over ranks ``0..world-1`` (path halving; a set is named by its smallest rank)."""

    def __init__(self, world: int) -> None:
        self._parent = list(range(world))
        self._joined: set[int] = set()

    def find(self, x: int) -> int:
        parent = self._parent
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def union(self, a: int, b: int) -> None:
        a, b = self.find(a), self.find(b)
        if a != b:
            self._parent[max(a, b)] = min(a, b)

    def join_holders(self, holder_lists: Iterable[list[int]]) -> int:
        """Join the ranks of each holder list, and the lists with each other; the first
        list's first rank (-1: no list). Equal lists that are one object (``gathered.distinct``)
        are joined within once."""
        last: list[int] | None = None
        head = -1
        for held in holder_lists:
            if held is last:
                continue
            last = held
            if id(held) not in self._joined:
                self._joined.add(id(held))
                for x in held[1:]:
                    self.union(held[0], x)
            if head < 0:
                head = held[0]
            else:
                self.union(head, held[0])
        return head
