"""Scenario (p) of ``benchmarks.run``: the DCP plug-ins, ``dcp.load`` / ``dcp.save`` through
``streamckpt.dcp`` against s3torchconnector's ``s3torchconnector.dcp``, on the same local server.

What a DCP user switches when they change one argument: the same ``dcp.load(sd, storage_reader=...)``
and ``dcp.save(sd, storage_writer=...)`` calls, DCP's own planners, only the storage plug-in differs.

* (p1) ``dcp.load`` of ``dcp_full`` (DCP, saved by one process) into plain tensors, one process;
* (p2) the same checkpoint into DTensors ``Shard(0)`` on 4 gloo ranks (each rank needs a quarter);
* (p3) ``dcp_rows4`` (saved by 4 ranks as ``Shard(0)``) into the same layout on 4 ranks;
* (p4) ``dcp.save`` of the whole model: one process (plain tensors), DDP-style on 2 and 4 ranks
  (every rank holds all of it; DCP's planner deduplicates), FSDP-style on 4 ranks (``Shard(0)``).

Spawned per rank as ``python -m benchmarks.dcpplug SPEC.json RANK`` (a fresh process per
measurement); the harness side (``run_plug_scenario``, ``render_plug``) runs in ``benchmarks.run``.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import data
from .server import BUCKET, KEY, REGION, SECRET

if TYPE_CHECKING:
    from .run import Harness

READERS = {"ours": "streamckpt.dcp.StorageReader", "s3torch": "s3torchconnector.dcp.S3StorageReader"}
WRITERS = {"ours": "streamckpt.dcp.StorageWriter", "s3torch": "s3torchconnector.dcp.S3StorageWriter",
           "s3torch.t8": "S3StorageWriter(thread_count=8)"}
NEEDS = {"s3torch": "s3torchconnector", "s3torch.t8": "s3torchconnector"}
PLUG_SAVES = "plugsaves"  # the bucket folder every measured save of (p4) writes under


@dataclass(frozen=True)
class LoadCase:
    dataset: str
    world: int
    layout: str  # "full": plain tensors; "rows": DTensor Shard(0) on ``world`` ranks
    title: str


@dataclass(frozen=True)
class SaveCase:
    style: str  # "plain" (one process), "ddp" (replicated), "fsdp" (Shard(0))
    world: int


LOAD_CASES = {
    "p1": LoadCase("dcp_full", 1, "full", "`dcp.load`, full, one process (plain tensors), of `dcp_full`"),
    "p2": LoadCase("dcp_full", 4, "rows", "`dcp.load` into DTensor `Shard(0)` on 4 gloo ranks, of `dcp_full` "
                   "(saved by one process: each rank needs a quarter of every stored item)"),
    "p3": LoadCase("dcp_rows4", 4, "rows", "`dcp.load` into DTensor `Shard(0)` on 4 gloo ranks, of `dcp_rows4` "
                   "(saved by 4 ranks in that layout)"),
}
SAVE_CASES = [SaveCase("plain", 1), SaveCase("ddp", 2), SaveCase("ddp", 4), SaveCase("fsdp", 4)]
QUICK_SAVE_CASES = [SaveCase("plain", 1), SaveCase("ddp", 2)]
LOAD_GOAL, SAVE_GOAL, AMPL_GOAL = 1.5, 1.5, 1.02


# =============================================================================== spawned side


def _opts(spec: dict[str, Any]) -> dict[str, Any]:
    return {"endpoint_url": spec["endpoint"], "key": KEY, "secret": SECRET}


def _s3config() -> Any:
    from s3torchconnector import S3ClientConfig

    return S3ClientConfig(force_path_style=True)


def make_reader(name: str, uri: str, spec: dict[str, Any]) -> Any:
    if name == "ours":
        from streamckpt.dcp import StorageReader

        return StorageReader(uri, storage_options=_opts(spec))
    from s3torchconnector.dcp import S3StorageReader

    return S3StorageReader(REGION, uri, s3client_config=_s3config())


def make_writer(name: str, uri: str, spec: dict[str, Any]) -> Any:
    if name == "ours":
        from streamckpt.dcp import StorageWriter

        return StorageWriter(uri, storage_options=_opts(spec))
    from s3torchconnector.dcp import S3StorageWriter

    return S3StorageWriter(REGION, uri, s3client_config=_s3config(), thread_count=8 if name == "s3torch.t8" else 1)


def _row_values(spec: dict[str, Any], model: data.ModelSpec, rank: int, world: int) -> dict[str, Any]:
    """This rank's row block of every tensor, from the local hf files (the expected data)."""
    return {t.name: x for t, x in data.rank_rows_from_hf(Path(spec["bucket_dir"]), model, rank, world)}


