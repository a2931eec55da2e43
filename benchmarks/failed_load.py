"""What a load that fails on a corrupt stored chunk leaves in its targets.

Not a timing. Saves one 1024 x 1024 fp32 matrix to streamckpt's embedded moto S3 server
(``streamckpt.testing.LocalS3``), flips one bit of one element in the stored data file
(the manifest and its CRC32C list unchanged), then loads it twice into zeroed targets:
the whole matrix (a read that lands straight in the target and is verified there) and a
column slice (a read that is staged, verified, then scattered). Each load raises
``CorruptCheckpointError``; the script prints what the target holds afterwards. Run it
from the repository root::

    PYTHONPATH=$PWD python -m benchmarks.failed_load
"""

from __future__ import annotations

import json

import torch

ROWS = COLS = 1024
ROW, COL = 700, 300  # the element whose stored bytes get a flipped bit


def main() -> None:
    import s3fs

    import streamckpt as sc
    from streamckpt.testing import LocalS3

    g = torch.Generator().manual_seed(0)
    w = torch.randn(ROWS, COLS, generator=g)
    with LocalS3() as s3:
        s3.make_bucket("failed")
        opts = s3.storage_options
        uri = "s3://failed/ckpt"
        sc.save({"w": w}, uri, storage_options=opts)
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **opts)
        shard = json.loads(fs.cat("failed/ckpt/manifest.json"))["tensors"]["w"]["shards"][0]
        path = f"failed/ckpt/{shard['file']}"
        data = bytearray(fs.cat(path))
        at = shard["byte_offset"] + (ROW * COLS + COL) * 4 + 1  # a mantissa byte of w[ROW, COL]
        data[at] ^= 0x10
        fs.pipe(path, bytes(data))
        print(f"flipped bit 4 of byte {at} of {shard['file']} (w[{ROW}, {COL}]; "
              f"checksum chunk {shard['chunk_size'] // 1024} KiB)")

        cases = [
            ("whole matrix (lands in the target)", torch.zeros(ROWS, COLS), w, None),
            ("columns [256, 384) (staged)", torch.zeros(ROWS, 128), w[:, 256:384], (ROWS, COLS)),
        ]
        for name, target, expected, global_shape in cases:
            t = target if global_shape is None else sc.ShardedTensor(target, global_shape, (0, 256))
            try:
                sc.load({"w": t}, uri, storage_options=opts)
                outcome = "returned"
            except sc.CheckpointError as e:
                outcome = f"raised {type(e).__name__}"
            wrong = (target != expected) & (target != 0)
            print(f"{name}: load {outcome}; target elements equal to the checkpoint's: "
                  f"{int((target == expected).sum())} of {target.numel()}, still zero: {int((target == 0).sum())}, "
                  f"holding a value the checkpoint does not have: {int(wrong.sum())}")
            for r, c in wrong.nonzero().tolist()[:3]:
                print(f"    [{r}, {c}] = {target[r, c].item()!r} (stored {expected[r, c].item()!r})")


if __name__ == "__main__":
    main()
