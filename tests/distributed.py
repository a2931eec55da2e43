"""A small harness for multi-rank tests: real processes, gloo on 127.0.0.1, no hangs.

``run_ranks(world_size, worker, **kwargs)`` starts ``world_size`` processes; each
joins a gloo process group on a free loopback port with a short collective
timeout, imports ``worker`` (a top-level function given as the function itself or
``"module:name"``) and calls ``worker(rank, world_size, **kwargs)``. Each rank
writes its outcome to a JSON file: the returned value (JSON-serializable) or the
exception (class name, class hierarchy, message, traceback). The parent waits up
to an overall deadline, kills stragglers, and returns one ``RankResult`` per rank;
a rank that died or was killed has ``error.cls == "NoResult"`` and the tail of its
output in the message.

Processes are forked from a multiprocessing fork server that imported torch, s3fs
and streamckpt once per test session (a fresh interpreter costs ~3 s of imports
per rank on a small machine); ``SC_TEST_SPAWN=subprocess`` starts fresh
interpreters instead. As with any fork server, a script (not pytest) that calls
``run_ranks`` needs the ``if __name__ == "__main__":`` guard. ``SC_TEST_LOG=DEBUG``
shows the library's logs in each rank's output.

``run_scenarios`` runs several named scenario functions in sequence inside one
spawn and keeps each scenario's outcome separate, so one failing case stays
attributable.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import pytest

TESTS_DIR = Path(__file__).resolve().parent
REPO_DIR = TESTS_DIR.parent


@dataclass(slots=True)
class ErrorInfo:
    """An exception raised on a rank, as plain data."""

    cls: str
    bases: list[str]
    msg: str
    tb: str = ""

    def isa(self, name: str) -> bool:
        """True when the exception's class or one of its bases is called ``name``."""
        return name in self.bases

    def __str__(self) -> str:
        return f"{self.cls}: {self.msg}"


@dataclass(slots=True)
class RankResult:
    rank: int
    value: Any = None
    error: ErrorInfo | None = None
    seconds: float = 0.0
    log_tail: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None

    def unwrap(self) -> Any:
        """The rank's value; fails the test with the rank's error otherwise."""
        if self.error is not None:
            raise AssertionError(f"rank {self.rank} failed: {self.error}\n{self.error.tb}\n{self.log_tail}")
        return self.value


def error_info(exc: BaseException) -> dict[str, Any]:
    return {
        "cls": type(exc).__name__,
        "bases": [c.__name__ for c in type(exc).__mro__],
        "msg": str(exc),
        "tb": "".join(traceback.format_exception(exc))[-4000:],
    }


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker_name(worker: Callable[..., Any] | str) -> str:
    if isinstance(worker, str):
        return worker
    return f"{worker.__module__}:{worker.__qualname__}"


def run_ranks(
    world_size: int,
    worker: Callable[..., Any] | str,
    *,
    kwargs: Mapping[str, Any] | None = None,
    timeout: float = 120.0,
    pg_timeout: float = 60.0,
    env: Mapping[str, str] | None = None,
    backend: str = "gloo",
    spawn: str | None = None,
) -> list[RankResult]:
    """Run ``worker(rank, world_size, **kwargs)`` on ``world_size`` ranks (gloo unless ``backend``;
    with "nccl" rank r uses cuda:r).

    ``timeout`` bounds the whole run (start-up included); ``pg_timeout`` is the
    process group's collective timeout, so a hung collective fails inside it.
    ``spawn`` ("subprocess" or "forkserver") overrides ``SC_TEST_SPAWN`` for this run.
    """
    port = free_port()
    mode = spawn or os.environ.get("SC_TEST_SPAWN", "forkserver")
    with tempfile.TemporaryDirectory(prefix="sc-ranks-") as tmp:
        work = Path(tmp)
        child_env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
        cfgs = []
        for rank in range(world_size):
            cfg = {
                "worker": _worker_name(worker),
                "kwargs": dict(kwargs or {}),
                "rank": rank,
                "world_size": world_size,
                "init": f"tcp://127.0.0.1:{port}",
                "pg_timeout": pg_timeout,
                "backend": backend,
                "result": str(work / f"rank{rank}.json"),
            }
            cfg_path = work / f"cfg{rank}.json"
            cfg_path.write_text(json.dumps(cfg))
            cfgs.append(str(cfg_path))
        logs = [str(work / f"rank{rank}.log") for rank in range(world_size)]
        if mode == "subprocess":
            outcome = _run_subprocesses(cfgs, logs, child_env, timeout)
        else:
            outcome = _run_forked(cfgs, logs, child_env, timeout)
        return [_collect(work, rank, rc, killed, timeout) for rank, (rc, killed) in enumerate(outcome)]


