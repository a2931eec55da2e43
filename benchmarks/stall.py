"""Scenario (t): the training stall an async save causes (issue 26, item 7).

    python -m benchmarks.stall --size 256MiB [--out stall.md]          # CPU, the local S3 server
    python -m benchmarks.stall --size 2GiB --device cuda --target file  # GPU, local files (benchmarks.gpu)

A training loop keeps stepping in the main thread while a checkpoint of ``--size`` bytes (the
"model", a replica held by this one rank) is saved asynchronously. Each saver runs in a fresh
process with a world-1 gloo group (DCP's process mode needs one; every saver gets the same):

- ``streamckpt``: ``sc.async_save``; durable at ``handle.result()``;
- ``dcp.thread`` / ``dcp.process``: ``dcp.async_save`` with ``AsyncCheckpointerType.THREAD`` /
  ``.PROCESS`` and s3torchconnector's ``S3StorageWriter`` (``--target s3``) or DCP's
  ``FileSystemWriter`` (``--target file``); durable when the upload future resolves.

Two loops: ``small`` (GIL-bound: many tiny tensor ops per step, as an optimizer over many small
parameters or a Python-heavy data path) and ``matmul`` (a 512×512 float32 product per step on the
CPU, a bf16 8192² product on the GPU; intra-op threads compete with the save). For each loop and
saver: save 1 and save 2 (the second in the same process, as a training job's next checkpoint), each
in its own window, with 1 s of steps and no save just before and just after it as its baseline. Per window:

- blocked: seconds the ``async_save`` call held the training thread;
- durable: seconds from the call to the checkpoint being durable (a waiter thread's ``result()``);
- median / longest step in the window (the step that called the save included) vs the baseline's;
- lost: window − (steps finished in the window × the baseline's mean step): training time the
  save cost, its blocking included.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from . import data, timelimit
from .server import BUCKET, REGION, BenchServer, free_port

REPO = Path(__file__).resolve().parent.parent
SAVERS = ["streamckpt", "dcp.thread", "dcp.process"]
LOOPS = ["small", "matmul"]
PRE_S = 0.4  # steps before the save call in each window
TAIL_S = 0.3  # steps after durable (so the window's last steps are not cut short)
BASELINE_S = 1.0  # before and after each window
WINDOW_LIMIT_S = 120.0
# The CPU loop's intra-op threads: one, so that a matmul step is one core's work and not a
# two-thread region waiting on its slower half whenever the save, the server or another job
# takes a core (on 2 cores that made baseline steps 4x slower and 'lost' meaningless).
INTRA_OP_THREADS = 1


@dataclass
class Window:
    """One save inside a stepping loop."""

    loop: str
    save: int
    blocked: float = 0.0
    durable: float = 0.0
    lost: float = 0.0
    steps: int = 0
    median_step: float = 0.0
    longest_step: float = 0.0
    base_median: float = 0.0
    base_longest: float = 0.0
    base_mean: float = 0.0
    error: str = ""


@dataclass
class Report:
    saver: str
    device: str
    target: str
    nbytes: int
    windows: list[Window] = field(default_factory=list)
    checked: str = ""
    error: str = ""

    @property
    def timed_out(self) -> bool:
        """Out of time (killed at its limit, or not started): not a broken saver."""
        return self.error.startswith(TIMEOUT)


TIMEOUT = "TIMEOUT"  # how a saver that ran out of time is reported, never as FAILED


# ------------------------------------------------------------------ training loops


def make_step(kind: str, device: str) -> Callable[[], None]:
    """One training step; on CUDA it ends with a synchronize, as a loop reading its loss does."""
    import torch

    if kind == "small":
        xs = [torch.randn(64, device=device) for _ in range(8)]

        def small() -> None:
            for _ in range(12):
                for x in xs:
                    x.mul_(0.999).add_(0.001)
            if device == "cuda":
                torch.cuda.synchronize()
        return small
    if device == "cuda":
        a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
        b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    else:
        a, b = torch.randn(512, 512), torch.randn(512, 512)
    out = torch.empty_like(a)

    def matmul() -> None:
        torch.mm(a, b, out=out)
        if device == "cuda":
            torch.cuda.synchronize()
    return matmul


def baseline(step: Callable[[], None], seconds: float) -> list[float]:
    """Step durations with no save running."""
    for _ in range(5):
        step()
    out = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        step()
        out.append(time.perf_counter() - t0)
    return out


class Waiter:
    """Records when a pending save becomes durable, from a thread that only blocks on it."""

    def __init__(self, pending: Any) -> None:
        self.at: float | None = None
        self.error = ""
        self.thread = threading.Thread(target=self._wait, args=(pending,), daemon=True)
        self.thread.start()

    def _wait(self, pending: Any) -> None:
        try:
            pending.result()
        except BaseException as e:  # noqa: BLE001 - reported in the window
            self.error = f"{type(e).__name__}: {e}"
        self.at = time.perf_counter()


def window(step: Callable[[], None], start_save: Callable[[], Any], base: list[float], loop: str,
           save: int) -> Window:
    """Steps before, during and after one save; the save call happens inside a step."""
    w = Window(loop, save, base_median=statistics.median(base), base_longest=max(base),
               base_mean=statistics.fmean(base))
    end_pre = time.perf_counter() + PRE_S
    while time.perf_counter() < end_pre:
        step()
    steps: list[tuple[float, float]] = []  # (end, duration)
    t_step = time.perf_counter()
    step()
    t0 = time.perf_counter()
    pending = start_save()
    w.blocked = time.perf_counter() - t0
    steps.append((time.perf_counter(), time.perf_counter() - t_step))
    waiter = Waiter(pending)
    limit = t0 + WINDOW_LIMIT_S
    while (waiter.at is None or time.perf_counter() < waiter.at + TAIL_S) and time.perf_counter() < limit:
        t1 = time.perf_counter()
        step()
        steps.append((time.perf_counter(), time.perf_counter() - t1))
    waiter.thread.join(timeout=5)
    if waiter.at is None:
        w.error = f"not durable within {WINDOW_LIMIT_S:.0f} s"
        return w
    w.error = waiter.error
    w.durable = waiter.at - t0
    inside = [d for e, d in steps if e <= waiter.at]
    w.steps = len(inside)
    w.median_step = statistics.median(inside) if inside else 0.0
    w.longest_step = max(inside) if inside else 0.0
    w.lost = w.durable - len(inside) * w.base_mean
    return w


def rebase(w: Window, base: list[float]) -> None:
    """The window's baseline figures from the steps just before and just after it (this machine's
    pace drifts with other work: one baseline per process made 'lost' negative)."""
    mean = statistics.fmean(base)
    w.lost += w.steps * (w.base_mean - mean)
    w.base_median, w.base_longest, w.base_mean = statistics.median(base), max(base), mean


# ------------------------------------------------------------------ savers (in the child)


def state_dict(nbytes: int, device: str) -> dict[str, Any]:
    """A model of 4 MiB fp32 tensors (16 MiB bf16 on the GPU), random, as a training job holds it."""
    import torch

    g = torch.Generator(device=device).manual_seed(1)
    if device == "cuda":
        n, shape, dtype = max(1, nbytes // (16 << 20)), (2048, 4096), torch.bfloat16
    else:
        n, shape, dtype = max(1, nbytes // (4 << 20)), (1024, 1024), torch.float32
    return {f"layers.{i}.weight": torch.randn(shape, generator=g, device=device, dtype=dtype) for i in range(n)}


def _dcp_writer(spec: dict[str, Any], path: str) -> Any:
    if spec["target"] == "file":
        from torch.distributed.checkpoint import FileSystemWriter

        return FileSystemWriter(path)
    from s3torchconnector import S3ClientConfig
    from s3torchconnector.dcp import S3StorageWriter

    return S3StorageWriter(REGION, path, s3client_config=S3ClientConfig(force_path_style=True))


def saver_fn(spec: dict[str, Any], sd: dict[str, Any]) -> Callable[[str], Any]:
    """``start(name)``: begin one save and return what becomes durable (``.result()``)."""
    saver = spec["saver"]
    base = spec["base"]
    if saver == "streamckpt":
        import streamckpt as sc

        opts = spec.get("storage_options")
        return lambda name: sc.async_save(sd, f"{base}/{name}", storage_options=opts)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    mode = AsyncCheckpointerType.THREAD if saver == "dcp.thread" else AsyncCheckpointerType.PROCESS

    def start(name: str) -> Any:
        out = dcp.async_save(sd, storage_writer=_dcp_writer(spec, f"{base}/{name}"), async_checkpointer_type=mode)
        if hasattr(out, "staging_completion"):  # AsyncSaveResponse: the caller waits for staging
            out.staging_completion.result()
            return out.upload_completion
        return out
    return start


def check_saved(spec: dict[str, Any], sd: dict[str, Any], name: str) -> str:
    """streamckpt's checkpoint read back and compared element by element (the figures mean nothing if wrong)."""
    if spec["saver"] != "streamckpt":
        return ""
    import torch

    import streamckpt as sc

    back = sc.load_full(f"{spec['base']}/{name}", storage_options=spec.get("storage_options"))
    wrong = [k for k, v in sd.items() if not torch.equal(back[k], v.cpu())]
    return f"{len(sd) - len(wrong)}/{len(sd)} tensors equal" + (f"; WRONG: {wrong[:3]}" if wrong else "")


