"""``streamckpt demo``: save to an embedded S3 server, load other layouts by range reads,
check every element; then real gloo processes reshard a checkpoint.

Multi-rank: 4 ranks save a model-like state (row-parallel weights, a replicated norm, a ZeRO-flat
optimizer state) to ``s3://…``; then 2 ranks load it column-wise and 3 ranks load it
as uneven row blocks + other flat ranges. Every rank checks every element and reports
its LoadResult; the parent prints one row per rank.
"""

from __future__ import annotations

import logging
import math
import sys
from dataclasses import dataclass
from typing import Any

import torch

from .loadbench import block
from .results import human_bytes as human
from .results import plural

log = logging.getLogger(__name__)

SHAPES = {"layers.0.w": (1536, 1024), "layers.1.w": (1536, 1024), "embed": (2048, 512)}


def _original(key: str) -> torch.Tensor:
    shape = SHAPES[key]
    g = torch.Generator().manual_seed(sum(map(ord, key)))
    return torch.randn(shape, generator=g)


def _norm() -> torch.Tensor:
    return torch.linspace(0.5, 1.5, 1024)


def _rows(n: int, world: int, rank: int) -> tuple[int, int]:
    """Uneven row blocks: the first ``n % world`` ranks get one more row."""
    return block(n, world, rank)


