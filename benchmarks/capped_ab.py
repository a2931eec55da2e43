"""(g1) A/B: the capped replicated load of ``benchmarks.run --scenario g`` for streamckpt from
several checkouts, alternating in one run, with a timeline of where each load's time went.

Issue 37 item 5 asks why 4 ranks that each need the whole 256 MiB model, reading once from a
server capped at 200 MB/s, take longer than the 1.34 s the cap allows. The harness's (g1)
measures one checkout; comparing a change needs the old and the new code under the same
machine load, so this runs each tree's ``streamckpt`` in fresh processes (4 gloo ranks,
``sys.path`` starting at the tree), alternating trees within each repetition, against one
``benchmarks.server`` (localbucket) with the cap, timing from a barrier before ``sc.load`` to
a barrier after it, as (g1) does. Each rank also records its CPU seconds (user, system) and
when each round's reads were in flight: the union over ranks is when the capped store was
busy, and an "idle" gap is time no rank had a read in flight, lost for good under a cap.

    PYTHONPATH=. python -m benchmarks.run --scenario g --size 256MiB --reps 1   # prepares bench-data once
    git worktree add /tmp/sc-main main
    PYTHONPATH=. python -m benchmarks.capped_ab --trees /tmp/sc-main,. --reps 5

Profiling only: it wraps ``Executor._fetch`` to timestamp reads (in these processes only).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

WORLD = 4
REPO = Path(__file__).resolve().parent.parent


def _rank(rank: int, port: int, endpoint: str, out: str, tree: str) -> None:
    import resource

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update({"AWS_ACCESS_KEY_ID": "bench-key", "AWS_SECRET_ACCESS_KEY": "bench-secret",
                       "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"})
    sys.path.insert(0, tree)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    import importlib

    import streamckpt as sc
    from streamckpt.loading import pipeline

    from benchmarks import data, worker

    for name in ("streamckpt.storage.obstore_backend", "streamckpt.storage.httpget"):
        importlib.import_module(name)
    spans: list[tuple[float, float, int]] = []
    t0 = [0.0]
    fetch = pipeline.Executor._fetch

    def timed(self: Any, k: int) -> Any:
        start = time.perf_counter() - t0[0]
        fut = fetch(self, k)
        if fut is not None:
            n = sum(r.length for _, r in self.fetched[k])
            fut.add_done_callback(lambda _f: spans.append((start, time.perf_counter() - t0[0], n)))
        return fut

    pipeline.Executor._fetch = timed  # type: ignore[method-assign]
    phases: dict[str, list[float]] = {}
    _stamp_phases(phases, t0)
    model = data.model_for_size(256 << 20)  # the (g1) model of --size 256MiB
    sd = worker.targets_full(model)
    opts = {"endpoint_url": endpoint, "key": "bench-key", "secret": "bench-secret"}
    dist.barrier()
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    t0[0] = time.perf_counter()
    res = sc.load(sd, "s3://bench/hf", storage_options=opts)
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    dist.barrier()
    wall = time.perf_counter() - t0[0]
    Path(out).write_text(json.dumps({
        "wall": wall, "user": ru1.ru_utime - ru0.ru_utime, "sys": ru1.ru_stime - ru0.ru_stime,
        "module": sc.__file__, "rounds": res.rounds, "staging": res.staging_bytes, "read": res.bytes_read, "spans": spans,
        "phases": phases}))
    dist.destroy_process_group()


PHASES = (("loading.loader", "collect", "collect targets"), ("loading.loader", "read_metadata_bytes", "metadata read"),
          ("loading.loader", "gather_targets", "specs gathered"),
          ("loading.loader", "_metadata_and_specs", "metadata+specs"), ("loading.loader", "build_plan", "plan"),
          ("loading.loader", "settle_rounds", "settle"), ("loading.pipeline", "Executor.__init__", "executor init"),
          ("loading.pipeline", "Executor.run", "executor run"), ("loading.requestrate", "gather_job", "job stats"))


def _stamp_phases(phases: dict[str, list[float]], t0: list[float]) -> None:
    """Wrap the load's steps (``PHASES``) to record when each started and ended, seconds from t0."""
    import importlib

    for module, attr, name in PHASES:
        mod = importlib.import_module(f"streamckpt.{module}")
        owner, _, fn_name = attr.rpartition(".")
        holder = getattr(mod, owner) if owner else mod
        fn = getattr(holder, fn_name)

        def wrapped(*a: Any, _fn: Any = fn, _name: str = name, **kw: Any) -> Any:
            start = time.perf_counter() - t0[0]
            try:
                return _fn(*a, **kw)
            finally:
                phases[_name] = [start, time.perf_counter() - t0[0]]

        setattr(holder, fn_name, wrapped)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def busy_and_idle(spans: list[tuple[float, float, int]]) -> tuple[float, float, float, float]:
    """(first read start, last read end, seconds some read was in flight, idle seconds between)."""
    spans = sorted(spans)
    busy = idle = 0.0
    lo, hi = spans[0][0], spans[0][1]
    for a, b, _ in spans[1:]:
        if a > hi:
            busy += hi - lo
            idle += a - hi
            lo, hi = a, b
        else:
            hi = max(hi, b)
    busy += hi - lo
    return spans[0][0], max(b for _, b, _ in spans), busy, idle