def child(spec: dict[str, Any]) -> Report:
    import torch
    import torch.distributed as dist

    rep = Report(spec["saver"], spec["device"], spec["target"], 0)
    if spec["device"] == "cpu":
        torch.set_num_threads(INTRA_OP_THREADS)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        sd = state_dict(spec["nbytes"], spec["device"])
        rep.nbytes = sum(t.numel() * t.element_size() for t in sd.values())
        start = saver_fn(spec, sd)
        for loop in spec["loops"]:
            step = make_step(loop, spec["device"])
            before = baseline(step, BASELINE_S)
            for k in (1, 2):
                name = f"{loop}-{k}"
                try:
                    w = window(step, lambda: start(name), before, loop, k)
                except Exception as e:  # noqa: BLE001 - one saver's failure is a row, not the run
                    w = Window(loop, k, error=f"{type(e).__name__}: {e}")
                after = baseline(step, BASELINE_S)  # the machine's pace right after, for this window and the next
                rebase(w, before + after)
                rep.windows.append(w)
                before = after
            if not rep.checked:
                rep.checked = check_saved(spec, sd, f"{loop}-1")
    finally:
        dist.destroy_process_group()
    return rep


# ------------------------------------------------------------------ the parent


def run_saver(spec: dict[str, Any], env: dict[str, str], timeout: float) -> Report:
    """One saver in a fresh process; its report comes back as the last line of its output."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    try:  # a session of its own: at the limit its whole group goes (DCP's process-mode saver holds the pipes)
        rc, out, err, timed_out = timelimit.run_captured(
            [sys.executable, "-m", "benchmarks.stall", "--child", f.name], timeout, cwd=REPO, env=env)
    finally:
        os.unlink(f.name)
    sys.stderr.write(err[-4000:])
    if timed_out:
        return Report(spec["saver"], spec["device"], spec["target"], 0, error=f"{TIMEOUT} after {timeout:.0f} s")
    last = out.strip().splitlines()[-1:] or [""]
    try:
        doc = json.loads(last[0])
    except json.JSONDecodeError:
        return Report(spec["saver"], spec["device"], spec["target"], 0, error=f"exit {rc}: {(out + err)[-1500:]}")
    doc["windows"] = [Window(**w) for w in doc["windows"]]
    return Report(**doc)


def installed(saver: str, target: str) -> bool:
    from importlib.util import find_spec

    return not (saver.startswith("dcp") and target == "s3" and find_spec("s3torchconnector") is None)


def measure(nbytes: int, device: str, target: str, savers: list[str], loops: list[str], work: Path,
            server: BenchServer | None = None, deadline: float | None = None, reps: int = 1) -> list[Report]:
    """Every saver in turn, each in its own process, against one server or folder; none starts
    after ``deadline`` (``time.perf_counter()``), and none runs past it by much."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(":")}
    own = None
    work.mkdir(parents=True, exist_ok=True)
    if target == "s3" and server is None:
        (work / BUCKET).mkdir(parents=True, exist_ok=True)
        own = server = BenchServer(work).start()
    try:
        if server is not None:
            env.update(server.env())
        reports = []
        for rep, saver in [(r, s) for r in range(reps) for s in savers]:  # repetitions alternate the savers
            if not installed(saver, target):
                reports.append(Report(saver, device, target, 0, error="s3torchconnector is not installed"))
                continue
            # a fresh prefix per process: no save overwrites another (localbucket answers the bulk
            # delete of `overwrite=True` with an error, which is not what this measures)
            name = f"stall-{saver}-r{rep}"
            base = f"s3://{BUCKET}/{name}" if target == "s3" else str(work / name)
            spec = {"saver": saver, "device": device, "target": target, "nbytes": nbytes, "loops": loops,
                    "base": base, "storage_options": server.storage_options if server else None}
            left = 600.0 if deadline is None else deadline - time.perf_counter()
            if left < 20:
                reports.append(Report(saver, device, target, 0, error=f"{TIMEOUT}: not started, {left:.0f} s left"))
                continue
            print(f"  (t) {saver} on {device}, {target} ...", flush=True)
            reports.append(run_saver(spec, env, timeout=min(600.0, left)))
        return reports
    finally:
        if own is not None:
            own.stop()


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}"
        n /= 1024
    return f"{n:.0f} GiB"


