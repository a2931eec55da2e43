"""GPU figures for a lent CUDA machine; ``benchmarks/gpu_check.sh`` runs it after the GPU tests.

    python -m benchmarks.gpu_check [--gib 2] [--out FILE]

1. Pinned memcpy: one pinned host buffer copied to the GPU (the ceiling).
2. Device pipeline: streamckpt's own ``DeviceStage`` over rounds of ``max_round_bytes``
   (two pinned arenas; acquire, raw upload on the side stream, write into the target,
   release) — the executor's device path with storage taken out. Reported ÷ (1); the
   goal is >= 0.8. Also with the host filling each arena first (bytes landing from
   storage, one memcpy), which is what a load from a fast source adds.
3. End-to-end load from local files (page cache, CRC32C checked): ``sc.load`` into CUDA
   targets and into CPU targets, GB/s and ÷ (1).
4. Save: ``sc.save`` of the same tensors on the GPU and on the CPU to local files.

Every part is timed twice and the better time reported; every result is checked
against what was written. Prints a plain-text report (also to ``--out``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch


def _timed(fn: Callable[[], None], reps: int = 2) -> float:
    best = float("inf")
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def memcpy(total: int, dev: torch.device) -> tuple[float, list[str]]:
    src = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    src.random_(0, 255)
    dst = torch.empty(total, dtype=torch.uint8, device=dev)
    dt = _timed(lambda: dst.copy_(src, non_blocking=True))
    ok = torch.equal(dst[-(1 << 20):].cpu(), src[-(1 << 20):])
    gbs = total / dt / 1e9
    return gbs, [f"pinned memcpy H2D, {total >> 20} MiB in one copy: {gbs:.2f} GB/s (matches: {ok})"]


def device_pipeline(total: int, round_bytes: int, dev: torch.device, ceiling: float) -> list[str]:
    from streamckpt.cuda.runtime import TorchCuda
    from streamckpt.cuda.device import DeviceStage

    stage = DeviceStage(TorchCuda(), dev, [round_bytes, round_bytes])
    for a in stage.arenas:
        a.random_(0, 255)
    host_src = torch.empty(round_bytes, dtype=torch.uint8)
    host_src.random_(0, 255)
    target = torch.empty(total, dtype=torch.uint8, device=dev)
    rounds = total // round_bytes
    lines = []
    for fill in (False, True):
        def run() -> None:
            stage.begin()
            for k in range(rounds):
                slot = k % 2
                stage.acquire(slot)
                if fill:
                    stage.arenas[slot].copy_(host_src)  # bytes landing from storage
                stage.write(target[k * round_bytes: (k + 1) * round_bytes], stage.upload(stage.arenas[slot]))
                stage.release(slot)
            stage.finish()

        dt = _timed(run)
        gbs = total / dt / 1e9
        last = stage.arenas[(rounds - 1) % 2] if not fill else host_src
        ok = torch.equal(target[(rounds - 1) * round_bytes: rounds * round_bytes].cpu(), last)
        what = "with a host memcpy filling each arena" if fill else "device path only"
        lines.append(f"DeviceStage pipeline, {rounds} rounds of {round_bytes >> 20} MiB, {what}: {gbs:.2f} GB/s = "
                     f"{gbs / ceiling:.2f} x pinned memcpy (goal >= 0.8 for the device path) (matches: {ok})")
    return lines


def _model(total: int) -> dict[str, torch.Tensor]:
    n = max(1, total // (64 << 20))
    g = torch.Generator().manual_seed(0)
    return {f"layers.{i}.w": torch.randn(4096, 4096, generator=g) for i in range(n)}  # 64 MiB fp32 each


def load_and_save(total: int, dev: torch.device, ceiling: float, root: Path) -> list[str]:
    import streamckpt as sc

    model = _model(total)
    nbytes = sum(t.numel() * t.element_size() for t in model.values())
    uri = str(root / "ckpt")
    t0 = time.perf_counter()
    sc.save(model, uri, overwrite=True)
    lines = [f"checkpoint: {len(model)} tensors, {nbytes / 2**30:.2f} GiB, saved from CPU in "
             f"{time.perf_counter() - t0:.2f} s"]
    for where in (dev, torch.device("cpu")):
        sd = {k: torch.empty_like(v, device=where) for k, v in model.items()}
        dt = _timed(lambda: sc.load(sd, uri))
        wrong = sum(not torch.equal(sd[k].cpu(), v) for k, v in model.items())
        gbs = nbytes / dt / 1e9
        lines.append(f"sc.load from local files into {where} targets: {dt:.2f} s, {gbs:.2f} GB/s = "
                     f"{gbs / ceiling:.2f} x pinned memcpy, wrong tensors: {wrong}")
        out = str(root / f"save-{where.type}")
        dt = _timed(lambda: sc.save(sd, out, overwrite=True))
        back = sc.load_full(out)
        wrong = sum(not torch.equal(back[k], v) for k, v in model.items())
        lines.append(f"sc.save of {where} tensors to local files: {dt:.2f} s, {nbytes / dt / 1e9:.2f} GB/s, "
                     f"wrong tensors: {wrong}")
        del sd, back
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=2.0, help="bytes moved per part (GiB)")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"CUDA is not available to torch {torch.__version__} (torch.version.cuda={torch.version.cuda}): "
              f"nothing measured", flush=True)
        return 2
    from streamckpt.plan.planner import PlanOptions

    dev = torch.device("cuda", torch.cuda.current_device())
    total = int(args.gib * 2**30)
    lines = [f"device: {torch.cuda.get_device_name(dev)}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
             f"{os.cpu_count()} CPU cores"]
    shm = Path("/dev/shm")
    root = Path(tempfile.mkdtemp(prefix="sc-gpucheck-", dir=shm if shm.is_dir() and os.access(shm, os.W_OK) else None))
    try:
        lines.append("## pinned memcpy")
        ceiling, got = memcpy(total, dev)
        lines += got
        parts: list[tuple[str, Callable[[], list[str]]]] = [
            ("device pipeline", lambda: device_pipeline(total, PlanOptions().max_round_bytes, dev, ceiling)),
            ("load and save", lambda: load_and_save(total, dev, ceiling, root)),
        ]
        for name, fn in parts:
            lines.append(f"## {name}")
            try:
                lines += fn()
            except Exception as e:  # noqa: BLE001 - report what broke and keep the other parts
                lines.append(f"FAILED: {type(e).__name__}: {e}")
            print("\n".join(lines[-4:]), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    text = "\n".join(lines)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print("--- report ---\n" + text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
