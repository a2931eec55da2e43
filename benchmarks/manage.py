"""What a CheckpointManager costs: listing a root of many checkpoints, collecting its
garbage, and what it adds to a save.

Against streamckpt's embedded moto S3 server (``streamckpt.testing.LocalS3``) on loopback,
every request counted by a ``FaultProxy`` that injects nothing (``rate=0``); times are
taken without the proxy. Run from the repository root::

    PYTHONPATH=$PWD python -m benchmarks.manage --checkpoints 500 --save-mib 256 --reps 3

1. ``--checkpoints`` small checkpoints saved through a manager (``keep`` everything), then
   ``steps()`` on a fresh manager (one LIST of the root, every manifest read, 16 at once),
   ``steps()`` again (manifests cached: one LIST), ``streamckpt ls`` (a fresh manager, as
   the command line makes one) and ``collect_garbage`` (dry run and real) on that root, with
   ten dead saves' objects in it.
2. A ``--save-mib`` save through a warm manager (a root holding two such checkpoints;
   ``keep_last=None`` and ``keep_last=2``, the latter deleting one checkpoint per save): the
   call's wall time minus its ``sc.save``'s own time until the commit, median of ``--reps``;
   and the requests of ``sc.save`` alone vs through the manager.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import time
from typing import Any, Callable

import torch

import streamckpt as sc
from streamckpt.cli import main as cli_main
from streamckpt.storage import Storage
from streamckpt.testing import FaultProxy, LocalS3


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def counted(proxy: FaultProxy, fn: Callable[[], Any]) -> tuple[int, dict[str, int], Any]:
    before = len(proxy.history)
    out = fn()
    kinds: dict[str, int] = {}
    for method, path, _ in proxy.history[before:]:
        query = path.partition("?")[2]
        kind = ("LIST" if "list-type" in query else "LIST-UPLOADS" if "uploads" in query.split("&") else
                "DELETE-BULK" if method == "POST" and "delete" in query.split("&") else method)
        kinds[kind] = kinds.get(kind, 0) + 1
    return sum(kinds.values()), kinds, out


def listing(s3: LocalS3, n: int) -> list[str]:
    opts, root = s3.storage_options, f"s3://bench/run-{n}"
    mgr = sc.CheckpointManager(root, storage_options=opts)
    t0 = time.perf_counter()
    for step in range(1, n + 1):
        mgr.save(step, {"w": torch.full((64,), float(step))}, metrics={"loss": 1.0 / step})
    made = time.perf_counter() - t0
    st = Storage(root, opts)
    for i in range(10):  # dead saves: data objects without a manifest
        st.write_bytes(f"dead-{i}/data/00000-0000.safetensors", b"\0" * 4096)
    rows = [f"setup: {n} checkpoints saved through a manager in {made:.1f} s ({made / n * 1000:.0f} ms each)"]
    with FaultProxy(s3.endpoint_url, rate=0.0) as proxy:
        popts = proxy.storage_options
        fresh = sc.CheckpointManager(root, storage_options=popts)
        total, kinds, steps = counted(proxy, fresh.steps)
        assert steps == list(range(1, n + 1))
        rows.append(f"steps(), fresh manager: {total} requests {kinds}")
        total, kinds, _ = counted(proxy, fresh.steps)
        rows.append(f"steps(), again (manifests cached): {total} requests {kinds}")
        flags = ["--endpoint-url", popts["endpoint_url"], "--storage-option", f"key={popts['key']}",
                 "--storage-option", f"secret={popts['secret']}"]
        with contextlib.redirect_stdout(io.StringIO()) as out:
            total, kinds, status = counted(proxy, lambda: cli_main(["ls", root, *flags]))
        assert status == 0 and len(out.getvalue().splitlines()) == n + 1
        rows.append(f"streamckpt ls: {total} requests {kinds}")
        total, kinds, found = counted(proxy, lambda: fresh.collect_garbage(older_than=0, dry_run=True))
        rows.append(f"collect_garbage(dry_run=True), warm: {total} requests {kinds}, {len(found)} found")
    times = {
        "steps(), fresh manager": timed(lambda: sc.CheckpointManager(root, storage_options=opts).steps())[0],
    }
    warm = sc.CheckpointManager(root, storage_options=opts)
    warm.steps()
    times["steps(), again (cached)"] = statistics.median(timed(warm.steps)[0] for _ in range(5))
    with contextlib.redirect_stdout(io.StringIO()):
        times["streamckpt ls (in process)"] = timed(lambda: cli_main(["ls", root, "--endpoint-url", opts["endpoint_url"],
                                                                       "--storage-option", f"key={opts['key']}",
                                                                       "--storage-option",
                                                                       f"secret={opts['secret']}"]))[0]
    times["collect_garbage(dry_run=True), fresh"] = timed(
        lambda: sc.CheckpointManager(root, storage_options=opts).collect_garbage(older_than=0, dry_run=True))[0]
    seconds, found = timed(lambda: warm.collect_garbage(older_than=0))
    assert len(found) == 10
    times["collect_garbage(), warm, removing 10 objects"] = seconds
    rows += [f"{k}: {v:.3f} s" for k, v in times.items()]
    return rows


def save_cost(s3: LocalS3, mib: int, reps: int) -> list[str]:
    """The wall time of ``CheckpointManager.save`` minus the time its ``sc.save`` took until the
    commit (``SaveResult.seconds``, measured inside the same call): what the manager adds, free
    of the run-to-run spread of the upload itself."""
    opts = s3.storage_options
    state = {"w": torch.randn(mib * 2**20 // 4)}
    rows = []
    for label, keep in (("keep all", None), ("keep_last=2, deleting one checkpoint per save", 2)):
        mgr = sc.CheckpointManager(f"s3://bench/{'all' if keep is None else 'last2'}", storage_options=opts,
                                   keep_last=keep)
        mgr.save(0, state)
        mgr.save(1, state)  # warm: the root listed, its manifests read
        saves, added = [], []
        for rep in range(reps):
            wall, result = timed(lambda: mgr.save(rep + 2, state))
            saves.append(result.seconds)
            added.append(wall - result.seconds)
        base, extra = statistics.median(saves), statistics.median(added)
        rows.append(f"manager ({label}), {mib} MiB: sc.save until commit median {base:.3f} s; the manager adds "
                    f"median {extra * 1000:.0f} ms ({extra / base * 100:.1f} %), each: "
                    f"{', '.join(f'{a * 1000:.0f}' for a in added)} ms")
        if keep is None:
            for step in range(reps + 2):  # free the server's memory
                Storage(f"s3://bench/all/step-{step}", opts).delete("", recursive=True)
    with FaultProxy(s3.endpoint_url, rate=0.0) as proxy:
        popts = proxy.storage_options
        total, kinds, _ = counted(proxy, lambda: sc.save(state, "s3://bench/counted-plain", storage_options=popts))
        rows.append(f"requests, sc.save {mib} MiB: {total} {kinds}")
        for label, keep in (("keep all", None), ("keep_last=2", 2)):
            mgr = sc.CheckpointManager(f"s3://bench/counted-{label.replace('=', '')}", storage_options=popts,
                                       keep_last=keep)
            mgr.save(0, state)
            mgr.save(1, state)
            total, kinds, _ = counted(proxy, lambda: mgr.save(2, state))
            rows.append(f"requests, manager ({label}), warm: {total} {kinds}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoints", type=int, default=500)
    ap.add_argument("--save-mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--part", choices=("all", "listing", "save"), default="all")
    args = ap.parse_args()
    with LocalS3() as s3:
        s3.make_bucket("bench")
        if args.part in ("all", "listing"):
            print("\n".join(listing(s3, args.checkpoints)), flush=True)
        if args.part in ("all", "save"):
            print("\n".join(save_cost(s3, args.save_mib, args.reps)), flush=True)


if __name__ == "__main__":
    main()
