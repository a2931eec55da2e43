"""One measured process: ``python -m benchmarks.worker SPEC.json RANK``.

The harness writes a JSON spec (loader, scenario, endpoint, model), starts one
such process per rank (env ``WORLD_SIZE``/``MASTER_PORT`` for gloo) and reads
``<out>.<rank>.json`` back. Each process: imports and sets up outside the clock;
barrier; timed load; barrier; then verifies the loaded tensors against the
fingerprints (crc32c per tensor view) outside the clock, and reports peak RSS
from the OS (``VmHWM``).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator

from . import data
from .server import BUCKET, KEY, REGION, SECRET


class NotApplicable(Exception):
    """This loader cannot do this scenario; the message says why."""


def _opts(spec: dict[str, Any]) -> dict[str, Any]:
    return {"endpoint_url": spec["endpoint"], "key": KEY, "secret": SECRET}


def _uri(name: str) -> str:
    return f"s3://{BUCKET}/{name}"


def _dtype(name: str):
    import torch

    return getattr(torch, name)


def _empty(t: data.TensorSpec, shape=None):
    import torch

    return torch.empty(shape or t.shape, dtype=_dtype(t.dtype))


# ------------------------------------------------------------ target layouts


def targets_full(model: data.ModelSpec) -> dict[str, Any]:
    return {t.name: _empty(t) for t in model.tensors()}


def rows_range(t: data.TensorSpec) -> tuple[int, int]:
    return data.row_slice(t.shape[0], data.TP_RANK, data.TP_WORLD)


def cols_local_shape(t: data.TensorSpec, world: int) -> tuple[int, ...]:
    return (t.shape[0], t.shape[1] // world) if len(t.shape) == 2 else t.shape


def dtensor_cols(model: data.ModelSpec, world: int) -> dict[str, Any]:
    """2-D tensors Shard(1) (columns), 1-D tensors Replicate(), on a CPU mesh."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for t in model.tensors():
        local = _empty(t, cols_local_shape(t, world))
        placement = [Shard(1)] if len(t.shape) == 2 else [Replicate()]
        out[t.name] = DTensor.from_local(
            local, mesh, placement, run_check=False, shape=torch.Size(t.shape),
            stride=torch.empty(t.shape, device="meta").stride(),
        )
    return out


def dtensor_rows(model: data.ModelSpec, world: int, rank: int, values: dict[str, Any]) -> dict[str, Any]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for t in model.tensors():
        out[t.name] = DTensor.from_local(
            values[t.name], mesh, [Shard(0)], run_check=False, shape=torch.Size(t.shape),
            stride=torch.empty(t.shape, device="meta").stride(),
        )
    return out


def local_of(v: Any) -> Any:
    return v.to_local() if hasattr(v, "to_local") else getattr(v, "local_tensor", v)


# ------------------------------------------------------------------ loaders
# Each returns (result dict name -> tensor, extra stats dict). Setup that a real
# job would also pay (clients, metadata reads) is inside the clock.


def _sc():
    import importlib

    import streamckpt as sc

    for name in ("streamckpt.storage.obstore_backend", "streamckpt.storage.httpget"):
        try:  # the clients' imports outside the clock, as every loader's are
            importlib.import_module(name)
        except ImportError:
            pass
    if not hasattr(sc, "load"):
        raise NotApplicable("streamckpt.load is not in this checkout yet")
    return sc


def _sc_stats(res: Any) -> dict[str, Any]:
    keys = ("bytes_read", "bytes_needed", "requests", "bytes_sent", "bytes_received")
    return {k: int(getattr(res, k)) for k in keys if hasattr(res, k)}


