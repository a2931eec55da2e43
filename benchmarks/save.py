"""One measured save: ``python -m benchmarks.save SPEC.json RANK``.

The harness (benchmarks/savebench.py) writes a JSON spec (saver, world, endpoint,
model, target prefix) and starts one such process per rank (gloo for world > 1).
Each process loads the whole llama-like model from the local ``hf`` files (every
rank holds all of it: DDP's replicated state), resets its peak-RSS mark, and times:

* ``blocked``: from the save call until the caller may change its tensors again
  (the call's return; for an ``AsyncSaveResponse``, its staging future too);
* ``durable``: until the checkpoint is committed (the sync call's return,
  ``handle.result()``, DCP's upload future).

An async caller overwrites every tensor (``zero_()``) as soon as it is unblocked,
as the next training step would, so the correctness check also shows that the
checkpoint holds the values at call time. When the spec asks (first repetition),
rank 0 reads the saved checkpoint back through the server, outside the clock,
and compares each tensor's crc32c with the generated data.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any, Callable

from . import data
from .server import BUCKET, KEY, REGION, SECRET
from .worker import NotApplicable, measuring, peak_rss, report_and_exit

PIECE = 8 << 20  # the ceilings' part / object size
CEILING_CONCURRENCY = 8


# ------------------------------------------------------------------ the clock


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS ("5" > clear_refs), so that loading the source
    state (mmap, transient copies) does not hide the save's own peak."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class SaveClock:
    """Seconds from a barrier to 'blocked' (caller free) and 'durable' (committed)."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.blocked_s: float | None = None
        self.durable_s: float | None = None
        self.rss_before = 0
        self.hwm_reset = False

    def start(self) -> None:
        import psutil

        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()
        self.hwm_reset = reset_peak_rss()
        self.rss_before = psutil.Process().memory_info().rss
        self._t0 = time.perf_counter()

    def blocked(self) -> None:
        self.blocked_s = time.perf_counter() - self._t0

    def durable(self) -> None:
        self.durable_s = time.perf_counter() - self._t0
        if self.blocked_s is None:
            self.blocked_s = self.durable_s


def scribble(sd: dict[str, Any]) -> None:
    """What the next training step does to the tensors an async save was handed."""
    for t in sd.values():
        t.zero_()


# ------------------------------------------------------------------ savers
# Each takes (spec, state_dict, clock, target) and returns extra stats; ``target`` is
# the object prefix (``saves/<tag>``) in the bucket. Client construction is inside
# the clock: a training job pays it on its first save too.


def _opts(spec: dict[str, Any]) -> dict[str, Any]:
    return {"endpoint_url": spec["endpoint"], "key": KEY, "secret": SECRET}


def _sc():
    import streamckpt as sc

    return sc


def save_streamckpt(spec: dict[str, Any], sd: dict[str, Any], clock: SaveClock, target: str) -> dict[str, Any]:
    sc = _sc()
    clock.start()
    res = sc.save(sd, f"s3://{BUCKET}/{target}", storage_options=_opts(spec))
    clock.durable()
    return {"bytes_written": int(getattr(res, "bytes_written", 0))}


def save_streamckpt_async(spec: dict[str, Any], sd: dict[str, Any], clock: SaveClock, target: str,
                          budget_fraction: float | None = None) -> dict[str, Any]:
    sc = _sc()
    if not hasattr(sc, "async_save"):
        raise NotApplicable("sc.async_save is not in this checkout yet")
    kwargs: dict[str, Any] = {}
    if budget_fraction:
        kwargs["staging_budget"] = staging_budget(sum(t.nbytes for t in sd.values()), budget_fraction)
    clock.start()
    handle = sc.async_save(sd, f"s3://{BUCKET}/{target}", storage_options=_opts(spec), **kwargs)
    clock.blocked()
    scribble(sd)
    res = handle.result()
    clock.durable()
    return {"bytes_written": int(getattr(res, "bytes_written", 0))}


def staging_budget(state_bytes: int, fraction: float) -> int:
    """The ``staging_budget`` of the budgeted async row: a fraction of the state, at least 16 MiB."""
    return max(16 << 20, int(state_bytes * fraction))


def _s3_writer(target: str, threads: int) -> Any:
    from s3torchconnector import S3ClientConfig
    from s3torchconnector.dcp import S3StorageWriter

    return S3StorageWriter(REGION, f"s3://{BUCKET}/{target}", s3client_config=S3ClientConfig(force_path_style=True),
                           thread_count=threads)


def save_dcp(spec: dict[str, Any], sd: dict[str, Any], clock: SaveClock, target: str,
             threads: int = 1) -> dict[str, Any]:
    """``threads``: S3StorageWriter's ``thread_count`` (default 1, as PyTorch's)."""
    import torch.distributed.checkpoint as dcp

    clock.start()
    dcp.save(sd, storage_writer=_s3_writer(target, threads))
    clock.durable()
    return {}


