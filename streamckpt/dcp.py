"""``torch.distributed.checkpoint`` plug-ins: DCP plans, streamckpt moves the bytes.

Switch an existing DCP job to object storage with one argument::

    import torch.distributed.checkpoint as dcp
    from streamckpt.dcp import StorageReader, StorageWriter

    opts = {"endpoint_url": "http://127.0.0.1:9000", "key": "...", "secret": "..."}  # fsspec options
    dcp.save(state, storage_writer=StorageWriter("s3://bucket/ckpt/step-100", storage_options=opts))
    dcp.async_save(state, storage_writer=StorageWriter(uri, storage_options=opts))  # also works
    dcp.load(state, storage_reader=StorageReader("s3://bucket/ckpt/step-100", storage_options=opts))

``StorageWriter`` leaves a native streamckpt checkpoint (data files with a CRC32C per
chunk, ``manifest.json`` written last by the coordinator once every rank's upload
succeeded: a failed save commits nothing and an overwritten checkpoint stays valid until
the new manifest replaces it). It reads back with ``StorageReader`` and also with
``sc.load`` / ``sc.load_state`` / ``streamckpt verify`` (checksummed, resharded to any
layout). DCP's own ``FileSystemReader`` cannot read it: the layout is streamckpt's, not
``.metadata`` + ``.distcp``, so that no pickle is ever stored and every byte is checksummed.
DCP keeps its job: its planner deduplicates replicas and runs the plan's collectives.

``StorageReader`` reads a native, Hugging Face or DCP checkpoint at ``uri`` and fetches
only the byte ranges of each ``ReadItem``'s sub-box (checksummed checkpoints: the chunks
covering it, verified), under streamckpt's retries and timeouts. Of a DCP checkpoint it
locates one item exactly and predicts where the others' tensor bytes start, as ``sc.load``
does (``formats.dcpguess``); the predicted item heads it relies on are read with the data
(adjacent ranges of a file are one request) and compared before any item is handed to DCP
(``formats.speculation``); on a difference it locates the items exactly and reads again.
Non-tensor values are
answered as ``torch.save``'d bytes, DCP's format for ``BYTE_IO`` items.
``reader.stats`` counts what the last load fetched (``bytes_read``, ``bytes_needed``,
``requests``). Errors are ``streamckpt.CheckpointError`` subclasses; DCP wraps them in a
``CheckpointException`` whose ``failures`` hold the original per rank.
"""

from __future__ import annotations

import bisect
import dataclasses
import io
import logging
import math
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import fsspec
import torch
import torch.distributed.checkpoint as tdcp
import zstandard
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   StorageMeta, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (LoadItemType, LoadPlan, LoadPlanner, ReadItem, SavePlan,
                                                  SavePlanner, WriteItemType)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from .core import dtypes, manifest as mf, tree as trees, values as vals
from .core.regions import Box, flat_range_boxes, runs
from .core.targets import TargetSpec
from .errors import (CheckpointError, CheckpointExistsError, CheckpointNotFoundError, CorruptCheckpointError,
                     IncompatibleStateDictError)
from .formats import read_hf_manifest, read_manifest, read_native_manifest, speculation as spec
from .formats.dcp import MAX_METADATA_BYTES, METADATA_NAME, SPECULATION_KEY, restorable_values
from .formats.dcpguess import guess_tensors
from .formats.dcpitem import MAX_VALUE_ITEM_BYTES, RangeCache, item_windows, located_shard, value_from_record
from .formats.dcpmeta import DcpMetadata, DcpTensor, ItemInfo, parse_metadata
from .saving import writeplan
from .manage.references import check_unreferenced
from .saving.writer import OBJECT_BYTES, ShardToWrite, write_data_files
from .storage import Landing, RangeRead, Storage

log = logging.getLogger(__name__)

__all__ = ["StorageReader", "StorageWriter", "ReadStats"]

MEMORY_BUDGET = 256 << 20  # bytes fetched per batch of read items
GAP_BYTES = 16 << 10  # an unchecked gap this small is read through rather than costing a request


def _valid_uri(checkpoint_id: str | os.PathLike) -> bool:
    """A path or a URL whose protocol fsspec knows."""
    try:
        proto = fsspec.core.split_protocol(os.fspath(checkpoint_id))[0]
    except TypeError:
        return False
    return proto is None or proto in fsspec.available_protocols()


# =============================================================================== writer


@dataclass(frozen=True)
class _Prefix:
    """A rank's data file names, given out by the coordinator (one save id for all)."""

    prefix: str


