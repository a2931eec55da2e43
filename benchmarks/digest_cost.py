"""What the per-shard xxh3-128 content digest costs a save that has no base, and what an
incremental save of a mostly frozen state saves.

Saves the same fp32 state (``--mib`` MiB, 64 tensors) to the local moto S3 server
(``streamckpt.testing.LocalS3``) in one process, alternating a save with the writer's digest
and one with it stubbed out (``--reps`` each), and reports the medians and the overhead;
then the digest's own throughput on one core; then, with 90 % of the tensors frozen, a full
save and an incremental one (``base=``): seconds and bytes uploaded. Run it:

    python -m benchmarks.digest_cost --mib 256 --reps 5
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
import uuid
from typing import Any

import torch
import xxhash

import streamckpt as sc
from streamckpt.saving import writer

log = logging.getLogger(__name__)


class _NoDigest:
    """The writer's hasher, doing nothing (the baseline)."""

    def update(self, _data: Any) -> None:
        return None

    def hexdigest(self) -> str:
        return "0" * 32


class _NoXxhash:
    xxh3_128 = _NoDigest


def _state(mib: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = mib * 2**20 // 4 // 64
    return {f"t{i:02d}": torch.randn(n, generator=g) for i in range(64)}


def _timed_save(state: dict[str, torch.Tensor], uri: str, opts: dict[str, Any], **kw: Any) -> tuple[float, int]:
    t0 = time.perf_counter()
    r = sc.save(state, uri, storage_options=opts, **kw)
    return time.perf_counter() - t0, r.bytes_written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    from streamckpt.testing import LocalS3

    state = _state(args.mib, 0)
    with LocalS3() as s3:
        s3.make_bucket("bench")
        opts = s3.storage_options
        root = f"s3://bench/digest-{uuid.uuid4().hex[:8]}"
        times: dict[str, list[float]] = {"digest": [], "none": []}
        _timed_save(state, f"{root}/warm", opts)
        for rep in range(args.reps):
            for mode in ("none", "digest") if rep % 2 else ("digest", "none"):
                real = writer.xxhash
                writer.xxhash = real if mode == "digest" else _NoXxhash  # type: ignore[assignment]
                try:
                    times[mode].append(_timed_save(state, f"{root}/{mode}-{rep}", opts)[0])
                finally:
                    writer.xxhash = real
        with_d, without = statistics.median(times["digest"]), statistics.median(times["none"])
        print(f"save of {args.mib} MiB to moto S3, no base: with digest {with_d:.3f} s "
              f"(min {min(times['digest']):.3f}), without {without:.3f} s (min {min(times['none']):.3f}); "
              f"overhead {100 * (with_d - without) / without:+.1f} % (medians of {args.reps})")

        hashed = []  # the digest pass over the state itself, as the writer runs it (one thread)
        for _ in range(5):
            t0 = time.perf_counter()
            for t in state.values():
                xxhash.xxh3_128(memoryview(t.numpy())).hexdigest()
            hashed.append(time.perf_counter() - t0)
        nbytes = sum(t.numel() * 4 for t in state.values())
        print(f"xxh3-128 of the whole state on one core: {min(hashed):.3f} s best, {statistics.median(hashed):.3f} s "
              f"median of 5 ({nbytes / statistics.median(hashed) / 1e9:.1f} GB/s): "
              f"{100 * statistics.median(hashed) / without:.1f} % of the save without digest")

        frozen = dict(state)
        full_t, full_b = _timed_save(frozen, f"{root}/step-1", opts)
        changed = {k: (t + 1 if i % 10 == 0 else t) for i, (k, t) in enumerate(frozen.items())}
        changed_bytes = sum(t.numel() * 4 for i, t in enumerate(frozen.values()) if i % 10 == 0)
        inc_t, inc_b = _timed_save(changed, f"{root}/step-2", opts, base=f"{root}/step-1")
        full2_t, _ = _timed_save(changed, f"{root}/step-2-full", opts)
        print(f"90 % frozen: full save {full_t:.3f} s / {full_b / 2**20:.1f} MiB, full again {full2_t:.3f} s; "
              f"incremental {inc_t:.3f} s / {inc_b / 2**20:.1f} MiB uploaded for {changed_bytes / 2**20:.1f} MiB "
              f"changed ({inc_b / changed_bytes:.3f} x), {inc_t / full2_t:.2f} x the full save's time")


if __name__ == "__main__":
    main()