def load_targets(spec: dict[str, Any], model: data.ModelSpec, rank: int, world: int) -> dict[str, Any]:
    from .worker import _empty, dtensor_rows, targets_full

    if spec["layout"] == "full":
        return targets_full(model)
    empty = {}
    for t in model.tensors():
        r0, r1 = data.row_slice(t.shape[0], rank, world)
        empty[t.name] = _empty(t, (r1 - r0,) + tuple(t.shape[1:]))
    return dtensor_rows(model, world, rank, empty)


def expected_crcs(spec: dict[str, Any], model: data.ModelSpec, rank: int, world: int) -> dict[str, int]:
    if spec["layout"] == "full":
        return json.loads(Path(spec["fingerprints"]).read_text())["full"]
    return {k: data.crc(v) for k, v in _row_values(spec, model, rank, world).items()}


def compare(got: dict[str, Any], expected: dict[str, int]) -> tuple[int, int]:
    """(checked, wrong): each tensor's crc32c against the expected one."""
    wrong = sum(1 for name, crc in expected.items() if name not in got or data.crc(got[name]) != crc)
    return len(expected), wrong


def run_load(spec: dict[str, Any], rank: int, world: int, result: dict[str, Any]) -> None:
    import torch.distributed.checkpoint as dcp

    from .worker import Clock, _sc, local_of, peak_rss

    _sc()  # streamckpt's client modules imported before the clock, as every loader's are
    try:  # and s3torchconnector's, in both rows alike
        import s3torchconnector.dcp  # noqa: F401
    except ImportError:
        pass

    model = data.spec_from_json(spec["model"])
    sd = load_targets(spec, model, rank, world)
    clock = Clock(world)
    with clock:
        reader = make_reader(spec["loader"], f"s3://{BUCKET}/{spec['dataset']}", spec)
        dcp.load(sd, storage_reader=reader)
    result["seconds"] = clock.seconds
    result["rss_before"] = clock.rss_before
    result["rss_peak"] = peak_rss()
    st = getattr(reader, "stats", None)
    if st is not None:
        result["reader"] = {"bytes_read": st.bytes_read, "bytes_needed": st.bytes_needed, "requests": st.requests}
    result["checked"], result["wrong"] = compare({k: local_of(v) for k, v in sd.items()},
                                                 expected_crcs(spec, model, rank, world))


def save_source(spec: dict[str, Any], model: data.ModelSpec, rank: int, world: int) -> dict[str, Any]:
    from .save import source_state_dict
    from .worker import dtensor_rows

    if spec["style"] == "fsdp":
        return dtensor_rows(model, world, rank, _row_values(spec, model, rank, world))
    return source_state_dict(Path(spec["bucket_dir"]))


def run_save(spec: dict[str, Any], rank: int, world: int, result: dict[str, Any]) -> None:
    import torch.distributed.checkpoint as dcp

    from .save import SaveClock, preimport, server_stats
    from .worker import peak_rss, targets_full

    preimport()
    model = data.spec_from_json(spec["model"])
    sd = save_source(spec, model, rank, world)
    uri = f"s3://{BUCKET}/{spec['target']}"
    clock = SaveClock(world)
    clock.start()
    dcp.save(sd, storage_writer=make_writer(spec["saver"], uri, spec))
    clock.durable()
    result.update(durable=clock.durable_s, rss_before=clock.rss_before, rss_peak=peak_rss(),
                  hwm_reset=clock.hwm_reset)
    del sd
    if world > 1:
        import torch.distributed as dist

        dist.barrier()  # every rank's part is written before rank 0 counts and reads back
    if rank == 0 and spec.get("counts"):
        result["server_stats"] = server_stats(spec["endpoint"])
    if rank == 0 and spec.get("verify"):  # through the same plug-in's reader
        back = targets_full(model)
        reader = make_reader("ours" if spec["saver"] == "ours" else "s3torch", uri, spec)
        dcp.load(back, storage_reader=reader, no_dist=True)
        result["checked"], result["wrong"] = compare(back, json.loads(Path(spec["fingerprints"]).read_text())["full"])


