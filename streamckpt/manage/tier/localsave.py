"""A local save: one step into every rank's node-local folder, copied to partners on other nodes.

The same data files as a bucket save (``saving``'s write plan, writer and manifest: chunks,
CRC32Cs, digests), written to ``LocalDir.step_dir`` instead of the bucket. Then each rank
sends its files to its ``replicas`` partners (``partners``), file by file over the process
group, and each partner writes them into its own folder; every rank checks every file it
now keeps (``verify``), the ranks agree, and only then does each rank write the step's local
manifest (the commit) and drop the steps ``local_keep`` no longer keeps. A save that fails or
is killed anywhere before that leaves no manifest on any rank that had not already committed,
and the next local save removes its files.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from ...comm import P2P, GroupComm, SoloComm
from ...core import manifest as mf
from ...errors import CheckpointError
from ...cuda.runtime import CudaApi, TorchCuda
from ...results import SaveResult
from ...saving.asyncsave import SaveHandle, session_for, start_staged
from ...saving.saver import CANCELLED, Prepared, assemble, gather_json, merged_tree, prepare, same_call, to_write
from ...saving.writer import write_data_files
from ...storage import Storage
from .localdir import LocalDir
from .localmanifest import LOCAL_KEY, LocalStep, local_metadata, parse
from .partners import Topology
from .verify import check_file

log = logging.getLogger(__name__)

CALL = "CheckpointManager.save (local tier)"


def data_name(rank: int, index: int, compression: str | None) -> str:
    """A local data file's name: the bucket save's (``saving.saver``), so that a step saved to
    both holds the same files under the same names, byte for byte."""
    return f"data/{rank:05d}-{index:04d}.{'zst' if compression else 'safetensors'}"


def save_local(comm: SoloComm | GroupComm, folder: LocalDir, state_dict: Mapping[str, Any], *, step: int,
               metadata: dict[str, Any], compression: str | None, topology: Topology, replicas: int,
               keep: int, background: "Background | None" = None) -> SaveResult | SaveHandle:
    """Save ``state_dict`` as local step ``step`` on every rank (collective); returns this
    rank's result (its own files and what it received). Raises the agreed error on every rank.

    ``background``: a ``Background`` (the training group and CUDA runtime): stage the state in
    host memory and return a ``SaveHandle`` at once, as ``async_save`` does; the files are
    written, replicated, checked and committed on a thread of their own, over the tier's own
    process group. The caller's tensors may change as soon as this returns."""
    t0 = time.perf_counter()
    session = None
    cuda = None
    if background is not None:
        cuda = background.cuda if background.cuda is not None or not torch.cuda.is_available() else TorchCuda()
        session = session_for(background.process_group, "local-tier")  # a collective on first use
        session.settle()
        comm = session.comm
    same_call(comm, f"{folder.root}#local-step-{step}", CALL, compression=compression, replicas=replicas)

    def begin() -> None:  # agreed in prepare's first collective: every rank's folder is clean before any writes
        try:
            folder.begin(step)
        except OSError as e:
            raise CheckpointError(f"local tier: cannot prepare {folder.step_dir(step)}: {e}") from None

    storage = Storage(str(folder.step_dir(step)))
    job = _Job(comm, folder, step, compression, topology, replicas, keep, t0)
    try:
        prep = prepare(comm, storage, state_dict, compression=compression, metadata=metadata, overwrite=True,
                       call=CALL, same=False, cuda=cuda, first=begin)
    except BaseException:
        storage.close()
        raise
    if session is not None:  # the background's thread closes storage when it ends
        return start_staged(session, storage, prep, cuda, None,
                            lambda shards, released, cancelled: job.run(storage, prep, shards, released, cancelled))
    try:
        return job.run(storage, prep, to_write(prep.items, prep.local))
    finally:
        storage.close()


@dataclass(frozen=True, slots=True)
class Background:
    """What a background local save needs beside the state: the training group (its tier
    session's key) and the CUDA runtime (None: torch's, where CUDA is available)."""

    process_group: Any
    cuda: CudaApi | None = None