class StorageWriter(tdcp.StorageWriter):
    """A ``torch.distributed.checkpoint`` writer that leaves a native streamckpt checkpoint.

    ``dcp.save(state, storage_writer=StorageWriter(uri, storage_options=opts))`` (also
    ``dcp.async_save``): DCP plans, streamckpt uploads (checksummed data files, the manifest
    written last by the coordinator, so a failed save commits nothing). Read it back with
    ``StorageReader``, ``sc.load`` or ``sc.load_state`` (see the module doc).

    Args:
        uri: The checkpoint's directory: an fsspec URL or local path (DCP's
            ``checkpoint_id`` replaces it when given).
        storage_options: Passed to fsspec unchanged. Default None.
        compression: None (default) or ``"zstd"``, as in ``sc.save``.
        overwrite: Replace a committed checkpoint at ``uri``. Default False: refuse it
            (``CheckpointExistsError``, in DCP's ``CheckpointException``); never one whose files
            incremental checkpoints reference (``CheckpointInUseError``, likewise).
        metadata: A JSON-serializable dict kept in the manifest. Default None.
        object_bytes: The size data files are cut to on upload, one request each
            (default 8 MiB).

    Raises:
        CheckpointError: ``compression`` is not None or ``"zstd"``.
    """

    def __init__(self, uri: str | os.PathLike, *, storage_options: dict[str, Any] | None = None,
                 compression: str | None = None, overwrite: bool = False,
                 metadata: dict[str, Any] | None = None, object_bytes: int = OBJECT_BYTES) -> None:
        super().__init__()
        if compression not in (None, "zstd"):
            raise CheckpointError(f"compression={compression!r} is not supported (use None or 'zstd')")
        self.uri = os.fspath(uri)
        self.storage_options = storage_options
        self.compression = compression
        self.overwrite = overwrite
        self.metadata = dict(metadata or {})
        self.object_bytes = object_bytes
        self._storage: Storage | None = None
        self.save_id = uuid.uuid4().hex[:12]

    # ------------------------------------------------------------ DCP protocol

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self._close()
        if checkpoint_id:
            self.uri = os.fspath(checkpoint_id)
        self.save_id = uuid.uuid4().hex[:12]

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return _valid_uri(checkpoint_id)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.uri, save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self._open()

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Refuse to replace a committed checkpoint (one HEAD) unless ``overwrite``, and one whose
        bytes incremental checkpoints reference in any case; name each rank's files."""
        storage = self._open()
        if storage.entry is not None:
            raise CheckpointError(f"{storage.describe(storage.entry)} names one file; a DCP save writes a "
                                  f"directory: pass its directory URI, e.g. {storage.describe('')}")
        if storage.modified(mf.MANIFEST_NAME) is not None:
            if not self.overwrite:
                raise CheckpointExistsError(f"{storage.describe(mf.MANIFEST_NAME)} exists: a committed checkpoint is "
                                            f"there; pass StorageWriter(..., overwrite=True) to replace it")
            check_unreferenced(storage.uri, self.storage_options)  # later incremental saves may use its bytes
        save_id = uuid.uuid4().hex[:8]
        return [dataclasses.replace(p, storage_data=_Prefix(f"data/{save_id}-{i:05d}")) for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Upload this rank's items as data files (CRC32C per chunk), several in flight."""
        storage = self._open()
        prefix: _Prefix = plan.storage_data
        tensors = [it for it in plan.items if it.type != WriteItemType.BYTE_IO]
        results = [_value_result(it, planner) for it in plan.items if it.type == WriteItemType.BYTE_IO]
        shards: list[ShardToWrite] = []
        owners: list[int] = []
        for n, it in enumerate(tensors):
            for piece in _pieces(it, planner.resolve_data(it), self.object_bytes):
                shards.append(piece)
                owners.append(n)
        ext = "zst" if self.compression else "safetensors"
        records, files = write_data_files(storage, lambda i: f"{prefix.prefix}-{i:04d}.{ext}", shards,
                                          compression=self.compression)
        per_item: list[list[mf.Shard]] = [[] for _ in tensors]
        for owner, (_key, shard) in zip(owners, records):
            per_item[owner].append(shard)
        for it, got in zip(tensors, per_item):
            docs = [mf._shard_doc(s) for s in got]
            results.append(WriteResult(index=it.index, size_in_bytes=sum(s.byte_length for s in got),
                                       storage_data={"shards": docs, "files": {s.file: files[s.file] for s in got}}))
        if not self.is_coordinator:
            self._close()
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Commit: validate the whole manifest, write ``manifest.json`` last, drop stale files."""
        storage = self._open()
        try:
            manifest = _assemble(metadata, results, self.metadata, where=f"DCP save to {storage.describe('')}")
            storage.write_bytes(mf.MANIFEST_NAME, mf.to_json(manifest))
            log.info("streamckpt DCP save %s: %d tensors, %d files", storage.describe(""), len(manifest.tensors),
                     len(manifest.files))
            _remove_stale(storage, manifest)
        finally:
            self._close()

    # ------------------------------------------------------------------ helpers

    def _open(self) -> Storage:
        if self._storage is None:
            self._storage = Storage(self.uri, self.storage_options)
        return self._storage

    def _close(self) -> None:
        if self._storage is not None:
            self._storage.close()
            self._storage = None


def _pieces(item: Any, data: Any, object_bytes: int) -> list[ShardToWrite]:
    """One DCP tensor item as shards of at most ``object_bytes`` (each fits one upload buffer)."""
    if not isinstance(data, torch.Tensor):
        raise IncompatibleStateDictError(f"{item.index.fqn}: the planner resolved a tensor item to "
                                         f"{type(data).__name__}, expected a torch.Tensor")
    td = item.tensor_data
    code = dtypes.to_code(td.properties.dtype, where=item.index.fqn)
    spec = TargetSpec(item.index.fqn, code, tuple(td.size), tuple(td.chunk.offsets), tuple(td.chunk.sizes))
    if tuple(data.shape) != spec.shape:
        raise IncompatibleStateDictError(f"{spec.key}: resolved tensor has shape {list(data.shape)}, "
                                         f"its chunk {list(spec.shape)}")
    data = data.detach().to(td.properties.dtype)
    out = []
    for piece in writeplan.split_item(writeplan.WriteItem(spec, spec), object_bytes):
        out.append(ShardToWrite(piece.spec, writeplan.piece_of(piece, data)))
    return out


def _value_result(item: Any, planner: SavePlanner) -> WriteResult:
    """A non-tensor item as plain data: DCP's ``torch.save`` bytes read back without running code."""
    fqn = item.index.fqn
    raw = planner.resolve_data(item)
    data = raw.getvalue() if isinstance(raw, io.BytesIO) else bytes(raw)
    try:
        value = value_from_record(data, where=f"DCP item {fqn!r}")
        why = vals.unsavable(value)
    except CorruptCheckpointError as e:
        why = f"not plain data ({e})"
    if why is not None:
        raise IncompatibleStateDictError(
            f"{fqn}: {why}; a streamckpt checkpoint stores non-tensor values as data "
            f"({vals.SAVABLE}): convert it, or keep it out of the state_dict")
    return WriteResult(index=item.index, size_in_bytes=len(data), storage_data={"value": vals.encode(value)})


def _assemble(metadata: Metadata, results: list[list[WriteResult]], user: dict[str, Any], *,
              where: str) -> mf.Manifest:
    """The manifest of a DCP save from its metadata and every rank's write results."""
    by_fqn: dict[str, list[Any]] = {}
    for wr in (w for rank in results for w in rank):
        by_fqn.setdefault(wr.index.fqn, []).append(wr.storage_data)
    parser = mf._Parser(where)
    tensors: dict[str, mf.TensorMeta] = {}
    values: dict[str, Any] = {}
    files: dict[str, int] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        docs = by_fqn.get(fqn, [])
        if isinstance(md, BytesStorageMetadata):
            if not docs:
                raise IncompatibleStateDictError(f"{where}: no rank wrote value {fqn!r}")
            values[fqn] = vals.decode(docs[0]["value"], where=fqn)
            continue
        shape = tuple(md.size)
        shards = [parser.shard(s, f"tensors.{fqn}", len(shape)) for d in docs for s in d["shards"]]
        for d in docs:
            files.update(d["files"])
        shards.sort(key=lambda s: (s.offset, s.flat_range or (0, 0)))
        tensors[fqn] = mf.TensorMeta(dtype=dtypes.to_code(md.properties.dtype, where=fqn), shape=shape,
                                     shards=tuple(shards))
    paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    tree = trees.from_paths(paths, tensors, values)
    manifest = mf.Manifest(tensors=tensors, files=files, values=values, tree=tree, committed_ns=time.time_ns(),
                           metadata={**user, "written_by": "streamckpt.dcp.StorageWriter"})
    try:
        mf.validate(manifest, where=where)
    except CorruptCheckpointError as e:
        raise IncompatibleStateDictError(f"the ranks' shards do not form a valid checkpoint: {e}") from None
    return manifest


def _remove_stale(storage: Storage, manifest: mf.Manifest) -> None:
    """Best effort: data files of a replaced checkpoint, now unreferenced."""
    try:
        for name in storage.list("data"):
            if name not in manifest.files:
                storage.delete(name)
    except CheckpointError as e:  # pragma: no cover - best effort
        log.warning("could not remove stale files under %s: %s", storage.describe("data"), e)


# =============================================================================== reader


@dataclass(frozen=True, slots=True)
class _Piece:
    """One DCP chunk: a box stored contiguously in a shard, from raw byte ``raw_base`` on."""

    key: str
    shard: mf.Shard
    box: Box
    raw_base: int
    dtype: str

    @property
    def itemsize(self) -> int:
        return dtypes.itemsize(self.dtype)


@dataclass(frozen=True, slots=True)
class _Unlocated:
    """A DCP chunk whose tensor bytes are not located yet (``StorageReader._locate``)."""

    key: str
    box: Box
    tensor: DcpTensor
    item: ItemInfo


@dataclass(slots=True)
class ReadStats:
    """What a reader's ``read_data`` calls fetched since the last ``reset``/``read_metadata``
    (tensor data, with the gaps read through and the predicted DCP item heads verified with
    it; the manifest and the items located before the data are not counted)."""

    bytes_read: int = 0  # from storage
    bytes_needed: int = 0  # into the read items' targets
    requests: int = 0
    items: int = 0
    seconds: float = 0.0
    fallbacks: int = 0  # predicted DCP layouts found wrong: items located exactly, batch read again


@dataclass(slots=True)
class _Unit:
    """A fetched span of one shard's raw bytes ``[raw_lo, raw_hi)`` (decoded when zstd)."""

    raw_lo: int
    raw_hi: int
    read: RangeRead
    frames: tuple[int, ...] = ()  # raw length of each zstd frame; empty: stored bytes are raw
    data: Any = None


class StorageReader(tdcp.StorageReader):
    """A ``torch.distributed.checkpoint`` reader of any checkpoint ``sc.load`` reads, by byte ranges.

    ``dcp.load(state, storage_reader=StorageReader(uri, storage_options=opts))`` on a
    native, Hugging Face or DCP checkpoint: each ``ReadItem`` costs only the byte ranges
    of its sub-box (checksummed where the format has checksums). ``stats`` (a
    ``ReadStats``) counts what the last load fetched: ``bytes_read``, ``bytes_needed``,
    ``requests``.

    Args:
        uri: The checkpoint: an fsspec URL or local path (DCP's ``checkpoint_id`` replaces
            it when given).
        storage_options: Passed to fsspec unchanged. Default None.
        memory_budget: Bytes fetched per batch of read items (default 256 MiB).
        max_concurrency: Range requests in flight (default 32).

    Raises:
        CheckpointError: ``memory_budget`` or ``max_concurrency`` is not positive.
    """

    def __init__(self, uri: str | os.PathLike, *, storage_options: dict[str, Any] | None = None,
                 memory_budget: int = MEMORY_BUDGET, max_concurrency: int = 32) -> None:
        super().__init__()
        if memory_budget <= 0 or max_concurrency <= 0:
            raise CheckpointError("memory_budget and max_concurrency must be positive")
        self.uri = os.fspath(uri)
        self.storage_options = storage_options
        self.memory_budget = memory_budget
        self.max_concurrency = max_concurrency
        self.stats = ReadStats()
        self._storage: Storage | None = None
        self._pieces: dict[str, list[_Piece | _Unlocated]] = {}
        self._parsed: dict[bytes, Any] = {}  # DCP item headers parsed so far (formats.dcpitem)
        self._dcp: DcpMetadata | None = None  # a DCP checkpoint's parsed .metadata
        self._checks: list[spec.Head] = []  # the predicted item heads to verify (formats.speculation)
        self._verified: set[tuple[str, str]] = set()  # parts of checks read and found as predicted (_parts)
        self._values: dict[str, Any] = {}
        self._unloadable: dict[str, str] = {}
        self._failed: CheckpointError | None = None

    # ------------------------------------------------------------ DCP protocol

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self._close()
        if checkpoint_id:
            self.uri = os.fspath(checkpoint_id)
        self.stats = ReadStats()
        self._pieces, self._values, self._unloadable, self._failed = {}, {}, {}, None
        self._parsed, self._dcp, self._checks, self._verified = {}, None, [], set()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return _valid_uri(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP ``Metadata`` built from the checkpoint's ``Manifest``.

        A ``CheckpointError`` here is kept and raised by ``set_up_storage_reader``: DCP
        turns a failing ``read_metadata`` into a bare ``AssertionError`` with only the
        message, while an error in the next step reaches the caller as itself (inside
        DCP's ``CheckpointException``)."""
        self.stats = ReadStats()
        self._failed = None
        try:
            return self._read_metadata(self._open())
        except CheckpointError as e:
            self._close()
            self._failed = e
            return Metadata(state_dict_metadata={})

    def _read_metadata(self, storage: Storage) -> Metadata:
        """A DCP checkpoint from its ``.metadata`` and one item located exactly (the others'
        offsets predicted, ``_metadata_of_dcp``); without a usable template, or after a wrong
        prediction, each rank locates only the items it reads (``_locate``)."""
        if storage.entry is None and read_native_manifest(storage) is None and read_hf_manifest(storage) is None:
            md = _dcp_metadata(storage)
            if md is not None:
                return self._metadata_of_dcp(storage, md)
        return self._metadata_of(read_manifest(storage))

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self._failed is not None:
            raise self._failed
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Values from the manifest; tensors by the ranges of their sub-boxes, in batches
        of at most ``memory_budget`` fetched bytes. A batch whose predicted DCP heads differ
        is read again once the items are located exactly; nothing of it was committed."""
        t0 = time.perf_counter()
        try:
            tensors = []
            for req in plan.items:
                if req.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(req, self._value_bytes(req.storage_index.fqn))
                else:
                    tensors.append(req)
            batches = self._planned(tensors)
            i = 0
            while i < len(batches):
                bad = self._read_batch(batches[i], planner)
                if bad is None:
                    i += 1
                    continue
                log.info("streamckpt DCP load %s: a DCP item's layout is not the predicted one (first: %s); "
                         "locating the items exactly and reading again", self._open().describe(""), bad)
                self.stats.fallbacks += 1
                self._unpredict()
                batches = batches[:i] + self._planned([r for b in batches[i:] for r in b])
        finally:
            self._close()
        self.stats.seconds += time.perf_counter() - t0
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    # --------------------------------------------------------------- metadata

    def _metadata_of(self, manifest: mf.Manifest) -> Metadata:
        sdm: dict[str, Any] = {}
        self._pieces = {}
        self._parsed, self._dcp, self._checks, self._verified = {}, None, [], set()
        for key, t in manifest.tensors.items():
            pieces = [p for s in t.shards for p in _pieces_of(key, s, t.dtype)]
            self._pieces[key] = pieces
            chunks = [ChunkStorageMetadata(offsets=torch.Size(p.box.offset), sizes=torch.Size(p.box.shape))
                      for p in pieces]
            sdm[key] = TensorStorageMetadata(properties=TensorProperties(dtype=dtypes.to_torch(t.dtype)),
                                             size=torch.Size(t.shape), chunks=chunks)
        self._values = _dcp_values(manifest.values)
        self._unloadable = dict(manifest.metadata.get("unloadable_reasons") or {})
        for key in [*_value_order(manifest.values), *self._unloadable]:
            sdm.setdefault(key, BytesStorageMetadata())
        paths = _planner_paths(manifest.tree, manifest.tensors, manifest.values, sdm)
        return Metadata(state_dict_metadata=sdm, planner_data=paths, storage_data={},
                        storage_meta=StorageMeta(checkpoint_id=self.uri))

    def _metadata_of_dcp(self, storage: Storage, md: DcpMetadata) -> Metadata:
        """DCP ``Metadata`` from a parsed ``.metadata``: one item located exactly and the others'
        offsets predicted from it (with the value items, one batch of small reads); when the
        template is not torch's plain layout the tensor items stay unlocated (``_locate``)."""
        sdm: dict[str, Any] = {}
        self._parsed, self._dcp, self._verified = {}, md, set()
        cache = RangeCache(storage)
        guessed = guess_tensors(cache, storage, md, self._parsed, meanwhile=lambda: None)
        self._pieces = _dcp_pieces(md, guessed[0] if guessed is not None else None)
        self._checks = [] if guessed is None else spec.all_checks(
            mf.Manifest(tensors=guessed[0], files={}, metadata={SPECULATION_KEY: guessed[1]}))
        for key, t in md.tensors.items():
            pieces = self._pieces[key]
            chunks = [ChunkStorageMetadata(offsets=torch.Size(p.box.offset), sizes=torch.Size(p.box.shape))
                      for p in pieces]
            sdm[key] = TensorStorageMetadata(properties=TensorProperties(dtype=dtypes.to_torch(t.dtype)),
                                             size=torch.Size(t.shape), chunks=chunks)
        values, self._unloadable = _dcp_item_values(cache, storage, md)
        self._values = _dcp_values(values)
        for key in [*_value_order(values), *self._unloadable]:
            sdm.setdefault(key, BytesStorageMetadata())
        tree = trees.from_paths(md.paths, md.tensors, values) if md.paths else None
        return Metadata(state_dict_metadata=sdm, planner_data=_planner_paths(tree, md.tensors, values, sdm),
                        storage_data={}, storage_meta=StorageMeta(checkpoint_id=self.uri))

    def _locate(self, reqs: Sequence[ReadItem]) -> None:
        """Find the tensor bytes of the DCP items these reads need (their ``torch.save``
        records' headers, a few small range reads per item, fetched together)."""
        todo: dict[tuple[str, tuple[int, ...]], _Unlocated] = {}
        for req in reqs:
            p = self._entry(req)
            if isinstance(p, _Unlocated):
                todo[(p.key, p.box.offset)] = p
        if not todo:
            return
        storage = self._open()
        cache = RangeCache(storage)
        cache.prefetch([w for p in todo.values() for w in item_windows(p.item)])
        for p in todo.values():
            shard, _ = located_shard(cache, storage, p.key, p.tensor, p.box.offset, p.box.shape, p.item,
                                     self._parsed)
            pieces = self._pieces[p.key]
            pieces[pieces.index(p)] = _Piece(p.key, shard, shard.box, 0, p.tensor.dtype)

    def _unpredict(self) -> None:
        """Forget every predicted offset: each item is located exactly when next read."""
        if self._dcp is not None:
            self._pieces = _dcp_pieces(self._dcp, None)
        self._checks, self._verified = [], set()

    def _planned(self, reqs: list[ReadItem]) -> list[list[ReadItem]]:
        """The reads located, in file order, cut into batches."""
        self._locate(reqs)
        reqs = sorted(reqs, key=lambda r: (self._piece(r).shard.file, self._piece(r).shard.byte_offset))
        return self._batches(reqs)

    def _value_bytes(self, fqn: str) -> io.BytesIO:
        if fqn not in self._values:
            raise IncompatibleStateDictError(
                f"{self._open().describe('')}: value {fqn!r} cannot be restored as data "
                f"({self._unloadable.get(fqn, 'not in the checkpoint')}); leave it out of the state_dict, or "
                f"read it with DCP's FileSystemReader if you trust the checkpoint")
        buf = io.BytesIO()
        torch.save(self._values[fqn], buf)
        buf.seek(0)
        return buf

    def _piece(self, req: ReadItem) -> _Piece:
        p = self._entry(req)
        if isinstance(p, _Unlocated):  # pragma: no cover - read_data locates every item first
            raise CheckpointError(f"{p.key}: internal error, item at {list(p.box.offset)} read before located")
        return p

    def _entry(self, req: ReadItem) -> _Piece | _Unlocated:
        idx = req.storage_index
        pieces = self._pieces.get(idx.fqn)
        if not pieces:
            raise IncompatibleStateDictError(f"{self._open().describe('')}: no tensor {idx.fqn!r}")
        offset = tuple(idx.offset) if idx.offset is not None else None
        if idx.index is not None and idx.index < len(pieces) and (
                offset is None or pieces[idx.index].box.offset == offset):
            return pieces[idx.index]
        for p in pieces:
            if p.box.offset == offset:
                return p
        raise IncompatibleStateDictError(f"{idx.fqn}: no stored chunk at offset {list(offset or ())}")

    # ----------------------------------------------------------------- data

    def _batches(self, reqs: Sequence[ReadItem]) -> list[list[ReadItem]]:
        out: list[list[ReadItem]] = []
        total = self.memory_budget
        for req in reqs:
            n = 2 * math.prod(req.lengths) * self._piece(req).itemsize  # staged + fetched
            if not out or total + n > self.memory_budget:
                out.append([])
                total = 0
            out[-1].append(req)
            total += n
        return out

    def _read_batch(self, reqs: list[ReadItem], planner: LoadPlanner) -> str | None:
        """Fetch the units covering every item's runs, then copy each item into its target;
        the first predicted DCP head found wrong instead (nothing delivered nor committed).

        A unit whose items each need one contiguous run into a contiguous target of the
        stored dtype (a whole tensor, a ``Shard(0)`` row block) is read straight into those
        targets, the bytes between them into scratch: no staging copy. Unchecked units and
        the heads to verify that lie close together in a file are one request."""
        storage = self._open()
        by_shard: dict[tuple[str, int], list[_Want]] = {}
        shards: dict[tuple[str, int], mf.Shard] = {}
        for req in reqs:
            want = _want(req, self._piece(req), planner)
            ident = (want.piece.shard.file, want.piece.shard.byte_offset)
            shards[ident] = want.piece.shard
            by_shard.setdefault(ident, []).append(want)
        checked = self._checks_of([w for ws in by_shard.values() for w in ws])
        units: dict[tuple[str, int], list[_Unit]] = {}
        reads: list[RangeRead] = []
        bufs: list[Any] = []
        staged: list[tuple[_Unit, bytearray]] = []
        spans: list[_Span] = [_Span(c.head.file, c.head.start, c.head.start + c.head.length,
                                    [memoryview(c.target.tensor.numpy())]) for c in checked]
        for ident, wants in by_shard.items():
            runs_of = [(a, a + n) for w in wants for a, n in w.runs]
            units[ident] = _units(shards[ident], wants[0].piece.itemsize, runs_of)
            for u in units[ident]:
                landing = _landing(u, wants)
                if landing is None:
                    buf = bytearray(u.read.length)
                    staged.append((u, buf))
                    landing = Landing([memoryview(buf)])
                if u.read.checks:
                    reads.append(u.read)
                    bufs.append(landing)
                else:
                    spans.append(_Span(u.read.name, u.read.start, u.read.stop, landing.parts))
        for sp in _joined(spans, GAP_BYTES):
            reads.append(RangeRead(sp.name, sp.start, sp.stop))
            bufs.append(Landing(sp.parts))
        self.stats.requests += storage.read_into(reads, bufs).result()
        self.stats.bytes_read += sum(r.length for r in reads)
        bad = spec.first_mismatch(checked, lambda t: t)
        if bad is not None:
            return bad
        self._verified.update(part for c in checked for part in _parts(c))
        for u, b in staged:
            u.data = _decode(u, b, storage)
        for ident, wants in by_shard.items():
            for w in wants:
                self._deliver(w, units[ident], planner)
        return None

    def _checks_of(self, wants: list[_Want]) -> list[spec.Checked]:
        """The checks covering a chunk these items read from, unless every part of a check that
        covers one of them (its head, its tail) was verified in an earlier batch."""
        if not self._checks:
            return []
        targets = [TargetSpec(w.piece.key, w.piece.dtype, (), tuple(o + s for o, s in zip(w.piece.box.offset,
                              w.req.storage_offsets)), tuple(w.req.lengths)) for w in wants]
        heads = spec.covering(self._checks, {t.key for t in targets})
        checked = spec.head_targets(heads, targets, False, lambda n: torch.empty(n, dtype=torch.uint8))
        return [c for c in checked if not _parts(c) <= self._verified]

    def _deliver(self, w: _Want, units: list[_Unit], planner: LoadPlanner) -> None:
        nbytes = sum(n for _, n in w.runs)
        if not w.landed and nbytes:
            starts = [u.raw_lo for u in units]
            if len(w.runs) == 1:  # one run: no staging, a view of the fetched bytes
                a, n = w.runs[0]
                u = units[bisect.bisect_right(starts, a) - 1]
                staged: Any = u.data[a - u.raw_lo:a - u.raw_lo + n]
            else:
                staged = bytearray(nbytes)
                pos = 0
                for a, n in w.runs:
                    u = units[bisect.bisect_right(starts, a) - 1]
                    staged[pos:pos + n] = u.data[a - u.raw_lo:a - u.raw_lo + n]
                    pos += n
            dtype = dtypes.to_torch(w.piece.dtype)
            src = torch.frombuffer(staged, dtype=torch.uint8).view(dtype).reshape(tuple(w.req.lengths))
            w.target.copy_(src)
        planner.commit_tensor(w.req, w.target)
        self.stats.bytes_needed += nbytes
        self.stats.items += 1

    # ------------------------------------------------------------------ helpers

    def _open(self) -> Storage:
        if self._storage is None:
            self._storage = Storage(self.uri, self.storage_options, max_concurrency=self.max_concurrency)
        return self._storage

    def _close(self) -> None:
        if self._storage is not None:
            self._storage.close()
            self._storage = None


def _pieces_of(key: str, shard: mf.Shard, dtype: str) -> list[_Piece]:
    """A shard as DCP chunks: its box, or the contiguous boxes of its flat range."""
    if shard.flat_range is None:
        return [_Piece(key, shard, shard.box, 0, dtype)]
    lo, hi = shard.flat_range
    size = dtypes.itemsize(dtype)
    return [_Piece(key, shard, box, (start - lo) * size, dtype) for start, box in flat_range_boxes(shard.box, lo, hi)]


@dataclass(slots=True)
class _Want:
    """One read item: its stored piece, the raw byte runs of its sub-box, its target."""

    req: ReadItem
    piece: _Piece
    runs: list[tuple[int, int]]  # (raw start, length) in the piece's shard
    target: torch.Tensor
    landed: bool = False  # read straight into ``target``


def _want(req: ReadItem, p: _Piece, planner: LoadPlanner) -> _Want:
    sub = Box(tuple(o + s for o, s in zip(p.box.offset, req.storage_offsets)), tuple(req.lengths))
    byte_runs = [(p.raw_base + s * p.itemsize, n * p.itemsize) for s, n in runs(p.box, sub) if n]
    return _Want(req, p, byte_runs, planner.resolve_tensor(req).detach())


def _direct(w: _Want) -> memoryview | None:
    """The target's memory, when the item's one run can land in it as stored."""
    t = w.target
    if len(w.runs) != 1 or t.device.type != "cpu" or not t.is_contiguous() or \
            t.dtype != dtypes.to_torch(w.piece.dtype) or t.numel() * t.element_size() != w.runs[0][1]:
        return None
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _landing(u: _Unit, wants: list[_Want]) -> Landing | None:
    """The unit's bytes straight into its items' targets (scratch between them), when every
    item inside it can take its bytes directly and none overlaps another; else None."""
    if u.frames:
        return None
    inside = sorted((w for w in wants if w.runs and u.raw_lo <= w.runs[0][0] < u.raw_hi), key=lambda w: w.runs[0][0])
    mems = [_direct(w) for w in inside]
    if not inside or any(m is None for m in mems):
        return None
    parts: list[memoryview] = []
    pos = u.raw_lo
    for w, mem in zip(inside, mems):
        a, n = w.runs[0]
        if a < pos or a + n > u.raw_hi:
            return None
        if a > pos:
            parts.append(memoryview(bytearray(a - pos)))
        parts.append(mem)
        pos = a + n
    if pos < u.raw_hi:
        parts.append(memoryview(bytearray(u.raw_hi - pos)))
    for w in inside:
        w.landed = True
    return Landing(parts)


def _parts(c: spec.Checked) -> set[tuple[str, str]]:
    """The parts of a check this batch compares: its head (its chunk is read), its tail (the
    previous chunk is read). A part verified for one chunk says nothing of the other's."""
    return {(c.head.name, part) for part, on in (("head", c.check_head), ("tail", c.check_tail)) if on}


@dataclass(slots=True)
class _Span:
    """Bytes ``[start, stop)`` of file ``name`` and the buffers that take them, in order."""

    name: str
    start: int
    stop: int
    parts: list[memoryview]


def _joined(spans: list[_Span], gap: int) -> list[_Span]:
    """Spans of one file that follow each other within ``gap`` bytes as one (scratch for the
    gaps); overlapping ones stay apart. A span at byte 0 is not extended: a read from 0 may
    be the whole object and is then one request, not parallel pieces (``storage.reads``)."""
    out: list[_Span] = []
    for sp in sorted(spans, key=lambda x: (x.name, x.start)):
        last = out[-1] if out else None
        if last is None or last.name != sp.name or last.start == 0 or not 0 <= sp.start - last.stop <= gap:
            out.append(_Span(sp.name, sp.start, sp.stop, list(sp.parts)))
            continue
        if sp.start > last.stop:
            last.parts.append(memoryview(bytearray(sp.start - last.stop)))
        last.parts.extend(sp.parts)
        last.stop = sp.stop
    return out


def _dcp_pieces(md: DcpMetadata, guessed: dict[str, mf.TensorMeta] | None) -> dict[str, list[_Piece | _Unlocated]]:
    """Each DCP tensor's chunks: at their predicted (or exactly located) shards, else unlocated."""
    out: dict[str, list[_Piece | _Unlocated]] = {}
    for key, t in md.tensors.items():
        if guessed is not None:  # guess_tensors keeps the order of the chunks
            out[key] = [_Piece(key, sh, sh.box, 0, t.dtype) for sh in guessed[key].shards]
        else:
            out[key] = [_Unlocated(key, Box(tuple(o), tuple(z)), t, item) for o, z, item in t.chunks]
    return out


def _merge(spans: list[tuple[int, int]], gap: int) -> list[tuple[int, int]]:
    """Sorted spans with overlaps (and gaps up to ``gap``) merged."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1] + gap:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _units(shard: mf.Shard, itemsize: int, spans: list[tuple[int, int]]) -> list[_Unit]:
    """The reads that cover the raw byte ``spans`` of one shard: exact ranges when the shard
    has no checksums, else the whole chunks (zstd frames) covering them, with their CRC32C."""
    spans = [(a, b) for a, b in spans if b > a]
    if shard.chunk_size == 0:
        return [_Unit(a, b, RangeRead(shard.file, shard.byte_offset + a, shard.byte_offset + b))
                for a, b in _merge(spans, GAP_BYTES)]
    cs, crcs = shard.chunk_size, shard.crc32c or ()
    raw_total = shard.numel * itemsize
    chunks = _merge([(a // cs, -(-b // cs)) for a, b in spans], 0)
    starts = shard.frame_offsets()
    out = []
    for c0, c1 in chunks:
        lo = starts[c0]
        hi = starts[c1 - 1] + (shard.frame_lengths[c1 - 1] if shard.frame_lengths else
                               min(cs, raw_total - (c1 - 1) * cs))
        checks = tuple((starts[c] - lo, (shard.frame_lengths[c] if shard.frame_lengths else
                                         min(cs, raw_total - c * cs)), crcs[c]) for c in range(c0, c1))
        frames = tuple(min(cs, raw_total - c * cs) for c in range(c0, c1)) if shard.codec == "zstd" else ()
        out.append(_Unit(c0 * cs, min(c1 * cs, raw_total), RangeRead(shard.file, lo, hi, checks), frames))
    return out


def _decode(u: _Unit, buf: bytearray, storage: Storage) -> Any:
    """A fetched unit's raw bytes: as read, or its zstd frames decoded (each to its exact size)."""
    if not u.frames:
        return memoryview(buf)
    dctx = zstandard.ZstdDecompressor()
    out = bytearray()
    for (off, length, _crc), raw_len in zip(u.read.checks, u.frames):
        where = f"{storage.describe(u.read.name)} bytes [{u.read.start + off}, {u.read.start + off + length})"
        try:
            data = dctx.decompress(bytes(buf[off:off + length]), max_output_size=raw_len)
        except zstandard.ZstdError as e:
            raise CorruptCheckpointError(f"{where}: zstd frame does not decode ({e})") from None
        if len(data) != raw_len:
            raise CorruptCheckpointError(f"{where}: zstd frame decodes to {len(data)} bytes, expected {raw_len}")
        out += data
    return memoryview(out)


def _dcp_values(values: dict[str, Any]) -> dict[str, Any]:
    """Values under their own keys and under the keys DCP's planner flattens them into
    (a native checkpoint keeps ``optim.param_groups`` whole; DCP asks for
    ``optim.param_groups.0.lr``)."""
    out = dict(values)
    for key, value in values.items():
        flat, _ = flatten_state_dict({key: value})
        for k, v in flat.items():
            out.setdefault(k, v)
    return out


def _value_order(values: dict[str, Any]) -> list[str]:
    """Value keys for DCP's metadata: each value's flattened aliases (see ``_dcp_values``)
    before the value itself, so that a planner rebuilding the state from the metadata in
    order (``_EmptyStateDictLoadPlanner``) ends with the whole value in its place."""
    out: list[str] = []
    for key, value in values.items():
        flat, _ = flatten_state_dict({key: value})
        out += [k for k in flat if k != key] + [key]
    return out


def _dcp_metadata(storage: Storage) -> DcpMetadata | None:
    """The parsed ``.metadata`` at the prefix (one GET, no pickle code run), or None."""
    try:
        raw = storage.read_bytes(METADATA_NAME, max_bytes=MAX_METADATA_BYTES)
    except CheckpointNotFoundError:
        return None
    return parse_metadata(raw, where=storage.describe(METADATA_NAME))


def _dcp_item_values(cache: RangeCache, storage: Storage, md: DcpMetadata) -> tuple[dict[str, Any], dict[str, str]]:
    """``formats.dcp.restorable_values``, their bytes fetched together first."""
    cache.prefetch([(it.file, it.offset, it.offset + it.length) for it in md.values.values()
                    if it.length <= MAX_VALUE_ITEM_BYTES])
    return restorable_values(cache, storage, md)


def _planner_paths(tree: Any, tensors: Any, values: dict[str, Any],
                   keys: Sequence[str]) -> dict[str, tuple[str | int, ...]]:
    """Every key's path in the saved state's nesting, as DCP's default planner records it in
    ``Metadata.planner_data`` (``_EmptyStateDictLoadPlanner``, hence ``dcp_to_torch_save``, and
    ``load_sharded_optimizer_state_dict`` rebuild the nesting from it); a key the tree does not
    place (a checkpoint without one) stays at the top level under its dotted name."""
    tree = tree if tree is not None else trees.flat(tensors, values)
    paths = dict(_tree_paths(tree, ()))
    for key, value in values.items():  # the flattened aliases of _dcp_values
        flat, mapping = flatten_state_dict({key: value})
        base = paths.get(key, (key,))
        for k in flat:
            paths.setdefault(k, base + tuple(mapping[k][1:]))
    return {k: paths.get(k, (k,)) for k in keys}


def _tree_paths(node: Any, path: tuple[str | int, ...]) -> Iterator[tuple[str, tuple[str | int, ...]]]:
    """(stored key, path) of every leaf of a (checked) tree document, see ``core.tree``."""
    if isinstance(node, list):
        for i, child in enumerate(node):
            if child is not None:
                yield from _tree_paths(child, path + (i,))
        return
    if not isinstance(node, dict):
        return
    if len(node) == 1:
        kind, inner = next(iter(node.items()))
        if kind in (trees.TENSOR, trees.VALUE) and isinstance(inner, str):
            yield inner, path
            return
        if kind == trees.TUPLE:
            yield from _tree_paths(inner, path)
            return
        if kind == trees.ITEMS:
            for name, child in inner:  # a dict key is a string in DCP's paths (it flattens with str(key))
                yield from _tree_paths(child, path + (str(name),))
            return
    for name, child in node.items():
        yield from _tree_paths(child, path + (name,))