def main() -> None:
    from .worker import measuring, report_and_exit

    spec_path, rank = sys.argv[1], int(sys.argv[2])
    spec = json.loads(Path(spec_path).read_text())
    world = int(spec["world"])
    result: dict[str, Any] = {"rank": rank}
    with measuring(rank, world, result):
        (run_load if spec["kind"] == "load" else run_save)(spec, rank, world, result)
    report_and_exit(spec_path, rank, result)


# =============================================================================== harness side


@dataclass
class PlugSample:
    seconds: float | None = None
    bytes_read: int | None = None  # GET body bytes the server sent (loads)
    put_bytes: int | None = None  # request body bytes the server received (saves)
    requests: dict[str, int] = field(default_factory=dict)
    rss_peak: int | None = None
    rss_delta: int | None = None
    reader: dict[str, int] = field(default_factory=dict)  # our reader's own stats, summed over ranks
    load_avg: float = 0.0  # 1-minute load average just before the run
    ok: str = "—"
    na: str | None = None
    error: str | None = None


@dataclass
class PlugResults:
    loads: dict[str, dict[str, list[PlugSample]]] = field(default_factory=dict)
    saves: dict[SaveCase, dict[str, list[PlugSample]]] = field(default_factory=dict)
    load_start: float = 0.0
    load_end: float = 0.0


def _installed(name: str) -> bool:
    from importlib.util import find_spec

    return NEEDS.get(name) is None or find_spec(NEEDS[name]) is not None


def _spawn_and_collect(h: "Harness", spec: dict[str, Any], world: int, tag: str, timeout: float,
                       wrap0: list[str] | None = None) -> tuple[list[dict[str, Any]], list[str]]:
    errors = h._spawn("dcpplug", spec, world, tag, timeout, wrap0)
    results = []
    for r in range(world):
        p = Path(f"{h._last_spec['out']}.{r}.json")
        if p.is_file():
            results.append(json.loads(p.read_text()))
            p.unlink()
    return results, errors


def _outcome(results: list[dict[str, Any]], errors: list[str], world: int) -> PlugSample:
    from .worker import fill_outcome

    s = PlugSample(load_avg=os.getloadavg()[0])
    fill_outcome(s, results, errors, world)
    return s


def profile_load(h: "Harness", case: str) -> None:
    """An extra, unmeasured load of ``case`` through our reader with rank 0 under py-spy
    (``--profile p3``): its summary goes to ``h.profiles``."""
    from .run import summarize_pyspy

    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        h.notes.append("--profile: py-spy not installed; no profile")
        return
    prof = h.root / f"pyspy-{case}.txt"
    prof.unlink(missing_ok=True)
    measure_load(h, case, "ours", -1, wrap0=[spy, "record", "-r", "250", "-f", "raw", "--threads", "-o", str(prof),
                                             "--"])
    if prof.is_file():
        h.profiles[case] = summarize_pyspy(prof)


def measure_load(h: "Harness", case: str, loader: str, rep: int, wrap0: list[str] | None = None) -> PlugSample:
    lc = LOAD_CASES[case]
    spec = {"kind": "load", "loader": loader, "world": lc.world, "dataset": lc.dataset, "layout": lc.layout,
            "endpoint": h.server.endpoint, "model": data.spec_to_json(h.model),
            "fingerprints": str(h.fingerprints_path), "bucket_dir": str(h.bucket_dir)}
    load_avg = os.getloadavg()[0]
    h.server.reset()
    timeout = 90 if h.args.quick else max(180.0, 60 + 3 * lc.world * h.size / (50 << 20))
    results, errors = _spawn_and_collect(h, spec, lc.world, f"{case}-{loader}-{rep}", timeout, wrap0)
    stats = h.server.stats()
    s = _outcome(results, errors, lc.world)
    s.load_avg = load_avg
    if s.rss_peak is None:
        return s
    s.seconds = max(r["seconds"] for r in results)
    if stats is not None:
        s.bytes_read = int(stats["get_body_bytes"])
        s.requests = {k: int(v) for k, v in stats["requests"].items()}
    for r in results:
        for k, v in r.get("reader", {}).items():
            s.reader[k] = s.reader.get(k, 0) + int(v)
    return s


