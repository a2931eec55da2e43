"""What ``streamckpt ls ROOT --local DIR`` shows: the run's local steps in one node's folder
(read from the folder alone; the bucket is not asked)."""

from __future__ import annotations

import datetime as dt
from typing import Any

from ...results import human_bytes
from ..index import METRICS_KEY
from .localdir import LocalDir
from .localmanifest import LOCAL_MANIFEST


def local_rows(folder: LocalDir) -> list[dict[str, Any]]:
    """One dict per step folder of the run, by step: ``step``, ``state`` (``committed``, or
    ``uncommitted``: a local save that did not finish, removed by the next one), ``committed``
    (UTC, ISO 8601, or None), ``files`` (here at their recorded size), ``of`` (the step's files,
    every rank's), ``bytes`` (here), ``keepers`` (file -> saving ranks) and ``metrics``."""
    out = []
    for step, path in sorted(folder.folders().items()):
        got = folder.read_step(step, path)
        present = {p.relative_to(path).as_posix(): p.stat().st_size for p in path.rglob("*")
                   if p.is_file() and p.name != LOCAL_MANIFEST and ".tmp-" not in p.name}
        row: dict[str, Any] = {"step": step, "state": "uncommitted", "committed": None, "files": len(present),
                               "of": None, "bytes": sum(present.values()), "keepers": {}, "metrics": {}}
        if got is not None:
            held = {f: n for f, n in present.items() if got.manifest.files.get(f) == n}
            ns = got.manifest.committed_ns or 0
            row.update(state="committed", files=len(held), of=len(got.manifest.files), bytes=sum(held.values()),
                       committed=dt.datetime.fromtimestamp(ns / 1e9, dt.timezone.utc).isoformat(timespec="seconds"),
                       keepers={f: got.keepers.get(f, []) for f in sorted(held)},
                       metrics=dict(got.manifest.metadata.get(METRICS_KEY) or {}))
        out.append(row)
    return out


def local_table(rows: list[dict[str, Any]]) -> str:
    """The rows as aligned text."""
    lines = [["step", "state", "committed (UTC)", "files here", "size here", "metrics"]]
    for r in rows:
        files = f"{r['files']} of {r['of']}" if r["of"] is not None else str(r["files"])
        lines.append([str(r["step"]), r["state"], (r["committed"] or "-").replace("+00:00", ""), files,
                      human_bytes(r["bytes"]), ", ".join(f"{k}={_short(v)}" for k, v in r["metrics"].items())])
    widths = [max(len(row[i]) for row in lines) for i in range(len(lines[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in lines)


def _short(v: Any) -> str:
    return f"{v:.6g}" if isinstance(v, float) else str(v)


__all__ = ["local_rows", "local_table"]
