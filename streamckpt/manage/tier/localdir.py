"""A rank's node-local folder of the memory/peer tier: where each step's files lie, which
steps committed, and what is removed (uncommitted saves, old steps, other runs' files).

::

    <local_dir>/streamckpt-local/<run key>/step-<S>/data/00003-0000.safetensors
                                                    local-manifest.json   (the commit)

The run key is a hash of the run's root, so two runs sharing a node's folder never read
each other's steps; the manifest names the root too, and a step whose manifest names
another root, another step or cannot be read is no step of this run. Ranks on one node may
share the folder: every removal tolerates another rank removing the same thing first.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from ...errors import CorruptCheckpointError
from .localmanifest import LOCAL_MANIFEST, LocalStep, parse

log = logging.getLogger(__name__)

TIER_FOLDER = "streamckpt-local"
_STEP = re.compile(r"^step-(\d+)$")


def run_key(root: str) -> str:
    return hashlib.sha256(root.encode()).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class LocalDir:
    """The tier's folder of one run on one rank."""

    local_dir: str
    root: str

    @property
    def tier(self) -> Path:
        return Path(self.local_dir) / TIER_FOLDER

    @property
    def run(self) -> Path:
        return self.tier / run_key(self.root)

    def step_dir(self, step: int) -> Path:
        return self.run / f"step-{step}"

    def folders(self) -> dict[int, Path]:
        """Every step folder of this run, committed or not."""
        out: dict[int, Path] = {}
        try:
            entries = list(os.scandir(self.run))
        except FileNotFoundError:
            return out
        for e in entries:
            m = _STEP.match(e.name)
            if m and e.is_dir():
                out[int(m.group(1))] = Path(e.path)
        return out

    def committed(self) -> dict[int, LocalStep]:
        """The committed steps of this run here (a manifest that is unreadable, or names
        another root or step, is skipped with a warning)."""
        out: dict[int, LocalStep] = {}
        for step, path in sorted(self.folders().items()):
            got = self.read_step(step, path)
            if got is not None:
                out[step] = got
        return out

    def read_step(self, step: int, path: Path | None = None) -> LocalStep | None:
        where = (path or self.step_dir(step)) / LOCAL_MANIFEST
        try:
            blob = where.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            log.warning("local tier: cannot read %s (%s): step %d is not used", where, e, step)
            return None
        try:
            got = parse(blob, str(where))
        except CorruptCheckpointError as e:
            log.warning("local tier: %s; step %d is not used", e, step)
            return None
        if got.root != self.root or got.step != step:
            log.warning("local tier: %s names step %d of %s, not step %d of %s: not used", where, got.step, got.root,
                        step, self.root)
            return None
        return got

    def commit(self, step: int, blob: bytes) -> None:
        """Write the step's local manifest (a temporary file renamed into place)."""
        final = self.step_dir(step) / LOCAL_MANIFEST
        tmp = final.with_name(f"{LOCAL_MANIFEST}.tmp-{os.getpid()}")
        tmp.write_bytes(blob)
        os.replace(tmp, final)

    def begin(self, step: int) -> None:
        """Before a local save of ``step``: remove an earlier save of the same step (another
        run of it, committed or not), other uncommitted saves, and other runs' folders."""
        self.remove_other_runs()
        for s, path in self.folders().items():
            if s == step or not (path / LOCAL_MANIFEST).exists():
                _remove(path)
        self.step_dir(step).mkdir(parents=True, exist_ok=True)

    def retain(self, keep: int) -> list[int]:
        """Keep the ``keep`` newest committed steps; remove the older ones. Returns those removed."""
        steps = sorted(s for s, p in self.folders().items() if (p / LOCAL_MANIFEST).exists())
        doomed = steps[:max(0, len(steps) - keep)]
        for s in doomed:
            self.remove_step(s)
        return doomed

    def remove_step(self, step: int) -> None:
        """The manifest first (the step stops being committed), then its files."""
        path = self.step_dir(step)
        try:
            (path / LOCAL_MANIFEST).unlink()
        except FileNotFoundError:
            pass
        _remove(path)

    def remove_other_runs(self) -> list[str]:
        """Remove the folders of other runs (other roots) in this local_dir's tier folder."""
        gone = []
        try:
            entries = list(os.scandir(self.tier))
        except FileNotFoundError:
            return gone
        mine = run_key(self.root)
        for e in entries:
            if e.name != mine and e.is_dir():
                log.info("local tier: removing %s, another run's local checkpoints (this run: %s)", e.path, self.root)
                _remove(Path(e.path))
                gone.append(e.path)
        return gone


def _remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


__all__ = ["LocalDir", "TIER_FOLDER", "run_key"]