def measure_save(h: "Harness", case: SaveCase, saver: str, rep: int) -> PlugSample:
    tag = f"{saver}-{case.style}{case.world}-{rep}"
    folder = h.bucket_dir / PLUG_SAVES / tag
    shutil.rmtree(folder, ignore_errors=True)
    spec = {"kind": "save", "saver": saver, "style": case.style, "world": case.world,
            "endpoint": h.server.endpoint, "model": data.spec_to_json(h.model),
            "fingerprints": str(h.fingerprints_path), "bucket_dir": str(h.bucket_dir),
            "target": f"{PLUG_SAVES}/{tag}", "verify": rep == 0, "counts": h.server.counts}
    load_avg = os.getloadavg()[0]
    h.server.reset()
    timeout = 90 if h.args.quick else max(240.0, 60 + 4 * case.world * h.size / (50 << 20))
    results, errors = _spawn_and_collect(h, spec, case.world, f"p4-{tag}", timeout)
    shutil.rmtree(folder, ignore_errors=True)
    s = _outcome(results, errors, case.world)
    s.load_avg = load_avg
    if s.rss_peak is None:
        return s
    s.seconds = max(r["durable"] for r in results)
    stats = next((r["server_stats"] for r in results if r.get("server_stats")), None)
    if stats is not None:
        s.requests = {k: int(v) for k, v in stats.get("requests", {}).items()}
        s.put_bytes = int(stats.get("put_body_bytes", 0))
    if not all(r.get("hwm_reset", True) for r in results):
        s.ok += " (peak RSS not reset)"
    return s


def _loop(names: list[str], reps: int, measure: Any, res: dict[str, list[PlugSample]], label: str) -> None:
    """``reps`` rounds over ``names``, who goes first rotating; a n/a answer is not asked again."""
    for rep in range(reps):
        k = rep % len(names)
        for name in names[k:] + names[:k]:
            if res[name] and res[name][-1].na:
                res[name].append(res[name][-1])
                continue
            s = PlugSample(na=f"{NEEDS.get(name)} not installed in this venv") if not _installed(name) \
                else measure(name, rep)
            res[name].append(s)
            shown = s.na and "n/a: " + s.na or s.error and "ERROR " + s.error or f"{s.seconds:.2f} s"
            print(f"  ({label}) rep {rep + 1}/{reps} {name:12s} {shown}", flush=True)


def _wanted(h: "Harness", names: list[str]) -> list[str]:
    picked = [x for x in h.args.loaders.split(",") if x] if h.args.loaders else []
    return [n for n in names if n in picked] or names


def run_plug_scenario(h: "Harness") -> None:
    """Fill ``h.plug`` (a PlugResults): every load case, then every save case."""
    pr = PlugResults(load_start=os.getloadavg()[0])
    h.plug = pr
    datasets = sorted({lc.dataset for lc in LOAD_CASES.values()})
    h.server.warm([f for ds in datasets if h.have(ds) for f in data.dataset_files(h.bucket_dir, ds)])
    readers = _wanted(h, list(READERS))
    for case, lc in LOAD_CASES.items():
        res: dict[str, list[PlugSample]] = {n: [] for n in readers}
        pr.loads[case] = res
        if not h.have(lc.dataset):
            for n in readers:
                res[n] = [PlugSample(na=f"dataset {lc.dataset} was not prepared")] * h.args.reps
            continue
        if case in h.args.profile and "ours" in readers:  # e.g. --profile p3
            profile_load(h, case)
        _loop(readers, h.args.reps, lambda n, rep, case=case: measure_load(h, case, n, rep), res, case)
    shutil.rmtree(h.bucket_dir / PLUG_SAVES, ignore_errors=True)
    writers = _wanted(h, list(WRITERS))
    for sc in QUICK_SAVE_CASES if h.args.quick else SAVE_CASES:
        res = {n: [] for n in writers}
        pr.saves[sc] = res
        _loop(writers, h.args.reps, lambda n, rep, sc=sc: measure_save(h, sc, n, rep), res,
              f"p4 {sc.style} W={sc.world}")
    shutil.rmtree(h.bucket_dir / PLUG_SAVES, ignore_errors=True)
    pr.load_end = os.getloadavg()[0]


# ------------------------------------------------------------------ report


def _med(vals: list[float], fmt: str = "{:.2f}") -> str:
    from .run import med_range

    return med_range(vals, fmt)


def _human(n: float | None) -> str:
    from .run import human

    return human(n)


