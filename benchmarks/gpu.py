"""The GPU benchmark for a lent CUDA machine (issue 26, item 2); ``benchmarks/gpu_check.sh`` runs it.

    python -m benchmarks.gpu [--gib 2] [--load-gib 1] [--stall-gib 0.5] [--work /tmp/sc-gpucheck] [--summary FILE]
                             [--out gpu.txt] [--budget-s 250]

1. h2d: one pinned host buffer copied to the GPU (the ceiling), then streamckpt's ``DeviceStage``
   over rounds of ``max_round_bytes`` (two pinned arenas, upload on the side stream, write into
   the target, release): the load's device path with storage taken out, ÷ the ceiling (goal
   >= 0.8); and the same with the host filling each arena first (bytes landing from storage).
2. d2h: one GPU buffer copied to one pinned host buffer (the ceiling), then the save's staging
   (``DeviceToHost.spans``: two pinned blocks, event-gated, the host touching each span as a
   checksum would), ÷ the ceiling.
3. load: ``sc.load`` from local files (page cache, CRC32C checked) into CUDA targets and into CPU
   targets, GB/s and ÷ the H2D ceiling; ``sc.save`` of CUDA and of CPU tensors to local files.
4. nccl: ``SKIP nccl-exchange: 1 GPU`` on a 1-GPU machine (NCCL refuses two ranks on one device);
   on 2+ GPUs ``nccl-exchange`` (``benchmarks.gpu_nccl``: message parts, relays on 4, relay hops
   kept on the device, every element checked); a world-1 NCCL ``GroupComm`` driving a real load
   through ``DeviceStage`` (``nccl_world1``).
5. stall: ``sc.async_save`` of CUDA tensors beside a GPU training loop, blocked time, time to
   durable and training time lost, beside ``dcp.async_save`` (thread and process modes) with
   DCP's ``FileSystemWriter`` (``benchmarks.stall --device cuda --target file``).

Local files under ``--work`` (after a free-space check), no S3 server. Test data is made on the GPU.
The sizes are the least that keep each figure's meaning (the ceilings need ~2 GiB, the stall ~0.5 GiB),
so that ``gpu_check.sh`` ends within 5 minutes and a lease leaves time for a rerun. Each part is timed twice
and the better time kept; every result is checked against what was written. Each check appends
one ``PASS|FAIL|SKIP name: figure`` line to ``--summary``: FAIL is a broken part (an exception, with
its traceback printed in full, or wrong bytes); a missed speed goal says MISSED in the figure.
Parts run in turn, the most informative first (the H2D/D2H ceilings, then loads into and saves from
CUDA), while time is left under ``--budget-s``; a part that runs out of time is not broken: it is
``TIMEOUT <part> after N s`` (not started once the budget is spent, or ended by the check's own
limit, whose SIGTERM arrives here as ``SystemExit``), never FAIL.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

GiB = 1 << 30


@dataclass
class Summary:
    """The per-check verdicts, appended to the summary file as they come."""

    path: str
    lines: list[str] = field(default_factory=list)
    failed: int = 0

    def check(self, ok: bool, name: str, figure: str) -> None:
        self.say("PASS" if ok else "FAIL", name, figure)

    def timeout(self, name: str, seconds: float, figure: str) -> None:
        """A part out of time: ``TIMEOUT <part> after N s``, not counted as failed."""
        self.say("TIMEOUT", f"{name} after {seconds:.0f} s", figure)

    def say(self, verdict: str, name: str, figure: str) -> None:
        """One line: PASS, FAIL (counted), TIMEOUT, or SKIP (what this machine cannot run, and why)."""
        line = f"{verdict} {name}: {figure}"
        self.failed += verdict == "FAIL"
        self.lines.append(line)
        print(">>> " + line, flush=True)
        if self.path:
            with open(self.path, "a") as f:
                f.write(line + "\n")


def need_space(where: Path, nbytes: int) -> None:
    """Refuse to write ``nbytes`` where less than that plus 2 GiB is free."""
    free = shutil.disk_usage(where).free
    if free < nbytes + 2 * GiB:
        raise OSError(f"{free / GiB:.1f} GiB free in {where}, {nbytes / GiB:.1f} GiB (+2) needed")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn: Callable[[], None], reps: int = 2) -> float:
    best = float("inf")
    for _ in range(reps):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        best = min(best, time.perf_counter() - t0)
    return best


def _goal(ratio: float, goal: float) -> str:
    return f"goal >= {goal}: {'met' if ratio >= goal else 'MISSED'}"


def h2d(total: int, dev: torch.device, out: Summary) -> float:
    from streamckpt.cuda.device import DeviceStage
    from streamckpt.cuda.runtime import TorchCuda
    from streamckpt.plan.planner import PlanOptions

    src = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    src.copy_(torch.randint(0, 256, (total,), dtype=torch.uint8, device=dev))  # on the GPU: a CPU random_ is serial
    dst = torch.empty(total, dtype=torch.uint8, device=dev)
    dt = _timed(lambda: dst.copy_(src, non_blocking=True))
    ceiling = total / dt / 1e9
    ok = torch.equal(dst[-(1 << 20):].cpu(), src[-(1 << 20):])
    out.check(ok, "h2d-ceiling", f"pinned memcpy H2D, {total >> 20} MiB in one copy: {ceiling:.2f} GB/s")
    del dst
    round_bytes = PlanOptions().max_round_bytes
    stage = DeviceStage(TorchCuda(), dev, [round_bytes, round_bytes])
    for a in stage.arenas:  # what the device-path-only rounds upload (checked in the target's last round)
        a.copy_(torch.randint(0, 256, (a.numel(),), dtype=torch.uint8, device=dev))
    target = torch.empty(total, dtype=torch.uint8, device=dev)
    rounds = total // round_bytes
    for fill in (False, True):
        def run() -> None:
            stage.begin()
            for k in range(rounds):
                slot = k % 2
                stage.acquire(slot)
                if fill:
                    stage.arenas[slot].copy_(src[k * round_bytes: (k + 1) * round_bytes])  # bytes landing
                stage.write(target[k * round_bytes: (k + 1) * round_bytes], stage.upload(stage.arenas[slot]))
                stage.release(slot)
            stage.finish()

        gbs = rounds * round_bytes / _timed(run) / 1e9
        if fill:
            ok = torch.equal(target[: rounds * round_bytes], src[: rounds * round_bytes].to(dev))
        else:
            ok = torch.equal(target[(rounds - 1) * round_bytes: rounds * round_bytes].cpu(),
                             stage.arenas[(rounds - 1) % 2])
        name = "h2d-pipeline-fill" if fill else "h2d-pipeline"
        what = "with a host memcpy filling each arena" if fill else "device path only"
        goal = "(no goal: the host memcpy is the bound)" if fill else _goal(gbs / ceiling, 0.8)
        out.check(ok, name, f"DeviceStage, {rounds} rounds of {round_bytes >> 20} MiB, {what}: {gbs:.2f} GB/s "
                            f"= {gbs / ceiling:.2f} x pinned memcpy, {goal}")
    return ceiling


def d2h(total: int, dev: torch.device, out: Summary) -> None:
    from streamckpt.cuda.device import SAVE_BLOCK_BYTES, DeviceToHost
    from streamckpt.cuda.runtime import TorchCuda

    src = torch.randint(0, 255, (total,), dtype=torch.uint8, device=dev)
    host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    dt = _timed(lambda: host.copy_(src, non_blocking=True))
    ceiling = total / dt / 1e9
    out.check(torch.equal(host[-(1 << 20):], src[-(1 << 20):].cpu()), "d2h-ceiling",
              f"pinned memcpy D2H, {total >> 20} MiB in one copy: {ceiling:.2f} GB/s")
    d2h = DeviceToHost(TorchCuda(), dev)
    sums: list[int] = []

    def run() -> None:
        sums.clear()
        for span in d2h.spans(src, SAVE_BLOCK_BYTES):
            sums.append(int(span[::4096].sum()))  # the host reads each span (a checksum touches every page)

    gbs = total / _timed(run) / 1e9
    d2h.close()
    want = [int(src[i: i + SAVE_BLOCK_BYTES][::4096].sum()) for i in range(0, total, SAVE_BLOCK_BYTES)]
    out.check(sums == want, "d2h-staging", f"DeviceToHost.spans, {SAVE_BLOCK_BYTES >> 20} MiB blocks: {gbs:.2f} GB/s "
                                           f"= {gbs / ceiling:.2f} x pinned D2H memcpy")


def _driver() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.split()
    except (OSError, subprocess.SubprocessError):
        out = []
    return out[0] if out else "unknown"


def pin_probe(dev: torch.device, api: Any = None) -> tuple[str, str]:
    """The first GPU part: pin 1 MiB with ``CudaApi.pin`` (``cudaHostRegister``), copy into it
    from the GPU, unpin it and run a kernel after; with the kernel and the driver. ``(verdict,
    figure)``: WARN when CUDA refuses to pin (staging then falls back, see ``device.pin_host``)."""
    import platform

    from streamckpt.cuda.runtime import PinRefused, TorchCuda

    api = api if api is not None else TorchCuda()
    real = isinstance(api, TorchCuda)
    where = (f"kernel {platform.release()}, driver {_driver() if real else 'none'}, "
             f"CUDA runtime {torch.version.cuda}")
    try:
        t = api.pin(1 << 20, dev)
    except PinRefused as e:
        return "WARN", f"{e}; staging falls back to torch's pinned allocator (one warning); {where}"
    want = (torch.arange(1 << 20) % 251).to(torch.uint8)
    if real:
        t.copy_(want.to(dev), non_blocking=True)
        torch.cuda.synchronize(dev)
    else:
        t.copy_(want)
    pinned = t.is_pinned() if real else True
    same = bool(torch.equal(t, want))
    api.unpin(t, dev)
    still = real and t.is_pinned()
    if real:
        torch.ones(1, device=dev).add_(1).item()  # a kernel after: no stray CUDA error left behind
    ok = pinned and same and not still
    return ("PASS" if ok else "FAIL"), (f"1 MiB pinned: {pinned}, bytes from the GPU exact: {same}, unpinned: "
                                        f"{not still}; {where}")


def nccl_world1(dev: torch.device, root: Path, out: Summary, *, backend: str = "nccl", cuda: Any = None,
                place: Callable[[torch.Tensor], torch.Tensor] | None = None,
                exchange: Callable[[int, Path], list[dict[str, Any]]] | None = None) -> None:
    """What one GPU can run of the NCCL path: NCCL refuses two ranks on one device, so the
    exchange between ranks is SKIP on a 1-GPU machine; a world-1 NCCL group still drives a real
    load through ``GroupComm`` (set-up, the GPU-side agreements and gathers, the data-plane
    choice) and ``DeviceStage`` (``run_load``: ``sc.load`` takes the single-process path at world 1).

    On 2+ GPUs, ``nccl-exchange``: ``benchmarks.gpu_nccl`` on min(GPUs, 4) ranks over NCCL, with
    message parts and (on 4) relays, each relay hop kept on the device (issue 42, items 2 and 5).

    ``backend``, ``cuda`` (a ``CudaApi``), ``place`` (a host tensor as this device's) and
    ``exchange`` (world, folder -> the ranks' reports) let a CPU test run the same code on gloo
    with the CUDA stand-in."""
    import torch.distributed as dist

    import streamckpt as sc
    from streamckpt.comm import GroupComm
    from streamckpt.cuda.runtime import TorchCuda
    from streamckpt.loading.loader import LoadRequest, run_load
    from streamckpt.plan.planner import PlanOptions
    from streamckpt.storage import Storage

    api = cuda if cuda is not None else TorchCuda()
    gpus = api.device_count()
    if gpus < 2:
        out.say("SKIP", "nccl-exchange", f"{gpus} GPU (NCCL refuses two ranks on one device: the exchange between "
                                         f"ranks needs 2 GPUs)")
    else:
        from . import gpu_nccl

        world = min(gpus, 4)
        try:
            reports = (exchange or gpu_nccl.run_exchange)(world, root)
        except Exception as e:  # noqa: BLE001 - the world-1 load below still runs
            traceback.print_exc()
            out.check(False, "nccl-exchange", f"{world} ranks: {type(e).__name__}: {e}")
        else:
            ok, figure = gpu_nccl.verdict(reports, world)
            out.check(ok, "nccl-exchange", figure)
    g = torch.Generator().manual_seed(36)
    want = {"w": torch.randn(1024, 1024, generator=g), "b": torch.randn(4099, generator=g).to(torch.bfloat16)}
    uri = str(root / "nccl-world1")
    sc.save(want, uri, overwrite=True)
    put = place if place is not None else (lambda t: t.to(dev))
    sd = {k: put(torch.full_like(v, -1)) for k, v in want.items()}
    bind = {"device_id": dev} if backend == "nccl" else {}
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **bind)
    try:
        comm = GroupComm(dist.group.WORLD, cuda=api)
        storage = Storage(uri)
        try:
            t0 = time.perf_counter()
            res = run_load(comm, storage, LoadRequest(state_dict=sd, strict=True, transforms=None, cuda=api,
                                                      options=PlanOptions(memory_budget=1 << 20)))
            dt = time.perf_counter() - t0
        finally:
            storage.close()
        plane = str(comm.data_device)
        wrong = [k for k, v in want.items() if not torch.equal(sd[k].cpu(), v)]
        ok = not wrong and res.rounds > 1 and (backend != "nccl" or plane == str(dev))
        out.check(ok, "nccl-world1", f"a world-1 {backend} GroupComm (backends {comm.backend}, data plane {plane}, "
                  f"agreement every {comm.agree_every} rounds) loading {res.bytes_needed >> 10} KiB through "
                  f"DeviceStage in {res.rounds} rounds: {dt:.2f} s, wrong tensors: {wrong or 0}")
    finally:
        dist.destroy_process_group()


def _model(total: int, dev: torch.device) -> dict[str, torch.Tensor]:
    """64 MiB fp32 tensors, random (made on the GPU: fast), kept on the CPU as the reference."""
    g = torch.Generator(device=dev).manual_seed(0)
    return {f"layers.{i}.w": torch.randn(4096, 4096, generator=g, device=dev).cpu()
            for i in range(max(1, total // (64 << 20)))}


def load_and_save(total: int, dev: torch.device, ceiling: float, root: Path, out: Summary) -> None:
    """(On ``--smoke``, ``dev`` is the CPU: both rows load into CPU targets.)"""
    import streamckpt as sc

    model = _model(total, dev)
    nbytes = sum(t.numel() * t.element_size() for t in model.values())
    need_space(root, 3 * nbytes)
    uri = str(root / "ckpt")
    t0 = time.perf_counter()
    sc.save(model, uri, overwrite=True)
    print(f"checkpoint: {len(model)} tensors, {nbytes / GiB:.2f} GiB, saved from CPU in "
          f"{time.perf_counter() - t0:.2f} s", flush=True)
    for where in (dev, torch.device("cpu")):
        sd = {k: torch.empty_like(v, device=where) for k, v in model.items()}
        dt = _timed(lambda: sc.load(sd, uri))
        wrong = sum(not torch.equal(sd[k].cpu(), v) for k, v in model.items())
        gbs = nbytes / dt / 1e9
        out.check(wrong == 0, f"load-{where.type}", f"sc.load from local files into {where.type} targets, "
                  f"{nbytes / GiB:.2f} GiB: {dt:.2f} s, {gbs:.2f} GB/s = {gbs / ceiling:.2f} x pinned H2D memcpy, "
                  f"wrong tensors: {wrong}")
        dest = str(root / f"save-{where.type}")
        dt = _timed(lambda: sc.save(sd, dest, overwrite=True))
        back = sc.load_full(dest)
        wrong = sum(not torch.equal(back[k], v) for k, v in model.items())
        out.check(wrong == 0, f"save-{where.type}", f"sc.save of {where.type} tensors to local files: {dt:.2f} s, "
                  f"{nbytes / dt / 1e9:.2f} GB/s, wrong tensors: {wrong}")
        del sd, back
        shutil.rmtree(dest, ignore_errors=True)


def stall(nbytes: int, device: str, root: Path, out: Summary, report: list[str], deadline: float) -> None:
    from . import stall as st

    need_space(root, 4 * nbytes)
    reports = st.measure(nbytes, device, "file", st.SAVERS, st.LOOPS, root / "stall", deadline=deadline)
    report += st.render(reports, ["--size", f"{nbytes >> 20}MiB", "--device", device, "--target", "file"])
    for r in reports:
        if r.timed_out:  # "TIMEOUT after N s" (ended at its limit) or "TIMEOUT: not started, ..."
            after = r.error[len(st.TIMEOUT):]
            out.say("TIMEOUT", f"stall-{r.saver}{after if after.startswith(' after') else ''}",
                    "its process was ended at its time limit" if after.startswith(" after") else after.lstrip(": "))
            continue
        for w in r.windows:
            out.check(not w.error, f"stall-{r.saver}-{w.loop}-{w.save}",
                      w.error or f"blocked {w.blocked:.3f} s, durable {w.durable:.2f} s, lost {w.lost:.2f} s, "
                                  f"median step {w.median_step * 1e3:.1f} ms (base {w.base_median * 1e3:.1f}), "
                                  f"longest {w.longest_step * 1e3:.1f} ms")
        if r.error:
            out.check(False, f"stall-{r.saver}", r.error[-400:])
        if r.checked:
            out.check("WRONG" not in r.checked, f"stall-{r.saver}-readback", r.checked)
    for g in st.goals(reports):
        print(g, flush=True)


def run_parts(parts: list[tuple[str, Callable[[], None]]], out: Summary, t0: float, budget_s: float,
              dev: torch.device) -> None:
    """Each part in turn: FAIL on an exception (and go on), TIMEOUT once ``budget_s`` is spent or
    when the check's limit ends this process mid-part (then for the rest too, and exit)."""
    for i, (name, fn) in enumerate(parts):
        if time.perf_counter() - t0 > budget_s:
            out.timeout(name, time.perf_counter() - t0, f"not started: the benchmark's {budget_s:.0f} s were spent")
            continue
        print(f"## {name}", flush=True)
        t1 = time.perf_counter()
        try:
            fn()
        except SystemExit:  # the check's limit (SIGTERM): out of time, not broken
            out.timeout(name, time.perf_counter() - t1, "ended by the check's time limit")
            for rest, _ in parts[i + 1:]:
                out.timeout(rest, time.perf_counter() - t0, "not started: the check's time limit ended the benchmark")
            raise
        except Exception as e:  # noqa: BLE001 - report what broke, in full, and run the other parts
            traceback.print_exc()
            out.check(False, name, f"{type(e).__name__}: {e}")
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        print(f"## {name} took {time.perf_counter() - t1:.1f} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=2.0, help="bytes per H2D/D2H copy (GiB): their ceilings")
    ap.add_argument("--load-gib", type=float, default=1.0, help="the checkpoint loaded and saved (GiB)")
    ap.add_argument("--stall-gib", type=float, default=0.5, help="the async-saved state (GiB)")
    ap.add_argument("--work", default="/tmp/sc-gpucheck", help="local files go here (not /dev/shm)")
    ap.add_argument("--summary", default="", help="append one PASS/FAIL line per check here")
    ap.add_argument("--out", default="", help="the report (plain text, for benchmarks.run --gpu-results)")
    ap.add_argument("--budget-s", type=float, default=250.0, help="start no part after this many seconds")
    ap.add_argument("--smoke", action="store_true", help="no GPU: run the load-save and stall parts on the CPU, "
                    "small, to check this script's own code paths")
    ap.add_argument("--probe-pin", action="store_true", help="pin and unpin 1 MiB only: print one line, "
                    "'PASS|WARN|FAIL figure' (gpu_check.sh's first GPU part)")
    args = ap.parse_args(argv)
    from . import timelimit

    timelimit.exit_on_sigterm()  # gpu_check.sh's limit: the stall part's savers (sessions of their own) go too
    if args.probe_pin:
        verdict, figure = pin_probe(torch.device("cuda", torch.cuda.current_device()))
        print(f"{verdict} {figure}", flush=True)
        return 1 if verdict == "FAIL" else 0
    out = Summary(args.summary)
    if args.smoke:
        dev, args.gib, args.stall_gib = torch.device("cpu"), min(args.gib, 0.125), min(args.stall_gib, 1 / 32)
        args.load_gib = min(args.load_gib, 0.125)
    elif not torch.cuda.is_available():
        out.check(False, "benchmark", f"CUDA is not available to torch {torch.__version__}: nothing measured")
        return 2
    else:
        dev = torch.device("cuda", torch.cuda.current_device())
    total = int(args.gib * GiB)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU (--smoke)"
    head = [f"device: {name}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
            f"{os.cpu_count()} CPU cores"]
    print(head[0], flush=True)
    Path(args.work).mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="bench-", dir=args.work))
    t0 = time.perf_counter()
    stall_lines: list[str] = []
    ceiling = [0.0]
    parts: list[tuple[str, Callable[[], None]]] = [  # the most informative first (issue 42)
        ("h2d", lambda: ceiling.__setitem__(0, h2d(total, dev, out))),
        ("d2h", lambda: d2h(total, dev, out)),
        ("load-save", lambda: load_and_save(int(args.load_gib * GiB), dev, ceiling[0] or float("nan"), root, out)),
        ("nccl", lambda: nccl_world1(dev, root, out)),
        ("stall", lambda: stall(int(args.stall_gib * GiB), dev.type, root, out, stall_lines,
                                deadline=t0 + args.budget_s + 15)),
    ]
    if args.smoke:
        parts = [p for p in parts if p[0] in ("load-save", "stall")]
    try:
        run_parts(parts, out, t0, args.budget_s, dev)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    text = "\n".join(head + out.lines + [""] + stall_lines)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print("--- report ---\n" + text, flush=True)
    return 1 if out.failed else 0


if __name__ == "__main__":
    sys.exit(main())