def _state(world: int, rank: int, layout: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """This rank's state_dict (to fill or to save) and the expected local tensors."""
    import streamckpt as sc

    sd: dict[str, Any] = {"model": {}, "optim": {}}
    expected: dict[str, torch.Tensor] = {}
    for key, shape in SHAPES.items():
        full = _original(key)
        if layout == "cols":
            lo, hi = _rows(shape[1], world, rank)
            local = full[:, lo:hi].contiguous()
            offset = (0, lo)
        else:
            lo, hi = _rows(shape[0], world, rank)
            local = full[lo:hi].contiguous()
            offset = (lo, 0)
        target = local.clone() if layout == "save" else torch.zeros_like(local)
        sd["model"][key] = sc.ShardedTensor(target, shape, offset)
        expected[f"model.{key}"] = local
        # ZeRO-1 style: the optimizer moment of the whole tensor, flat-partitioned over ranks
        numel = math.prod(shape)
        a, b = _rows(numel, world, rank)
        moment = (full * 0.01).reshape(-1)[a:b].contiguous()
        mt = moment.clone() if layout == "save" else torch.zeros_like(moment)
        sd["optim"][f"{key}.exp_avg"] = sc.ShardedTensor(mt, shape, (0, 0), local_shape=shape, flat_range=(a, b))
        expected[f"optim.{key}.exp_avg"] = moment
    norm = _norm() if layout == "save" else torch.zeros(1024)
    sd["model"]["norm"] = norm  # replicated on every rank: written once, read once and shared
    expected["model.norm"] = _norm()
    sd["step"] = 1000 if layout == "save" else 0
    return sd, expected


def _lookup(sd: dict[str, Any], dotted: str) -> torch.Tensor:
    head, _, rest = dotted.partition(".")
    v = sd[head][rest] if head in ("model", "optim") else sd[dotted]
    return v.local_tensor if hasattr(v, "local_tensor") else v


@dataclass
class RankReport:
    phase: str
    rank: int
    world: int
    ok: bool
    bytes_needed: int = 0
    bytes_read: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    requests: int = 0
    seconds: float = 0.0
    error: str = ""
    bytes_written: int = 0  # a save's


def _phase(rank: int, world: int, phase: str, uri: str, opts: dict[str, Any]) -> RankReport:
    import streamckpt as sc

    if phase == "save":
        sd, _ = _state(world, rank, "save")
        res = sc.save(sd, uri, storage_options=opts, metadata={"demo": "multirank"}, overwrite=True)
        return RankReport(phase, rank, world, True, bytes_written=res.bytes_written, requests=res.requests,
                          seconds=res.seconds)
    sd, expected = _state(world, rank, phase)
    r = sc.load(sd, uri, storage_options=opts)
    ok = sd["step"] == 1000 and all(torch.equal(_lookup(sd, k), v) for k, v in expected.items())
    return RankReport(phase, rank, world, ok, r.bytes_needed, r.bytes_read, r.bytes_sent, r.bytes_received,
                      r.requests, r.seconds)


def run_phase(phase: str, world: int, uri: str, opts: dict[str, Any], timeout: float = 300) -> list[RankReport]:
    """Run one phase in ``world`` fresh gloo processes; reports sorted by rank."""
    from .spawn import run_ranks

    return [o.value if o.ok else RankReport(phase, o.rank, world, False, error=o.error)
            for o in run_ranks(_phase, world, (phase, uri, opts), timeout)]


def multirank_demo(uri: str, opts: dict[str, Any]) -> list[RankReport]:
    """Save with 4 ranks (rows), load with 2 (columns) and 3 (uneven rows, other flat ranges)."""
    out = run_phase("save", 4, uri, opts)
    if all(r.ok for r in out):
        out += run_phase("cols", 2, uri, opts)
        out += run_phase("rows", 3, uri, opts)
    return out


def format_reports(reports: list[RankReport]) -> str:
    """One row per rank: a save's row shows the bytes it wrote (and its PUTs), a load's what it
    needed, read, sent and received (and its GETs); MB/s is of the bytes written or needed."""
    head = (f"{'phase':<6} {'rank':>4} {'needed':>10} {'read':>10} {'written':>10} {'sent':>10} {'recv':>10} "
            f"{'reqs':>5} {'sec':>6} {'MB/s':>7}  ok")
    lines = [head, "-" * len(head)]

    def mib(n: int, shown: bool) -> str:
        return f"{n / 2**20:>8.2f}Mi" if shown else f"{'-':>10}"

    for r in reports:
        save = r.phase == "save"
        useful = r.bytes_written if save else r.bytes_needed
        mbps = useful / r.seconds / 1e6 if r.seconds and useful else 0.0
        lines.append(
            f"{r.phase + '/' + str(r.world):<6} {r.rank:>4} {mib(r.bytes_needed, not save)} {mib(r.bytes_read, not save)} "
            f"{mib(r.bytes_written, save)} {mib(r.bytes_sent, not save)} {mib(r.bytes_received, not save)} "
            f"{r.requests:>5} {r.seconds:>6.2f} {mbps:>7.1f}  {'yes' if r.ok else 'NO'}"
        )
        if r.error:
            lines.append("    " + r.error.strip().splitlines()[0])
    lines.append("(MB/s: bytes written, or needed, per second; reqs: PUTs, or GETs)")
    loads = [r for r in reports if r.phase != "save"]
    for phase in sorted({r.phase for r in loads}):
        rs = [r for r in loads if r.phase == phase]
        need = sum(r.bytes_needed for r in rs)
        read = sum(r.bytes_read for r in rs)
        lines.append(f"{phase}: all ranks read {read / 2**20:.2f} MiB for {need / 2**20:.2f} MiB needed "
                     f"(read once: the stored checkpoint is {_stored_mib(rs):.2f} MiB; a byte several ranks "
                     f"need, such as the replicated norm's, is read by one and sent to the others)")
    return "\n".join(lines)


def _stored_mib(rs: list[RankReport]) -> float:
    total = sum(math.prod(s) * 4 * 2 for s in SHAPES.values()) + 1024 * 4
    return total / 2**20


# ------------------------------------------------- the single-process part and the command

DEMO_BUCKET = "streamckpt-demo"


def demo_state(size_mb: float) -> dict[str, Any]:
    """A small transformer-like state_dict of about ``size_mb`` MiB (seeded)."""
    import torch

    h = 1024 if size_mb >= 48 else 512 if size_mb >= 16 else 128
    g = torch.Generator().manual_seed(1234)
    layer_bytes = (3 * h * h + h * h + 2 * h * h + 2 * h * h) * 4
    embed_bytes = 4096 * h * 2
    layers = max(1, round((size_mb * 2**20 - embed_bytes) / layer_bytes))
    sd: dict[str, Any] = {"embed.weight": torch.randn(4096, h, generator=g).to(torch.bfloat16)}
    for i in range(layers):
        p = f"layers.{i}."
        sd[p + "attn.wqkv.weight"] = torch.randn(3 * h, h, generator=g)
        sd[p + "attn.wo.weight"] = torch.randn(h, h, generator=g)
        sd[p + "mlp.w1.weight"] = torch.randn(2 * h, h, generator=g)
        sd[p + "mlp.w2.weight"] = torch.randn(h, 2 * h, generator=g)
        sd[p + "norm.weight"] = torch.rand(h, generator=g) + 0.5
    sd["step"] = 1000
    return sd


def demo_layouts(sd: dict[str, Any]) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(name, state_dict to load into, expected tensors) for layouts unlike the saved one."""
    import torch

    from .core.sharded import ShardedTensor

    tensors = {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}
    out = []

    def tp(rank: int, world: int, dim: int) -> tuple[dict[str, Any], dict[str, Any]]:
        targets, expected = {}, {}
        for k, v in tensors.items():
            if v.dim() < 2:
                targets[k], expected[k] = torch.empty_like(v), v
                continue
            n = v.shape[dim] // world
            exp = v.narrow(dim, rank * n, n)
            offset = [0] * v.dim()
            offset[dim] = rank * n
            targets[k] = ShardedTensor(torch.empty_like(exp), v.shape, offset)
            expected[k] = exp
        return targets, expected

    def zero(rank: int, world: int) -> tuple[dict[str, Any], dict[str, Any]]:
        targets, expected = {}, {}
        for k, v in tensors.items():
            n = v.numel()
            a, b = n * rank // world, n * (rank + 1) // world
            exp = v.reshape(-1)[a:b]
            targets[k] = ShardedTensor(torch.empty_like(exp), v.shape, [0] * v.dim(), local_shape=v.shape,
                                       flat_range=(a, b))
            expected[k] = exp
        return targets, expected

    out.append(("TP rank 1/4, rows (Shard(0))", *tp(1, 4, 0)))
    out.append(("TP rank 2/4, columns (Shard(1))", *tp(2, 4, 1)))
    out.append(("ZeRO rank 5/8, flat range", *zero(5, 8)))
    full = {k: torch.empty_like(v) for k, v in tensors.items()}
    full["step"] = 0
    out.append(("full replica", full, {**tensors, "step": sd["step"]}))
    return out


def _local(v: Any) -> Any:
    return getattr(v, "local_tensor", v)


def run_demo(size_mb: float = 64.0, quiet: bool = False, serve: bool = False, multirank: bool = True) -> int:
    """Save to an embedded S3 server, load other layouts by range reads, check every element."""
    import torch

    from . import api
    from .progress import ByteProgress
    from .testing import LocalS3

    with LocalS3() as s3:
        s3.make_bucket(DEMO_BUCKET)
        opts = s3.storage_options
        uri = f"s3://{DEMO_BUCKET}/run-1/step-1000"
        sd = demo_state(size_mb)
        nbytes = sum(v.numel() * v.element_size() for v in sd.values() if isinstance(v, torch.Tensor))
        print(f"embedded S3 server (moto) at {s3.endpoint_url}")
        print(f"saving {plural(len(sd) - 1, 'tensor')} ({human(nbytes)}) to {uri} ...")
        saved = api.save(sd, uri, storage_options=opts, metadata={"demo": True})
        print(f"saved {human(saved.bytes_written)} in {plural(len(saved.files), 'file')}, {saved.seconds:.2f} s")
        rows = []
        for name, targets, expected in demo_layouts(sd):
            with ByteProgress(f"{name} (read)", enabled=not quiet) as bar:
                res = api.load(targets, uri, storage_options=opts, progress=bar, strict=True)
            bad = [k for k, exp in expected.items()
                   if not (torch.equal(_local(targets[k]), exp) if isinstance(exp, torch.Tensor) else targets[k] == exp)]
            if bad:
                print(f"MISMATCH in layout {name!r}: {', '.join(bad[:5])}", file=sys.stderr)
                return 1
            rows.append((name, res))
        print()
        print(_demo_table(rows))
        print("\nevery element of every layout matched the saved tensors.")
        if multirank:
            mr_uri = f"s3://{DEMO_BUCKET}/run-2/step-1000"
            print(f"\nmulti-rank: 4 gloo processes save {mr_uri} row-wise; 2 processes load it column-wise,"
                  f"\n3 processes as uneven row blocks (weights, a replicated norm, ZeRO-flat moments) ...")
            reports = multirank_demo(mr_uri, opts)
            print(format_reports(reports))
            if not all(r.ok for r in reports):
                print("a rank failed or loaded wrong values", file=sys.stderr)
                return 1
            print("every rank's every element matched.")
        if serve:
            _serve(s3, uri)
    return 0


def _demo_table(rows: list[tuple[str, Any]]) -> str:
    head = ("layout loaded", "needed", "read", "read/needed", "requests", "seconds", "needed MB/s")
    lines = [head]
    for name, r in rows:
        rate = r.bytes_needed / r.seconds / 1e6 if r.seconds else 0.0
        amp = r.bytes_read / r.bytes_needed if r.bytes_needed else 0.0
        lines.append((name, human(r.bytes_needed), human(r.bytes_read), f"{amp:.2f}", str(r.requests),
                      f"{r.seconds:.3f}", f"{rate:.1f}"))
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    fmt = [f"{{:<{widths[0]}}}"] + [f"{{:>{w}}}" for w in widths[1:]]
    out = ["  ".join(f.format(c) for f, c in zip(fmt, row)) for row in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


def _serve(s3: Any, uri: str) -> None:
    import threading

    from .testing.s3server import TEST_KEY, TEST_SECRET

    flags = f"--endpoint-url {s3.endpoint_url} --storage-option key={TEST_KEY} --storage-option secret={TEST_SECRET}"
    print(f"\nthe embedded S3 server keeps running (Ctrl-C stops it); try:\n"
          f"  streamckpt inspect {uri} {flags}\n"
          f"  streamckpt verify {uri} {flags}\n"
          f"  streamckpt merge {uri} s3://{DEMO_BUCKET}/hf --max-shard-bytes 8MiB {flags}", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