def _reqs(s: PlugSample) -> str:
    if not s.requests:
        return "n/a"
    return f"{sum(s.requests.values())} ({', '.join(f'{k} {v}' for k, v in sorted(s.requests.items()))})"


def _good(samples: list[PlugSample]) -> list[PlugSample]:
    return [s for s in samples if s.seconds is not None]


def _failed_row(name: str, samples: list[PlugSample], cols: int) -> str | None:
    first = samples[0] if samples else PlugSample(na="not run")
    if first.na:
        return f"| {name} | n/a ({first.na}) |" + " |" * (cols - 2)
    if not _good(samples):
        err = next((s.error for s in samples if s.error), None) or "no result"
        return f"| {name} | error: {err.replace('|', '/')} |" + " |" * (cols - 2)
    return None


def load_table(h: "Harness", case: str) -> tuple[list[str], dict[str, float], dict[str, float]]:
    """Lines, each reader's median wall and its median read amplification."""
    res = h.plug.loads[case]
    need = h.model.nbytes  # every case needs each stored byte once over all ranks
    lines = ["| reader | wall s, median (min–max) | GB/s | read ampl. | requests (first rep) | peak RSS / rank | "
             "Δ RSS / rank | correct |", "|---|---|---|---|---|---|---|---|"]
    walls: dict[str, float] = {}
    ampls: dict[str, float] = {}
    for name, samples in res.items():
        label = READERS[name]
        head = _failed_row(label, samples, 8)
        if head:
            lines.append(head)
            continue
        good = _good(samples)
        walls[name] = statistics.median(s.seconds for s in good)
        amp = [s.bytes_read / need for s in good if s.bytes_read is not None]
        if amp:
            ampls[name] = statistics.median(amp)
        bad = len(samples) - len(good)
        lines.append(f"| {label} | {_med([s.seconds for s in good])} | {need / walls[name] / 1e9:.2f} | "
                     f"{_med(amp, '{:.3f}') if amp else 'n/a'} | {_reqs(good[0])} | "
                     f"{_human(statistics.median(s.rss_peak for s in good))} | "
                     f"{_human(statistics.median(s.rss_delta for s in good))} | "
                     f"{good[0].ok}{f' ({bad} failed reps)' if bad else ''} |")
    ours = next((s for s in _good(res.get("ours", []))), None)
    if ours and ours.reader:
        lines += ["", "`StorageReader.stats`, summed over ranks (first rep): " +
                  ", ".join(f"{k}={_human(v) if k.startswith('bytes') else v}" for k, v in ours.reader.items())]
    if "ours" in walls and "s3torch" in walls:
        ratio = walls["s3torch"] / walls["ours"]
        lines += ["", f"speed-up (S3StorageReader wall ÷ StorageReader wall): {ratio:.2f}×"]
    return lines, walls, ampls


def save_table(h: "Harness") -> tuple[list[str], dict[SaveCase, dict[str, float]]]:
    lines = ["| writer | ranks | state | wall s, median (min–max) | MB/s | requests (first rep) | bytes uploaded | "
             "peak RSS / rank | Δ RSS / rank | correct |", "|---|---|---|---|---|---|---|---|---|---|"]
    walls: dict[SaveCase, dict[str, float]] = {}
    style = {"plain": "plain tensors", "ddp": "replicated (DDP)", "fsdp": "`Shard(0)` (FSDP)"}
    for sc, res in h.plug.saves.items():
        for name, samples in res.items():
            head = _failed_row(f"{WRITERS[name]} | {sc.world} | {style[sc.style]}", samples, 8)
            if head:
                lines.append(head)
                continue
            good = _good(samples)
            wall = statistics.median(s.seconds for s in good)
            walls.setdefault(sc, {})[name] = wall
            put = [s.put_bytes for s in good if s.put_bytes is not None]
            lines.append(f"| {WRITERS[name]} | {sc.world} | {style[sc.style]} | {_med([s.seconds for s in good])} | "
                         f"{h.model.nbytes / wall / 1e6:.0f} | {_reqs(good[0])} | "
                         f"{_human(statistics.median(put)) if put else 'n/a'} | "
                         f"{_human(statistics.median(s.rss_peak for s in good))} | "
                         f"{_human(statistics.median(s.rss_delta for s in good))} | {good[0].ok} |")
    return lines, walls