_PRELOAD = ["distributed", "torch", "torch.distributed", "torch.distributed.tensor",
            "torch.distributed.device_mesh", "s3fs", "streamckpt", "streamckpt.testing"]


def _run_forked(cfgs: list[str], logs: list[str], env: dict[str, str], timeout: float) -> list[tuple[int | None, bool]]:
    """Ranks forked from a server that imported torch, s3fs and streamckpt once per test
    session: a rank starts in milliseconds instead of seconds of imports."""
    import multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # takes effect when the server first starts
    procs = [ctx.Process(target=_forked_main, args=(c, log, env), daemon=True) for c, log in zip(cfgs, logs)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    out = []
    for p in procs:
        killed = p.is_alive()
        if killed:
            p.kill()
            p.join(30)
        out.append((p.exitcode, killed))
    return out


def _run_subprocesses(cfgs: list[str], logs: list[str], env: dict[str, str], timeout: float) -> list[tuple[int | None, bool]]:
    """Ranks as fresh interpreters (SC_TEST_SPAWN=subprocess): slower, nothing shared."""
    child_env = dict(os.environ)
    child_env.update(env)
    child_env["PYTHONPATH"] = os.pathsep.join(
        [str(TESTS_DIR), str(REPO_DIR), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    procs = []
    for cfg, log in zip(cfgs, logs):
        with open(log, "wb") as f:
            procs.append(subprocess.Popen(
                [sys.executable, "-c", "import distributed as d, sys; d._child_main(sys.argv[1])", cfg],
                stdout=f, stderr=subprocess.STDOUT, env=child_env, cwd=str(REPO_DIR),
            ))
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    out = []
    for p in procs:
        killed = p.poll() is None
        if killed:
            p.kill()
            p.wait(timeout=30)
        out.append((p.returncode, killed))
    return out


def _forked_main(cfg_path: str, log_path: str, env: dict[str, str]) -> None:
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.update(env)
    _child_main(cfg_path)


def _collect(work: Path, rank: int, rc: int | None, killed: bool, timeout: float) -> RankResult:
    log = work / f"rank{rank}.log"
    tail = (log.read_bytes() if log.exists() else b"")[-int(os.environ.get("SC_TEST_TAIL", "6000")):].decode(errors="replace")
    path = work / f"rank{rank}.json"
    if not path.exists():
        why = f"killed after the {timeout:.0f} s overall timeout" if killed else f"exited with code {rc}"
        return RankResult(rank, error=ErrorInfo("NoResult", ["NoResult"], f"rank {rank} {why}; output:\n{tail}"),
                          log_tail=tail)
    doc = json.loads(path.read_text())
    err = ErrorInfo(**doc["error"]) if doc.get("error") else None
    return RankResult(rank, value=doc.get("value"), error=err, seconds=doc.get("seconds", 0.0), log_tail=tail)


def _child_main(cfg_path: str) -> None:
    """Entry point of one rank's process."""
    cfg = json.loads(Path(cfg_path).read_text())
    t0 = time.perf_counter()
    out: dict[str, Any] = {}
    try:
        import logging

        import torch
        import torch.distributed as dist

        level = os.environ.get("SC_TEST_LOG")  # e.g. SC_TEST_LOG=DEBUG: library logs in the rank's output
        if level:
            logging.basicConfig(level=level.upper(), format=f"rank{cfg['rank']} %(asctime)s %(name)s %(message)s")
        torch.set_num_threads(1)
        if cfg["backend"] == "nccl":
            torch.cuda.set_device(cfg["rank"])
        dist.init_process_group(
            cfg["backend"], init_method=cfg["init"], rank=cfg["rank"], world_size=cfg["world_size"],
            timeout=timedelta(seconds=cfg["pg_timeout"]),
        )
        try:
            mod_name, fn_name = cfg["worker"].split(":")
            fn = importlib.import_module(mod_name)
            for part in fn_name.split("."):
                fn = getattr(fn, part)
            out["value"] = fn(cfg["rank"], cfg["world_size"], **cfg["kwargs"])
        finally:
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a peer may be gone already
                pass
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        out["error"] = error_info(e)
    out["seconds"] = time.perf_counter() - t0
    tmp = cfg["result"] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(out, f, default=_jsonable)
    os.replace(tmp, cfg["result"])
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown (gloo threads, fsspec loop): the result is written


def _jsonable(v: Any) -> Any:
    if hasattr(v, "tolist"):
        return v.tolist()
    if isinstance(v, (set, tuple)):
        return list(v)
    return repr(v)


# ----------------------------------------------------------------------------- scenarios


@dataclass(slots=True)
class ScenarioResults:
    """Per-scenario outcomes of one spawn: ``[name][rank] -> value`` or an error."""

    ranks: list[RankResult]
    names: Sequence[str] = field(default_factory=list)

    def of(self, name: str) -> list[dict[str, Any]]:
        """Each rank's record for scenario ``name``: ``{"value": ...}`` or ``{"error": {...}}``."""
        out = []
        for r in self.ranks:
            if r.error is not None:  # the whole rank failed (start-up, crash, timeout)
                out.append({"error": {"cls": r.error.cls, "bases": r.error.bases,
                                      "msg": r.error.msg, "tb": r.error.tb + r.log_tail}})
                continue
            out.append(r.value.get(name, {"error": {"cls": "NotRun", "bases": ["NotRun"],
                                                    "msg": f"scenario {name} did not run on rank {r.rank}",
                                                    "tb": ""}}))
        return out

    def values(self, name: str) -> list[Any]:
        """Each rank's value for ``name``; fails the test with every rank's error otherwise."""
        recs = self.of(name)
        bad = [(i, r["error"]) for i, r in enumerate(recs) if "error" in r]
        if bad:
            lines = [f"rank {i}: {e['cls']}: {e['msg']}\n{e.get('tb', '')}" for i, e in bad]
            raise AssertionError(f"scenario {name!r} failed:\n" + "\n".join(lines))
        return [r["value"] for r in recs]

    def seconds(self, name: str) -> list[float]:
        """Each rank's wall time in scenario ``name`` (inf where it did not run)."""
        return [r.get("seconds", float("inf")) for r in self.of(name)]

    def errors(self, name: str) -> list[ErrorInfo | None]:
        return [ErrorInfo(**r["error"]) if "error" in r else None for r in self.of(name)]


def run_scenarios(
    rank: int, world_size: int, scenarios: Sequence[tuple[str, Callable[[int, int], Any]]], *,
    barrier: bool = True,
) -> dict[str, Any]:
    """Run each ``(name, fn)`` in order on this rank; record each value or error.

    With ``barrier`` every rank waits for all the others after each scenario, so a
    scenario that only some ranks take part in (a sub-group) is over before the next
    starts, and each scenario's wall time is its own.
    """
    import torch.distributed as dist

    out: dict[str, Any] = {}
    for name, fn in scenarios:
        t0 = time.perf_counter()
        try:
            out[name] = {"value": fn(rank, world_size)}
        except Exception as e:  # noqa: BLE001 - recorded per scenario
            out[name] = {"error": error_info(e)}
        out[name]["seconds"] = time.perf_counter() - t0
        if barrier and dist.is_initialized():
            dist.barrier()
    return out


# ----------------------------------------------------------------------------- deterministic data


def original(name: str, shape: Sequence[int], dtype: Any) -> Any:
    """The same tensor in every process: seeded from its name."""
    import zlib

    import torch

    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    shape = tuple(shape)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).to(torch.bool)
    info = torch.iinfo(dtype)
    lo, hi = max(info.min, -(2**62)), min(info.max, 2**62)
    return torch.randint(lo, hi, shape, generator=g, dtype=torch.int64).to(dtype)


def bounds(n: int, parts: int, i: int) -> tuple[int, int]:
    """Part ``i`` of ``parts`` of ``range(n)``: uneven splits differ by one element."""
    return (i * n) // parts, ((i + 1) * n) // parts


def sharded(full: Any, dim: int, parts: int, i: int, *, fill: bool = True) -> tuple[Any, Any]:
    """``(ShardedTensor, expected local)`` for part ``i`` of ``full`` along ``dim``.

    With ``fill=False`` the local tensor is a sentinel-filled target to load into.
    """
    import streamckpt as sc

    lo, hi = bounds(full.shape[dim], parts, i)
    expected = full.narrow(dim, lo, hi - lo)
    local = expected.clone() if fill else sentinel_like(expected)
    offset = [0] * full.dim()
    offset[dim] = lo
    return sc.ShardedTensor(local, tuple(full.shape), tuple(offset)), expected


def flat_sharded(full: Any, start: int, stop: int, *, fill: bool = True) -> tuple[Any, Any]:
    """A ZeRO-style flat slice ``[start, stop)`` of the whole box of ``full``."""
    import streamckpt as sc

    expected = full.reshape(-1)[start:stop]
    local = expected.clone() if fill else sentinel_like(expected)
    return sc.ShardedTensor(local, tuple(full.shape), (0,) * full.dim(), local_shape=tuple(full.shape),
                            flat_range=(start, stop)), expected


def sentinel_like(t: Any) -> Any:
    """A target that differs from ``t`` everywhere a load could leave it untouched."""
    import torch

    if t.dtype == torch.bool:
        return ~t.clone()
    if t.dtype.is_floating_point:
        return torch.full_like(t, float("nan"))
    return t.clone() ^ torch.ones_like(t)  # flips the low bit of every element


def dtensor(full: Any, mesh: Any, placements: Sequence[Any], *, fill: bool = True) -> tuple[Any, Any]:
    """``(DTensor, expected local)`` of ``full`` on ``mesh`` (no communication)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(full.shape, mesh, placements)
    sl = tuple(slice(o, o + s) for o, s in zip(offset, shape))
    expected = full[sl]
    local = expected.clone().contiguous() if fill else sentinel_like(expected.contiguous())
    dt = DTensor.from_local(local, mesh, placements, run_check=False, shape=full.shape, stride=full.stride())
    return dt, expected


def check_equal(name: str, got: Any, expected: Any) -> None:
    """Element-by-element equality (NaN-free data), with a useful message."""
    import torch

    if tuple(got.shape) != tuple(expected.shape) or got.dtype != expected.dtype:
        raise AssertionError(f"{name}: got {list(got.shape)} {got.dtype}, expected {list(expected.shape)} "
                             f"{expected.dtype}")
    if got.dtype.is_floating_point:  # bitwise: -0.0 vs 0.0 or NaN payloads count as different
        as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[got.element_size()]
        same = got.contiguous().view(as_int) == expected.contiguous().view(as_int)
    else:
        same = got == expected
    if not bool(same.all()):
        bad = (~same).nonzero()
        first = tuple(bad[0].tolist())
        raise AssertionError(f"{name}: {bad.shape[0]} of {got.numel()} elements differ; first at {first}: "
                             f"got {got[first].item()!r}, expected {expected[first].item()!r}")


def result_dict(res: Any) -> dict[str, Any]:
    """A LoadResult/SaveResult as plain JSON data."""
    import dataclasses

    return {f.name: getattr(res, f.name) for f in dataclasses.fields(res)}


def kill_when_stalled(child: "subprocess.Popen[str]", proxy: Any, timeout: float = 90.0) -> None:
    """SIGKILL the child as soon as one of its requests is held by the proxy."""
    deadline = time.monotonic() + timeout
    while proxy.stalled_now == 0:
        if child.poll() is not None:
            out, err = child.communicate()
            pytest.fail(f"the child ended before it could be killed (rc={child.returncode}): {out}{err[-2000:]}")
        if time.monotonic() > deadline:
            child.kill()
            pytest.fail("the child never reached the held request")
        time.sleep(0.02)
    child.send_signal(signal.SIGKILL)
    assert child.wait(timeout=30) == -signal.SIGKILL
