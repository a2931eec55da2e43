"""One ``save`` on one rank: decide who writes what, upload data files, commit.

Each distinct stored region is written once, by one of the ranks holding it,
balanced by bytes (``writeplan``); every writing rank uploads its share as data files of a
bounded size, several at once (``writer.write_data_files``); rank 0 gathers the shard records,
validates the whole manifest (shards must tile every tensor exactly) and writes
``manifest.json`` last. Every step ends in failure agreement, so ``save``
returns on every rank only after the commit, or raises on every rank.

The manifest records the state's structure (``core.tree``) as rank 0 holds it, plus the
tensors only other ranks hold (pipeline stages): each rank sends the part of its tree
that reaches tensors rank 0 lacks, with its shard records.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, NoReturn, Sequence

from ..comm import (GroupComm, SoloComm, alone_in_launched_job, encode_error, gather_targets, raise_agreed,
                    warn_if_peers_late)
from ..core import manifest as mf, tree as trees, values as vals
from ..core.report import expect_total
from ..core.targets import LocalTarget, TargetSpec, collect
from ..cuda.device import cuda_devices
from ..cuda.runtime import CudaApi, TorchCuda
from ..errors import (CheckpointError, CheckpointExistsError, CheckpointNotFoundError, CorruptCheckpointError,
                      IncompatibleStateDictError)
from ..results import SaveResult
from ..storage import Storage
from ..storage.ratelimit import prefix_uri
from ..storage.uploads import delete_written
from . import putrate, writeplan
from .commitcheck import check_present
from .incremental import BaseShards, read_base, split
from .writer import DEFAULT_CHUNK_SIZE, ShardToWrite, UploadShape, write_data_files

log = logging.getLogger(__name__)

CANCELLED = "the save was cancelled (SaveHandle.cancel, or the process exiting with it in flight); nothing was committed"

COMPRESSIONS = (None, "zstd")

Guard = Callable[[str, "dict[str, Any] | None"], None]  # rank 0's check before replacing a committed checkpoint


def _data_name(rank: int, index: int, compression: str | None) -> str:
    return f"data/{rank:05d}-{index:04d}.{'zst' if compression else 'safetensors'}"


def _holds_data(storage: Storage) -> bool:
    """Whether data files lie under a prefix with no manifest (one LIST). A missing bucket is
    left for the first write to report, as a write."""
    try:
        return bool(storage.list("data"))
    except CheckpointNotFoundError:
        return False


def _check_layout(holders: dict[TargetSpec, list[int]], hint: str = "") -> None:
    """The distinct regions of every tensor must tile it exactly once (``hint``: appended to the error)."""
    by_key: dict[str, list[TargetSpec]] = {}
    for spec in holders:
        by_key.setdefault(spec.key, []).append(spec)
    for key, specs in by_key.items():
        try:
            mf.check_tiling(specs[0].global_shape, [(sp.box, sp.flat_range) for sp in specs], f"tensor {key!r}:")
        except CorruptCheckpointError as e:
            ranks = sorted({r for sp in specs for r in holders[sp]})
            raise IncompatibleStateDictError(
                f"the ranks' shards do not form a valid checkpoint: {e} (held by ranks {ranks[:16]}); every "
                f"element of every tensor must be held by some rank, and distinct shards may not overlap{hint}"
            ) from None


def to_write(items: list[writeplan.WriteItem], local: list[LocalTarget]) -> list[ShardToWrite]:
    """This rank's items with the tensors (or pieces of them) that hold their bytes."""
    tensors = {t.spec: t.tensor for t in local}
    return [ShardToWrite(it.spec, writeplan.piece_of(it, tensors[it.source])) for it in items]


def gather_json(comm: SoloComm | GroupComm, doc: Any, own: BaseException | None) -> list[Any]:
    """Every rank's ``doc``, or the agreed error on every rank."""
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


def same_call(comm: SoloComm | GroupComm, uri: str, call: str = "sc.save", **options: Any) -> None:
    """Every rank of a collective save names the same checkpoint and the same options, checked
    before rank 0 deletes or writes anything (its overwrite decides what it replaces): ranks given
    different URIs committed rank 0's manifest listing data files the others wrote elsewhere.
    One small all-gather; every rank reaches the same verdict from the same answers."""
    if isinstance(comm, SoloComm):
        return
    mine = {"uri": uri, **{k: v if v is None or isinstance(v, (bool, int, str)) else str(v) for k, v in options.items()}}
    with warn_if_peers_late(comm, call):  # the save's first collective: where a rank-0-only save waits
        every = gather_json(comm, mine, None)
    for rank, theirs in enumerate(every):
        differ = [k for k in every[0] if theirs.get(k) != every[0][k]]
        if differ:
            what = ", ".join(f"{k}={every[0][k]!r} on rank 0 but {theirs.get(k)!r} on rank {rank}" for k in differ)
            raise CheckpointError(f"a collective save got different arguments on different ranks: {what}; every rank "
                                  f"of the group must pass the same (nothing was written)")


