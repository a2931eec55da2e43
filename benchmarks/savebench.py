"""Scenario (s) of ``benchmarks.run``: saving, side by side, to the same local S3 server.

One process saves the whole llama-like model (plain CPU tensors) with each saver in
turn, savers alternating within each repetition, a fresh process per save
(benchmarks/save.py); then 2 and 4 gloo ranks each holding the whole model (DDP:
every tensor replicated) save it with ``sc.save`` and with ``dcp.save``. Each
checkpoint goes to its own prefix ``saves/<tag>`` and is deleted after it was
measured (and, on the first repetition, read back and checked).
"""

from __future__ import annotations

import json
import re
import shutil
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import data
from .save import BUDGET_FRACTION, CEILING_CONCURRENCY, PIECE, SAVER_MODULE, staging_budget
from .server import BUCKET
from .worker import fill_outcome

if TYPE_CHECKING:
    from .run import Harness

SAVERS = ["streamckpt", "streamckpt.s3fs", "streamckpt.async", "streamckpt.async.budget", "dcp-s3", "dcp-s3.t8",
          "dcp-s3.async", "streamckpt.async.again", "dcp-s3.async.again", "naive", "ceiling.obstore", "ceiling.boto3"]
QUICK_SAVERS = ["streamckpt", "streamckpt.async", "dcp-s3", "naive", "ceiling.obstore"]
DDP_SAVERS = ["streamckpt", "dcp-s3"]
DDP_WORLDS = (2, 4)
QUICK_DDP_WORLDS = (2,)
SAVES = "saves"  # the prefix (and bucket folder) every measured save writes under


@dataclass
class SaveSample:
    blocked: float | None = None
    durable: float | None = None
    rss_peak: int | None = None
    rss_delta: int | None = None
    requests: dict[str, int] = field(default_factory=dict)
    put_bytes: int | None = None  # request body bytes the server received (PUT/POST), its own counter
    per_rank: list[int] = field(default_factory=list)  # stored bytes written by each rank (data files)
    stored: int = 0  # bytes of every object the save left
    ok: str = "—"
    na: str | None = None
    error: str | None = None


# ------------------------------------------------------------------ measuring


_RANK_OF = (re.compile(r"^data/0*(\d+)[-.]"), re.compile(r"^__(\d+)_\d+\.distcp$"))


def rank_of(rel: str) -> int | None:
    """The writing rank from a data file's name: streamckpt ``data/00001-0003.safetensors``,
    DCP ``__1_0.distcp``; None for metadata and other objects."""
    for pat in _RANK_OF:
        m = pat.match(rel)
        if m:
            return int(m.group(1))
    return None


def stored_files(folder: Path) -> dict[str, int]:
    """Object name (relative) -> size of everything a save left in the server's folder."""
    return {p.relative_to(folder).as_posix(): p.stat().st_size for p in folder.rglob("*") if p.is_file()}


def per_rank_bytes(files: dict[str, int], world: int) -> list[int]:
    out = [0] * world
    for rel, size in files.items():
        r = rank_of(rel)
        if r is not None and r < world:
            out[r] += size
    return out


def measure_save(h: "Harness", saver: str, world: int, rep: int) -> SaveSample:
    tag = f"{saver}-w{world}-{rep}"
    folder = h.bucket_dir / SAVES / tag
    shutil.rmtree(folder, ignore_errors=True)
    spec: dict[str, Any] = {
        "saver": saver, "world": world, "endpoint": h.server.endpoint, "model": data.spec_to_json(h.model),
        "fingerprints": str(h.fingerprints_path), "bucket_dir": str(h.bucket_dir), "target": f"{SAVES}/{tag}",
        "verify": rep == 0, "counts": h.server.counts,
    }
    h.server.reset()
    timeout = 90 if h.args.quick else max(240.0, 60 + 4 * world * h.size / (50 << 20))
    errors = h._spawn("save", spec, world, f"s-{tag}", timeout)
    stats = h.server.stats()
    results = []
    for r in range(world):
        p = Path(f"{h._last_spec['out']}.{r}.json")
        if p.is_file():
            results.append(json.loads(p.read_text()))
            p.unlink()
    files = stored_files(folder) if folder.is_dir() else {}
    shutil.rmtree(folder, ignore_errors=True)
    shutil.rmtree(folder.with_name(f"{tag}-first"), ignore_errors=True)  # the unmeasured first save of *.again
    # rank 0's snapshot at the end of the save: the read-back check's GETs are not the save's
    stats = next((r["server_stats"] for r in results if r.get("server_stats")), stats)
    return _sample(results, errors, stats, files, world)