def _f(x: float, unit: str = "s") -> str:
    return f"{x:.2f} {unit}" if x >= 0.1 else f"{x * 1000:.1f} ms"


def merged(reports: list[Report]) -> dict[tuple[str, str, int], list[Window]]:
    """The good windows of every repetition, by (saver, loop, save)."""
    by: dict[tuple[str, str, int], list[Window]] = {}
    for r in reports:
        for w in r.windows:
            if not w.error:
                by.setdefault((r.saver, w.loop, w.save), []).append(w)
    return by


def med(ws: list[Window], attr: str) -> float:
    return statistics.median(getattr(w, attr) for w in ws)


def _spread(ws: list[Window], attr: str) -> str:
    vals = [getattr(w, attr) for w in ws]
    return _f(statistics.median(vals)) + (f" ({_f(min(vals))}–{_f(max(vals))})" if len(vals) > 1 else "")


def table(reports: list[Report]) -> list[str]:
    """Medians over repetitions (lost and durable with their min–max)."""
    rows = ["| loop | save | saver | reps | blocked | durable | median step (base) | longest step (base) | lost |",
            "|---|---|---|---|---|---|---|---|---|"]
    by = merged(reports)
    savers = list(dict.fromkeys(r.saver for r in reports))
    for loop in LOOPS:
        for k in (1, 2):
            for saver in savers:
                ws = by.get((saver, loop, k))
                if not ws:
                    continue
                rows.append(f"| {loop} | {k} | {saver} | {len(ws)} | {_f(med(ws, 'blocked'))} | "
                            f"{_spread(ws, 'durable')} | {_f(med(ws, 'median_step'))} ({_f(med(ws, 'base_median'))})"
                            f" | {_f(med(ws, 'longest_step'))} ({_f(med(ws, 'base_longest'))}) | "
                            f"{_spread(ws, 'lost')} |")
    for r in reports:
        for w in r.windows:
            if w.error:
                rows.append(f"| {w.loop} | {w.save} | {r.saver} | FAILED: {w.error[:200]} ||||||")
        if r.error:
            rows.append(f"| | | {r.saver} | {'' if r.timed_out else 'FAILED: '}{r.error[-300:]} ||||||")
    return rows