def run_once(tree: str, endpoint: str, work: Path, tag: str) -> dict[str, Any]:
    import torch.multiprocessing as mp

    out = str(work / tag)
    port = _free_port()
    mp.start_processes(_rank_entry, args=(port, endpoint, out, tree), nprocs=WORLD, start_method="spawn")
    ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(WORLD)]
    first, last, busy, idle = busy_and_idle([s for d in ranks for s in d["spans"]])
    phases = {name: max(d["phases"].get(name, [0.0, 0.0])[1] for d in ranks) for _, _, name in PHASES}
    return {**{f"end of {k}": v for k, v in phases.items()}, "wall": max(d["wall"] for d in ranks), "cpu": sum(d["user"] + d["sys"] for d in ranks),
            "sys": sum(d["sys"] for d in ranks), "first_read": first, "last_read": last, "busy": busy,
            "idle": idle, "module": ranks[0]["module"], "rounds": ranks[0]["rounds"], "staging_MiB": max(d["staging"] for d in ranks) / 2**20}


def _rank_entry(rank: int, port: int, endpoint: str, out: str, tree: str) -> None:
    _rank(rank, port, endpoint, f"{out}.{rank}", tree)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trees", required=True, help="comma-separated checkouts whose streamckpt to compare")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cap", default="200MB/s")
    ap.add_argument("--data", default=str(REPO / "bench-data" / "h1024-i2816-v16000-l9-s1234"),
                    help="the prepared bench data of 256MiB (benchmarks.run makes it)")
    args = ap.parse_args(argv)
    trees = [str(Path(t).resolve()) for t in args.trees.split(",")]
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "benchmarks.server", "--root", args.data, "--port", str(port),
                               "--bandwidth-cap", args.cap], cwd=REPO, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    results: dict[str, list[dict[str, Any]]] = {t: [] for t in trees}
    load0 = os.getloadavg()[0]
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("benchmarks.server did not start") from None
                time.sleep(0.1)
        with tempfile.TemporaryDirectory(prefix="capped-ab-") as tmp:
            for rep in range(args.reps):
                for i, tree in enumerate(trees):
                    r = run_once(tree, endpoint, Path(tmp), f"r{rep}t{i}")
                    results[tree].append(r)
                    print(f"rep {rep + 1}/{args.reps} {tree}: wall {r['wall']:.3f} s, store idle {r['idle']:.3f} s, "
                          f"cpu {r['cpu']:.2f} s (load {os.getloadavg()[0]:.1f})", flush=True)
    finally:
        server.terminate()
        server.wait()
    print(f"\nload average (1 min) at start {load0:.1f}, at end {os.getloadavg()[0]:.1f}")
    print("| tree | wall s, median (min–max) | first read at s | store idle s (median) | store busy s | "
          "CPU s of the 4 ranks (sys) | rounds | staging MiB/rank |")
    print("|---|---|---|---|---|---|---|---|")
    for tree, rs in results.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "module"}
        if any(not r["module"].startswith(tree) for r in rs):
            print(f"WARNING: {tree}'s runs imported streamckpt from {rs[0]['module']}")
        walls = [r["wall"] for r in rs]
        print(f"| {tree} | {med['wall']:.2f} ({min(walls):.2f}–{max(walls):.2f}) | {med['first_read']:.3f} | "
              f"{med['idle']:.3f} | {med['busy']:.3f} | {med['cpu']:.2f} ({med['sys']:.2f}) | {rs[0]['rounds']} | "
              f"{med['staging_MiB']:.0f} |")
    print("\nwhen each step ended, seconds from the load's start (the latest rank; medians):")
    for tree, rs in results.items():
        steps = [k for k in rs[0] if k.startswith("end of ")]
        print(f"{tree}: " + ", ".join(f"{k[7:]} {statistics.median(r[k] for r in rs):.3f}" for k in steps)
              + f", last read done {statistics.median(r['last_read'] for r in rs):.3f}")


if __name__ == "__main__":
    main()