def save_dcp_async(spec: dict[str, Any], sd: dict[str, Any], clock: SaveClock, target: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    clock.start()
    out = dcp.async_save(sd, storage_writer=_s3_writer(target, 1))
    upload = out
    if hasattr(out, "staging_completion"):  # AsyncSaveResponse: the caller waits for staging
        out.staging_completion.result()
        upload = out.upload_completion
    clock.blocked()
    scribble(sd)
    upload.result()
    clock.durable()
    return {}


def again(fn: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    """``fn`` measured on the second save of one process, as in a training loop that saves
    every N steps: a first save of a copy of the state (to ``<target>-first``, waited for,
    not measured) warms clients, threads and whatever staging the saver keeps; the
    server's counters are reset after it."""

    def run(spec: dict[str, Any], sd: dict[str, Any], clock: SaveClock, target: str) -> dict[str, Any]:
        fn(spec, {k: v.clone() for k, v in sd.items()}, SaveClock(clock.world), f"{target}-first")
        if spec.get("counts"):
            try:
                req = urllib.request.Request(f"{spec['endpoint']}/__bench__/reset", method="POST", data=b"")
                urllib.request.urlopen(req, timeout=10).read()
            except OSError:  # a server without counters (moto fallback)
                pass
        return fn(spec, sd, clock, target)

    return run


def _boto3(spec: dict[str, Any], pool: int = 10) -> Any:
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=spec["endpoint"], aws_access_key_id=KEY, aws_secret_access_key=SECRET,
                        region_name=REGION, config=Config(max_pool_connections=pool, s3={"addressing_style": "path"}))


def save_naive(spec: dict[str, Any], sd: dict[str, Any], clock: SaveClock, target: str) -> dict[str, Any]:
    """What a hand-rolled job does: serialize to safetensors bytes, one PUT."""
    import safetensors.torch

    clock.start()
    body = safetensors.torch.save(sd)
    _boto3(spec).put_object(Bucket=BUCKET, Key=f"{target}/model.safetensors", Body=body)
    clock.durable()
    return {}


def _pieces(sd: dict[str, Any]) -> list[bytes]:
    """The state's bytes, back to back, cut in PIECE-sized ``bytes`` (made before the clock)."""
    buf = bytearray()
    for t in sd.values():
        buf += data.tensor_bytes(t)
    view = memoryview(buf)
    return [bytes(view[i:i + PIECE]) for i in range(0, len(buf), PIECE)]


def ceiling_obstore(spec: dict[str, Any], sd: dict[str, Any], clock: SaveClock, target: str) -> dict[str, Any]:
    """The same bytes as one multipart object, PIECE-sized parts, 8 in flight (Rust client)."""
    import obstore
    from obstore.store import S3Store

    pieces = _pieces(sd)
    clock.start()
    store = S3Store(BUCKET, endpoint=spec["endpoint"], access_key_id=KEY, secret_access_key=SECRET, region=REGION,
                    virtual_hosted_style_request=False, client_options={"allow_http": True})
    obstore.put(store, f"{target}/blob", pieces, chunk_size=PIECE, max_concurrency=CEILING_CONCURRENCY)
    clock.durable()
    return {"pieces": len(pieces)}


def ceiling_boto3(spec: dict[str, Any], sd: dict[str, Any], clock: SaveClock, target: str) -> dict[str, Any]:
    """The same bytes as PIECE-sized objects, 8 ``put_object`` calls in flight (boto3 threads)."""
    pieces = _pieces(sd)
    clock.start()
    client = _boto3(spec, CEILING_CONCURRENCY + 2)
    with ThreadPoolExecutor(CEILING_CONCURRENCY) as ex:
        list(ex.map(lambda kv: client.put_object(Bucket=BUCKET, Key=f"{target}/{kv[0]:05d}", Body=kv[1]),
                    enumerate(pieces)))
    clock.durable()
    return {"pieces": len(pieces)}


def _with_env(fn: Callable[..., Any], **env: str) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        os.environ.update(env)
        return fn(*args, **kwargs)

    return run


BUDGET_FRACTION = 0.25  # streamckpt.async.budget stages at most a quarter of the state at a time


SAVERS: dict[str, Callable[..., dict[str, Any]]] = {
    "streamckpt": save_streamckpt,
    "streamckpt.s3fs": _with_env(save_streamckpt, STREAMCKPT_S3_BACKEND="s3fs"),
    "streamckpt.async": save_streamckpt_async,
    "streamckpt.async.budget": partial(save_streamckpt_async, budget_fraction=BUDGET_FRACTION),
    "dcp-s3": save_dcp,
    "dcp-s3.t8": partial(save_dcp, threads=8),
    "dcp-s3.async": save_dcp_async,
    "streamckpt.async.again": again(save_streamckpt_async),
    "dcp-s3.async.again": again(save_dcp_async),
    "naive": save_naive,
    "ceiling.obstore": ceiling_obstore,
    "ceiling.boto3": ceiling_boto3,
}
# The pip module each saver needs beyond torch (for "not installed" rows).
SAVER_MODULE = {"dcp-s3": "s3torchconnector", "dcp-s3.t8": "s3torchconnector", "dcp-s3.async": "s3torchconnector",
                "dcp-s3.async.again": "s3torchconnector",
                "naive": "boto3", "ceiling.obstore": "obstore", "ceiling.boto3": "boto3"}


# ------------------------------------------------------------------ read-back check


def _read_back(spec: dict[str, Any]) -> dict[str, Any]:
    """The saved tensors, read back through the server (so the moto fallback works too)."""
    saver, uri = spec["saver"], f"s3://{BUCKET}/{spec['target']}"
    if saver.startswith("streamckpt"):
        return _sc().load_full(uri, storage_options=_opts(spec))
    if saver.startswith("dcp"):
        import torch.distributed.checkpoint as dcp
        from s3torchconnector import S3ClientConfig
        from s3torchconnector.dcp import S3StorageReader

        from .worker import targets_full

        sd = targets_full(data.spec_from_json(spec["model"]))
        reader = S3StorageReader(REGION, uri, s3client_config=S3ClientConfig(force_path_style=True))
        dcp.load(sd, storage_reader=reader, no_dist=True)
        return sd
    if saver == "naive":
        import safetensors.torch

        body = _boto3(spec).get_object(Bucket=BUCKET, Key=f"{spec['target']}/model.safetensors")["Body"].read()
        return safetensors.torch.load(body)
    raise NotApplicable("no read-back for " + saver)


def verify_saved(spec: dict[str, Any]) -> tuple[int, int]:
    """(checked, wrong): every saved tensor's crc32c against the generated data."""
    if spec["saver"].startswith("ceiling"):
        return 0, 0
    fps = json.loads(Path(spec["fingerprints"]).read_text())["full"]
    got = _read_back(spec)
    wrong = sum(1 for name, expected in fps.items() if name not in got or data.crc(got[name]) != expected)
    return len(fps), wrong


# ------------------------------------------------------------------ running


PREIMPORT = ("streamckpt", "streamckpt.storage.obstore_backend", "streamckpt.storage.httpget",
             "streamckpt.storage.s3fs_backend", "s3fs", "obstore", "boto3", "safetensors.torch", "torch.distributed.checkpoint", "s3torchconnector.dcp", "psutil")


def preimport() -> None:
    """Every saver's client libraries, imported before the clock by every process alike:
    the figures are the save, not a first import (as in the load worker)."""
    import importlib

    for name in PREIMPORT:
        try:
            importlib.import_module(name)
        except ImportError:
            pass


def server_stats(endpoint: str) -> dict[str, Any]:
    """The bench server's counters now (benchmarks/server.py; the stats request is not counted)."""
    import urllib.request

    with urllib.request.urlopen(f"{endpoint}/__bench__/stats", timeout=10) as r:
        return json.loads(r.read())


def source_state_dict(bucket_dir: Path) -> dict[str, Any]:
    """The whole model as plain CPU tensors (a replica on every rank), from the local hf files."""
    import safetensors.torch

    sd: dict[str, Any] = {}
    for fname in data.hf_file_names():
        # cloned: tensors in anonymous memory, as a training job holds them (not pages of a
        # mapped file that the save would fault in and count as its own RSS)
        sd.update({k: v.clone() for k, v in safetensors.torch.load_file(str(bucket_dir / "hf" / fname)).items()})
    return sd


def run(spec_path: str, rank: int) -> dict[str, Any]:
    spec = json.loads(Path(spec_path).read_text())
    world = int(spec.get("world", 1))
    result: dict[str, Any] = {"rank": rank}
    with measuring(rank, world, result):
        clock = SaveClock(world)
        saver = SAVERS[spec["saver"]]
        preimport()
        bucket_dir = Path(spec["bucket_dir"])
        sd = source_state_dict(bucket_dir)
        result.update(saver(spec, sd, clock, spec["target"]))
        result["blocked"] = clock.blocked_s
        result["durable"] = clock.durable_s
        result["rss_before"] = clock.rss_before
        result["rss_peak"] = peak_rss()
        result["hwm_reset"] = clock.hwm_reset
        del sd
        if world > 1:
            import torch.distributed as dist

            dist.barrier()  # every rank's part is committed before rank 0 reads back
        if spec.get("counts") and rank == 0:  # the save's requests, before the read-back adds its own
            result["server_stats"] = server_stats(spec["endpoint"])
        if spec.get("verify") and rank == 0:
            result["checked"], result["wrong"] = verify_saved(spec)
    return result


def main() -> None:
    spec_path, rank = sys.argv[1], int(sys.argv[2])
    report_and_exit(spec_path, rank, run(spec_path, rank))


if __name__ == "__main__":
    main()
