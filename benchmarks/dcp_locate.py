"""How many bytes exact locating of DCP items reads, tensor data included.

Not a timing. Writes a PyTorch DCP checkpoint from one process into a temporary
directory (local files: the counts do not depend on the store) with items of several
sizes, then fetches the locating windows as ``sc.inspect`` / ``sc.load_full`` / a
fallback do (``formats.dcpitem.RangeCache.prefetch`` of ``_locating_windows``: each
item's first ``HEAD_BYTES`` and last ``TAIL_BYTES``, merged across gaps up to
``MAX_GAP``) and prints, per item size, the requests and bytes read against the
items' own bytes. Run it from the repository root::

    PYTHONPATH=$PWD python -m benchmarks.dcp_locate
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

import torch

SIZES = {"norm 1024 fp32 (4 KiB)": (1024,), "16 x 256 fp32 (16 KiB)": (16, 256),
         "64 x 256 fp32 (64 KiB)": (64, 256), "256 x 256 fp32 (256 KiB)": (256, 256)}
N = 12  # items of each size, in one checkpoint each


def main() -> None:
    import torch.distributed.checkpoint as dcp

    from streamckpt.formats import dcpitem, dcpmeta
    from streamckpt.storage import Storage

    print(f"HEAD_BYTES {dcpitem.HEAD_BYTES}, TAIL_BYTES {dcpitem.TAIL_BYTES}, MAX_GAP {dcpitem.MAX_GAP}")
    print(f"{'items':<28} {'item bytes':>11} {'tensor bytes':>13} {'requests':>8} {'bytes read':>11} "
          f"{'read/items':>10}")
    for name, shape in SIZES.items():
        g = torch.Generator().manual_seed(0)
        state = {f"t{i}": torch.randn(shape, generator=g) for i in range(N)}
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "ck"
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.save(state, checkpoint_id=str(path))
            md = dcpmeta.parse_metadata((path / ".metadata").read_bytes(), where="bench")
            storage = Storage(str(path))
            cache = dcpitem.RangeCache(storage)
            cache.prefetch(dcpitem._locating_windows(md))
            items = [it for t in md.tensors.values() for _, _, it in t.chunks]
            for k, t in md.tensors.items():
                dcpitem.locate_tensor(cache, t.chunks[0][2], where=k)  # served from the windows
            storage.close()
        item_bytes = sum(it.length for it in items)
        tensor_bytes = N * 4 * int(torch.tensor(shape).prod())
        print(f"{N} x {name:<23} {item_bytes:>11} {tensor_bytes:>13} {cache.requests:>8} {cache.bytes_read:>11} "
              f"{cache.bytes_read / item_bytes:>10.2f}")


if __name__ == "__main__":
    main()
