"""Resume from the memory/peer tier vs from the bucket, on nodes made of network namespaces
(issue 43 item 5; ``benchmarks/netns.py``).

4 ranks on 2 "nodes" (2 ranks each, ``LOCAL_WORLD_SIZE=2``), each node with its own link to
the store (a moto server in a namespace of its own, ``--store-mbit``) and to the fabric
(``--fabric-mbit``; gloo's traffic between nodes). A state of ``--tensors`` fp32 matrices,
row-sharded over the ranks, is saved through ``CheckpointManager(local_dir=<node folder>,
replicas=1)`` to the bucket and the tier at once. Node 1 is then "replaced": its folder is
wiped. Two restores into column shards (another layout) follow, each on 4 fresh processes:
from the tier (its bytes from node 0's folders, sent over the fabric; the bucket only for
bytes no survivor holds) and from the bucket alone. Every element is checked.

Also measured: the blocking time of a tier-only save (``local_every=1``, not due for the
bucket; ``async_save=True``: staged, then written and replicated in the background;
``local_keep=1``) beside ``sc.async_save`` of the same state (``--saves`` of each in a row:
the first, then the medians of the rest), and each node's fabric bytes sent during the
save (``/sys/class/net/fab/statistics/tx_bytes``) against its ranks' shards x replicas.
The nodes' folders are in ``/dev/shm`` (memory, as the tier is meant to be used; on this
machine's disk the steady saves' blocking spread far more: BENCHMARKS.md).

    sudo PYTHONPATH=. python -m benchmarks.tier_resume --tensors 64 --store-mbit 1600 --fabric-mbit 10000

Needs root (namespaces). The ranks are processes of this machine: with 2 cores, CPU is shared.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROWS, COLS = 2048, 2048  # one 16 MiB fp32 tensor
WORLD, PER_NODE = 4, 2
PORT, MASTER_PORT = 9000, 29561


# ----------------------------------------------------------------------------- the ranks


def block(i: int, r0: int, r1: int, c0: int = 0, c1: int = COLS):  # -> torch.Tensor
    """Rows r0:r1, columns c0:c1 of tensor i: values a function of (i, row, column)."""
    import torch

    rows = torch.arange(r0, r1, dtype=torch.int64).unsqueeze(1)
    cols = torch.arange(c0, c1, dtype=torch.int64).unsqueeze(0)
    return ((rows * COLS + cols + i * 7919) % 1_000_003).to(torch.float32)


def _state(spec: dict[str, Any], rank: int, layout: str, fill: bool) -> dict[str, Any]:
    import torch

    import streamckpt as sc

    out: dict[str, Any] = {}
    for i in range(spec["tensors"]):
        if layout == "rows":
            r0, r1 = ROWS * rank // WORLD, ROWS * (rank + 1) // WORLD
            local = block(i, r0, r1) if fill else torch.zeros(r1 - r0, COLS)
            out[f"t{i}"] = sc.ShardedTensor(local, (ROWS, COLS), (r0, 0))
        else:
            c0, c1 = COLS * rank // WORLD, COLS * (rank + 1) // WORLD
            local = block(i, 0, ROWS, c0, c1) if fill else torch.zeros(ROWS, c1 - c0)
            out[f"t{i}"] = sc.ShardedTensor(local, (ROWS, COLS), (0, c0))
    return out


def _fab_tx() -> int:
    try:
        return int(Path("/sys/class/net/fab/statistics/tx_bytes").read_text())
    except OSError:
        return -1


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import streamckpt as sc

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=600))
    opts, root, mode = spec["storage_options"], spec["root"], spec["mode"]
    node_dir = spec["local_dirs"][rank // PER_NODE]
    out: dict[str, Any] = {"rank": rank}
    if mode == "save":
        state = _state(spec, rank, "rows", fill=True)
        with sc.CheckpointManager(f"{root}/run", storage_options=opts, local_dir=node_dir, local_every=1,
                                  save_every=1, replicas=1) as mgr:
            dist.barrier()
            tx0, t0 = _fab_tx(), time.perf_counter()
            mgr.save(1, state)
            out["save_s"], out["fab_tx_save"] = time.perf_counter() - t0, _fab_tx() - tx0
        with sc.CheckpointManager(f"{root}/tier-only", storage_options=opts, local_dir=node_dir + "-b",
                                  local_every=1, save_every=1000, local_keep=1, replicas=1, async_save=True) as mgr:
            for step in range(1, spec["saves"] + 1):  # the first save also makes the tier's process group
                dist.barrier()
                tx0, t0 = _fab_tx(), time.perf_counter()
                mgr.save(step, state)  # due for the tier alone: training waits for the staging only
                out[f"local_blocking_s{step}"] = time.perf_counter() - t0
                mgr.wait()
                out[f"local_total_s{step}"], out[f"fab_tx_local{step}"] = time.perf_counter() - t0, _fab_tx() - tx0
        for step in range(1, spec["saves"] + 1):
            dist.barrier()
            t0 = time.perf_counter()
            handle = sc.async_save(state, f"{root}/async/step-{step}", storage_options=opts)
            out[f"async_blocking_s{step}"] = time.perf_counter() - t0
            handle.result()
            if rank == 0:  # the store keeps objects in memory: one async checkpoint at a time
                from streamckpt.storage import Storage

                done = Storage(f"{root}/async/step-{step}", opts)
                done.delete("", recursive=True)
                done.close()
        out["shard_bytes"] = sum(t.local_tensor.numel() * 4 for t in state.values())
    else:
        state = _state(spec, rank, "cols", fill=False)
        kw = {"local_dir": node_dir, "local_every": 1, "save_every": 1, "replicas": 1} if mode == "tier" else {}
        with sc.CheckpointManager(f"{root}/run", storage_options=opts, **kw) as mgr:
            dist.barrier()
            t0 = time.perf_counter()
            got = mgr.restore(state)
            mine = time.perf_counter() - t0
            dist.barrier()
            out["resume_s"] = time.perf_counter() - t0
        assert got is not None
        out.update(own_s=mine, source=got.source, step=got.step, bytes_local=got.bytes_local,
                   bytes_peers=got.bytes_peers, bytes_bucket=got.bytes_bucket, bucket_bytes_read=got.bucket_bytes_read)
        for i in range(spec["tensors"]):
            c0, c1 = COLS * rank // WORLD, COLS * (rank + 1) // WORLD
            if not torch.equal(state[f"t{i}"].local_tensor, block(i, 0, ROWS, c0, c1)):
                raise SystemExit(f"rank {rank}: t{i} differs from what was saved")
        out["checked"] = True
    dist.barrier()
    dist.destroy_process_group()
    return out


# ----------------------------------------------------------------------------- the harness


def _run_phase(topo: Any, spec: dict[str, Any], tmp: Path, timeout: float = 900) -> list[dict[str, Any]]:
    from benchmarks.netns import child_env

    path = tmp / f"{spec['mode']}.json"
    path.write_text(json.dumps(spec))
    launches = []
    for r in range(WORLD):
        env = child_env(RANK=str(r), WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(PER_NODE),
                        LOCAL_RANK=str(r % PER_NODE), MASTER_ADDR=topo.fabric_addr(0),
                        MASTER_PORT=str(MASTER_PORT), GLOO_SOCKET_IFNAME="fab", OMP_NUM_THREADS="1")
        launches.append((topo.node_ns(r // PER_NODE), [sys.executable, "-m", "benchmarks.tier_resume", "--worker",
                                                        str(path)], env))
    topo.run_ranks(launches, timeout, f"phase {spec['mode']}")
    return [json.loads((tmp / f"{spec['mode']}.{r}.out").read_text()) for r in range(WORLD)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--tensors", type=int, default=64, help="16 MiB fp32 tensors (default 64: 1 GiB)")
    ap.add_argument("--store-mbit", type=float, default=1600, help="each node's link to the store (1600: 200 MB/s)")
    ap.add_argument("--fabric-mbit", type=float, default=10000, help="each node's fabric link")
    ap.add_argument("--reps", type=int, default=3, help="restores of each kind, alternately (default 3: medians)")
    ap.add_argument("--saves", type=int, default=5,
                    help="tier-only saves and sc.async_saves, each in a row (default 5: the first, then 4 steady)")
    args = ap.parse_args(argv)
    if args.worker:
        spec = json.loads(Path(args.worker).read_text())
        out = worker(spec)
        Path(args.worker).with_suffix(f".{out['rank']}.out").write_text(json.dumps(out))
        return
    from benchmarks import netns
    from streamckpt.testing.s3server import TEST_KEY, TEST_SECRET

    why = netns.available()
    if why:
        raise SystemExit(f"tier_resume needs network namespaces: {why}")
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None  # the nodes' folders in memory, as the tier is meant
    with tempfile.TemporaryDirectory(dir=shm) as tmpdir, \
            netns.Topology(2, fabric=netns.Link(args.fabric_mbit), node_store=netns.Link(args.store_mbit)) as topo:
        tmp = Path(tmpdir)
        server = topo.popen(topo.store_ns, [sys.executable, "-m", "streamckpt.testing.s3server", "--host",
                                            netns.STORE_ADDR, "--port", str(PORT), "--bucket", "bench"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            time.sleep(4)
            opts = {"endpoint_url": f"http://{netns.STORE_ADDR}:{PORT}", "key": TEST_KEY, "secret": TEST_SECRET}
            dirs = [str(tmp / f"node{k}") for k in range(2)]
            spec = {"storage_options": opts, "root": "s3://bench", "tensors": args.tensors, "local_dirs": dirs,
                    "saves": max(2, args.saves)}
            saved = _run_phase(topo, {**spec, "mode": "save"}, tmp)
            shutil.rmtree(dirs[1], ignore_errors=True)  # node 1 replaced: an empty folder
            tiers, buckets = [], []
            for _ in range(args.reps):  # alternately: drift on the shared machine hits both alike
                tiers.append(_run_phase(topo, {**spec, "mode": "tier"}, tmp))
                buckets.append(_run_phase(topo, {**spec, "mode": "bucket"}, tmp))
        finally:
            server.terminate()
            server.wait(timeout=10)
    state = args.tensors * ROWS * COLS * 4
    t_tiers = [max(r["resume_s"] for r in t) for t in tiers]
    t_buckets = [max(r["resume_s"] for r in b) for b in buckets]
    t_tier, t_bucket = statistics.median(t_tiers), statistics.median(t_buckets)
    tier = tiers[0]
    from_bucket = max(sum(r["bytes_bucket"] for r in t) for t in tiers)
    print(json.dumps({"saved": saved, "tier": tiers, "bucket": buckets}))
    print(f"state {state / 2**30:.2f} GiB on {WORLD} ranks / 2 nodes, store {args.store_mbit:g} Mbit/s per node, "
          f"fabric {args.fabric_mbit:g} Mbit/s; node 1's folder wiped; restored into column shards")
    print(f"resume from the tier: median {t_tier:.2f} s of {', '.join(f'{t:.2f}' for t in t_tiers)} (source "
          f"{tier[0]['source']}, step {tier[0]['step']}); from the bucket alone: median {t_bucket:.2f} s of "
          f"{', '.join(f'{t:.2f}' for t in t_buckets)}; ratio of the medians {t_tier / t_bucket:.2f}")
    print(f"bytes from the bucket in a tier resume (the most of any): {from_bucket} ({from_bucket / state:.1%} of the state); "
          f"local {sum(r['bytes_local'] for r in tier)}, from peers {sum(r['bytes_peers'] for r in tier)}")
    def blocking(kind: str, step: int) -> float:  # the slowest rank's
        return max(r[f"{kind}_blocking_s{step}"] for r in saved)

    steady = range(2, spec["saves"] + 1)
    tier_b, async_b = [blocking("local", s) for s in steady], [blocking("async", s) for s in steady]
    committed = statistics.median(max(r[f"local_total_s{s}"] for r in saved) for s in steady)
    print(f"first save (makes its process group): tier-only save (async_save=True) blocking (max rank) "
          f"{blocking('local', 1):.2f} s, until committed {max(r['local_total_s1'] for r in saved):.2f} s; "
          f"sc.async_save blocking {blocking('async', 1):.2f} s")
    print(f"saves 2..{spec['saves']}: tier-only save blocking median {statistics.median(tier_b):.3f} s of "
          f"{', '.join(f'{t:.3f}' for t in tier_b)}; sc.async_save blocking median "
          f"{statistics.median(async_b):.3f} s of {', '.join(f'{t:.3f}' for t in async_b)}; ratio of the medians "
          f"{statistics.median(tier_b) / statistics.median(async_b):.2f}; tier save until committed (median) "
          f"{committed:.2f} s")
    print(f"bucket + tier save (synchronous): {max(r['save_s'] for r in saved):.2f} s")
    for node in range(2):
        ranks = [r for r in saved if r["rank"] // PER_NODE == node]
        shards = sum(r["shard_bytes"] for r in ranks)
        tx = ranks[0]["fab_tx_local2"]  # the node's fabric link: both its ranks
        print(f"node {node}: fabric bytes sent during the tier-only save {tx} = {tx / shards:.3f} x its ranks' "
              f"shards x 1 replica")


if __name__ == "__main__":
    main()
