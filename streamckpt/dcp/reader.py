"""``StorageReader``: any checkpoint ``sc.load`` reads, handed to DCP's load planner by byte ranges.

The reader's own logic is here: metadata, read items matched to stored pieces, batches under
the memory budget, predicted DCP item heads checked before any item is handed over. Where an
item's bytes lie is ``pieces``; the non-tensor values and DCP's planner paths are ``values``.
"""

from __future__ import annotations

import bisect
import io
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed.checkpoint as tdcp
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata, StorageMeta,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from ..core import dtypes, manifest as mf, tree as trees
from ..core.targets import TargetSpec
from ..errors import CheckpointError, IncompatibleStateDictError
from ..formats import read_hf_manifest, read_manifest, read_native_manifest, speculation as spec
from ..formats.dcp import SPECULATION_KEY
from ..formats.dcpguess import guess_tensors
from ..formats.dcpitem import RangeCache, item_windows, located_shard
from ..formats.dcpmeta import DcpMetadata
from ..storage import Landing, RangeRead, Storage
from .common import GAP_BYTES, MEMORY_BUDGET, valid_uri
from .pieces import (Piece, Span, Unit, Unlocated, Want, check_parts, dcp_pieces, decode, joined, landing_of,
                     pieces_of, units_of, want_of)
from .values import dcp_item_values, dcp_metadata, dcp_values, planner_paths, value_order