def goals(reports: list[Report]) -> list[str]:
    """Issue 26's goal per loop and save (medians): lost ≤ the best DCP mode's, durable ≤ 0.5 × it."""
    out = []
    by = merged(reports)
    for loop in LOOPS:
        for k in (1, 2):
            sc = by.get(("streamckpt", loop, k))
            dcps = [by[(d, loop, k)] for d in ("dcp.thread", "dcp.process") if (d, loop, k) in by]
            if not sc or not dcps:
                continue
            lost, durable = med(sc, "lost"), med(sc, "durable")
            best_lost = min(med(d, "lost") for d in dcps)
            best_durable = min(med(d, "durable") for d in dcps)
            out.append(f"- {loop}, save {k}: lost {lost:.2f} s vs best DCP {best_lost:.2f} s — "
                       f"{'met' if lost <= best_lost else 'MISSED'}; durable {durable:.2f} s vs 0.5 × best DCP "
                       f"{0.5 * best_durable:.2f} s — {'met' if durable <= 0.5 * best_durable else 'MISSED'}")
    return out


def render(reports: list[Report], argv: list[str], note: str = "") -> list[str]:
    nbytes = next((r.nbytes for r in reports if r.nbytes), 0)
    r0 = reports[0] if reports else None
    lines = [f"## (t) training stall: a training loop stepping while an async save runs ({human(nbytes)}, "
             f"{r0.device if r0 else '?'}, {r0.target if r0 else '?'})", "",
             "```", "python -m benchmarks.stall " + " ".join(shlex.quote(a) for a in argv), "```", "",
             "Each saver in a fresh process (world-1 gloo group), repetitions alternating the savers; "
             "medians over them (durable and lost with min–max). Per loop save 1 and save 2 in their own "
             "windows, each with 1 s of steps just before and just after it as its baseline. blocked: the "
             "`async_save` call; durable: call → `result()`; lost: window − steps finished in it × baseline "
             "mean step. `small`: GIL-bound tiny ops; `matmul`: 512² fp32 products on one intra-op thread (CPU) / "
             "8192² bf16 (GPU). See benchmarks/stall.py.", ""]
    if note:
        lines += [note, ""]
    lines += table(reports) + [""]
    checked = [f"{r.saver}: {r.checked}" for r in reports if r.checked]
    if checked:
        lines += ["- read back: " + "; ".join(checked)]
    lines += goals(reports) + [""]
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python -m benchmarks.stall", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    ap.add_argument("--size", default="256MiB")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--target", default="s3", choices=["s3", "file"])
    ap.add_argument("--savers", default=",".join(SAVERS))
    ap.add_argument("--loops", default=",".join(LOOPS))
    ap.add_argument("--reps", type=int, default=2, help="processes per saver, alternating")
    ap.add_argument("--work", default="", help="folder for the server's bucket or the files (default: a temp dir)")
    ap.add_argument("--out", default="", help="write the markdown section here too")
    args = ap.parse_args(argv)
    if args.child:
        rep = child(json.loads(Path(args.child).read_text()))
        print(json.dumps(asdict(rep)), flush=True)
        return 0
    timelimit.exit_on_sigterm()  # a limit on this process ends the saver in flight too
    work = Path(args.work or tempfile.mkdtemp(prefix="sc-stall-", dir="/tmp"))
    reports = measure(data.parse_size(args.size), args.device, args.target, args.savers.split(","),
                      args.loops.split(","), work, reps=args.reps)
    text = "\n".join(render(reports, argv))
    print(text, flush=True)
    if args.out:
        Path(args.out).write_text(text + "\n")
    for r in reports:
        if r.timed_out:
            print(f"TIMEOUT {r.saver} {r.error[len(TIMEOUT):].lstrip(': ')}", flush=True)
    broken = [r for r in reports if (r.error and not r.timed_out) or any(w.error for w in r.windows)]
    return 1 if broken else 0  # a saver out of time is reported TIMEOUT, not broken


if __name__ == "__main__":
    sys.exit(main())
