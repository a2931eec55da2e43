"""``StorageWriter``: DCP plans the save, streamckpt writes a native checkpoint (manifest last)."""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as tdcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ..core import dtypes, manifest as mf, tree as trees, values as vals
from ..core.targets import TargetSpec
from ..errors import CheckpointError, CheckpointExistsError, CorruptCheckpointError, IncompatibleStateDictError
from ..formats.dcpitem import value_from_record
from ..saving import writeplan
from ..manage.references import check_unreferenced
from ..saving.writer import OBJECT_BYTES, ShardToWrite, write_data_files
from ..storage import Storage
from .common import valid_uri

log = logging.getLogger(__name__)


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
        return valid_uri(checkpoint_id)

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
