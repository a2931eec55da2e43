"""Merge any checkpoint streamckpt reads into a Hugging Face safetensors layout.

Output: ``model-00001-of-0000N.safetensors`` files of at most ``max_shard_bytes``
of tensor data each (a tensor larger than that gets a file of its own) and
``model.safetensors.index.json`` (``metadata.total_size``, ``weight_map``),
written last so a reader never sees an index naming missing files.

Streamed: every shape and dtype is known from the manifest, so each file's
header is written first and the tensors follow in header order. Tensors are
fetched in batches of at most ``memory_budget`` bytes, and a tensor larger than
that is fetched as consecutive flat ranges, so peak memory is about two budgets
(the batch plus the loader's staging) whatever the checkpoint or tensor size.
With a process group, ranks split the output files (balanced by bytes) and
rank 0 writes the index once every rank has committed its files.

(The module is not called ``merge``: importing ``streamckpt.merge`` would
replace the public function ``streamckpt.merge`` with the module.)
"""

from __future__ import annotations

import json
import logging
import math
import struct
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch

from .comm import SoloComm, make_comm
from .core import dtypes
from .core.manifest import Manifest
from .core.sharded import ShardedTensor
from .core.targets import collect
from .errors import CheckpointError
from .loading.loader import share_manifest
from .loading.pipeline import Destinations, Executor
from .plan.planner import IdentityView, PlanOptions, build_plan
from .storage import Storage
from .storage.store import out_options

log = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"
HEADER_ALIGN = 8  # safetensors pads the JSON header with spaces to this multiple


@dataclass(frozen=True, slots=True)
class OutFile:
    """One output file: its name and the tensors it holds, in order."""

    name: str
    keys: tuple[str, ...]
    nbytes: int


@dataclass(slots=True)
class MergeResult:
    """What this rank did (``streamckpt.merge`` itself returns None)."""

    files: list[str] = field(default_factory=list)  # every output file, all ranks
    written: list[str] = field(default_factory=list)  # the files this rank wrote
    total_size: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    requests: int = 0
    seconds: float = 0.0


# ------------------------------------------------------------------ planning


def file_name(i: int, n: int) -> str:
    """Hugging Face's shard naming (1-based, five digits)."""
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def select_keys(manifest: Manifest, skip: Sequence[str]) -> list[str]:
    """The manifest's tensors in order, less those whose name ends with a ``skip`` suffix."""
    suffixes = tuple(skip)
    return [k for k in manifest.tensors if not (suffixes and k.endswith(suffixes))]


def split_files(manifest: Manifest, keys: Sequence[str], max_shard_bytes: int) -> list[OutFile]:
    """Greedy in key order: a new file starts when the next tensor would overflow."""
    if max_shard_bytes <= 0:
        raise CheckpointError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    groups: list[list[str]] = []
    sizes: list[int] = []
    for k in keys:
        n = manifest.tensors[k].nbytes
        if not groups or (sizes[-1] + n > max_shard_bytes and groups[-1]):
            groups.append([])
            sizes.append(0)
        groups[-1].append(k)
        sizes[-1] += n
    return [OutFile(file_name(i, len(groups)), tuple(g), s) for i, (g, s) in enumerate(zip(groups, sizes))]


def assign_files(files: Sequence[OutFile], world: int) -> list[list[int]]:
    """File indices per rank: largest first to the least-loaded rank (deterministic)."""
    load = [0] * world
    out: list[list[int]] = [[] for _ in range(world)]
    for i in sorted(range(len(files)), key=lambda i: (-files[i].nbytes, i)):
        r = min(range(world), key=lambda r: (load[r], r))
        out[r].append(i)
        load[r] += files[i].nbytes
    return [sorted(x) for x in out]


def header_bytes(manifest: Manifest, keys: Sequence[str], metadata: dict[str, str] | None = None) -> bytes:
    """The 8-byte length and the space-padded JSON header of one output file."""
    doc: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
    pos = 0
    for k in keys:
        t = manifest.tensors[k]
        doc[k] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [pos, pos + t.nbytes]}
        pos += t.nbytes
    raw = json.dumps(doc, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-(8 + len(raw)) % HEADER_ALIGN)
    return struct.pack("<Q", len(raw)) + raw


def index_bytes(files: Sequence[OutFile], total_size: int) -> bytes:
    weight_map = {k: f.name for f in files for k in f.keys}
    doc = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    return (json.dumps(doc, indent=2) + "\n").encode("utf-8")


@dataclass(frozen=True, slots=True)
class Piece:
    """Elements ``[start, stop)`` of a tensor's row-major flattening."""

    key: str
    start: int
    stop: int
    whole: bool


