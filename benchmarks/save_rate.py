"""PUTs per second on one key prefix when thousands of ranks save (issue 37, item 4).

A save writes each rank's share as data files of about ``object_bytes_for(ranks)`` (8 MiB up
to 255 ranks, doubling at 256, 512 and 1,024 to 64 MiB), one PUT each, ``UPLOAD_BUFFERS`` (4)
filled or in flight per rank (``streamckpt.saving.writer``; ``STREAMCKPT_UPLOAD_OBJECT_BYTES`` /
``STREAMCKPT_UPLOAD_BUFFERS``); the PUTs of every
rank land on the checkpoint's one key prefix, which S3 serves at 3,500 PUT/s before it
answers SlowDown (``configs/scale/aws_p5.yaml``,
``store.prefix_put_per_s``). This takes the checkpoints of ``scale_model``'s cases
(``build_manifest``: the saved layout's stored bytes; coarsened cases scaled up to the
whole model), spreads their bytes over the saving ranks as the saver does (replicated
tensors written once, each rank about the same bytes), and predicts the upload time
of the slowest rank from the same machine figures as the load model: per-connection
throughput and first-byte latency, a node's store bandwidth. Then: PUTs per second on
the prefix, and the time the prefix limit alone would take. Pure arithmetic.

    PYTHONPATH=. python -m benchmarks.save_rate            # every case, the saver's default sizes
    PYTHONPATH=. python -m benchmarks.save_rate --object-mib 8    # STREAMCKPT_UPLOAD_OBJECT_BYTES=8MiB
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from benchmarks.scale_model import CASES, Case, Machine, build_manifest, coarsening, flatten, load_machine

MiB = 1 << 20
GB = 1e9


@dataclass(frozen=True)
class SavePrediction:
    case: str
    ranks: int  # saving ranks = data files
    stored_GB: float  # the whole checkpoint
    object_MiB: int
    puts: int  # every rank's PUTs (one per data file) and the manifest
    seconds: float  # the slowest rank's upload, ignoring the prefix limit
    puts_per_s: float  # on the prefix, over that time
    prefix_seconds: float  # puts ÷ the per-prefix PUT limit: the save can take no less

    @property
    def bound(self) -> str:
        return "S3 prefix PUT rate" if self.prefix_seconds > self.seconds else "upload bandwidth/latency"


def predict_save(key: str, case: Case, m: Machine, put_limit: float, obj: int, in_flight: int) -> SavePrediction:
    """Every rank uploads ``stored / ranks`` bytes as ``obj``-byte objects, ``in_flight`` at a time,
    each costing one first-byte latency and its bytes at the per-connection rate (the node's
    store bandwidth shared by its GPUs caps the sum)."""
    stored = sum(build_manifest(case).files.values()) * coarsening(case)
    ranks = case.saved.world
    per_rank = math.ceil(stored / ranks)
    files = max(1, -(-per_rank // obj))
    rate = min(in_flight * m.conn_Bps, m.node_store_Bps / m.gpus_per_node)
    seconds = math.ceil(files / in_flight) * m.first_byte_s + per_rank / rate
    puts = ranks * files + 1
    return SavePrediction(key, ranks, stored / GB, obj // MiB, puts, seconds, puts / seconds, puts / put_limit)


def table(rows: Sequence[SavePrediction]) -> str:
    lines = ["| case | saving ranks | stored GB | object MiB | PUTs (job) | upload s (slowest rank) | PUT/s on the prefix "
             "| s at 3,500 PUT/s | bound |", "|---|---|---|---|---|---|---|---|---|"]
    for p in rows:
        lines.append(f"| {p.case} | {p.ranks} | {p.stored_GB:.0f} | {p.object_MiB} | {p.puts} | {p.seconds:.1f} | "
                     f"{p.puts_per_s:,.0f} | {p.prefix_seconds:.1f} | {p.bound} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    import argparse
    from pathlib import Path

    import yaml

    from streamckpt.saving.writer import UPLOAD_BUFFERS, object_bytes_for

    ap = argparse.ArgumentParser(description="Predict saves' PUT rate per key prefix at scale.")
    ap.add_argument("cases", nargs="*", default=list(CASES), help=f"of {', '.join(CASES)}")
    ap.add_argument("--machine", default="configs/scale/aws_p5.yaml")
    ap.add_argument("--object-mib", type=int, default=0,
                    help="data object size (default 0: the saver's default for the case's ranks, object_bytes_for)")
    args = ap.parse_args(argv)
    m = load_machine(args.machine)
    put_limit = flatten(yaml.safe_load(Path(args.machine).read_text()))["store.prefix_put_per_s"]["value"]
    rows = [predict_save(k, CASES[k], m, put_limit, args.object_mib * MiB or object_bytes_for(CASES[k].saved.world),
                         UPLOAD_BUFFERS) for k in args.cases]
    print(table(rows))


if __name__ == "__main__":
    main()
