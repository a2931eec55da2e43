"""What the surviving ranks hold in their local folders, and which step a restore takes.

Every rank reports the committed local steps its folder holds (each save's id, commit time
and the files present at their recorded sizes: a cheap look, no byte read). All ranks get
every report and reach the same verdicts from them (pure functions here): the candidate
steps newest first, and for one save which ranks hold each file and which files no rank
does. Reports come from the ranks of the restoring job, whatever the saving job's size:
a replaced node's ranks report nothing, a stale folder reports its own (older) steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from ...core.manifest import Manifest, Shard
from .localdir import LocalDir
from .localmanifest import LocalStep


@dataclass(frozen=True, slots=True)
class Save:
    """One local save (a step's id) as all ranks' reports show it."""

    step: int
    id: str
    committed_ns: int
    holders: dict[str, list[int]] = field(default_factory=dict)  # file present -> ranks, ascending

    @property
    def first(self) -> int:
        """The lowest rank that holds its manifest (sends it to the others)."""
        return min(r for rs in self.holders.values() for r in rs) if self.holders else -1


def report(folder: LocalDir, wanted: int | None = None) -> tuple[dict[str, Any], dict[str, LocalStep]]:
    """This rank's report (JSON) and its committed saves by id (only ``wanted``'s when given)."""
    steps = folder.committed()
    saves: dict[str, LocalStep] = {}
    out = []
    for step, got in steps.items():
        if wanted is not None and step != wanted:
            continue
        present = []
        for name, size in got.manifest.files.items():
            try:
                if (folder.step_dir(step) / name).stat().st_size == size:
                    present.append(name)
            except OSError:
                pass
        if present:
            saves[got.id] = got
            out.append({"step": step, "id": got.id, "ns": got.manifest.committed_ns or 0, "files": sorted(present)})
    return {"saves": out}, saves


def saves_of(reports: Sequence[Mapping[str, Any]]) -> list[Save]:
    """Every save some rank reports, newest step first (a step's later save first)."""
    found: dict[str, Save] = {}
    for rank, rep in enumerate(reports):
        for s in rep["saves"]:
            save = found.setdefault(s["id"], Save(int(s["step"]), s["id"], int(s["ns"])))
            for name in s["files"]:
                save.holders.setdefault(name, []).append(rank)
    return sorted(found.values(), key=lambda s: (s.step, s.committed_ns, s.id), reverse=True)


def stale(saves: Iterable[Save]) -> list[Save]:
    """Saves from a timeline the run left: one committed before a save of a *lower* step was
    (a run that went back to an older checkpoint and saved again; steps grow with time on one
    timeline). Commit times are rank 0's clocks: a skew larger than the time between two local
    saves can only make a good save look stale, so a restore then takes an older whole step."""
    out = []
    later = -1  # the latest commit among lower steps
    by_step: dict[int, list[Save]] = {}
    for s in saves:
        by_step.setdefault(s.step, []).append(s)
    for step in sorted(by_step):
        out += [s for s in by_step[step] if s.committed_ns < later]
        later = max(later, *(s.committed_ns for s in by_step[step]))
    return out


def candidates(saves: Iterable[Save], bucket_steps: Iterable[int], step: int | None = None
               ) -> list[tuple[int, Save | None]]:
    """(step, the save to try or None for the bucket alone), newest first: each step once,
    with its latest local save (an older save of the same step is a run that went back), and
    no ``stale`` save."""
    saves = list(saves)
    left = {id(s) for s in stale(saves)}
    local: dict[int, Save] = {}
    for s in saves:
        if id(s) not in left:
            local.setdefault(s.step, s)  # saves come newest first
    steps = sorted(set(local) | set(bucket_steps), reverse=True)
    if step is not None:
        steps = [s for s in steps if s == step]
    return [(s, local.get(s)) for s in steps]


def missing_files(manifest: Manifest, holders: Mapping[str, Sequence[int]]) -> list[str]:
    """The files of a save that no rank holds (verified)."""
    return sorted(f for f in manifest.files if not holders.get(f))


def same_file(local: Manifest, bucket: Manifest, name: str) -> bool:
    """Whether the bucket's checkpoint holds ``name`` with the very bytes the local save wrote
    there: the same size and the same shards at the same offsets with the same checksums."""
    if local.files.get(name) != bucket.files.get(name) or name not in local.files:
        return False
    return _shards_in(local, name) == _shards_in(bucket, name)


def _shards_in(m: Manifest, name: str) -> list[tuple[str, Shard]]:
    return sorted(((k, s) for k, t in m.tensors.items() for s in t.shards if s.file == name),
                  key=lambda x: x[1].byte_offset)


__all__ = ["Save", "candidates", "missing_files", "report", "same_file", "saves_of", "stale"]
