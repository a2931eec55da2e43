"""Which committed checkpoints a run keeps: the union of its rules (pure, no I/O).

``keep_last=N`` keeps the N newest steps, ``keep_every=K`` the steps divisible by K,
``keep_best=(metric, "min"|"max", k)`` the k best by a metric given to ``save`` (steps
without it, or with nan or a non-number, are no candidates; of steps with equal values the
newer ranks first, so a plateau keeps its latest weights). The newest step is always kept, and with no rule at all
everything is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from ..errors import CheckpointError
from .index import Entry


@dataclass(frozen=True, slots=True)
class Policy:
    keep_last: int | None = None
    keep_every: int | None = None
    keep_best: tuple[str, str, int] | None = None

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_every"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise CheckpointError(f"{name} must be a positive int or None, got {v!r}")
        best = self.keep_best
        if best is not None:
            ok = (isinstance(best, (tuple, list)) and len(best) == 3 and isinstance(best[0], str)
                  and best[1] in ("min", "max") and isinstance(best[2], int) and not isinstance(best[2], bool)
                  and best[2] >= 1)
            if not ok:
                raise CheckpointError(f"keep_best must be (metric, 'min' or 'max', k >= 1), such as "
                                      f"('loss', 'min', 3); got {best!r}")
            object.__setattr__(self, "keep_best", tuple(best))

    @property
    def keeps_all(self) -> bool:
        return self.keep_last is None and self.keep_every is None and self.keep_best is None

    def reasons(self, entries: Sequence[Entry]) -> dict[int, list[str]]:
        """For each step of ``entries`` (the managed ones), why it is kept; an empty list: pruned."""
        steps = sorted({e.step for e in entries if e.step is not None})
        out: dict[int, list[str]] = {s: [] for s in steps}
        if not steps:
            return out
        if self.keeps_all:
            return {s: ["all"] for s in steps}
        if self.keep_last is not None:
            for s in steps[-self.keep_last:]:
                out[s].append("last")
        if self.keep_every is not None:
            for s in steps:
                if s % self.keep_every == 0:
                    out[s].append("every")
        if self.keep_best is not None:
            for s in _best(entries, *self.keep_best):
                out[s].append("best")
        if not out[steps[-1]]:
            out[steps[-1]].append("newest")
        return out

    def to_prune(self, entries: Sequence[Entry]) -> list[Entry]:
        """The managed entries no rule keeps, oldest first."""
        reasons = self.reasons(entries)
        return sorted((e for e in entries if e.step is not None and not reasons.get(e.step)),
                      key=lambda e: e.step)  # type: ignore[arg-type, return-value]


def _best(entries: Sequence[Entry], metric: str, mode: str, k: int) -> list[int]:
    scored: list[tuple[float, int]] = []
    for e in entries:
        value = _number(e.metrics.get(metric))
        if value is not None and e.step is not None:
            scored.append((value, e.step))
    scored.sort(key=lambda vs: (vs[0] if mode == "min" else -vs[0], -vs[1]))  # ties: the newer
    return [s for _, s in scored[:k]]


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
        return None
    return float(v)