def _sample(results: list[dict[str, Any]], errors: list[str], stats: dict[str, Any] | None,
            files: dict[str, int], world: int) -> SaveSample:
    s = SaveSample()
    if not fill_outcome(s, results, errors, world):
        return s
    s.blocked = max(r["blocked"] for r in results)
    s.durable = max(r["durable"] for r in results)
    if stats is not None:
        s.requests = {k: int(v) for k, v in stats.get("requests", {}).items()}
        s.put_bytes = int(stats["put_body_bytes"]) if "put_body_bytes" in stats else None
    s.per_rank = per_rank_bytes(files, world)
    s.stored = sum(files.values())
    if not all(r.get("hwm_reset", True) for r in results):
        s.ok += " (peak RSS not reset: Δ may be low)"
    return s


def _installed(saver: str) -> bool:
    from importlib.util import find_spec

    mod = SAVER_MODULE.get(saver)
    return mod is None or find_spec(mod) is not None


def run_save_scenario(h: "Harness") -> None:
    """Fill ``h.save_results[(saver, world)]`` with one SaveSample per repetition."""
    shutil.rmtree(h.bucket_dir / SAVES, ignore_errors=True)
    wanted = [x for x in h.args.loaders.split(",") if x] if h.args.loaders else []
    savers = [x for x in SAVERS if x in wanted] if wanted else (QUICK_SAVERS if h.args.quick else SAVERS)
    ddp = [x for x in DDP_SAVERS if not wanted or x in wanted]
    worlds = QUICK_DDP_WORLDS if h.args.quick else DDP_WORLDS
    runs = [(x, 1) for x in savers] + [(x, w) for w in worlds for x in ddp]
    res: dict[tuple[str, int], list[SaveSample]] = {r: [] for r in runs}
    h.save_results = res
    for rep in range(h.args.reps):
        for world in [1, *worlds]:
            group = [r for r in runs if r[1] == world]
            if not group:
                continue
            k = rep % len(group)
            for saver, w in group[k:] + group[:k]:  # alternate who goes first
                if res[(saver, w)] and res[(saver, w)][-1].na:  # the same answer every time
                    res[(saver, w)].append(res[(saver, w)][-1])
                    continue
                if not _installed(saver):
                    s = SaveSample(na="not installed in this venv (see benchmarks/requirements.txt)")
                else:
                    s = measure_save(h, saver, w, rep)
                res[(saver, w)].append(s)
                shown = s.na and "n/a: " + s.na or s.error and "ERROR " + s.error or \
                    f"blocked {s.blocked:.3f} s, durable {s.durable:.3f} s"
                print(f"  (s) rep {rep + 1}/{h.args.reps} {saver:24s} W={w} {shown}", flush=True)
    shutil.rmtree(h.bucket_dir / SAVES, ignore_errors=True)


# ------------------------------------------------------------------ report


def _med(vals: list[float], fmt: str = "{:.2f}") -> str:
    from .run import med_range

    return med_range(vals, fmt)


def _human(n: float | None) -> str:
    from .run import human

    return human(n)


def _requests(s: SaveSample) -> str:
    total = sum(s.requests.values())
    if not s.requests:
        return "n/a"
    parts = ", ".join(f"{k} {v}" for k, v in sorted(s.requests.items()))
    return f"{total} ({parts})"


def _good(samples: list[SaveSample]) -> list[SaveSample]:
    return [s for s in samples if s.durable is not None]


def _head(saver: str, samples: list[SaveSample], cols: int) -> str | None:
    """The whole row when the saver did not run or failed every repetition."""
    first = samples[0] if samples else SaveSample(na="not run")
    if first.na:
        return f"| {saver} | n/a ({first.na}) |" + " |" * (cols - 2)
    if not _good(samples):
        err = next((s.error for s in samples if s.error), "no result") or "no result"
        return f"| {saver} | error: {err.replace('|', '/')} |" + " |" * (cols - 2)
    return None


