"""GPU checks for a lent CUDA machine: ``python -m benchmarks.gpu [--size 1GiB] [--out gpu.txt]``.

1. Host→device throughput: a plain ``copy_`` from one big pinned buffer (the
   ceiling) against a pipeline of two pinned staging buffers filled by the CPU
   while the previous one is copied on a side stream (what streamckpt's pipeline
   does per round), for several chunk sizes.
2. Scenario (a) on one GPU: the benchmark's HF model served by the local S3
   server, loaded by ``sc.load`` into CUDA tensors, checked against the
   fingerprints; the naive loader (download, safetensors, ``.to("cuda")``) beside it.

Self-contained: it prepares its own data with ``benchmarks.data`` and starts its
own server, so one call of a few minutes does everything. Prints a plain-text
report (also written to ``--out``) for ``benchmarks.run --gpu-results``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from . import data
from .server import BUCKET, BenchServer

REPO = Path(__file__).resolve().parent.parent


def h2d(total: int, chunks: list[int]) -> list[str]:
    import torch

    dev = torch.device("cuda")
    lines = []
    src = torch.empty(total, dtype=torch.uint8).pin_memory()
    src.random_(0, 255)
    dst = torch.empty(total, dtype=torch.uint8, device=dev)
    for _ in range(2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        plain = time.perf_counter() - t0
    lines.append(f"plain pinned copy_ of {total >> 20} MiB: {total / plain / 1e9:.2f} GB/s")
    pageable = torch.empty(total, dtype=torch.uint8)
    pageable.copy_(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    dst.copy_(pageable)
    torch.cuda.synchronize()
    lines.append(f"pageable copy_ of {total >> 20} MiB: {total / (time.perf_counter() - t0) / 1e9:.2f} GB/s")
    stream = torch.cuda.Stream()
    for chunk in chunks:
        bufs = [torch.empty(chunk, dtype=torch.uint8).pin_memory() for _ in range(2)]
        done = [torch.cuda.Event(), torch.cuda.Event()]
        for e in done:
            e.record(stream)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for k, off in enumerate(range(0, total, chunk)):
            n = min(chunk, total - off)
            b = bufs[k % 2]
            done[k % 2].synchronize()  # the copy that last used this buffer has finished
            b[:n].copy_(src[off:off + n])  # CPU fill (stands for bytes landing from storage)
            with torch.cuda.stream(stream):
                dst[off:off + n].copy_(b[:n], non_blocking=True)
                done[k % 2].record(stream)
        stream.synchronize()
        dt = time.perf_counter() - t0
        lines.append(f"double-buffered pinned pipeline, {chunk >> 20} MiB chunks (CPU fill + H2D): "
                     f"{total / dt / 1e9:.2f} GB/s")
    ok = torch.equal(dst[:1 << 20].cpu(), src[:1 << 20])
    lines.append(f"pipeline result matches source: {ok}")
    return lines


def load_a(size: str, data_dir: Path) -> list[str]:
    import torch

    import streamckpt as sc

    model = data.model_for_size(data.parse_size(size))
    root = data_dir / model.key()
    bucket = root / BUCKET
    bucket.mkdir(parents=True, exist_ok=True)
    fps = data.generate_local(bucket, model)["full"]
    lines = [f"model {model} ({model.nbytes / 2**30:.2f} GiB)"]
    with BenchServer(root) as srv:
        srv.warm(data.dataset_files(bucket, "hf"))
        opts = srv.storage_options
        for rep in range(2):
            sd = {t.name: torch.empty(t.shape, dtype=getattr(torch, t.dtype), device="cuda") for t in model.tensors()}
            torch.cuda.synchronize()
            srv.reset()
            t0 = time.perf_counter()
            res = sc.load(sd, f"s3://{BUCKET}/hf", storage_options=opts)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            wrong = sum(1 for k, v in sd.items() if data.crc(v.cpu()) != fps[k])
            lines.append(f"sc.load into CUDA, rep {rep + 1}: {dt:.2f} s, {model.nbytes / dt / 1e9:.2f} GB/s, "
                         f"bytes_read={res.bytes_read}, requests={res.requests}, server={srv.stats()}, wrong={wrong}")
            del sd
        import s3fs
        import safetensors.torch

        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **opts)
        out = {}
        for f in data.hf_file_names():
            for k, v in safetensors.torch.load(fs.cat_file(f"{BUCKET}/hf/{f}")).items():
                out[k] = v.to("cuda")
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        lines.append(f"naive (download, safetensors, .to(cuda)): {dt:.2f} s, {model.nbytes / dt / 1e9:.2f} GB/s")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--size", default="1GiB")
    ap.add_argument("--h2d-bytes", default="2GiB")
    ap.add_argument("--data-dir", default=str(REPO / "bench-data"))
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure", file=sys.stderr)
        return 2
    lines = [f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, {os.cpu_count()} CPU cores"]
    for part, fn in (("H2D", lambda: h2d(data.parse_size(args.h2d_bytes), [8 << 20, 32 << 20, 128 << 20])),
                     ("scenario (a) on 1 GPU", lambda: load_a(args.size, Path(args.data_dir)))):
        lines.append(f"## {part}")
        try:
            lines += fn()
        except Exception as e:  # noqa: BLE001 - report what broke and keep the other part
            lines.append(f"FAILED: {type(e).__name__}: {e}")
        print("\n".join(lines), flush=True)
    text = "\n".join(lines)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(json.dumps({"done": True}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