def fail_together(comm: SoloComm | GroupComm, own: CheckpointError, call: str = "sc.save") -> NoReturn:
    """A rank whose save failed before the save's first collective (``same_call``: a bad
    argument, an unknown storage option) takes part in it with its error: every rank raises it."""
    with warn_if_peers_late(comm, call):
        gather_json(comm, None, own)
    raise own  # pragma: no cover - gather_json raised (alone: this error; in a group: the agreed one)


@dataclass
class Prepared:
    """A save after its first collective: every rank's specs, checked, and who writes what."""

    all_specs: list[list[TargetSpec]]
    items: list[writeplan.WriteItem]  # this rank's
    local: list[LocalTarget]
    values: dict[str, Any]
    tree: dict[str, Any]  # this rank's; on ranks other than 0 only what reaches tensors rank 0 lacks
    metadata: dict[str, Any]
    compression: str | None
    upload: UploadShape
    started: float = field(default_factory=time.perf_counter)
    base: BaseShards | None = None  # an incremental save's base: shards equal to its are referenced


def prepare(
    comm: SoloComm | GroupComm,
    storage: Storage,
    state_dict: Mapping[str, Any],
    *,
    compression: str | None,
    metadata: dict[str, Any] | None,
    overwrite: bool,
    max_item_bytes: int | None = None,
    cuda: CudaApi | None = None,
    base: str | None = None,
    storage_options: dict[str, Any] | None = None,
    guard: Guard | None = None,
    call: str = "sc.save",
    same: bool = True,
    first: Callable[[], None] | None = None,
) -> Prepared:
    """Validate, gather every rank's specs and assign writers; raises the agreed error on every rank.

    Items larger than a data file (``UploadShape.object_bytes``) or ``max_item_bytes`` are cut
    into pieces (row blocks or flat ranges), so that each fits one upload buffer (and a
    bounded staging buffer). ``cuda``: the CUDA runtime (a test's stand-in). ``base``: an
    incremental save's base checkpoint (rank 0 reads its manifest, every rank gets it);
    ``storage_options``: the base's (the save's own). ``guard(uri, storage_options)``: called
    on rank 0 before a committed checkpoint is replaced (``overwrite``), or when a fresh save
    finds data files under its prefix (a pruned base's shared files stay there), before
    anything is deleted; its ``CheckpointError`` fails the save on every rank (the wiring passes
    ``manage.references.check_unreferenced``: saving sits below manage). ``call``: the public
    call, as a rank that waits long for its peers names it. ``first``: the caller's step to run
    on every rank before the first collective of the specs, whose ``CheckpointError`` is agreed
    there (a local save's folder cleanup: no rank writes before every rank's is done).
    """
    t0 = time.perf_counter()
    own: BaseException | None = None
    upload = UploadShape()
    specs: list[TargetSpec] = []
    local: list[LocalTarget] = []
    values: dict[str, Any] = {}
    tree: dict[str, Any] = {}
    base_doc = b""
    base_manifest: mf.Manifest | None = None
    if same:
        same_call(comm, storage.describe(""), call, overwrite=overwrite, compression=compression, base=base)
    try:
        if first is not None:
            first()
        if storage.entry is not None:
            raise CheckpointError(
                f"{storage.describe(storage.entry)} names one file; a save writes a directory of files: "
                f"pass its directory URI, e.g. {storage.describe('')}"
            )
        if compression not in COMPRESSIONS:
            raise CheckpointError(f"compression={compression!r} is not supported (use None or 'zstd')")
        if metadata is not None:
            try:
                json.dumps(metadata, allow_nan=False)
            except (TypeError, ValueError) as e:
                raise CheckpointError(f"metadata must be a JSON-serializable dict ({e})") from None
        try:
            upload = UploadShape.from_env(comm.world_size)
        except ValueError as e:
            raise CheckpointError(f"upload settings: {e}") from None
        local, slots = collect(state_dict, for_save=True)
        comm.prefer_device(cuda_devices(cuda or TorchCuda(), (t.tensor for t in local)))
        specs = [t.spec for t in local]
        values = {v.key: vals.decode(vals.encode(v.value), where=v.key) for v in slots}  # a copy, as of now
        tree = trees.describe(state_dict)
        if comm.rank == 0:
            if storage.modified(mf.MANIFEST_NAME) is not None:  # one HEAD (exists() would also LIST)
                if not overwrite:
                    raise CheckpointExistsError(
                        f"{storage.describe(mf.MANIFEST_NAME)} exists: a committed checkpoint is there; "
                        f"pass overwrite=True to replace it"
                    )
                if guard is not None:  # its bytes may be a later incremental save's base
                    guard(storage.uri, storage_options)
                storage.delete(mf.MANIFEST_NAME)  # uncommit first: old data files are about to change
            elif guard is not None and _holds_data(storage):  # a pruned base's shared files stay here
                guard(storage.uri, storage_options)
            if base is not None:
                base_doc, base_manifest = read_base(storage.uri, str(base), storage_options)
    except CheckpointError as e:
        own = e
    all_specs = gather_targets(comm, specs, own, call)  # compact: distinct layouts travel once
    items: list[writeplan.WriteItem] = []
    try:
        _check_layout(writeplan.holders_of(all_specs), alone_in_launched_job(comm))  # before any upload: a bad layout leaves no orphans
        items = writeplan.assign(all_specs)[comm.rank]
        cap = min(upload.object_bytes, max_item_bytes or upload.object_bytes)
        items = [piece for it in items for piece in writeplan.split_item(it, cap)]
        if comm.rank != 0:
            tree = trees.only(tree, {s.key for s in specs} - {s.key for s in all_specs[0]})
    except CheckpointError as e:
        own = e
    comm.agree(own)
    shards = None
    if base is not None:
        doc = comm.broadcast_bytes(base_doc if comm.rank == 0 else None)
        shards = BaseShards.of(base_manifest, storage.uri, str(base)) if base_manifest is not None \
            else BaseShards.parse(doc, storage.uri, str(base))  # rank 0 parsed it already
    return Prepared(all_specs, items, local, values, tree, metadata or {}, compression, upload, t0, shards)