@dataclass(frozen=True, slots=True)
class _Job:
    """A local save after ``prepare``: write, replicate, check, commit, retain."""

    comm: SoloComm | GroupComm
    folder: LocalDir
    step: int
    compression: str | None
    topo: Topology
    replicas: int
    keep: int
    t0: float

    def run(self, storage: Storage, prep: Prepared, mine: Sequence[Any], on_written: Any = None,
            cancelled: Callable[[], bool] = lambda: False) -> SaveResult:
        comm, folder, step, compression = self.comm, self.folder, self.step, self.compression
        own: BaseException | None = None
        records: list[tuple[str, mf.Shard]] = []
        files: dict[str, int] = {}
        try:
            if mine:
                records, files = write_data_files(storage, lambda i: data_name(comm.rank, i, compression), mine,
                                                  compression=compression, shape=prep.upload, on_written=on_written)
            if cancelled():
                raise CheckpointError(CANCELLED)
        except CheckpointError as e:
            own = e
        doc = {"files": files, "records": [[k, json.loads(json.dumps(mf._shard_doc(s)))] for k, s in records],
               "tree": prep.tree if comm.rank != 0 and prep.tree else None}
        per_rank = gather_json(comm, doc, own)
        writers = {name: r for r, d in enumerate(per_rank) for name in d["files"]}
        usable = self.topo.usable_replicas(self.replicas)
        keepers = {name: [r, *self.topo.partners(r, usable)] for name, r in writers.items()}
        blob: bytes | None = None
        try:
            if comm.rank == 0:
                meta = {**prep.metadata, LOCAL_KEY: local_metadata(folder.root, step, keepers, comm.world_size,
                                                                   self.topo.ranks_per_node, usable)}
                blob = mf.to_json(assemble(prep.all_specs, per_rank, prep.values, merged_tree(prep, per_rank), meta,
                                           storage))
        except CheckpointError as e:
            own = e
        comm.agree(own)
        blob = comm.broadcast_bytes(blob if comm.rank == 0 else None)
        local = parse(blob, f"the local manifest of step {step}")
        received = 0
        try:
            received = replicate(comm, storage, per_rank, self.topo, usable)
            check_held(local, folder.step_dir(step), [n for n, ks in keepers.items() if comm.rank in ks])
            if cancelled():
                raise CheckpointError(CANCELLED)
        except CheckpointError as e:
            own = e
        comm.agree(own)  # every rank keeps all it should: commit
        try:
            folder.commit(step, blob)
        except OSError as e:
            own = CheckpointError(f"local tier: cannot commit {folder.step_dir(step)}: {e}")
        comm.agree(own)
        removed = folder.retain(self.keep)
        if removed:
            log.info("local tier: removed local step(s) %s of %s (local_keep=%d)", removed, folder.root, self.keep)
        result = SaveResult(uri=str(folder.step_dir(step)), files=sorted(files),
                            bytes_written=sum(files.values()) + received, seconds=time.perf_counter() - self.t0)
        result.requests = len(files)
        return result


def replicate(comm: SoloComm | GroupComm, storage: Storage, per_rank: Sequence[Any], topo: Topology,
              replicas: int) -> int:
    """Send this rank's files to its partners and write theirs here, one file index at a time
    (every rank walks the same indices, so the grouped send/recv pairs up); returns the bytes
    received. A rank whose file cannot be read sends zeros of its size, which fail the
    partner's check: the exchange itself never stalls."""
    if replicas == 0 or isinstance(comm, SoloComm):
        return 0
    comm.choose_data_plane(False)  # a mixed group: the files ride the CPU backend
    device = comm.data_device
    names = [sorted(d["files"]) for d in per_rank]
    partners = topo.partners(comm.rank, replicas)
    sources = topo.sources(comm.rank, replicas)
    received = 0
    error: BaseException | None = None
    for j in range(max(map(len, names), default=0)):
        sends, recvs, incoming = [], [], []
        if j < len(names[comm.rank]):
            name = names[comm.rank][j]
            try:
                data = torch.frombuffer(bytearray(storage.read_bytes(name)), dtype=torch.uint8)
            except CheckpointError as e:
                error = error or e
                data = torch.zeros(per_rank[comm.rank]["files"][name], dtype=torch.uint8)
            data = data.to(device)
            sends = [P2P(p, data, k) for k, p in enumerate(partners)]
        for k, src in enumerate(sources):
            if j < len(names[src]):
                name = names[src][j]
                buf = torch.empty(per_rank[src]["files"][name], dtype=torch.uint8, device=device)
                recvs.append(P2P(src, buf, k))
                incoming.append((name, buf))
        comm.wait(comm.exchange(sends, recvs))
        for name, buf in incoming:
            try:
                storage.write_bytes(name, memoryview(buf.cpu().numpy()))
                received += buf.numel()
            except CheckpointError as e:
                error = error or e
    if error is not None:
        raise error
    return received


def check_held(local: LocalStep, folder: Path, names: Sequence[str]) -> None:
    """Every file this rank keeps for the step is whole and matches the manifest."""
    by_file = local.shards_by_file()
    for name in names:
        why = check_file(folder / name, local.manifest.files[name], by_file.get(name, []))
        if why is not None:
            raise CheckpointError(f"local tier: step {local.step} is not committed: {why}")


__all__ = ["Background", "data_name", "gather_json", "replicate", "save_local"]