def load_streamckpt(spec: dict[str, Any], model: data.ModelSpec, rank: int, world: int, clock: "Clock"):
    sc = _sc()
    scen = spec["scenario"]
    opts = _opts(spec)
    if scen == "b":
        sd = {}
        for t in model.tensors():
            r0, r1 = rows_range(t)
            local = _empty(t, (r1 - r0,) + t.shape[1:])
            sd[t.name] = sc.ShardedTensor(local, t.shape, (r0,) + (0,) * (len(t.shape) - 1))
        uri = _uri(spec.get("dataset") or "hf")
    elif scen == "c":
        sd = dtensor_cols(model, world)
        uri = _uri("sc_rows4")
    elif scen == "e":
        sd = targets_full(model)
        uri = _uri(spec.get("dataset") or "sc_rows4_zstd")
    else:  # a, d
        sd = targets_full(model)
        uri = _uri(spec.get("dataset") or "hf")
    touch = _make_resident(sd) if spec.get("resident") else {}
    with clock:
        res = sc.load(sd, uri, storage_options=opts, **spec.get("load_kwargs", {}))
    return {k: local_of(v) for k, v in sd.items()}, {**_sc_stats(res), "backend": _read_backend(uri, opts), **touch}


def _make_resident(sd: dict[str, Any]) -> dict[str, Any]:
    """Write every target once before the clock (a resume into live parameters); the time
    that takes on fresh pages (CPU seconds, user + sys, one thread) is the page-fault floor
    a fresh-target load pays on top."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # no OpenMP workers spinning on the CPU clock
    try:
        t0 = time.process_time()  # CPU time (faults are kernel time): robust to a shared machine's other work
        for v in sd.values():
            local_of(v).zero_()
        return {"touch_s": time.process_time() - t0}
    finally:
        torch.set_num_threads(threads)


def _resident(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The same loader into resident targets (``spec["resident"]``)."""

    def run(spec: dict[str, Any], *args: Any) -> Any:
        return fn(dict(spec, resident=True), *args)

    return run


def load_rangereader(client: str) -> Callable[..., Any]:
    """The hand-rolled range reader (benchmarks/rangereader.py) on ``client``: (a) and (b)."""

    def run(spec: dict[str, Any], model: data.ModelSpec, rank: int, world: int, clock: "Clock"):
        from . import rangereader

        if spec["scenario"] not in ("a", "b"):
            raise NotApplicable("reads HF safetensors ranges in one process; no resharding")
        targets = rangereader.targets_for(model, spec["scenario"], False)
        touch = _make_resident(targets) if spec.get("resident") else {}
        read = rangereader.load_obstore if client == "obstore" else rangereader.load_s3fs
        return targets, {**read(spec, targets, clock), **touch}

    return run


def _read_backend(uri: str, opts: dict[str, Any]) -> str:
    """Which client did the range reads (obstore, or the s3fs fallback): no request is made."""
    from streamckpt.storage import Storage

    return Storage(uri, opts).read_backend


def load_streamckpt_full(spec: dict[str, Any], model: data.ModelSpec, rank: int, world: int, clock: "Clock"):
    sc = _sc()
    if spec["scenario"] not in ("a", "e"):
        raise NotApplicable("load_full loads whole tensors in one process")
    uri = _uri("hf" if spec["scenario"] == "a" else "sc_rows4_zstd")
    with clock:
        out = sc.load_full(uri, storage_options=_opts(spec))
    return out, {}


def _s3fs(spec: dict[str, Any]):
    import s3fs

    return s3fs.S3FileSystem(skip_instance_cache=True, **_opts(spec))


def load_naive(spec: dict[str, Any], model: data.ModelSpec, rank: int, world: int, clock: "Clock"):
    import safetensors.torch
    import torch

    scen = spec["scenario"]
    names = data.hf_file_names()
    with clock:
        fs = _s3fs(spec)
        out: dict[str, Any] = {}
        if scen in ("a", "d"):
            for f in names:
                out.update(safetensors.torch.load(fs.cat_file(f"{BUCKET}/hf/{f}")))
        elif scen == "b":
            for f in names:
                full = safetensors.torch.load(fs.cat_file(f"{BUCKET}/hf/{f}"))
                for k, v in full.items():
                    r0, r1 = data.row_slice(v.shape[0], data.TP_RANK, data.TP_WORLD)
                    out[k] = v[r0:r1].clone()
                del full
        elif scen == "c":
            parts = [safetensors.torch.load(fs.cat_file(f"{BUCKET}/naive_rows4/rank{k}.safetensors"))
                     for k in range(data.SAVE_WORLD)]
            for t in model.tensors():
                whole = torch.cat([p.pop(t.name) for p in parts], dim=0)
                if whole.dim() == 2:
                    c0, c1 = data.row_slice(whole.shape[1], rank, world)
                    out[t.name] = whole[:, c0:c1].clone()
                else:
                    out[t.name] = whole
        elif scen == "e":
            import zstandard

            d = zstandard.ZstdDecompressor()
            for f in names:
                raw = d.decompress(fs.cat_file(f"{BUCKET}/naive_zst/{f}.zst"))
                out.update(safetensors.torch.load(raw))
                del raw
    return out, {}


