"""Storage amplification of incremental checkpoints after prune, with compaction (issue 44 item 6).

A fine-tuning-like state: frozen weights and small trainable tensors interleaved, so data
files mix them. Saves ``--steps`` incremental checkpoints (only the trainable tensors change),
then prunes to the newest one through a counting proxy in front of the embedded S3 server.
Reports the stored bytes a prune without compaction would leave (every file the newest step
references, whole), what is stored after the prune (compaction included), the distinct bytes
of the kept checkpoint, what the client sent during the prune, its requests and seconds.

    PYTHONPATH=. python -m benchmarks.compaction --frozen-mib 28 --trainable-mib 4.7 --steps 5
"""

from __future__ import annotations

import argparse
import time

import torch

import streamckpt as sc
from streamckpt.manage.lease import LEASE_NAME
from streamckpt.storage import Storage
from streamckpt.testing import LocalS3
from streamckpt.testing.faultproxy import FaultProxy

MiB = 1 << 20


def state(step: int, frozen_mib: float, trainable_mib: float, layers: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out: dict[str, torch.Tensor] = {}
    for i in range(layers):
        out[f"layers.{i}.frozen"] = torch.randn(int(frozen_mib * MiB / layers) // 4, generator=g)
        out[f"layers.{i}.adapter"] = torch.full((int(trainable_mib * MiB / layers) // 4,), float(step))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frozen-mib", type=float, default=28.0)
    ap.add_argument("--trainable-mib", type=float, default=4.7)
    ap.add_argument("--layers", type=int, default=7)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    with LocalS3() as s3:
        s3.make_bucket("bench")
        root, opts = "s3://bench/run", s3.storage_options
        with sc.CheckpointManager(root, storage_options=opts, incremental=True) as mgr:
            for step in range(1, args.steps + 1):
                mgr.save(step, state(step, args.frozen_mib, args.trainable_mib, args.layers))
            newest = mgr.checkpoints()[-1]
        sizes = {n: i.size for n, i in Storage(root, opts).list_info("").items() if n != LEASE_NAME}
        without = sum(sizes[n] for n in newest.objects)  # a prune that keeps whole files
        distinct = sum(t.numel() * t.element_size() for t in state(1, args.frozen_mib, args.trainable_mib,
                                                                    args.layers).values())
        with FaultProxy(s3.endpoint_url, faults=["slowdown"], rate=0.0, methods=()) as proxy:
            t0 = time.perf_counter()
            with sc.CheckpointManager(root, storage_options=proxy.storage_options, keep_last=1) as mgr:
                mgr.prune()
            seconds = time.perf_counter() - t0
            sent = proxy.sent()
        after = {n: i.size for n, i in Storage(root, opts).list_info("").items() if n != LEASE_NAME}
        manifests = sum(n for name, n in after.items() if name.endswith("manifest.json"))
        data_after = sum(after.values()) - manifests
        copies = [s for s in sent if s[3] is not None]
        print(f"state: {distinct / MiB:.1f} MiB ({args.frozen_mib:g} frozen, {args.trainable_mib:g} trainable, "
              f"{args.layers} layers), {args.steps} incremental saves, pruned to the newest")
        print(f"stored after a prune keeping whole files: {without / MiB:.1f} MiB "
              f"({without / distinct:.3f}x the distinct bytes)")
        print(f"stored after the prune with compaction:   {data_after / MiB:.1f} MiB of data "
              f"({data_after / distinct:.3f}x) + {manifests / 1024:.1f} KiB of manifests")
        print(f"the prune: {len(sent)} requests, {sum(n for *_, n, _ in sent) / MiB:.3f} MiB sent by the client "
              f"(request bodies), {len(copies)} ranges copied by the server, {seconds:.2f} s")


if __name__ == "__main__":
    main()
