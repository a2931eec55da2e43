"""The memory/peer tier in the scale model: a resume from the surviving nodes' local copies
with one node lost, against the same resume from the bucket (issue 43 item 5, docs/SCALE.md).

The saving job (``Case.saved``, ranks numbered node by node, ``gpus_per_node`` a node) kept
each rank's data file in its node's ``local_dir`` and one copy on a partner node
(``streamckpt.manage.tier.partners``, ``replicas=1``). One node is then lost and replaced by
an empty one; the resumed job (``Case.loaded``, possibly larger: its extra nodes are new and
empty) takes each file from a surviving holder, as ``restore`` plans it: the planner's plan
with ``plan.holders.constrain_readers``, a holder's read charged to its node's local read
bandwidth (``node.local_read_GBps``) instead of the store, its bytes sent to the ranks that
need them over NVLink and the fabric as in any load. The bucket's resume is the same case
planned without holders.

Both are planned over the whole loaded world with fewer decoder layers (``layers``), figures
scaled up by bytes: a restore's readers are the holders, which the stage sampling of
``scale_model.CASES`` would leave out. Pure Python, no I/O beyond the YAML.

    PYTHONPATH=. python -m benchmarks.tier_model [--machine configs/scale/aws_p5.yaml]
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Sequence

from benchmarks.scale_model import (CASES, Case, Machine, Prediction, build_manifest, build_targets, coarsening,
                                    count_plan, load_machine, predict)

# the cases planned whole, with this many decoder layers (a multiple of both layouts' stages)
TIER_CASES = {"70b-resume": 8, "405b-scale": 16}


def holders(case: Case, per_node: int, lost_node: int, replicas: int = 1) -> dict[str, list[int]]:
    """file -> the loaded job's ranks that hold a copy: the saving rank and its partners,
    less the lost node's (a rank keeps its id and node across the restart)."""
    from streamckpt.manage.tier.partners import topology

    topo = topology(case.saved.world, per_node)
    out: dict[str, list[int]] = {}
    for r in range(case.saved.world):
        keep = [k for k in (r, *topo.partners(r, replicas)) if k // per_node != lost_node]
        out[f"data/{r:05d}.safetensors"] = keep
    return out


def predict_tier(case: Case, m: Machine, lost_node: int = 1) -> tuple[Prediction, Prediction, dict[str, float]]:
    """(the bucket's resume, the tier's resume, what the tier read where) of ``case`` planned whole."""
    from streamckpt.plan.holders import constrain_readers
    from streamckpt.plan.planner import PlanOptions, build_plan

    manifest, targets = build_manifest(case), build_targets(case)
    ranks = range(case.loaded.world)
    scale = coarsening(case)
    options = PlanOptions(ranks_per_node=m.gpus_per_node)
    plan = build_plan(manifest, targets, options)
    bucket = predict(count_plan(plan, ranks, m.gpus_per_node, m.concurrency["streamckpt"],
                                m.request_bytes["streamckpt"], world=len(ranks)), m, "streamckpt", scale)
    held = {f: ks for f, ks in holders(case, m.gpus_per_node, lost_node).items() if ks}
    plan = build_plan(manifest, targets, options)
    constrain_readers(plan, held)
    counts = count_plan(plan, ranks, m.gpus_per_node, m.concurrency["streamckpt"], m.request_bytes["streamckpt"],
                        world=len(ranks), local_files=set(held))
    tier = predict(counts, m, "streamckpt", scale)
    local = sum(c.local for c in counts.cells.values()) * scale
    fetched = sum(c.fetched for c in counts.cells.values()) * scale
    lost = [f for f, ks in holders(case, m.gpus_per_node, lost_node).items() if not ks]
    return bucket, tier, {"local_GB": local / 1e9, "bucket_GB": fetched / 1e9, "files_lost": len(lost)}


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Predict a resume from the memory/peer tier at scale.")
    ap.add_argument("cases", nargs="*", default=list(TIER_CASES), help=f"of {', '.join(TIER_CASES)}")
    ap.add_argument("--machine", default="configs/scale/aws_p5.yaml")
    ap.add_argument("--local-gbytes", type=float, default=None,
                    help="a node's local read bandwidth in GB/s (default: the machine file's node.local_read_GBps)")
    args = ap.parse_args(argv)
    m = load_machine(args.machine)
    if args.local_gbytes is not None:
        m = dataclasses.replace(m, local_Bps=args.local_gbytes * 1e9)
    if not m.local_Bps:
        raise SystemExit(f"{args.machine} has no node.local_read_GBps: pass --local-gbytes")
    print("| case | node-local read GB/s | bucket resume s (bottleneck) | tier resume s (bottleneck) | ratio "
          "| tier: GB from local copies / from the bucket | inter-node sent GB (max rank): bucket, tier |")
    print("|---|---|---|---|---|---|---|")
    for key in args.cases:
        case = dataclasses.replace(CASES[key], stages=None, layers=TIER_CASES[key])
        t0 = time.perf_counter()
        bucket, tier, where = predict_tier(case, m)
        print(f"| {key} | {m.local_Bps / 1e9:g} | {bucket.seconds:.1f} ({bucket.bottleneck}) | {tier.seconds:.1f} "
              f"({tier.bottleneck}) | {tier.seconds / bucket.seconds:.2f} | {where['local_GB']:.0f} / "
              f"{where['bucket_GB']:.0f} | {bucket.max_inter_sent_GB_per_rank:.2f}, "
              f"{tier.max_inter_sent_GB_per_rank:.2f} |", flush=True)
        print(f"<!-- {key}: planned {case.loaded.world} ranks with {case.layers} layers in "
              f"{time.perf_counter() - t0:.0f} s; terms bucket {bucket.terms}, tier {tier.terms} -->", flush=True)


if __name__ == "__main__":
    main()
