"""A restore from the memory/peer tier: the newest step the survivors hold, in one plan.

Every rank reports what its folder holds (``holdings``); for the newest candidate step the
lowest rank holding its save sends the local manifest to all; the reports say who holds
which file of it (at its recorded size), and the load reads from them. The load checks each
chunk's CRC32C as it reads it; when it fails, every rank checks its copies in full
(``verify``: size, CRC32Cs, digests; a bad one is dropped with a warning naming it) and the
step is loaded again from the copies that passed. Files no surviving rank holds are
read from the bucket's checkpoint of the same step, when it holds the very same bytes
(``holdings.same_file``); otherwise the step is passed over. The load is then one plan over
one manifest (``loading.run_load`` with ``holders``): a local file is read only by a rank
that holds it and its bytes travel over the exchange to the ranks that need them; a bucket
file by any rank. Any world size and any layout: the plan does not care who saved.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ...comm import GroupComm, SoloComm
from ...core import manifest as mf
from ...errors import CheckpointError, IncompatibleStateDictError, MissingKeysError
from ...formats.native import read_native_bytes
from ...loading.loader import LoadRequest, run_load
from ...plan.data import LoadPlan, PlanOptions
from ...plan.holders import bytes_by_reader
from ...results import LoadResult
from ...storage import Storage
from .holdings import Save, candidates, missing_files, report, same_file, saves_of, stale
from .localdir import LocalDir
from .localmanifest import LocalStep, parse
from .localsave import gather_json
from .sources import BUCKET, Sources
from .verify import check_file

log = logging.getLogger(__name__)

LOAD_OPTIONS = ("strict", "read_once", "memory_budget", "max_concurrency")  # what a tier load takes of load's


@dataclass(slots=True)
class FromTier:
    """What a restore from the tier loaded, on this rank."""

    step: int
    uri: str  # this rank's folder of the step
    result: LoadResult
    bytes_local: int  # into this rank's targets, read by this rank from its own folder
    bytes_peers: int  # ... read by other ranks from their folders, sent over the exchange
    bytes_bucket: int  # ... read from the bucket (by this rank or another)
    bucket_bytes_read: int  # what this rank fetched from the bucket
    from_bucket: list[str]  # the step's files that no surviving rank held
    skipped: list[tuple[str, str]]  # (this rank's folder of a newer local step, why it was passed over)


def restore_from_tier(comm: SoloComm | GroupComm, folder: LocalDir, state_dict: Any, *,
                      bucket_steps: Callable[[], list[int]], bucket_uri: Callable[[int], str],
                      storage_options: dict[str, Any] | None, load_kwargs: Mapping[str, Any],
                      step: int | None = None) -> FromTier | None:
    """Restore the newest step the tier can serve (collective); None when the newest step to
    restore is the bucket's alone (the caller restores from the bucket). ``bucket_steps()``
    (collective) is called after the ranks' reports are gathered."""
    own: CheckpointError | None = None
    rep: dict[str, Any] = {"saves": []}
    mine: dict[str, LocalStep] = {}
    try:
        rep, mine = report(folder, step)
    except OSError as e:  # agreed below: every rank turns to the bucket, none waits for this one
        own = CheckpointError(f"local tier: cannot read {folder.run}: {e}")
    reports = gather_json(comm, rep, own)
    in_bucket = bucket_steps()
    skipped: list[tuple[str, str]] = []
    saves = saves_of(reports)
    for old in stale(saves):
        if comm.rank == 0:
            log.warning("local tier: local step %d (save %s) was committed before a lower step's save: it belongs "
                        "to a timeline the run went back from, and is not restored", old.step, old.id[:12])
    for s, save in candidates(saves, in_bucket, step):
        if save is None:
            return None
        local = _shared_manifest(comm, save, mine)
        for whole in (False, True):  # first the reports' sizes and the load's own checks; after a failure, in full
            holders = _verified_holders(comm, folder, save, local) if whole else save.holders
            lost = missing_files(local.manifest, holders)
            if lost and (s not in in_bucket or not _bucket_has(comm, bucket_uri(s), storage_options, local, lost)):
                log.warning("local tier: step %d cannot be restored from the tier: no surviving rank holds %d "
                            "file(s) (%s)%s", s, len(lost), ", ".join(lost[:5]),
                            "; the bucket's checkpoint of that step is restored instead" if s in in_bucket else "")
                if s in in_bucket:
                    return None
                skipped.append((str(folder.step_dir(s)), f"no surviving rank holds {', '.join(lost[:5])}"))
                break
            try:
                got = _load(comm, folder, state_dict, local, holders, lost, bucket_uri(s), storage_options,
                            load_kwargs)
            except (IncompatibleStateDictError, MissingKeysError):
                raise  # the caller's own mistake: no copy is to blame
            except CheckpointError as e:  # agreed on every rank
                if whole:
                    raise
                log.warning("local tier: the load of local step %d failed (%s: %s); checking every local copy in "
                            "full and loading it again", s, type(e).__name__, e)
                continue
            got.skipped = skipped
            return got
    return None


