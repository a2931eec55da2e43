"""The local manifest: the commit of one step in the memory/peer tier.

It is a checkpoint manifest (``core.manifest``: every tensor, every shard's file, byte
range, CRC32Cs and digest) whose metadata also names the run's root, the step and which
saving ranks keep each file (``LOCAL_KEY``). Every rank writes the same bytes (rank 0
assembles them, the others receive them) as ``local-manifest.json`` in its step folder,
last: a folder without it is a local save that did not commit. Its name differs from
``manifest.json`` on purpose: a step folder holds only some ranks' files, and no tool
should take it for a whole checkpoint. The bytes' xxh3-128 identifies the save: two
saves of the same step (a run that went back to an older step and saved it again) differ.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import xxhash

from ...core import manifest as mf
from ...core.manifest import Manifest, Shard
from ...errors import CorruptCheckpointError

LOCAL_MANIFEST = "local-manifest.json"
LOCAL_KEY = "streamckpt.local"  # the tier's part of the metadata


@dataclass(frozen=True, slots=True)
class LocalStep:
    """One committed local save, as one rank's folder holds its manifest."""

    manifest: Manifest
    root: str  # the run's root (the bucket prefix its manager saves under)
    step: int
    id: str  # xxh3-128 of the manifest's bytes: which save of the step this is
    blob: bytes
    keepers: dict[str, list[int]]  # file -> the saving ranks that keep it (writer first)

    def shards_by_file(self) -> dict[str, list[tuple[str, int, Shard]]]:
        """file -> (tensor, itemsize, shard) of every shard stored in it, by byte offset."""
        out: dict[str, list[tuple[str, int, Shard]]] = {}
        for key, t in self.manifest.tensors.items():
            for s in t.shards:
                out.setdefault(s.file, []).append((key, t.itemsize, s))
        for shards in out.values():
            shards.sort(key=lambda x: x[2].byte_offset)
        return out


def local_metadata(root: str, step: int, keepers: dict[str, list[int]], world: int, ranks_per_node: int,
                   replicas: int) -> dict[str, Any]:
    """The tier's metadata entry (``LOCAL_KEY``)."""
    return {"root": root, "step": step, "world": world, "ranks_per_node": ranks_per_node, "replicas": replicas,
            "keepers": {f: list(r) for f, r in sorted(keepers.items())}}


def parse(blob: bytes, where: str) -> LocalStep:
    """A local manifest's bytes as a ``LocalStep``.

    Raises:
        CorruptCheckpointError: not a manifest, or without the tier's entry.
    """
    m = mf.from_json(blob, where=where)
    entry = m.metadata.get(LOCAL_KEY)
    if not isinstance(entry, dict) or not isinstance(entry.get("root"), str) or \
            not isinstance(entry.get("step"), int) or not isinstance(entry.get("keepers"), dict):
        raise CorruptCheckpointError(f"{where}: no {LOCAL_KEY!r} entry naming the run's root, step and keepers")
    keepers = {str(f): [int(r) for r in rs] for f, rs in entry["keepers"].items()}
    return LocalStep(m, entry["root"], entry["step"], xxhash.xxh3_128_hexdigest(blob), blob, keepers)


__all__ = ["LOCAL_KEY", "LOCAL_MANIFEST", "LocalStep", "local_metadata", "parse"]
