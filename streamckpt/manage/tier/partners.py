"""Which ranks keep a copy of a rank's local files: ``replicas`` partners on other nodes.

Pure arithmetic on ranks. torchrun numbers ranks node by node (``node = rank //
ranks_per_node``); rank ``r`` at local index ``i`` of node ``n`` sends its files to local
index ``i`` of nodes ``n + 1, ..., n + replicas`` (mod the node count), so the copies of
one node's files lie on ``replicas`` *other* nodes, each spread over as many ranks as the
node has: losing any ``replicas`` nodes loses no byte. With one node there is no other node:
no partner (the local tier then survives a process restart, not the node's loss).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Topology:
    """The saving job's ranks grouped into nodes (``ranks_per_node`` divides ``world``)."""

    world: int
    ranks_per_node: int

    @property
    def nodes(self) -> int:
        return self.world // self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def usable_replicas(self, replicas: int) -> int:
        """At most one copy per other node: ``min(replicas, nodes - 1)``."""
        return max(0, min(replicas, self.nodes - 1))

    def partners(self, rank: int, replicas: int) -> list[int]:
        """The ranks that keep copies of ``rank``'s files, nearest node first."""
        n, i, per = self.node_of(rank), rank % self.ranks_per_node, self.ranks_per_node
        return [((n + k) % self.nodes) * per + i for k in range(1, self.usable_replicas(replicas) + 1)]

    def sources(self, rank: int, replicas: int) -> list[int]:
        """The ranks whose files ``rank`` keeps copies of, in the order of ``partners``' k."""
        n, i, per = self.node_of(rank), rank % self.ranks_per_node, self.ranks_per_node
        return [((n - k) % self.nodes) * per + i for k in range(1, self.usable_replicas(replicas) + 1)]


def topology(world: int, ranks_per_node: int) -> Topology:
    """The topology for ``ranks_per_node`` (0 or one not dividing ``world``: one node of all ranks)."""
    if ranks_per_node < 1 or world % ranks_per_node:
        return Topology(world, world)
    return Topology(world, ranks_per_node)


__all__ = ["Topology", "topology"]