def pieces(manifest: Manifest, keys: Sequence[str], budget: int) -> Iterator[list[Piece]]:
    """Batches of pieces in output order, each batch at most ``budget`` bytes
    (a batch always holds at least one element), never one key twice."""
    batch: list[Piece] = []
    used = 0
    for k in keys:
        t = manifest.tensors[k]
        numel, size = math.prod(t.shape), t.itemsize
        if numel == 0:
            continue
        start = 0
        while start < numel:
            room = budget - used
            if room < size or any(p.key == k for p in batch):
                if batch:
                    yield batch
                batch, used, room = [], 0, budget
            stop = min(numel, start + max(1, room // size))
            batch.append(Piece(k, start, stop, start == 0 and stop == numel))
            used += (stop - start) * size
            start = stop
    if batch:
        yield batch


# ------------------------------------------------------------------- reading


def read_pieces(manifest: Manifest, storage: Storage, batch: Sequence[Piece],
                options: PlanOptions) -> tuple[list[torch.Tensor], int, int]:
    """Fetch one batch through the planner and pipeline (single process).
    Returns the pieces' tensors, bytes read and requests made."""
    state: dict[str, Any] = {}
    out: list[torch.Tensor] = []
    for p in batch:
        t = manifest.tensors[p.key]
        dt = dtypes.to_torch(t.dtype)
        if p.whole:
            buf = torch.empty(t.shape, dtype=dt)
            state[p.key] = buf
        else:
            buf = torch.empty(p.stop - p.start, dtype=dt)
            state[p.key] = ShardedTensor(buf, t.shape, (0,) * len(t.shape), local_shape=t.shape,
                                         flat_range=(p.start, p.stop))
        out.append(buf)
    targets, _ = collect(state)
    plan = build_plan(manifest, [[t.spec for t in targets]], options, IdentityView(manifest))
    if plan.missing[0]:  # pragma: no cover - keys come from the manifest itself
        raise CheckpointError(f"internal: merge planned keys the checkpoint lacks: {plan.missing[0][:5]}")
    dest = Destinations({uid: t.tensor for uid, t in zip(plan.rank_targets[0], targets) if uid >= 0})
    with torch.no_grad():
        stats = Executor(plan, SoloComm(), storage, dest).run()
    return out, stats.bytes_read, stats.requests


def _raw(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


# ------------------------------------------------------------------- writing


def write_file(manifest: Manifest, storage: Storage, out: Storage, f: OutFile, options: PlanOptions,
               result: MergeResult, progress: Callable[[int], None] | None) -> None:
    """Stream one output file: header, then every tensor's bytes in header order."""
    with out.open_write(f.name) as up:
        head = header_bytes(manifest, f.keys)
        up.write(head)
        written = len(head)
        for batch in pieces(manifest, f.keys, max(1, options.memory_budget // 2)):
            tensors, nread, nreq = read_pieces(manifest, storage, batch, options)
            result.bytes_read += nread
            result.requests += nreq
            for t in tensors:
                up.write(_raw(t))
                written += t.numel() * t.element_size()
                if progress is not None and t.numel():
                    progress(t.numel() * t.element_size())
            del tensors
        expected = len(head) + f.nbytes
        if written != expected:  # pragma: no cover - pieces() covers every element
            raise CheckpointError(f"internal: wrote {written} bytes to {f.name}, expected {expected}")
    result.bytes_written += written
    result.written.append(f.name)
    log.info("merge: wrote %s (%d tensors, %d bytes)", out.describe(f.name), len(f.keys), written)


def merge(
    uri: str,
    out_uri: str,
    *,
    max_shard_bytes: int = 5 * 2**30,
    skip: Sequence[str] = (),
    storage_options: dict[str, Any] | None = None,
    out_storage_options: dict[str, Any] | None = None,
    process_group: Any = None,
    memory_budget: int = 256 * 2**20,
    progress: Callable[[int], None] | None = None,
) -> MergeResult:
    """Write the checkpoint at ``uri`` as a Hugging Face safetensors directory at
    ``out_uri``. Collective when a process group is given or initialized.

    ``out_storage_options`` default to ``storage_options``: an export writes to the store
    it read from (the same endpoint and keys) unless told otherwise, never to a default
    endpoint such as AWS's."""
    t0 = time.perf_counter()
    if isinstance(skip, str):
        skip = (skip,)
    comm = make_comm(process_group)
    opened: list[Storage] = []
    own: BaseException | None = None
    try:  # agreed before the first collective: a mistake on one rank must not leave the others waiting
        opened.append(Storage(uri, storage_options))
        opened.append(Storage(out_uri, out_options(out_uri, storage_options, out_storage_options)))
    except CheckpointError as e:
        own = e
    try:
        comm.agree(own)
    except BaseException:
        for st in opened:
            st.close()
        raise
    storage, out = opened
    result = MergeResult()
    try:
        manifest = share_manifest(comm, storage)
        own = None
        files: list[OutFile] = []
        try:
            if memory_budget <= 0:
                raise CheckpointError(f"memory_budget must be positive, got {memory_budget}")
            if out.entry is not None:
                raise CheckpointError(f"{out.describe(out.entry)} names one file; merge writes a directory: "
                                      f"pass its directory URI")
            same_store = out_storage_options is None or out_storage_options == storage_options
            if same_store and out.describe("") == storage.describe(""):
                raise CheckpointError(f"merge {storage.describe('')} into itself: pass another out_uri (the export "
                                      f"would be written among the files it reads)")
            keys = select_keys(manifest, skip)
            if not keys:
                raise CheckpointError(f"nothing to merge: {storage.describe('')} has no tensors left after skip={list(skip)}")
            files = split_files(manifest, keys, max_shard_bytes)
            result.files = [f.name for f in files]
            result.total_size = sum(f.nbytes for f in files)
            options = PlanOptions(memory_budget=storage.reserve_inflight(memory_budget))
            for i in assign_files(files, comm.world_size)[comm.rank]:
                write_file(manifest, storage, out, files[i], options, result, progress)
        except Exception as e:  # noqa: BLE001 - every rank must learn of any failure
            own = e
        comm.agree(own)  # every file is committed (or every rank raises)
        if comm.rank == 0:
            out.write_bytes(INDEX_NAME, index_bytes(files, result.total_size))
            log.info("merge: %d files, %d bytes of tensors -> %s", len(files), result.total_size, out.describe(""))
        comm.barrier()
    finally:
        storage.close()
        out.close()
    result.seconds = time.perf_counter() - t0
    return result
