"""The manager's argument checks: a step, a child name's format, metrics for a manifest.

Checked before any collective, so that one rank's mistake is agreed instead of leaving the
other ranks waiting (``Manager.save`` gathers them).
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any, Mapping

from ..errors import CheckpointError, near_names

log = logging.getLogger(__name__)


def check_name(name: str) -> None:
    """A child name is a format string with ``{step}`` and no ``/`` (``"step-{step}"``)."""
    try:
        a, b = name.format(step=1), name.format(step=2)
    except (KeyError, IndexError, ValueError, AttributeError) as e:
        raise CheckpointError(f"name must be a format string with {{step}} only, such as 'step-{{step}}'; "
                              f"{name!r} fails: {e}") from None
    if a == b or "/" in a or a in ("", ".", ".."):
        raise CheckpointError(f"name must hold {{step}} and no '/', such as 'step-{{step}}'; got {name!r}")


def check_step(step: Any) -> None:
    """A step is an int >= 0 (a str "10" named a step that never matched: 'no step 10 (steps: 10)')."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"step must be an int >= 0, got {step!r}")


def plain_metrics(metrics: Mapping[str, Any] | None) -> dict[str, Any]:
    """Metrics as the manifest's JSON holds them: one-element tensors as numbers, nan/inf as strings."""
    out: dict[str, Any] = {}
    for k, v in dict(metrics or {}).items():
        if not isinstance(k, str):
            raise CheckpointError(f"metric names must be str, got {k!r}")
        if hasattr(v, "item") and callable(v.item):
            n = v.numel() if callable(getattr(v, "numel", None)) else getattr(v, "size", 1)
            if n != 1:  # torch's own words ("a Tensor with 2 elements cannot be converted") name no metric
                raise CheckpointError(f"metric {k!r} has {n} elements; pass one number (e.g. loss.mean().item())")
            v = v.item()
        if isinstance(v, float) and not math.isfinite(v):  # a diverged loss: the manifest's JSON has no nan,
            v = repr(v)  # so 'nan' / 'inf' / '-inf', which keep_best never ranks (the save must not fail for it)
        out[k] = v
    try:
        json.dumps(out, allow_nan=True)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"metrics must be JSON-serializable numbers and strings: {e}") from None
    return out


def warn_unranked(root: str, step: int, metrics: Mapping[str, Any], keep_best: tuple[str, str, int] | None) -> None:
    """Metrics without ``keep_best``'s metric (a misspelt name, most often): that rule never
    keeps the step, and a policy of keep_best alone would prune every step but the newest."""
    if keep_best is None or not metrics or keep_best[0] in metrics:
        return
    near = near_names(keep_best[0], metrics, n=1) or sorted(m for m in metrics if keep_best[0] in m)[:1]  # val_loss
    log.warning("CheckpointManager %s: step %d's metrics (%s) lack %r, by which keep_best ranks the steps%s: "
                "keep_best will not keep it; pass metrics={%r: ...} to rank it", root, step,
                ", ".join(sorted(metrics)), keep_best[0], f" (did you mean {near[0]!r}?)" if near else "", keep_best[0])