def plug_targets(load_walls: dict[str, dict[str, float]], load_ampls: dict[str, dict[str, float]],
                 save_walls: dict[SaveCase, dict[str, float]]) -> list[str]:
    """Issue 25's goals from this run's medians."""
    out = []
    for case, w in load_walls.items():
        if "ours" in w and "s3torch" in w:
            r = w["s3torch"] / w["ours"]
            out.append(f"- ({case}) `dcp.load` ≥ {LOAD_GOAL}× S3StorageReader: {r:.2f}× — "
                       f"{'met' if r >= LOAD_GOAL else 'MISSED'}")
    for case, a in load_ampls.items():
        if LOAD_CASES[case].layout == "rows" and "ours" in a:
            theirs = f" (S3StorageReader: {a['s3torch']:.3f})" if "s3torch" in a else ""
            out.append(f"- ({case}) sharded load read amplification ≤ {AMPL_GOAL}: {a['ours']:.3f}{theirs} — "
                       f"{'met' if a['ours'] <= AMPL_GOAL else 'MISSED'}")
    for sc, w in save_walls.items():
        if "ours" in w and "s3torch" in w:
            r = w["s3torch"] / w["ours"]
            t8 = f" (thread_count=8: {w['s3torch.t8'] / w['ours']:.2f}×)" if "s3torch.t8" in w else ""
            out.append(f"- (p4) `dcp.save` {sc.style} on {sc.world} rank(s) ≥ {SAVE_GOAL}× S3StorageWriter: "
                       f"{r:.2f}×{t8} — {'met' if r >= SAVE_GOAL else 'MISSED'}")
    return out


def render_plug(h: "Harness", title: str) -> list[str]:
    pr: PlugResults | None = getattr(h, "plug", None)
    if pr is None:
        return []
    from .run import git_rev

    avgs = [s.load_avg for res in [*pr.loads.values(), *pr.saves.values()] for v in res.values() for s in v
            if s.seconds is not None]
    lines = [f"## (p) {title}", "",
             f"The model above ({_human(h.model.nbytes)}), the same `dcp.load` / `dcp.save` calls with DCP's default "
             "planners; only the storage plug-in differs. A fresh process per rank and measurement, "
             f"{h.args.reps} repetition(s), plug-ins alternating; medians (min–max). streamckpt at git {git_rev()}. "
             f"Load average (1 min): {pr.load_start:.1f} at the start of (p), {pr.load_end:.1f} at its end, "
             f"{_med(avgs, '{:.1f}')} before each measured run (2 cores, shared).", "",
             "- wall: from a barrier before the call (plug-in construction inside) to its return (saves: the "
             "slowest rank's); GB/s and MB/s: the model's bytes ÷ wall.",
             "- read ampl.: GET body bytes the server sent, over all ranks (its own counter) ÷ the model's bytes "
             "(each case needs every stored byte once over all ranks); requests: every request the server "
             "answered, by method; bytes uploaded: request bodies it received.",
             "- peak RSS: each rank's `VmHWM` (saves: reset just before the call); Δ RSS: peak minus the RSS "
             "just before the call (targets or source state already allocated).",
             "- correct: every loaded tensor's (each rank's slice's) crc32c equals that of the generated data; "
             "saves: the first repetition's checkpoint loaded back by rank 0 through the same plug-in's reader.",
             "- S3StorageReader/Writer: s3torchconnector's defaults (`S3ClientConfig(force_path_style=True)`; "
             "the writer's `thread_count=1`, also shown with 8).", ""]
    load_walls, load_ampls = {}, {}
    for case, lc in LOAD_CASES.items():
        if case not in pr.loads:
            continue
        table, walls, ampls = load_table(h, case)
        load_walls[case], load_ampls[case] = walls, ampls
        lines += [f"### ({case}) {lc.title}", ""] + table + [""]
    save_walls: dict[SaveCase, dict[str, float]] = {}
    if pr.saves:
        table, save_walls = save_table(h)
        lines += ["### (p4) `dcp.save` of the whole model: one process; DDP-style (every rank holds it all, DCP "
                  "deduplicates) and FSDP-style (`Shard(0)`) on gloo ranks", ""] + table + [""]
    checks = plug_targets(load_walls, load_ampls, save_walls)
    if checks:
        lines += ["Targets (issue 25):", ""] + checks + [""]
    return lines


if __name__ == "__main__":
    main()