def single_table(h: "Harness") -> tuple[list[str], dict[str, float]]:
    """The one-process table; returns its lines and each saver's median durable MB/s."""
    res = {saver: v for (saver, w), v in h.save_results.items() if w == 1}
    total = h.model.nbytes
    mbps = {saver: total / statistics.median(s.durable for s in _good(v)) / 1e6 for saver, v in res.items() if _good(v)}
    ceilings = {k: v for k, v in mbps.items() if k.startswith("ceiling")}
    ceiling = max(ceilings.values()) if ceilings else None
    lines = ["| saver | caller blocked s | durable s | MB/s | × ceiling | peak RSS | Δ RSS | requests | "
             "bytes uploaded | bytes stored | correct |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for saver, samples in res.items():
        head = _head(saver, samples, 11)
        if head:
            lines.append(head)
            continue
        good = _good(samples)
        bad = len(samples) - len(good)
        xc = f"{mbps[saver] / ceiling:.2f}" if ceiling else "n/a"
        put = [s.put_bytes for s in good if s.put_bytes is not None]
        lines.append(
            f"| {saver} | {_med([s.blocked for s in good])} | {_med([s.durable for s in good])} | {mbps[saver]:.0f} | "
            f"{xc} | {_human(statistics.median(s.rss_peak for s in good))} | "
            f"{_human(statistics.median(s.rss_delta for s in good))} | {_requests(good[0])} | "
            f"{_human(statistics.median(put)) if put else 'n/a'} | {_human(good[0].stored)} | "
            f"{good[0].ok}{f' ({bad} failed reps)' if bad else ''} |")
    return lines, mbps


def ddp_table(h: "Harness") -> tuple[list[str], dict[tuple[str, int], float]]:
    """The DDP table; returns its lines and each (saver, W)'s max ÷ mean bytes per rank."""
    lines = ["| saver | ranks | wall s | MB/s | bytes written per rank (first rep) | max ÷ mean | peak RSS / rank | "
             "Δ RSS / rank | requests | correct |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    balance: dict[tuple[str, int], float] = {}
    for (saver, w), samples in h.save_results.items():
        if w == 1:
            continue
        head = _head(f"{saver} | {w}", samples, 11)
        if head:
            lines.append(head)
            continue
        good = _good(samples)
        per = good[0].per_rank
        mean = sum(per) / len(per) if per else 0
        if mean:
            balance[(saver, w)] = max(per) / mean
        wall = statistics.median(s.durable for s in good)
        lines.append(
            f"| {saver} | {w} | {_med([s.durable for s in good])} | {h.model.nbytes / wall / 1e6:.0f} | "
            f"{', '.join(_human(b) for b in per)} | {f'{balance[(saver, w)]:.2f}' if mean else 'n/a'} | "
            f"{_human(statistics.median(s.rss_peak for s in good))} | "
            f"{_human(statistics.median(s.rss_delta for s in good))} | {_requests(good[0])} | {good[0].ok} |")
    return lines, balance


def targets(h: "Harness", mbps: dict[str, float], balance: dict[tuple[str, int], float]) -> list[str]:
    """Issue 13's goals, from this run's medians."""
    out = []
    one = {saver: _good(v) for (saver, w), v in h.save_results.items() if w == 1}

    def med(saver: str, attr: str) -> float | None:
        good = one.get(saver) or []
        return statistics.median(getattr(s, attr) for s in good) if good else None

    if "streamckpt" in mbps and "dcp-s3" in mbps:
        r = mbps["streamckpt"] / mbps["dcp-s3"]
        out.append(f"- durable `sc.save` ≥ 1.5× `dcp.save` + S3StorageWriter: {r:.2f}× — {'met' if r >= 1.5 else 'MISSED'}")
    ceilings = {k: v for k, v in mbps.items() if k.startswith("ceiling")}
    if "streamckpt" in mbps and ceilings:
        best = max(ceilings, key=ceilings.get)
        r = mbps["streamckpt"] / ceilings[best]
        out.append(f"- `sc.save` ≥ 0.8× the raw upload ceiling ({best}): {r:.2f}× — {'met' if r >= 0.8 else 'MISSED'}")
    a, d = med("streamckpt.async", "blocked"), med("dcp-s3.async", "blocked")
    if a is not None and d is not None:
        out.append(f"- `sc.async_save` blocks ≤ `dcp.async_save`: {a:.3f} s vs {d:.3f} s — {'met' if a <= d else 'MISSED'}")
    a, d = med("streamckpt.async.again", "blocked"), med("dcp-s3.async.again", "blocked")
    if a is not None and d is not None:
        out.append(f"- (not a goal) the second save in one process, as in a training loop: `sc.async_save` blocks "
                   f"{a:.3f} s, `dcp.async_save` {d:.3f} s ({d / a:.1f}×)")
    for saver, frac in (("streamckpt.async", None), ("streamckpt.async.budget", BUDGET_FRACTION)):
        delta = med(saver, "rss_delta")
        if delta is None:
            continue
        budget = staging_budget(h.model.nbytes, frac) if frac else h.model.nbytes
        limit = budget + (64 << 20)
        out.append(f"- `{saver}` Δ RSS ≤ staging_budget ({_human(budget)}{'' if frac else ': None = the whole state'}) "
                   f"+ 64 MiB: {_human(delta)} — {'met' if delta <= limit else 'MISSED'}")
    for (saver, w), r in balance.items():
        if saver == "streamckpt":
            out.append(f"- DDP on {w} ranks, max ÷ mean bytes written per rank ≤ 1.1: {r:.2f} — "
                       f"{'met' if r <= 1.1 else 'MISSED'}")
    return out


def render_save(h: "Harness", title: str) -> list[str]:
    if not getattr(h, "save_results", None):
        return []
    m = h.model
    lines = [f"## (s) {title}", "",
             f"The model above ({len(m.tensors())} tensors, {_human(m.nbytes)}) as plain CPU tensors, saved to "
             f"`s3://{BUCKET}/{SAVES}/…` on the same local server; a fresh process per save, "
             f"{h.args.reps} repetition(s), savers alternating in order; medians (min–max).", "",
             "- caller blocked: seconds from a barrier before the save call until the caller may change its tensors "
             "(the call's return); durable: until the checkpoint is committed (sync: the call's return; "
             "`handle.result()`; DCP's upload future). Client construction is inside the clock. An async caller "
             "zeroes every tensor as soon as it is unblocked, as the next training step would.",
             "- MB/s: the model's bytes ÷ durable seconds (10⁶ B/s); × ceiling: ÷ the faster `ceiling.*` row, "
             f"which uploads the same bytes from memory as {PIECE >> 20} MiB pieces, {CEILING_CONCURRENCY} in flight: "
             "`ceiling.obstore` as the parts of one multipart object (obstore), `ceiling.boto3` as separate objects "
             "(boto3 `put_object` in threads).",
             "- peak RSS: the process's `VmHWM`, reset (`/proc/self/clear_refs`) just before the save; Δ RSS: peak "
             "minus the RSS at the call (the source state is already resident).",
             "- requests: every request the server answered during the save, by method; bytes uploaded: request "
             "bodies the server received (its counter); bytes stored: the objects the save left.",
             "- `streamckpt.s3fs`: `sc.save` on its s3fs client (`STREAMCKPT_S3_BACKEND=s3fs`); "
             f"`streamckpt.async.budget`: `sc.async_save(staging_budget=max(16 MiB, {BUDGET_FRACTION:g} × state))`; "
             "`dcp-s3`: `torch.distributed.checkpoint.save` with s3torchconnector's `S3StorageWriter` "
             "(defaults: `thread_count=1`), `dcp-s3.t8` with `thread_count=8`; `naive`: `safetensors.torch.save` "
             "to bytes, one boto3 `put_object`; `*.again`: the second save of one process (a first save of "
             "a copy of the state, waited for and not counted, warms clients and whatever staging the saver "
             "keeps), as a training loop saving every N steps sees it.",
             "- correct: the first repetition's checkpoint read back through the server (`sc.load_full`, "
             "`dcp.load` with `S3StorageReader`, boto3 GET + `safetensors.torch.load`) and every tensor's crc32c "
             "compared with the generated data.", ""]
    table, mbps = single_table(h)
    lines += table + [""]
    ddp, balance = ddp_table(h)
    if len(ddp) > 2:
        lines += ["DDP: every rank holds the whole model (replicated plain tensors) and saves it collectively (gloo). "
                  "wall: the slowest rank's durable seconds; bytes written per rank: sizes of each rank's data files "
                  "(streamckpt `data/<rank>-*`, DCP `__<rank>_*.distcp`), first repetition.", ""] + ddp + [""]
    checks = targets(h, mbps, balance)
    if checks:
        lines += ["Targets (issue 13):", ""] + checks + [""]
    return lines
