"""Plans are equal across independent interpreters (issue #37, item 4's first prerequisite).

torchrun starts every rank as its own interpreter, each with its own string-hash seed;
the rest of the suite forks ranks from one process, so a planner that let ``hash()`` or
the order of a set of strings pick a reader, a round or a tag would pass it and still
deadlock a real job. Here seam-heavy plans (ZeRO slices resharded, FSDP rows resharded:
many edge reads shared by the ranks at a seam) are made in fresh interpreters with
different ``PYTHONHASHSEED``s, the all-ranks plan and every rank's own settled plan, and
their digests must agree. No torch: the manifests come from ``benchmarks.scale_model``.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SEEDS = ("0", "1", "4242")


def _cases():
    from benchmarks import scale_model as sm

    tiny = sm.Model("tiny", 3, 48, 80, 16, 200)
    return [
        sm.Case("zero-1 reshard", tiny, sm.Layout(2, 2, 2), sm.Layout(2, 1, 3), optim=True),
        sm.Case("fsdp 4 -> 6", tiny, sm.Layout(1, 1, 4, fsdp=True), sm.Layout(1, 1, 6, fsdp=True), optim=True),
        sm.Case("fsdp 3 -> 5", tiny, sm.Layout(1, 1, 3, fsdp=True), sm.Layout(1, 1, 5, fsdp=True)),
    ]


def _signature(read) -> tuple:
    return (read.file, read.start, read.stop, read.reader, read.round, read.tag, read.private,
            tuple((c.target, c.offset, c.length, tuple(c.dst_box.offset), tuple(c.dst_box.shape), c.dst_base)
                  for c in read.copies))


def _plan_digest(plan) -> list:
    return [plan.num_rounds, [_signature(r) for r in plan.reads], [t.spec for t in plan.targets]]


def digest() -> tuple[str, int]:
    """sha256 of every case's all-ranks plan and each rank's own settled plan; edge reads counted."""
    from benchmarks import scale_model as sm
    from streamckpt.plan.planner import PlanOptions, build_plan, settle_all

    opts = PlanOptions(memory_budget=64 << 10, max_gap_bytes=256)
    out, edges = [], 0
    for case in _cases():
        manifest, targets = sm.build_manifest(case), sm.build_targets(case)
        full = build_plan(manifest, targets, opts)
        plans = [build_plan(manifest, targets, opts, rank=r) for r in range(len(targets))]
        settle_all(plans)
        edges += len(full.edge_reads)
        out.append([_plan_digest(full)] + [_plan_digest(p) for p in plans])
    return hashlib.sha256(repr(out).encode()).hexdigest(), edges


def _in_fresh_interpreters(seeds: tuple[str, ...]) -> dict[str, str]:
    """Each seed's digest, the interpreters run side by side (importing torch is most of their time)."""
    procs = {seed: subprocess.Popen([sys.executable, __file__], env=dict(os.environ, PYTHONHASHSEED=seed,
                                                                          PYTHONPATH=str(ROOT)),
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for seed in seeds}
    outs = {}
    for seed, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        outs[seed] = out.strip()
    return outs


def test_plans_equal_across_hash_seeds() -> None:
    outs = _in_fresh_interpreters(SEEDS)
    assert len(set(outs.values())) == 1, outs
    edges = int(next(iter(outs.values())).split()[1])
    assert edges > 10  # the cases do exercise edge reads (seams inside checksum chunks)


if __name__ == "__main__":
    h, n = digest()
    print(h, n)
