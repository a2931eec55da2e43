"""Scenario (f): the planner alone on a simulated 70B-like job, no processes started.

Saved layout: TP=8 × PP=8 (64 writers, one data file each), weights split the
Megatron way (column-parallel q/k/v/gate/up/embed/lm_head on dim 0, row-parallel
o/down on dim 1, norms written once whole), plus a ZeRO-1 optimizer state
(``exp_avg``, fp32) whose every TP box is flattened and split over a DP of 8.
Loaded layout: TP=4 × PP=16 × DP = ranks / 64, weights replicated over DP, the
optimizer state flat-partitioned over DP. ``bench(ranks)`` times ``build_plan``
on one core and returns a table row: the plan one rank makes in a real load
(``rank=r``: shared targets planned alike everywhere, single-holder targets
only near the rank), for the first rank and one in the middle, and the
all-ranks plan (``rank=None``, what a simulation of every rank computes).

``metadata(ranks)`` times the whole per-rank metadata path of a load on the
same job, the old JSON gather and ``streamckpt.plan.specwire`` side by side: this
rank's encoding, the gather (bytes each rank receives, and the CPU time of
cutting them out of the receive buffer as ``all_gather_bytes`` does; network
time is not simulated), decoding every rank's specs, and rank 0's plan.

Any multiple of 64 ranks works; BENCHMARKS.md's (f) runs 512, 1,024, 4,096 and
16,384 (``python -m benchmarks.planner_bench 512 1024 4096 16384`` and the same with
``--metadata``). ``bench`` plans from plain lists (a caller's own, deduplicated by
hashing every spec); a load plans from the gathered pieces, as ``metadata`` does, which
is the per-rank figure that counts at scale.
"""

from __future__ import annotations

import math
import resource
import time
from typing import Any

LAYERS = 80
HIDDEN, INTER, KV, VOCAB = 8192, 28672, 1024, 128256
CHUNK = 256 << 10  # checksum chunk of the native format


def _weights(layers: int = LAYERS, hidden: int = HIDDEN, inter: int = INTER, kv: int = KV,
             vocab: int = VOCAB) -> list[tuple[str, tuple[int, ...], int | None, int]]:
    """(name, shape, TP split dim or None, layer or -1 (embed) / ``layers`` (head, final norm));
    the sizes are Llama 3 70B's unless given (``scale_model`` passes other models')."""
    HIDDEN, INTER, KV, VOCAB = hidden, inter, kv, vocab  # noqa: N806 (the table below reads them)
    out: list[tuple[str, tuple[int, ...], int | None, int]] = [("model.embed_tokens.weight", (VOCAB, HIDDEN), 0, -1)]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (HIDDEN,), None, i),
            (p + "self_attn.q_proj.weight", (HIDDEN, HIDDEN), 0, i),
            (p + "self_attn.k_proj.weight", (KV, HIDDEN), 0, i),
            (p + "self_attn.v_proj.weight", (KV, HIDDEN), 0, i),
            (p + "self_attn.o_proj.weight", (HIDDEN, HIDDEN), 1, i),
            (p + "post_attention_layernorm.weight", (HIDDEN,), None, i),
            (p + "mlp.gate_proj.weight", (INTER, HIDDEN), 0, i),
            (p + "mlp.up_proj.weight", (INTER, HIDDEN), 0, i),
            (p + "mlp.down_proj.weight", (HIDDEN, INTER), 1, i),
        ]
    out += [("model.norm.weight", (HIDDEN,), None, layers), ("lm_head.weight", (VOCAB, HIDDEN), 0, layers)]
    return out


def _stage(layer: int, pp: int, layers: int = LAYERS) -> int:
    if layer < 0:
        return 0
    if layer >= layers:
        return pp - 1
    return layer * pp // layers


