"""Write the datasets saved by 4 ranks: ``python -m benchmarks.saver SPEC.json RANK``.

Each rank takes its row block of every tensor from the local hf files and saves
it as a DTensor ``Shard(0)`` on a 4-rank gloo mesh: with DCP (plain and with its
ZStandard extension) and with ``streamckpt.save`` (plain and ``compression="zstd"``),
all into the server's bucket folder on local disk.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from . import data
from .worker import dtensor_rows


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    rank = int(sys.argv[2])
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    world = int(spec["world"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    bucket_dir = Path(spec["bucket_dir"])
    model = data.spec_from_json(spec["model"])
    values = {t.name: x for t, x in data.rank_rows_from_hf(bucket_dir, model, rank, world)}
    sd = dtensor_rows(model, world, rank, values)
    todo = spec["datasets"]
    if "dcp_rows4" in todo:
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(bucket_dir / "dcp_rows4")))
    if "dcp_rows4_zstd" in todo:
        from torch.distributed.checkpoint._extension import ZStandard

        writer = dcp.FileSystemWriter(str(bucket_dir / "dcp_rows4_zstd"), _extensions=[ZStandard()])
        dcp.save(sd, storage_writer=writer)
    try:
        import streamckpt as sc
    except ImportError:
        sc = None
    if sc is not None and hasattr(sc, "save"):
        if "sc_rows4" in todo:
            sc.save(sd, (bucket_dir / "sc_rows4").as_uri(), overwrite=True)
        if "sc_rows4_zstd" in todo:
            sc.save(sd, (bucket_dir / "sc_rows4_zstd").as_uri(), compression="zstd", overwrite=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
