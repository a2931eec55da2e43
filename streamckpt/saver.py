"""One ``save`` on one rank: decide who writes what, stream data files, commit.

Each distinct stored region is written once, by the lowest rank holding it;
every writing rank streams its own data file; rank 0 gathers the shard records,
validates the whole manifest (shards must tile every tensor exactly) and writes
``manifest.json`` last. Every step ends in failure agreement, so ``save``
returns on every rank only after the commit, or raises on every rank.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Mapping

from . import manifest as mf
from .comm import GroupComm, SoloComm, encode_error, raise_agreed
from .cudaapi import CudaApi, TorchCuda
from .device import cuda_devices
from .errors import CheckpointError, CheckpointExistsError, CorruptCheckpointError, IncompatibleStateDictError
from .results import SaveResult
from .storage import Storage
from .targets import TargetSpec, collect
from .writer import DEFAULT_CHUNK_SIZE, ShardToWrite, write_data_file

log = logging.getLogger(__name__)

COMPRESSIONS = (None, "zstd")


def _data_name(rank: int, compression: str | None) -> str:
    return f"data/{rank:05d}.{'zst' if compression else 'safetensors'}"


def _owners(all_specs: list[list[TargetSpec]]) -> dict[TargetSpec, int]:
    """The lowest rank holding each distinct region; global shapes/dtypes must agree."""
    owner: dict[TargetSpec, int] = {}
    seen: dict[str, tuple[tuple[int, ...], str, int]] = {}
    for rank, specs in enumerate(all_specs):
        for s in specs:
            prev = seen.setdefault(s.key, (s.global_shape, s.dtype, rank))
            if prev[:2] != (s.global_shape, s.dtype):
                raise IncompatibleStateDictError(
                    f"{s.key}: rank {prev[2]} holds global shape {list(prev[0])} {prev[1]}, rank {rank} "
                    f"holds {list(s.global_shape)} {s.dtype}"
                )
            owner.setdefault(s, rank)
    return owner


def _check_layout(owner: dict[TargetSpec, int]) -> None:
    """The distinct regions of every tensor must tile it exactly once."""
    by_key: dict[str, list[TargetSpec]] = {}
    for spec in owner:
        by_key.setdefault(spec.key, []).append(spec)
    for key, specs in by_key.items():
        try:
            mf.check_tiling(specs[0].global_shape, [(sp.box, sp.flat_range) for sp in specs], f"tensor {key!r}:")
        except CorruptCheckpointError as e:
            holders = sorted({owner[sp] for sp in specs})
            raise IncompatibleStateDictError(
                f"the ranks' shards do not form a valid checkpoint: {e} (held by ranks {holders[:16]}); every "
                f"element of every tensor must be held by some rank, and distinct shards may not overlap"
            ) from None


def _gather_json(comm: SoloComm | GroupComm, doc: Any, own: BaseException | None) -> list[Any]:
    if isinstance(comm, SoloComm):
        if own is not None:
            raise own
        return [doc]
    payload = {"error": encode_error(own, comm.rank)} if own is not None else {"ok": doc}
    got = [json.loads(b) for b in comm.all_gather_bytes(json.dumps(payload).encode())]
    failures = [g["error"] for g in got if "error" in g]
    if failures:
        raise_agreed(failures, own)
    return [g["ok"] for g in got]


def run_save(
    comm: SoloComm | GroupComm,
    storage: Storage,
    state_dict: Mapping[str, Any],
    *,
    compression: str | None,
    metadata: dict[str, Any] | None,
    overwrite: bool,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    cuda: CudaApi | None = None,
) -> SaveResult:
    t0 = time.perf_counter()
    own: BaseException | None = None
    specs: list[TargetSpec] = []
    local = []
    values: dict[str, Any] = {}
    try:
        if compression not in COMPRESSIONS:
            raise CheckpointError(f"compression={compression!r} is not supported (use None or 'zstd')")
        if metadata is not None:
            try:
                json.dumps(metadata, allow_nan=False)
            except (TypeError, ValueError) as e:
                raise CheckpointError(f"metadata must be a JSON-serializable dict ({e})") from None
        targets, slots = collect(state_dict, for_save=True)
        comm.prefer_device(cuda_devices(cuda or TorchCuda(), (t.tensor for t in targets)))
        local = targets
        specs = [t.spec for t in targets]
        values = {v.key: v.value for v in slots}
        if comm.rank == 0:
            if storage.exists(mf.MANIFEST_NAME):
                if not overwrite:
                    raise CheckpointExistsError(
                        f"{storage.describe(mf.MANIFEST_NAME)} exists: a committed checkpoint is there; "
                        f"pass overwrite=True to replace it"
                    )
                storage.delete(mf.MANIFEST_NAME)  # uncommit first: old data files are about to change
    except CheckpointError as e:
        own = e
    gathered = _gather_json(comm, [s.to_json() for s in specs], own)
    all_specs = [[TargetSpec.from_json(v) for v in g] for g in gathered]

    result = SaveResult(uri=storage.describe(""))
    records: list[tuple[str, mf.Shard]] = []
    files: dict[str, int] = {}
    try:
        owner = _owners(all_specs)
        _check_layout(owner)  # before any upload: a bad layout leaves no orphaned data files
        mine = [ShardToWrite(t.spec, t.tensor) for t in local if owner[t.spec] == comm.rank]
        if mine:
            name = _data_name(comm.rank, compression)
            records, size = write_data_file(storage, name, mine, compression=compression, chunk_size=chunk_size, cuda=cuda)
            files[name] = size
            result.files.append(name)
            result.bytes_written += size
    except CheckpointError as e:
        own = e
    doc = {"files": files, "records": [[k, json.loads(json.dumps(mf._shard_doc(s)))] for k, s in records]}
    per_rank = _gather_json(comm, doc, own)

    try:
        if comm.rank == 0:
            manifest = _assemble(all_specs, per_rank, values, metadata or {}, storage)
            blob = mf.to_json(manifest)
            storage.write_bytes(mf.MANIFEST_NAME, blob)
            result.files.append(mf.MANIFEST_NAME)
            result.bytes_written += len(blob)
            _remove_stale(storage, manifest)
    except CheckpointError as e:
        own = e
    comm.agree(own)
    result.seconds = time.perf_counter() - t0
    if comm.rank == 0:
        log.info("streamckpt save %s: %d files, %.3f s", storage.describe(""), len(result.files), result.seconds)
    return result


def _assemble(
    all_specs: list[list[TargetSpec]], per_rank: list[Any], values: dict[str, Any],
    metadata: dict[str, Any], storage: Storage,
) -> mf.Manifest:
    shapes: dict[str, tuple[tuple[int, ...], str]] = {}
    for specs in all_specs:
        for s in specs:
            shapes.setdefault(s.key, (s.global_shape, s.dtype))
    shards: dict[str, list[mf.Shard]] = {k: [] for k in shapes}
    files: dict[str, int] = {}
    parser = mf._Parser("save")
    for doc in per_rank:
        files.update(doc["files"])
        for key, sdoc in doc["records"]:
            shards[key].append(parser.shard(sdoc, f"tensors.{key}", len(shapes[key][0])))
    tensors = {
        k: mf.TensorMeta(dtype=dt, shape=shape, shards=tuple(sorted(shards[k], key=lambda s: (s.offset, s.flat_range or (0, 0)))))
        for k, (shape, dt) in shapes.items()
    }
    manifest = mf.Manifest(tensors=tensors, files=files, values=values, metadata=metadata)
    try:
        mf.validate(manifest, where=f"save to {storage.describe('')}")
    except CorruptCheckpointError as e:
        raise IncompatibleStateDictError(
            f"the ranks' shards do not form a valid checkpoint: {e} (every element of every tensor must "
            f"be held by some rank, and distinct shards may not overlap)"
        ) from None
    return manifest


def _remove_stale(storage: Storage, manifest: mf.Manifest) -> None:
    """Best effort: drop data files of an overwritten checkpoint that are no longer listed."""
    try:
        for name in storage.list("data"):
            if name not in manifest.files and not name.endswith(".tmp"):
                storage.delete(name)
    except CheckpointError as e:  # pragma: no cover - best effort
        log.warning("could not remove stale files under %s: %s", storage.describe("data"), e)
