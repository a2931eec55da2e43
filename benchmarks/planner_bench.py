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
"""

from __future__ import annotations

import math
import resource
import time
from typing import Any

LAYERS = 80
HIDDEN, INTER, KV, VOCAB = 8192, 28672, 1024, 128256
CHUNK = 256 << 10  # checksum chunk of the native format


def _weights(layers: int = LAYERS) -> list[tuple[str, tuple[int, ...], int | None, int]]:
    """(name, shape, TP split dim or None, layer or -1 (embed) / ``layers`` (head, final norm))."""
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
    from streamckpt.manifest import Manifest, Shard, TensorMeta

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
    from streamckpt.targets import TargetSpec

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
    from streamckpt.plan import PlanOptions, build_plan

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


if __name__ == "__main__":
    import json
    import sys

    for n in (int(a) for a in sys.argv[1:] or ["512"]):
        print(json.dumps(bench(n)), flush=True)