def _shared_manifest(comm: SoloComm | GroupComm, save: Save, mine: Mapping[str, LocalStep]) -> LocalStep:
    """The save's local manifest on every rank, from the lowest rank that holds it. A rank that
    holds the save has parsed the very bytes already (the save's id is their hash): only the
    others parse what they receive."""
    own = mine.get(save.id)
    blob = own.blob if own is not None else None
    if not isinstance(comm, SoloComm):
        blob = comm.broadcast_bytes(blob if comm.rank == save.first else None, src=save.first)
    if own is not None:
        return own
    if blob is None:  # pragma: no cover - alone, a save reported is one this rank holds
        raise CheckpointError(f"internal: no local manifest of step {save.step}")
    return parse(blob, f"the local manifest of step {save.step}")


def _verified_holders(comm: SoloComm | GroupComm, folder: LocalDir, save: Save, local: LocalStep
                      ) -> dict[str, list[int]]:
    """file -> the ranks whose copy passed every check (each rank checks its own copies: size,
    every chunk's CRC32C, every shard's digest). Only after a load failed: before it,
    ``save.holders`` (the reports list only files of the recorded size) is trusted, and the
    load checks the CRC32C of every chunk it reads before any byte of it is used, as every
    load does: a copy read without a defect is not read twice."""
    by_file = local.shards_by_file()
    good = []
    for name, ranks in save.holders.items():
        if comm.rank not in ranks:
            continue
        why = check_file(folder.step_dir(save.step) / name, local.manifest.files[name], by_file.get(name, []))
        if why is None:
            good.append(name)
        else:
            log.warning("local tier: rank %d's copy of %s (step %d) is not used: %s", comm.rank, name, save.step, why)
    every = gather_json(comm, good, None)
    holders: dict[str, list[int]] = {}
    for rank, names in enumerate(every):
        for name in names:
            holders.setdefault(name, []).append(rank)
    return holders


def _bucket_has(comm: SoloComm | GroupComm, uri: str, storage_options: dict[str, Any] | None, local: LocalStep,
                lost: list[str]) -> bool:
    """Whether the bucket's checkpoint at ``uri`` holds every lost file byte for byte (rank 0 reads
    its manifest, every rank gets it)."""
    blob = b""
    if comm.rank == 0:
        storage = Storage(uri, storage_options)
        try:
            blob = read_native_bytes(storage) or b""
        except CheckpointError as e:
            log.warning("local tier: the bucket's checkpoint %s cannot be read: %s", uri, e)
        finally:
            storage.close()
    if not isinstance(comm, SoloComm):
        blob = comm.broadcast_bytes(blob if comm.rank == 0 else None)
    if not blob:
        return False
    try:
        bucket = mf.from_json(blob, where=f"{uri}/{mf.MANIFEST_NAME}")
    except CheckpointError:
        return False
    return all(same_file(local.manifest, bucket, f) for f in lost)


def _load(comm: SoloComm | GroupComm, folder: LocalDir, state_dict: Any, local: LocalStep,
          holders: dict[str, list[int]], lost: list[str], bucket_uri: str, storage_options: dict[str, Any] | None,
          load_kwargs: Mapping[str, Any]) -> FromTier:
    kw = {k: load_kwargs[k] for k in LOAD_OPTIONS if k in load_kwargs}
    manifest = _with_bucket_files(local.manifest, set(lost))
    local_files = set(local.manifest.files) - set(lost)
    seen: list[LoadPlan] = []
    mine = Storage(str(folder.step_dir(local.step)), max_concurrency=kw.get("max_concurrency", 32))
    bucket = Storage(bucket_uri, storage_options, max_concurrency=kw.get("max_concurrency", 32))
    try:
        budget = bucket.reserve_inflight(kw.get("memory_budget", 256 << 20))
        sources = Sources(mine, bucket)
        req = LoadRequest(state_dict=state_dict, strict=kw.get("strict", True),
                          options=PlanOptions(memory_budget=budget, read_once=kw.get("read_once", True)),
                          transforms=None, manifest=manifest, holders={f: holders[f] for f in local_files},
                          on_plan=seen.append)
        result = run_load(comm, sources, req)  # type: ignore[arg-type] - Sources is the executor's Storage
    finally:
        mine.close()
        bucket.close()
    own, peers, rest = bytes_by_reader(seen[-1], comm.rank, local_files) if seen else (0, 0, 0)
    if comm.rank == 0:
        log.info("local tier: restored step %d: %d file(s) from the tier, %d from the bucket", local.step,
                 len(local_files), len(lost))
    return FromTier(local.step, str(folder.step_dir(local.step)), result, own, peers, rest, sources.bytes_bucket,
                    lost, [])


def _with_bucket_files(m: mf.Manifest, lost: set[str]) -> mf.Manifest:
    """The manifest with the ``lost`` files named as the bucket's (``sources.BUCKET``)."""
    if not lost:
        return m
    tensors = {k: dataclasses.replace(t, shards=tuple(dataclasses.replace(s, file=BUCKET + s.file) if s.file in lost
                                                       else s for s in t.shards)) for k, t in m.tensors.items()}
    files = {(BUCKET + f if f in lost else f): n for f, n in m.files.items()}
    return dataclasses.replace(m, tensors=tensors, files=files)


__all__ = ["FromTier", "LOAD_OPTIONS", "restore_from_tier"]