def write_and_commit(
    comm: SoloComm | GroupComm, storage: Storage, prep: Prepared, mine: Sequence[ShardToWrite], *,
    chunk_size: int = DEFAULT_CHUNK_SIZE, on_written: Callable[[int], None] | None = None,
    cuda: CudaApi | None = None, progress: Callable[[int], None] | None = None,
    cancelled: Callable[[], bool] | None = None,
) -> SaveResult:
    """Upload this rank's data files, gather the shard records, commit the manifest on rank 0.

    ``progress(nbytes)``: each object's size once stored (data files, then rank 0's manifest),
    so that its calls add up to ``SaveResult.bytes_written``. ``cancelled`` (an async save's)
    is asked after each shard and before the records are gathered: once it says yes, nothing
    is committed and this rank deletes what it wrote. Whenever the save fails before the
    commit, every rank deletes its own data files."""
    own: BaseException | None = None
    result = SaveResult(uri=storage.describe(""))
    records: list[tuple[str, mf.Shard]] = []
    files: dict[str, int] = {}
    refs: dict[str, int] = {}
    upload = list(range(len(mine)))
    digests: dict[int, str] = {}  # an incremental save's digests of uploads it hashed to compare
    upload_seconds = 0.0

    def written(i: int) -> None:
        if on_written is not None:
            on_written(upload[i])
        _check_cancelled(cancelled)

    try:
        if prep.base is not None:
            decided = split(mine, prep.base, prep.compression)
            upload, digests = decided.upload, decided.digests
            for i, key, shard in decided.reused:
                records.append((key, shard))
                refs[shard.file] = prep.base.sizes[shard.file]
                result.bytes_reused += shard.byte_length
                if on_written is not None:
                    on_written(i)
        if upload:
            t_upload = time.perf_counter()
            new, files = write_data_files(
                storage, lambda i: _data_name(comm.rank, i, prep.compression), [mine[i] for i in upload],
                compression=prep.compression, shape=prep.upload, chunk_size=chunk_size, on_written=written,
                cuda=cuda, progress=progress, digests=[digests.get(i) for i in upload])
            upload_seconds = time.perf_counter() - t_upload
            records += new
            result.files.extend(files)
            result.bytes_written += sum(files.values())
        _check_cancelled(cancelled)
    except CheckpointError as e:
        own = e
    doc = {"files": {**files, **refs}, "records": [[k, json.loads(json.dumps(mf._shard_doc(s)))] for k, s in records],
           "tree": prep.tree if comm.rank != 0 and prep.tree else None,
           "puts": len(files), "upload_us": round(upload_seconds * 1e6)}  # the job's PUT rate (putrate)
    try:
        per_rank = gather_json(comm, doc, own)
    except BaseException:
        discard(storage, list(files))  # no rank commits: this rank's data files are garbage now
        raise

    try:
        if comm.rank == 0:
            manifest = _assemble(prep.all_specs, per_rank, prep.values, merged_tree(prep, per_rank), prep.metadata,
                                 storage)
            blob = mf.to_json(manifest)
            expect_total(progress, len(blob))
            check_present(storage, manifest)
            storage.write_bytes(mf.MANIFEST_NAME, blob)
            result.files.append(mf.MANIFEST_NAME)
            result.bytes_written += len(blob)
            if progress is not None:
                progress(len(blob))
            _remove_stale(storage, manifest)
    except CheckpointError as e:
        own = e
    comm.agree(own)
    result.seconds = time.perf_counter() - prep.started
    _count_puts(comm, storage, result, per_rank, prep.upload)
    if comm.rank == 0:
        log.info("streamckpt save %s: %d files, %.3f s", storage.describe(""), len(result.files), result.seconds)
    return result


