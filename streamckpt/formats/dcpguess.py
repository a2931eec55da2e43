"""A DCP manifest without locating every item first: one item exactly, the rest predicted.

Locating each item costs a small range read (its ZIP tail and the next item's
head) before any data moves. Here one *template* item is located exactly and
the layout it shows (``dcplayout``) predicts every other item's head, so every
tensor's byte offset. Items too large to predict (4 GiB or more) are located
exactly in the same batch. The manifest records the template under
``dcp.SPECULATION_KEY``: a load reads every predicted head it relies on with the
tensor data and compares it before returning (``streamckpt.formats.speculation``); on
any difference the load locates every item exactly and runs again.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable

from ..core.manifest import Shard, TensorMeta
from ..storage import Storage
from . import dcplayout
from .dcpitem import RangeCache, TensorRef, _directory, item_where, item_windows, located_shard, value_windows
from .dcpmeta import DcpMetadata, DcpTensor, ItemInfo

log = logging.getLogger(__name__)

Chunk = tuple[str, DcpTensor, tuple[int, ...], tuple[int, ...], ItemInfo]


def guess_tensors(cache: RangeCache, storage: Storage, md: DcpMetadata, parsed: dict[bytes, TensorRef],
                  meanwhile: Callable[[], None]) -> tuple[dict[str, TensorMeta], dict[str, Any]] | None:
    """Every tensor's shards (predicted where possible) and the manifest metadata that
    says how; None (before any read) when there is nothing to predict or (after
    reading the template) when the template is not torch's plain layout."""
    chunks = [(fqn, t, offs, sizes, item) for fqn, t in md.tensors.items() for offs, sizes, item in t.chunks]
    guessable = [c for c in chunks if dcplayout.predictable(c[1].dtype, c[3])]
    nonempty = [c for c in guessable if math.prod(c[3]) > 0]
    if not nonempty:
        return None
    # the fewest tensor bytes: its head and tail are one small read
    template = min(nonempty, key=lambda c: (math.prod(c[3]) * dcplayout.itemsize(c[1].dtype), c[4].length))
    exact = [c for c in chunks if not dcplayout.predictable(c[1].dtype, c[3])]
    windows = [w for c in (template, *exact) for w in item_windows(c[4])]
    cache.prefetch(windows + value_windows(md), meanwhile=meanwhile)
    learnt = _learn(cache, storage, template, parsed)
    if learnt is None:
        log.debug("DCP template item %s is not in the layout streamckpt predicts; locating every item",
                  item_where(storage, template[0], template[2], template[4]))
        return None
    heads: dict[tuple[str, tuple[int, ...]], bytes | None] = {}
    shards: dict[str, list[Shard]] = {fqn: [] for fqn in md.tensors}
    for fqn, t, offs, sizes, item in chunks:
        if not dcplayout.predictable(t.dtype, sizes):
            shards[fqn].append(located_shard(cache, storage, fqn, t, offs, sizes, item, parsed)[0])
            continue
        key = (t.dtype, sizes)
        if key not in heads:
            heads[key] = dcplayout.predict(learnt, t.dtype, sizes)
        head = heads[key]
        nbytes = math.prod(sizes) * dcplayout.itemsize(t.dtype)
        if head is None or len(head) + nbytes > item.length:
            return None  # cannot be torch's record of this tensor: locate exactly (and name the fault)
        shards[fqn].append(Shard(offset=offs, shape=sizes, file=item.file, byte_offset=item.offset + len(head),
                                 byte_length=nbytes, codec="raw", chunk_size=0))
    tensors = {fqn: TensorMeta(dtype=t.dtype, shape=t.shape, shards=tuple(shards[fqn])) for fqn, t in md.tensors.items()}
    return tensors, {"template": learnt.to_json()}


def _learn(cache: RangeCache, storage: Storage, c: Chunk, parsed: dict[bytes, TensorRef]) -> dcplayout.Template | None:
    """The template of chunk ``c``'s item, located exactly (a corrupt item raises here)."""
    fqn, t, offs, sizes, item = c
    _shard, loc = located_shard(cache, storage, fqn, t, offs, sizes, item, parsed)
    if loc.ref.storage_offset != 0 or loc.ref.storage_key != "0":
        return None
    where = item_where(storage, fqn, offs, item)
    entries = _directory(cache, item, where)
    names = [e.filename for e in entries]
    pkl = [n for n in names if n.endswith("/data.pkl") or n == "data.pkl"]
    if len(pkl) != 1:
        return None
    data_name = pkl[0][: -len("data.pkl")] + "data/0"
    head = cache.get(item.file, item.offset, loc.byte_offset)
    sizes_of = {e.filename: e.file_size for e in entries}
    return dcplayout.learn(head, sizes_of, pkl[0], data_name, loc.ref.dtype, loc.ref.size)
