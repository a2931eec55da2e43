"""``az://`` beside ``s3://`` on the same data: save and full-load throughput of streamckpt,
each as a ratio against its own server's raw ceiling.

Azurite is a Node.js server (one thread, in memory) and the S3 server is localbucket (or
moto without it): their absolute speeds say little about each other, so each streamckpt
figure is divided by what a bare client gets from the same server on the same bytes —
obstore's ``put`` of 8 MiB objects, 4 at a time (the ceiling for a save), and obstore's
ranged GETs of 4 MiB pieces, 16 at a time, over the saved data files (for a load).

    PYTHONPATH=$PWD python -m benchmarks.azure --size 128MiB --repeats 3
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

import streamckpt as sc
from streamckpt.storage import Storage

from .data import parse_size
from .server import BUCKET, BenchServer

MiB = 1 << 20
PUT_OBJECT = 8 * MiB
GET_PIECE = 4 * MiB


def state_dict(size: int) -> dict[str, torch.Tensor]:
    """``size`` bytes of fp32 in 16 tensors (random bits: nothing compresses or dedups)."""
    g = torch.Generator().manual_seed(0)
    n = size // 16 // 4
    return {f"layer.{i}.w": torch.randn(n, generator=g) for i in range(16)}


def _median_rate(nbytes: int, fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / MiB


def _obstore_store(uri: str, opts: dict[str, Any]) -> tuple[Any, str]:
    """The obstore store streamckpt itself builds for ``uri`` (same client, same options), and the key prefix."""
    st = Storage(uri, opts)
    backend = st._reader.backend
    bucket, _, prefix = st.root.partition("/")
    return backend.store(bucket, writes=True), prefix


def raw_put(uri: str, opts: dict[str, Any], blob: bytes, nbytes: int) -> None:
    import obstore

    store, prefix = _obstore_store(uri, opts)
    count = max(1, nbytes // PUT_OBJECT)
    with cf.ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: obstore.put(store, f"{prefix}/raw/{i:05d}", blob, use_multipart=False), range(count)))


def raw_get(uri: str, opts: dict[str, Any]) -> int:
    """Every data file of the checkpoint at ``uri`` in 4 MiB ranged GETs, 16 at a time; returns bytes."""
    import obstore

    store, prefix = _obstore_store(uri, opts)
    files = [m for m in obstore.list(store, f"{prefix}/data/").collect()]
    pieces = [(m["path"], a, min(m["size"], a + GET_PIECE)) for m in files for a in range(0, m["size"], GET_PIECE)]
    with cf.ThreadPoolExecutor(16) as pool:
        return sum(pool.map(lambda p: len(obstore.get_range(store, p[0], start=p[1], end=p[2])), pieces))


def measure(label: str, uri: str, opts: dict[str, Any], sd: dict[str, torch.Tensor], repeats: int) -> dict[str, Any]:
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    blob = bytes(PUT_OBJECT)
    ckpt = f"{uri}/ckpt"
    row: dict[str, Any] = {"store": label}
    row["raw_put"] = _median_rate(nbytes, lambda: raw_put(uri, opts, blob, nbytes), repeats)
    runs = iter(range(repeats))  # a fresh prefix per save (localbucket has no multi-object delete)
    row["save"] = _median_rate(nbytes, lambda: sc.save(sd, f"{uri}/save-{next(runs)}", storage_options=opts), repeats)
    sc.save(sd, ckpt, storage_options=opts)
    stored = raw_get(ckpt, opts)
    row["raw_get"] = _median_rate(stored, lambda: raw_get(ckpt, opts), repeats)
    out = {k: torch.empty_like(v) for k, v in sd.items()}
    row["load"] = _median_rate(nbytes, lambda: sc.load(out, ckpt, storage_options=opts), repeats)
    if any(not torch.equal(out[k], v) for k, v in sd.items()):
        raise AssertionError(f"{label}: the load returned different tensors")
    row["read_backend"] = Storage(ckpt, opts).read_backend
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="128MiB")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    sd = state_dict(parse_size(args.size))
    from streamckpt.testing import LocalAzure

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-azure-") as tmp:
        (Path(tmp) / BUCKET).mkdir()
        with BenchServer(Path(tmp)) as s3:
            rows.append(measure(f"s3:// ({s3.kind})", f"s3://{BUCKET}/az-bench", s3.storage_options, sd,
                                args.repeats))
            os.environ["STREAMCKPT_S3_BACKEND"] = "obstore"  # the same client as az:// reads with
            try:
                rows.append(measure(f"s3:// ({s3.kind})", f"s3://{BUCKET}/az-bench-obstore", s3.storage_options,
                                    sd, args.repeats))
            finally:
                del os.environ["STREAMCKPT_S3_BACKEND"]
        with LocalAzure() as az:
            az.make_container(BUCKET)
            rows.append(measure("az:// (Azurite)", f"az://{BUCKET}/az-bench", az.storage_options, sd, args.repeats))
    print(f"{args.size} in 16 fp32 tensors, median of {args.repeats}; MiB/s\n")
    print("| store | reads via | raw put | sc.save | save / raw | raw ranged get | sc.load | load / raw |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['store']} | {r['read_backend']} | {r['raw_put']:.0f} | {r['save']:.0f} | "
              f"{r['save'] / r['raw_put']:.2f} | {r['raw_get']:.0f} | {r['load']:.0f} | "
              f"{r['load'] / r['raw_get']:.2f} |")


if __name__ == "__main__":
    main()