def _dcp_targets(spec: dict[str, Any], model: data.ModelSpec, world: int) -> tuple[dict[str, Any], str]:
    scen = spec["scenario"]
    if scen == "c":
        return dtensor_cols(model, world), "dcp_rows4"
    if scen == "e":
        return targets_full(model), "dcp_rows4_zstd"
    return targets_full(model), "dcp_full"


def _dcp_finish(spec: dict[str, Any], sd: dict[str, Any]) -> dict[str, Any]:
    out = {k: local_of(v) for k, v in sd.items()}
    if spec["scenario"] == "b":  # DCP reads whole stored items; the TP rank keeps its rows
        for k, v in list(out.items()):
            r0, r1 = data.row_slice(v.shape[0], data.TP_RANK, data.TP_WORLD)
            out[k] = v[r0:r1].clone()
    return out


def load_dcp_fsspec(spec: dict[str, Any], model: data.ModelSpec, rank: int, world: int, clock: "Clock"):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    sd, ds = _dcp_targets(spec, model, world)
    with clock:
        reader = FsspecReader(_uri(ds), **_opts(spec))
        dcp.load(sd, storage_reader=reader)
    return _dcp_finish(spec, sd), {}


def load_s3torch(spec: dict[str, Any], model: data.ModelSpec, rank: int, world: int, clock: "Clock"):
    import torch.distributed.checkpoint as dcp
    from s3torchconnector import S3ClientConfig
    from s3torchconnector.dcp import S3StorageReader

    sd, ds = _dcp_targets(spec, model, world)
    with clock:
        reader = S3StorageReader(REGION, _uri(ds), s3client_config=S3ClientConfig(force_path_style=True))
        dcp.load(sd, storage_reader=reader)
    return _dcp_finish(spec, sd), {}


def load_runai(spec: dict[str, Any], model: data.ModelSpec, rank: int, world: int, clock: "Clock"):
    scen = spec["scenario"]
    if scen == "c":
        raise NotApplicable("reads HF safetensors files whole; no resharding of a checkpoint saved by ranks")
    if scen == "e":
        raise NotApplicable("no compressed input")
    os.environ.setdefault("RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING", "0")
    os.environ.setdefault("RUNAI_STREAMER_S3_REQUEST_TIMEOUT_MS", "60000")
    os.environ.setdefault("RUNAI_STREAMER_LOG_LEVEL", "WARNING")
    from runai_model_streamer import SafetensorsStreamer

    paths = [f"s3://{BUCKET}/hf/{f}" for f in data.hf_file_names()]
    out: dict[str, Any] = {}
    with clock:
        with SafetensorsStreamer() as streamer:
            streamer.stream_files(paths)
            for name, t in streamer.get_tensors():
                if scen == "b":  # whole tensors are streamed; the TP rank keeps its rows
                    r0, r1 = data.row_slice(t.shape[0], data.TP_RANK, data.TP_WORLD)
                    t = t[r0:r1].clone()
                out[name] = t
    return out, {}


def ceiling_ranges(spec: dict[str, Any]) -> list[tuple[str, int, int]]:
    return [tuple(r) for r in spec["ranges"]]  # type: ignore[misc]