def _tp_box(shape: tuple[int, ...], dim: int | None, tp: int, r: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if dim is None:
        return (0,) * len(shape), shape
    step = shape[dim] // tp
    off = [0] * len(shape)
    off[dim] = r * step
    sh = list(shape)
    sh[dim] = step
    return tuple(off), tuple(sh)


def _flat(numel: int, dp: int, r: int) -> tuple[int, int]:
    step = math.ceil(numel / dp)
    return min(numel, r * step), min(numel, (r + 1) * step)


def build_manifest(tp: int = 8, pp: int = 8, zero_dp: int = 8, layers: int = LAYERS):
    from streamckpt.core.manifest import Manifest, Shard, TensorMeta

    files: dict[str, int] = {}
    pos: dict[str, int] = {}
    tensors: dict[str, TensorMeta] = {}
    crcs: dict[int, tuple[int, ...]] = {}

    def shard(fname: str, off, shape, itemsize: int, flat=None) -> Shard:
        numel = (flat[1] - flat[0]) if flat else math.prod(shape)
        n = numel * itemsize
        start = pos.get(fname, 0)
        pos[fname] = start + n
        k = -(-n // CHUNK)
        if k not in crcs:
            crcs[k] = (0,) * k
        return Shard(off, shape, fname, start, n, flat, "raw", CHUNK, crcs[k])

    for name, shape, dim, layer in _weights(layers):
        st = _stage(layer, pp, layers)
        ranks = range(tp) if dim is not None else range(1)
        w, o = [], []
        for r in ranks:
            fname = f"data/{st:02d}-{r:02d}.safetensors"
            off, sh = _tp_box(shape, dim, tp, r)
            w.append(shard(fname, off, sh, 2))
            numel = math.prod(sh)
            for z in range(zero_dp):
                fl = _flat(numel, zero_dp, z)
                if fl[1] > fl[0]:
                    o.append(shard(fname, off, sh, 4, fl))
        tensors[name] = TensorMeta("BF16", shape, tuple(w))
        tensors[f"optim.exp_avg.{name}"] = TensorMeta("F32", shape, tuple(o))
    for f, n in pos.items():
        files[f] = n
    return Manifest(tensors=tensors, files=files)


def build_targets(ranks: int, tp: int = 4, pp: int = 16, layers: int = LAYERS):
    from streamckpt.core.targets import TargetSpec

    dp = ranks // (tp * pp)
    weights = _weights(layers)
    by_rank = []
    for rank in range(ranks):
        t, rest = rank % tp, rank // tp
        st, d = rest % pp, rest // pp
        specs = []
        for name, shape, dim, layer in weights:
            if _stage(layer, pp, layers) != st:
                continue
            off, sh = _tp_box(shape, dim, tp, t)
            specs.append(TargetSpec(name, "BF16", shape, off, sh))
            fl = _flat(math.prod(sh), dp, d)
            if fl[1] > fl[0]:
                specs.append(TargetSpec(f"optim.exp_avg.{name}", "F32", shape, off, sh, fl))
        by_rank.append(specs)
    return by_rank


def _hwm() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def bench(ranks: int, layers: int = LAYERS, full: bool = True) -> dict[str, Any]:
    """Plan a load onto ``ranks`` (a multiple of 64) ranks; ``layers`` < 80 only for --quick."""
    from streamckpt.plan.planner import PlanOptions, build_plan

    t0 = time.perf_counter()
    manifest = build_manifest(layers=layers)
    targets = build_targets(ranks, layers=layers)
    setup = time.perf_counter() - t0
    row: dict[str, Any] = {"ranks": ranks, "layers": layers, "target specs": sum(len(t) for t in targets)}
    cpu, wall = [], []
    for rank in (0, ranks // 2 + 1):
        t0, w0 = time.process_time(), time.perf_counter()
        plan = build_plan(manifest, targets, PlanOptions(), rank=rank)
        cpu.append(time.process_time() - t0)
        wall.append(time.perf_counter() - w0)
        if rank == 0:
            row["distinct targets"] = len(plan.targets)
            row["reads (rank 0)"] = len(plan.reads)
            row["edge reads (rank 0)"] = len(plan.edge_reads)
    row["one rank's plan: CPU s (max of 2 ranks)"] = round(max(cpu), 2)
    row["wall s"] = round(max(wall), 2)
    if full:
        t0 = time.process_time()
        plan = build_plan(manifest, targets, PlanOptions())
        row["all ranks' plan: CPU s"] = round(time.process_time() - t0, 2)
        row["reads (all ranks)"] = len(plan.reads)
        row["rounds"] = plan.num_rounds
    row["setup s"] = round(setup, 2)
    row["peak RSS MiB"] = _hwm() >> 20
    return row


def _cpu(fn: Any) -> tuple[Any, float]:
    t0 = time.process_time()
    out = fn()
    return out, time.process_time() - t0


def _received(blobs: list[bytes]) -> tuple[list[bytes], int, float]:
    """One padded all-gather as this rank sees it: what it returns, bytes received, CPU s
    of cutting each rank's bytes out of the receive buffer."""
    width = max(map(len, blobs))
    buf = b"".join(b.ljust(width, b"\0") for b in blobs)  # what arrives (built outside the timing)
    view = memoryview(buf)
    out, cpu = _cpu(lambda: [bytes(view[i * width:i * width + len(b)]) for i, b in enumerate(blobs)])
    return out, len(buf), cpu


def _json_path(targets: list[list[Any]], rank: int) -> tuple[list[list[Any]], dict[str, Any]]:
    """The gather before specwire: every rank's specs as one JSON document each."""
    import json

    from streamckpt.core.targets import TargetSpec

    docs = [json.dumps({"targets": [s.to_json() for s in t]}).encode() for t in targets]  # the other ranks
    _, enc = _cpu(lambda: json.dumps({"targets": [s.to_json() for s in targets[rank]]}).encode())
    got, nbytes, gather = _received(docs)
    specs, dec = _cpu(lambda: [[TargetSpec.from_json(v) for v in json.loads(b)["targets"]] for b in got])
    return specs, {"encode ms": enc * 1e3, "received MiB": nbytes / 2**20, "gather s": gather, "decode s": dec}


def _encoded(specs: list[Any]) -> tuple[Any, bytes]:
    from streamckpt.plan import specwire as sw

    enc = sw.encode(specs)
    return enc, enc.header()


def _route(wire: Any, heads: list[bytes]) -> Any:
    """The routing a rank computes from the gathered headers, as ``specwire.exchange`` does
    (a reference tree from before ``route_headers``: parse each header, then route)."""
    if hasattr(wire, "route_headers"):
        return wire.route_headers(heads)
    return wire.route([wire.parse_header(h, r) for r, h in enumerate(heads)])


def _specwire_path(targets: list[list[Any]], rank: int) -> tuple[list[list[Any]], dict[str, Any]]:
    """specwire: headers, then each distinct section once, split over its holders."""
    from streamckpt.plan import specwire as sw

    encs = [sw.encode(t) for t in targets]  # the other ranks
    heads = [e.header() for e in encs]
    (mine, _), enc = _cpu(lambda: _encoded(targets[rank]))
    got_heads, n1, g1 = _received(heads)
    routing, route = _cpu(lambda: _route(sw, got_heads))
    payloads = [sw.payload(routing, r, e) for r, e in enumerate(encs)]
    _, pay = _cpu(lambda: sw.payload(routing, rank, mine))
    got, n2, g2 = _received(payloads)
    specs, dec = _cpu(lambda: sw.decode_all(routing, sw.assemble(routing, got)))
    return specs, {"encode ms": (enc + pay) * 1e3, "received MiB": (n1 + n2) / 2**20, "gather s": g1 + g2,
                   "decode s": route + dec, "distinct blobs": len(routing.blobs)}


def metadata(ranks: int, layers: int = LAYERS, rank: int = 0, json_too: bool = True) -> list[dict[str, Any]]:
    """Rows (JSON, specwire) of one rank's metadata path onto ``ranks`` ranks: encode,
    gather, decode every rank's specs, then this rank's plan from the decoded specs
    (specwire alone without ``json_too``)."""
    import gc

    from streamckpt.plan.planner import PlanOptions, build_plan

    manifest = build_manifest(layers=layers)
    targets = build_targets(ranks, layers=layers)
    rows = []
    paths = (("JSON (before)", _json_path), ("specwire", _specwire_path))
    for name, path in paths if json_too else paths[1:]:
        gc.collect()
        specs, row = path(targets, rank)
        if specs != targets:
            raise AssertionError(f"{name}: decoded specs differ from the originals")
        _, plan = _cpu(lambda: build_plan(manifest, specs, PlanOptions(), rank=rank))
        specs = None  # free it before the next path
        total = row["encode ms"] / 1e3 + row["gather s"] + row["decode s"] + plan
        rows.append({"ranks": ranks, "path": name, "target specs": sum(map(len, targets)),
                     "received MiB/rank": round(row["received MiB"], 2),
                     "encode ms": round(row["encode ms"], 2), "gather copy s": round(row["gather s"], 3),
                     "decode s": round(row["decode s"], 3), "plan s": round(plan, 2),
                     "metadata + plan s": round(total, 2), "distinct blobs": row.get("distinct blobs", "")})
    return rows


def compare(ranks: int, against: Any, reps: int = 5, layers: int = LAYERS) -> list[dict[str, Any]]:
    """This tree's planner and specwire against a reference copy of the package
    (``plan_equiv.load_reference``), alternating within each repetition on the same
    inputs: rows of median (min) CPU seconds of rank 0's and a middle rank's plan from
    fresh specs, routing + decoding every rank's specs, and rank 0's plan from the
    decoded specs (routing, assembling and decoding, as a rank does after the gathers);
    the metadata + plan figure is decode + that plan."""
    import gc
    import importlib
    import statistics

    import streamckpt.plan.planner as this_plan
    import streamckpt.plan.specwire as this_wire

    ref_wire = importlib.import_module(against.__name__.rsplit(".", 1)[0] + ".specwire")
    manifest, targets = build_manifest(layers=layers), build_targets(ranks, layers=layers)
    got: dict[tuple[str, str], list[float]] = {}
    for _ in range(reps):
        for name, plan, wire in (("reference", against, ref_wire), ("this tree", this_plan, this_wire)):
            encs = [wire.encode(t) for t in targets]
            heads = [e.header() for e in encs]
            routing = _route(wire, heads)
            payloads = [wire.payload(routing, r, e) for r, e in enumerate(encs)]
            for rank in (0, ranks // 2 + 1):
                gc.collect()
                _, t = _cpu(lambda: plan.build_plan(manifest, targets, plan.PlanOptions(), rank=rank))
                got.setdefault((name, f"plan rank {rank} s"), []).append(t)

            def received(wire: Any = wire, heads: list[bytes] = heads, payloads: list[bytes] = payloads) -> Any:
                routing = _route(wire, heads)
                return wire.decode_all(routing, wire.assemble(routing, payloads))

            gc.collect()
            specs, dec = _cpu(received)
            _, t = _cpu(lambda: plan.build_plan(manifest, specs, plan.PlanOptions(), rank=0))
            specs = None  # free it before the next path
            got.setdefault((name, "decode s"), []).append(dec)
            got.setdefault((name, "plan from decoded s"), []).append(t)
            got.setdefault((name, "metadata + plan s"), []).append(dec + t)
    rows = []
    for name in ("reference", "this tree"):
        row: dict[str, Any] = {"ranks": ranks, "planner": name, "reps": reps}
        for (who, what), v in got.items():
            if who == name:
                row[what] = f"{statistics.median(v):.3f} ({min(v):.3f})"
        rows.append(row)
    return rows


if __name__ == "__main__":
    import argparse
    import json
    import tempfile
    from pathlib import Path

    ap = argparse.ArgumentParser(description="Scenario (f): the planner alone on a simulated 70B-like job.")
    ap.add_argument("ranks", type=int, nargs="*", default=[512], help="simulated world sizes (multiples of 64)")
    ap.add_argument("--metadata", action="store_true", help="time the per-rank metadata path, JSON vs specwire")
    ap.add_argument("--specwire-only", action="store_true", help="with --metadata: skip the JSON path")
    ap.add_argument("--against", metavar="REV", help="compare with the planner at git revision REV, alternating")
    ap.add_argument("--reps", type=int, default=5, help="repetitions for --against")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        reference = None
        if args.against:
            from benchmarks.plan_equiv import load_reference

            reference = load_reference(args.against, Path(tmp))
        for n in args.ranks:
            if reference is not None:
                for row in compare(n, reference, args.reps):
                    print(json.dumps(row), flush=True)
            elif args.metadata:
                for row in metadata(n, json_too=not args.specwire_only):
                    print(json.dumps(row), flush=True)
            else:
                print(json.dumps(bench(n)), flush=True)
