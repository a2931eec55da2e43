"""What ``streamckpt ls`` shows of a run: one row per committed checkpoint (plain data and a table)."""

from __future__ import annotations

import datetime as dt
from typing import Any, Sequence

from ..results import abbreviate, human_bytes
from .index import Entry
from .retention import Policy


def rows(entries: Sequence[Entry], policy: Policy | None = None) -> list[dict[str, Any]]:
    """One dict per checkpoint, by step (the manager's, then the others by name): ``name``,
    ``step``, ``committed`` (UTC, ISO 8601), ``bytes`` (all it reads), ``own_bytes`` (stored under
    its prefix), ``shared_bytes`` (in files of sibling checkpoints it references), ``files``,
    ``metrics``, ``error`` and,
    with a ``policy``, ``keep`` (the rules that keep it; empty: pruned; None: never pruned)."""
    managed = [e for e in entries if e.step is not None and e.error is None]
    reasons = policy.reasons(managed) if policy is not None else {}
    ordered = sorted(managed, key=lambda e: (e.step, e.committed_ns)) + sorted(
        (e for e in entries if e not in managed), key=lambda e: e.name)
    out = []
    for e in ordered:
        row: dict[str, Any] = {
            "name": e.name, "step": e.step,
            "committed": dt.datetime.fromtimestamp(e.committed_ns / 1e9, dt.timezone.utc).isoformat(timespec="seconds"),
            "bytes": e.size, "own_bytes": e.own_bytes, "shared_bytes": e.shared_bytes, "files": len(e.objects),
            "metrics": e.metrics, "error": e.error,
        }
        if policy is not None:
            row["keep"] = reasons.get(e.step) if e in managed else None  # type: ignore[arg-type]
        out.append(row)
    return out


def table(found: Sequence[dict[str, Any]]) -> str:
    """The rows as aligned text (sizes human-readable, one line each)."""
    has_keep = any("keep" in r for r in found)
    shares = any(r.get("shared_bytes") for r in found)  # incremental checkpoints: own and shared bytes too
    head = ["step", "name", "committed (UTC)", "size"] + (["own", "shared"] if shares else []) + \
        ["files", "metrics"] + (["policy"] if has_keep else [])
    lines = [head]
    for r in found:
        metrics = ", ".join(f"{k}={_short(v)}" for k, v in r["metrics"].items()) if r["error"] is None else \
            f"unreadable: {abbreviate(r['error'], 50)}"
        sizes = [r["bytes"]] + ([r["own_bytes"], r["shared_bytes"]] if shares else [])
        line = ["-" if r["step"] is None else str(r["step"]), r["name"], r["committed"].replace("+00:00", "")] + \
            [human_bytes(n) for n in sizes] + [str(r["files"]), metrics]
        if has_keep:
            keep = r.get("keep")
            line.append("never pruned" if keep is None else "keep (" + ", ".join(keep) + ")" if keep else "prune")
        lines.append(line)
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in lines)


def _short(v: Any) -> str:
    return f"{v:.6g}" if isinstance(v, float) else abbreviate(str(v), 20)