def load_ceiling(spec: dict[str, Any], model: data.ModelSpec, rank: int, world: int, clock: "Clock"):
    """s3fs ``cat_ranges`` of the scenario's needed bytes in 8 MiB pieces: the client stack's ceiling."""
    piece = 8 << 20
    paths, starts, ends = [], [], []
    for name, start, stop in ceiling_ranges(spec):
        for s in range(start, stop, piece):
            paths.append(f"{BUCKET}/{name}")
            starts.append(s)
            ends.append(min(stop, s + piece))
    with clock:
        fs = _s3fs(spec)
        got = fs.cat_ranges(paths, starts, ends)
    n = sum(len(g) for g in got)
    if n != sum(e - s for s, e in zip(starts, ends)):
        raise RuntimeError(f"short read: {n} bytes")
    return None, {"bytes_read": n, "requests": len(paths)}


def load_ceiling_obstore(spec: dict[str, Any], model: data.ModelSpec, rank: int, world: int, clock: "Clock"):
    """The same needed bytes through obstore (Rust object_store): is the Python client the limit?"""
    import obstore
    from obstore.store import S3Store

    by_file: dict[str, tuple[list[int], list[int]]] = {}
    piece = 8 << 20
    for name, start, stop in ceiling_ranges(spec):
        starts, ends = by_file.setdefault(name, ([], []))
        for s in range(start, stop, piece):
            starts.append(s)
            ends.append(min(stop, s + piece))

    with clock:
        store = S3Store(BUCKET, endpoint=spec["endpoint"], access_key_id=KEY, secret_access_key=SECRET,
                        region=REGION, virtual_hosted_style_request=False, client_options={"allow_http": True})
        # One object at a time: concurrent get_ranges_async on two objects stalled for seconds here.
        got = [obstore.get_ranges(store, name, starts=st, ends=en) for name, (st, en) in by_file.items()]
    n = sum(len(b) for per_file in got for b in per_file)
    return None, {"bytes_read": n}


def _with_backend(fn: Callable[..., Any], backend: str) -> Callable[..., Any]:
    """The same streamckpt loader on another S3 read path (``STREAMCKPT_S3_BACKEND``): ``s3fs``
    (the fallback), ``obstore`` or ``http`` (``http.client`` range reads into the targets)."""

    def run(*args: Any, **kwargs: Any) -> Any:
        os.environ["STREAMCKPT_S3_BACKEND"] = backend
        return fn(*args, **kwargs)

    return run


def _with_load_kwargs(fn: Callable[..., Any], **kwargs: Any) -> Callable[..., Any]:
    """The same streamckpt loader with extra ``sc.load`` arguments (e.g. ``read_once=False``)."""

    def run(spec: dict[str, Any], *args: Any) -> Any:
        return fn(dict(spec, load_kwargs={**spec.get("load_kwargs", {}), **kwargs}), *args)

    return run


LOADERS: dict[str, Callable[..., Any]] = {
    "streamckpt": load_streamckpt,
    "streamckpt.s3fs": _with_backend(load_streamckpt, "s3fs"),
    "streamckpt.obstore": _with_backend(load_streamckpt, "obstore"),
    "streamckpt.http": _with_backend(load_streamckpt, "http"),
    "streamckpt.no_read_once": _with_load_kwargs(load_streamckpt, read_once=False),
    "streamckpt.load_full": load_streamckpt_full,
    "streamckpt.dcp": lambda spec, *a: load_streamckpt({**spec, "dataset": "dcp_full"}, *a),
    "naive": load_naive,
    "dcp-fsspec": load_dcp_fsspec,
    "s3torchconnector": load_s3torch,
    "runai": load_runai,
    "streamckpt.resident": _resident(load_streamckpt),
    "rangereader.s3fs": load_rangereader("s3fs"),
    "rangereader.obstore": load_rangereader("obstore"),
    "rangereader.obstore.resident": _resident(load_rangereader("obstore")),
    "ceiling": load_ceiling,
    "ceiling.obstore": load_ceiling_obstore,
}


# ------------------------------------------------------------------ running