def merged_tree(prep: Prepared, per_rank: Sequence[Any]) -> Any:
    """Rank 0's tree of the state with the parts only other ranks hold (their gathered docs)."""
    tree = prep.tree
    for d in per_rank[1:]:
        if d.get("tree"):
            tree = trees.merge(tree, d["tree"])
    return tree


def _count_puts(comm: SoloComm | GroupComm, storage: Storage, result: SaveResult, per_rank: Sequence[Any],
                shape: UploadShape) -> None:
    """The job's PUTs on the checkpoint's data prefix into ``result``, from the shard records
    every rank gathered; rank 0 warns when they came faster than a prefix is served."""
    result.requests = len(result.files)
    job = putrate.job_puts(per_rank, prefix_uri(storage.uri, [storage.path("data/")]))
    result.job_requests = job.requests
    result.job_requests_per_s = job.per_second
    result.request_prefix = job.prefix
    if comm.rank == 0:
        warning = putrate.over_put_limit(job, putrate.put_limit(), shape)
        if warning:
            log.warning("streamckpt save %s: %s", storage.describe(""), warning)


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
    progress: Callable[[int], None] | None = None,
    base: str | None = None,
    storage_options: dict[str, Any] | None = None,
    guard: Guard | None = None,
) -> SaveResult:
    prep = prepare(comm, storage, state_dict, compression=compression, metadata=metadata, overwrite=overwrite,
                   cuda=cuda, base=base, storage_options=storage_options, guard=guard)
    mine = to_write(prep.items, prep.local)
    return write_and_commit(comm, storage, prep, mine, chunk_size=chunk_size, cuda=cuda, progress=progress)


def _assemble(
    all_specs: list[list[TargetSpec]], per_rank: list[Any], values: dict[str, Any], tree: dict[str, Any],
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
    bases = sorted({ref[0] for ref in map(mf.split_reference, files) if ref is not None})
    manifest = mf.Manifest(tensors=tensors, files=files, values=values, metadata=metadata, tree=tree,
                           committed_ns=time.time_ns(), bases=tuple(bases))
    try:
        mf.validate(manifest, where=f"save to {storage.describe('')}")
    except CorruptCheckpointError as e:
        raise IncompatibleStateDictError(
            f"the ranks' shards do not form a valid checkpoint: {e} (every element of every tensor must "
            f"be held by some rank, and distinct shards may not overlap)"
        ) from None
    return manifest


assemble = _assemble  # the manifest of gathered shard records (the local tier's too)


def _check_cancelled(cancelled: Callable[[], bool] | None) -> None:
    if cancelled is not None and cancelled():
        raise CheckpointError(CANCELLED)


def discard(storage: Storage, names: Sequence[str]) -> None:
    """Best effort: delete the data files of a save that will not commit."""
    delete_written(storage.delete, names, f"the save to {storage.describe('')}")


def _remove_stale(storage: Storage, manifest: mf.Manifest) -> None:
    """Best effort: drop data files of an overwritten checkpoint that are no longer listed."""
    try:
        for name in storage.list("data"):
            if name not in manifest.files and not name.endswith(".tmp"):
                storage.delete(name)
    except CheckpointError as e:  # pragma: no cover - best effort
        log.warning("could not remove stale files under %s: %s", storage.describe("data"), e)