log = logging.getLogger(__name__)


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
        self._pieces: dict[str, list[Piece | Unlocated]] = {}
        self._parsed: dict[bytes, Any] = {}  # DCP item headers parsed so far (formats.dcpitem)
        self._dcp: DcpMetadata | None = None  # a DCP checkpoint's parsed .metadata
        self._checks: list[spec.Head] = []  # the predicted item heads to verify (formats.speculation)
        self._verified: set[tuple[str, str]] = set()  # parts of checks read and found as predicted (check_parts)
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
        return valid_uri(checkpoint_id)

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
            md = dcp_metadata(storage)
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
            pieces = [p for s in t.shards for p in pieces_of(key, s, t.dtype)]
            self._pieces[key] = pieces
            chunks = [ChunkStorageMetadata(offsets=torch.Size(p.box.offset), sizes=torch.Size(p.box.shape))
                      for p in pieces]
            sdm[key] = TensorStorageMetadata(properties=TensorProperties(dtype=dtypes.to_torch(t.dtype)),
                                             size=torch.Size(t.shape), chunks=chunks)
        self._values = dcp_values(manifest.values)
        self._unloadable = dict(manifest.metadata.get("unloadable_reasons") or {})
        for key in [*value_order(manifest.values), *self._unloadable]:
            sdm.setdefault(key, BytesStorageMetadata())
        paths = planner_paths(manifest.tree, manifest.tensors, manifest.values, sdm)
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
        self._pieces = dcp_pieces(md, guessed[0] if guessed is not None else None)
        self._checks = [] if guessed is None else spec.all_checks(
            mf.Manifest(tensors=guessed[0], files={}, metadata={SPECULATION_KEY: guessed[1]}))
        for key, t in md.tensors.items():
            pieces = self._pieces[key]
            chunks = [ChunkStorageMetadata(offsets=torch.Size(p.box.offset), sizes=torch.Size(p.box.shape))
                      for p in pieces]
            sdm[key] = TensorStorageMetadata(properties=TensorProperties(dtype=dtypes.to_torch(t.dtype)),
                                             size=torch.Size(t.shape), chunks=chunks)
        values, self._unloadable = dcp_item_values(cache, storage, md)
        self._values = dcp_values(values)
        for key in [*value_order(values), *self._unloadable]:
            sdm.setdefault(key, BytesStorageMetadata())
        tree = trees.from_paths(md.paths, md.tensors, values) if md.paths else None
        return Metadata(state_dict_metadata=sdm, planner_data=planner_paths(tree, md.tensors, values, sdm),
                        storage_data={}, storage_meta=StorageMeta(checkpoint_id=self.uri))

    def _locate(self, reqs: Sequence[ReadItem]) -> None:
        """Find the tensor bytes of the DCP items these reads need (their ``torch.save``
        records' headers, a few small range reads per item, fetched together)."""
        todo: dict[tuple[str, tuple[int, ...]], Unlocated] = {}
        for req in reqs:
            p = self._entry(req)
            if isinstance(p, Unlocated):
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
            pieces[pieces.index(p)] = Piece(p.key, shard, shard.box, 0, p.tensor.dtype)

    def _unpredict(self) -> None:
        """Forget every predicted offset: each item is located exactly when next read."""
        if self._dcp is not None:
            self._pieces = dcp_pieces(self._dcp, None)
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

    def _piece(self, req: ReadItem) -> Piece:
        p = self._entry(req)
        if isinstance(p, Unlocated):  # pragma: no cover - read_data locates every item first
            raise CheckpointError(f"{p.key}: internal error, item at {list(p.box.offset)} read before located")
        return p

    def _entry(self, req: ReadItem) -> Piece | Unlocated:
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
        by_shard: dict[tuple[str, int], list[Want]] = {}
        shards: dict[tuple[str, int], mf.Shard] = {}
        for req in reqs:
            want = want_of(req, self._piece(req), planner)
            ident = (want.piece.shard.file, want.piece.shard.byte_offset)
            shards[ident] = want.piece.shard
            by_shard.setdefault(ident, []).append(want)
        checked = self._checks_of([w for ws in by_shard.values() for w in ws])
        units: dict[tuple[str, int], list[Unit]] = {}
        reads: list[RangeRead] = []
        bufs: list[Any] = []
        staged: list[tuple[Unit, bytearray]] = []
        spans: list[Span] = [Span(c.head.file, c.head.start, c.head.start + c.head.length,
                                    [memoryview(c.target.tensor.numpy())]) for c in checked]
        for ident, wants in by_shard.items():
            runs_of = [(a, a + n) for w in wants for a, n in w.runs]
            units[ident] = units_of(shards[ident], wants[0].piece.itemsize, runs_of)
            for u in units[ident]:
                landing = landing_of(u, wants)
                if landing is None:
                    buf = bytearray(u.read.length)
                    staged.append((u, buf))
                    landing = Landing([memoryview(buf)])
                if u.read.checks:
                    reads.append(u.read)
                    bufs.append(landing)
                else:
                    spans.append(Span(u.read.name, u.read.start, u.read.stop, landing.parts))
        for sp in joined(spans, GAP_BYTES):
            reads.append(RangeRead(sp.name, sp.start, sp.stop))
            bufs.append(Landing(sp.parts))
        self.stats.requests += storage.read_into(reads, bufs).result()
        self.stats.bytes_read += sum(r.length for r in reads)
        bad = spec.first_mismatch(checked, lambda t: t)
        if bad is not None:
            return bad
        self._verified.update(part for c in checked for part in check_parts(c))
        for u, b in staged:
            u.data = decode(u, b, storage)
        for ident, wants in by_shard.items():
            for w in wants:
                self._deliver(w, units[ident], planner)
        return None

    def _checks_of(self, wants: list[Want]) -> list[spec.Checked]:
        """The checks covering a chunk these items read from, unless every part of a check that
        covers one of them (its head, its tail) was verified in an earlier batch."""
        if not self._checks:
            return []
        targets = [TargetSpec(w.piece.key, w.piece.dtype, (), tuple(o + s for o, s in zip(w.piece.box.offset,
                              w.req.storage_offsets)), tuple(w.req.lengths)) for w in wants]
        heads = spec.covering(self._checks, {t.key for t in targets})
        checked = spec.head_targets(heads, targets, False, lambda n: torch.empty(n, dtype=torch.uint8))
        return [c for c in checked if not check_parts(c) <= self._verified]

    def _deliver(self, w: Want, units: list[Unit], planner: LoadPlanner) -> None:
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