class Clock:
    """Times the block between two barriers (all ranks start and end together)."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.seconds = 0.0
        self.rss_before = 0

    def _barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    def __enter__(self) -> "Clock":
        import psutil

        self._barrier()
        self.rss_before = psutil.Process().memory_info().rss
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        self.seconds = time.perf_counter() - self._t0
        if exc_type is None:
            self._barrier()


def peak_rss() -> int:
    """This process's RSS high-water mark (VmHWM), in bytes.

    Not ``ru_maxrss``: Linux carries that across fork+exec, so a child started by
    a big parent would report the parent's size.
    """
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def verify(spec: dict[str, Any], out: dict[str, Any] | None, rank: int) -> tuple[int, int]:
    """(checked, wrong) tensors against the fingerprints of this scenario's view."""
    if out is None:
        return 0, 0
    view = spec["views"][rank]
    fps = json.loads(Path(spec["fingerprints"]).read_text())[view]
    wrong = 0
    for name, expected in fps.items():
        got = out.get(name)
        if got is None or data.crc(got) != expected:
            wrong += 1
    return len(fps), wrong


@contextlib.contextmanager
def measuring(rank: int, world: int, result: dict[str, Any]) -> Iterator[None]:
    """One rank's measurement: its gloo group (world > 1) and torch threads around the
    block, and the outcome in ``result``: ``na`` (NotApplicable) or ``error`` (the
    traceback goes to the log)."""
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        yield
    except NotApplicable as e:
        result["na"] = str(e)
    except Exception as e:  # noqa: BLE001 - reported in the table, with the traceback in the log
        result["error"] = f"{type(e).__name__}: {e}"[:300]
        traceback.print_exc()
    finally:
        if world > 1:
            import torch.distributed as dist

            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


def run(spec_path: str, rank: int) -> dict[str, Any]:
    spec = json.loads(Path(spec_path).read_text())
    world = int(spec.get("world", 1))
    result: dict[str, Any] = {"rank": rank}
    with measuring(rank, world, result):
        model = data.spec_from_json(spec["model"])
        loader = LOADERS[spec["loader"]]
        clock = Clock(world)
        out, stats = loader(spec, model, rank, world, clock)
        result.update(stats)
        result["seconds"] = clock.seconds
        result["rss_before"] = clock.rss_before
        result["rss_peak"] = peak_rss()
        checked, wrong = verify(spec, out, rank)
        result["checked"] = checked
        result["wrong"] = wrong
    return result


def fill_outcome(sample: Any, results: list[dict[str, Any]], errors: list[str], world: int) -> bool:
    """The parent's side of ``measuring``: every rank's result (``report_and_exit``) into
    ``sample``'s ``na``/``error``, or its ``rss_peak``/``rss_delta``/``ok`` (max over ranks;
    correctness summed). Returns whether all ranks measured, so the caller adds its own figures."""
    nas = [r["na"] for r in results if "na" in r]
    errs = [r["error"] for r in results if "error" in r] + errors
    if nas:
        sample.na = nas[0]
        return False
    if errs or len(results) != world:
        sample.error = (errs or ["no result"])[0]
        return False
    sample.rss_peak = max(r["rss_peak"] for r in results)
    sample.rss_delta = max(r["rss_peak"] - r["rss_before"] for r in results)
    checked = sum(r.get("checked", 0) for r in results)
    wrong = sum(r.get("wrong", 0) for r in results)
    sample.ok = "—" if checked == 0 else ("yes" if wrong == 0 else f"NO ({wrong}/{checked} wrong)")
    return True


def report_and_exit(spec_path: str, rank: int, result: dict[str, Any]) -> None:
    """Write this rank's result where the parent looks for it, and leave at once."""
    out = json.loads(Path(spec_path).read_text())["out"]
    Path(f"{out}.{rank}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: native clients (Rust/C++ runtimes) sometimes abort
    # there, which would turn a finished measurement into a failed one.
    os._exit(0)


def main() -> None:
    spec_path, rank = sys.argv[1], int(sys.argv[2])
    report_and_exit(spec_path, rank, run(spec_path, rank))


if __name__ == "__main__":
    main()
