"""Bytes read for slices that cut rows (column slices, row slices of transposed targets).

Not a timing: it prints ``LoadResult.bytes_read / bytes_needed`` (and, for several ranks,
bytes sent and received) for loads from streamckpt's embedded moto S3 server
(``streamckpt.testing.LocalS3``), each loaded tensor compared element by element. Run it
from the repository root::

    PYTHONPATH=$PWD python -m benchmarks.colslice            # one process, then 4 gloo ranks
    PYTHONPATH=$PWD python -m benchmarks.colslice --world 0  # one process only

One process loads, from a checkpoint of four 2048 x 1024 fp32 matrices (8 MiB each,
rows of 4 KiB, checksum chunks of 16 KiB) and one 8 x 524288 fp32 matrix (16 MiB, rows of
2 MiB): 1/8 of the rows, 1/8 of the columns, and 1/8 of the rows of the transposed
matrices (``transpose`` rule: 1024 x 2048 targets). Then ``--world`` ranks each load
1/world of the columns of the four matrices with ``read_once=True`` and with
``read_once=False``.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

NARROW = [f"w{i}" for i in range(4)]  # 2048 x 1024 fp32: 4 KiB rows
WIDE = "wide"  # 8 x 524288 fp32: 2 MiB rows
PARTS = 8


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {k: torch.randn(2048, 1024, generator=g) for k in NARROW}
    out[WIDE] = torch.randn(8, 1 << 19, generator=g)
    return out


def _slice(full: torch.Tensor, dim: int, part: int, parts: int) -> tuple[torch.Tensor, list[int]]:
    n = full.shape[dim] // parts
    offset = [0] * full.dim()
    offset[dim] = part * n
    return full.narrow(dim, part * n, n).contiguous(), offset


def _load(keys: list[str], dim: int, part: int, parts: int, uri: str, opts: dict[str, Any],
          transposed: bool = False, read_once: bool = True) -> Any:
    import streamckpt as sc

    full = _tensors()
    targets: dict[str, Any] = {}
    expected: dict[str, torch.Tensor] = {}
    rules = []
    for k in keys:
        src = full[k]
        if transposed:
            rules.append({"transpose": {"from": k, "to": f"{k}T"}})
            src, k = src.t().contiguous(), f"{k}T"
        exp, offset = _slice(src, dim, part, parts)
        targets[k] = sc.ShardedTensor(torch.zeros_like(exp), tuple(src.shape), offset)
        expected[k] = exp
    res = sc.load(targets, uri, storage_options=opts, strict=False, read_once=read_once,
                  transforms=rules or None)
    ok = all(torch.equal(targets[k].local_tensor, v) for k, v in expected.items())
    return res, ok


def _rank(rank: int, world: int, uri: str, opts: dict[str, Any], read_once: bool) -> dict[str, Any]:
    res, ok = _load(NARROW, 1, rank, world, uri, opts, read_once=read_once)
    return {"needed": res.bytes_needed, "read": res.bytes_read, "sent": res.bytes_sent,
            "received": res.bytes_received, "requests": res.requests, "ok": ok}


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4, help="ranks for the multi-rank part (0: skip it)")
    args = ap.parse_args()

    import streamckpt as sc
    from streamckpt.spawn import run_ranks
    from streamckpt.storage import Storage
    from streamckpt.testing import LocalS3

    with LocalS3() as s3:
        s3.make_bucket("colslice")
        opts = s3.storage_options
        uri = "s3://colslice/ckpt"
        sc.save(_tensors(), uri, storage_options=opts)
        st = Storage(uri, opts)
        manifest = json.loads(st.read_bytes("manifest.json"))
        st.close()
        for k, t in manifest["tensors"].items():
            shards = t["shards"]
            print(f"stored {k}: {t['shape']} {t['dtype']}, {len(shards)} shard(s) of {shards[0]['shape']}, "
                  f"checksum chunk {shards[0]['chunk_size'] // 1024} KiB")
        print(f"one process, part 3 of {PARTS}:")
        print(f"{'tensors':<22} {'slice':<28} {'needed':>10} {'read':>10} {'read/needed':>11} {'requests':>8}  ok")
        cases = [
            ("4 x 2048x1024 fp32", "rows (dim 0)", NARROW, 0, False),
            ("4 x 2048x1024 fp32", "columns (dim 1)", NARROW, 1, False),
            ("4 x 2048x1024 fp32", "rows of the transposed", NARROW, 0, True),
            ("8 x 524288 fp32", "columns (dim 1)", [WIDE], 1, False),
        ]
        for name, what, keys, dim, transposed in cases:
            res, ok = _load(keys, dim, 3, PARTS, uri, opts, transposed=transposed)
            print(f"{name:<22} {what:<28} {_mib(res.bytes_needed):>10} {_mib(res.bytes_read):>10} "
                  f"{res.bytes_read / res.bytes_needed:>11.2f} {res.requests:>8}  {ok}")
        if args.world > 0:
            print(f"\n{args.world} gloo ranks, each 1/{args.world} of the columns of the 4 x 2048x1024 fp32 "
                  f"(32 MiB stored):")
            for read_once in (True, False):
                outs = run_ranks(_rank, args.world, (uri, opts, read_once), timeout=300)
                bad = [o.error for o in outs if not o.ok]
                if bad:
                    raise SystemExit(bad[0])
                vals = [o.value for o in outs]
                for r, v in enumerate(vals):
                    print(f"  read_once={read_once!s:<5} rank {r}: needed {_mib(v['needed'])}, read {_mib(v['read'])}, "
                          f"sent {_mib(v['sent'])}, received {_mib(v['received'])}, requests {v['requests']}, "
                          f"ok {v['ok']}")
                need = sum(v["needed"] for v in vals)
                read = sum(v["read"] for v in vals)
                print(f"  read_once={read_once}: all ranks read {_mib(read)} for {_mib(need)} needed "
                      f"({read / need:.2f}x)")


if __name__ == "__main__":
    main()
