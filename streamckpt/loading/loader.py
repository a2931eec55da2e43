"""One ``load`` on one rank: agree on the manifest and everyone's targets, plan,
execute, report. The rank-0-reads-and-broadcasts pattern keeps metadata
requests at one per load, whatever the world size."""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import os
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, NoReturn, Sequence

import torch

from ..comm import GroupComm, SoloComm, encode_error, gather_targets, raise_agreed
from ..core import manifest as mf
from ..core.targets import LocalTarget, TargetSpec, ValueSlot, collect
from ..core.values import ValuePlan, plan_values
from ..cuda.device import Placement, cuda_devices, place
from ..cuda.runtime import CudaApi, TorchCuda
from ..errors import CheckpointError, IncompatibleStateDictError, MissingKeysError, close_to, prefix_hint
from ..formats import speculation as spec
from ..formats import read_foreign_manifest, read_manifest
from ..formats.native import read_native_bytes
from ..plan.holders import constrain_readers
from ..plan.planner import IdentityView, LoadPlan, PlanOptions, build_plan, settle_rounds
from ..results import LoadResult
from ..storage import Storage
from ..storage.ratelimit import prefix_uri
from .missing import kind_clash, warn_missing
from . import requestrate
from .pipeline import Destinations, Executor

log = logging.getLogger(__name__)


def read_metadata_bytes(storage: Storage, speculative: bool = False) -> bytes:
    """What rank 0 sends the others: our own manifest as stored, or one built from
    another format's headers as our JSON (``speculative``: a DCP manifest may hold
    predicted offsets, which ``run_load`` verifies: ``speculation``)."""
    raw = read_native_bytes(storage)
    return raw if raw is not None else mf.to_json(read_foreign_manifest(storage, speculative=speculative))


def start_metadata(comm: SoloComm | GroupComm, storage: Storage, pool: cf.ThreadPoolExecutor,
                   speculative: bool = False) -> cf.Future | None:
    """Rank 0 of a group starts reading the checkpoint's metadata in ``pool``, so that its
    requests overlap the exchange of target specs; None on other ranks and alone."""
    if isinstance(comm, SoloComm) or comm.rank != 0:
        return None
    return pool.submit(read_metadata_bytes, storage, speculative)


def share_manifest(comm: SoloComm | GroupComm, storage: Storage, started: cf.Future | None = None, *,
                   speculative: bool = False) -> mf.Manifest:
    """Rank 0 reads the checkpoint's metadata (or takes what ``started`` read); every rank
    gets the same Manifest.

    Our own manifest goes out as the bytes stored and every rank parses it at once;
    a manifest built from other formats' headers goes out as our JSON.
    ``speculative`` (rank 0's decides; ``started`` says it for itself): see ``read_metadata_bytes``.
    """
    return shared_manifest(comm, storage, started, speculative=speculative)[0]


def shared_manifest(comm: SoloComm | GroupComm, storage: Storage, started: cf.Future | None = None, *,
                    speculative: bool = False) -> tuple[mf.Manifest, str]:
    """``share_manifest``, and the URI rank 0 read it from (its ``storage.describe("")``):
    a rank whose own differs was given another ``uri`` than rank 0 (``same_uri``)."""
    if isinstance(comm, SoloComm):
        return read_manifest(storage, speculative=speculative), storage.describe("")
    blob: bytes | None = None
    own: BaseException | None = None
    if comm.rank == 0:
        where = storage.describe("").encode()
        try:
            meta = started.result() if started is not None else read_metadata_bytes(storage, speculative)
            blob = b"M" + len(where).to_bytes(4, "little") + where + meta
        except CheckpointError as e:
            own = e
            blob = b"E" + json.dumps(encode_error(e, 0)).encode()
    data = comm.broadcast_bytes(blob, src=0)
    if data[:1] == b"E":
        raise_agreed([json.loads(data[1:])], own)
    n = int.from_bytes(data[1:5], "little")
    source = data[5:5 + n].decode()
    return mf.from_json(data[5 + n:], where=storage.describe(mf.MANIFEST_NAME)), source


def same_uri(comm: SoloComm | GroupComm, storage: Storage, source: str, call: str = "sc.load") -> None:
    """A collective call reads one checkpoint: rank 0's manifest is every rank's, so a rank
    given another ``uri`` would read its data files from the wrong prefix (or the right ones
    under the wrong manifest)."""
    mine = storage.describe("")
    if mine != source:
        raise CheckpointError(
            f"rank {comm.rank} was given uri {mine}, rank 0 {source}: {call} is collective, every rank of the "
            f"group reads the same checkpoint; pass the same uri on every rank (or call it without a process "
            f"group on each rank alone)")


def fail_together(comm: SoloComm | GroupComm, own: CheckpointError) -> NoReturn:
    """A rank whose load failed before the load's first collective (a bad argument, an unknown
    storage option) takes part in it with its error: every rank raises it, none waits for this one."""
    gather_targets(comm, [], own, "sc.load")
    raise own  # pragma: no cover - gather_targets raised (alone: this error; in a group: the agreed one)


@dataclass(slots=True)
class LoadRequest:
    state_dict: Mapping[str, Any]
    strict: bool
    options: PlanOptions
    transforms: Any  # streamckpt.transforms.Transforms | None
    progress: Callable[[int], None] | None = None
    manifest: mf.Manifest | None = None  # already read by the caller (single process)
    cuda: CudaApi | None = None  # the CUDA runtime (TorchCuda unless a test injects a stand-in)
    # files only some ranks can read (a memory/peer tier's local copies): file -> those ranks. With it,
    # ``manifest`` is every rank's (no rank reads one), and the plan is made whole on every rank and
    # its reads moved to allowed ranks (``plan.holders``); ``on_plan`` sees that plan
    holders: Mapping[str, Sequence[int]] | None = None
    on_plan: Callable[[LoadPlan], None] | None = None


def _metadata_and_specs(comm: SoloComm | GroupComm, storage: Storage, specs: list[TargetSpec],
                        own: BaseException | None, speculative: bool,
                        ) -> tuple[tuple[mf.Manifest, str], Sequence[Sequence[TargetSpec]]]:
    """The manifest and every rank's target specs; rank 0's metadata requests run while
    the ranks exchange their specs (the same collectives, in the same order, everywhere)."""
    with cf.ThreadPoolExecutor(1, thread_name_prefix="streamckpt-metadata") as pool:
        started = start_metadata(comm, storage, pool, speculative)
        try:
            all_specs = gather_targets(comm, specs, own, "sc.load")
        except BaseException:
            if started is not None:
                started.cancel()
            raise
        return shared_manifest(comm, storage, started, speculative=speculative), all_specs


def _check_not_tensors(values: Sequence[ValueSlot], view: Any) -> None:
    """A leaf that is no tensor (a numpy array, a list) where the checkpoint holds a tensor is
    not a missing key, as it would otherwise be reported: say what to pass instead."""
    for v in values:
        if v.value is not None and v.key in view.tensors:
            meta = view.tensors[v.key]
            raise IncompatibleStateDictError(
                f"{v.key}: the checkpoint holds a tensor here ({getattr(meta, 'dtype', '?')} "
                f"{list(getattr(meta, 'shape', ()))}), the state_dict a {type(v.value).__name__}: pass a torch "
                f"tensor to fill in place (torch.from_numpy(array) shares an array's memory), or read it with "
                f"sc.load_state / sc.load_full")


def _view(manifest: mf.Manifest, transforms: Any) -> Any:
    if transforms is None:
        return IdentityView(manifest)
    source = {k: (t.shape, t.dtype) for k, t in manifest.tensors.items()}
    return transforms.apply(source)


def run_load(comm: SoloComm | GroupComm, storage: Storage, req: LoadRequest) -> LoadResult:
    """One load. A DCP checkpoint is first tried with predicted item layouts (verified
    as part of the load); if any rank finds a prediction wrong, every rank locates
    the items exactly and loads again (targets' contents are unspecified until then)."""
    t0 = time.perf_counter()
    throttled0 = storage.throttled_responses
    own: BaseException | None = None
    targets: list[LocalTarget] = []
    values: list[ValueSlot] = []
    cuda = req.cuda if req.cuda is not None else TorchCuda()
    try:
        targets, values = collect(req.state_dict)
        comm.prefer_device(cuda_devices(cuda, (t.tensor for t in targets)))
    except CheckpointError as e:
        own = e
    source = storage.describe("")
    if req.manifest is not None and (isinstance(comm, SoloComm) or req.holders is not None):
        manifest = req.manifest
        all_specs = gather_targets(comm, [t.spec for t in targets], own, "sc.load")
    else:
        (manifest, source), all_specs = _metadata_and_specs(comm, storage, [t.spec for t in targets], own,
                                                            speculative=req.transforms is None)
    req = dataclasses.replace(req, options=with_nodes(comm, req.options))
    result, mismatch = _attempt(comm, storage, req, manifest, all_specs, targets, values, cuda, t0, throttled0,
                                source)
    if result is None:
        log.info("streamckpt load %s: a DCP item's layout is not the predicted one (first: %s); "
                 "locating every item exactly and loading again", storage.describe(""), mismatch)
        exact = share_manifest(comm, storage)
        result, mismatch = _attempt(comm, storage, req, exact, all_specs, targets, values, cuda, t0, throttled0)
        if result is None:  # pragma: no cover - an exact manifest predicts nothing
            raise CheckpointError(f"internal: predicted layout after exact locating ({mismatch})")
    return result


def with_nodes(comm: SoloComm | GroupComm, options: PlanOptions) -> PlanOptions:
    """``options`` with ``ranks_per_node`` from torchrun's environment, when every rank agrees.

    The planner relays a piece many ranks need so that it enters each node once
    (``plan.routes.node_grid``), so it must know which ranks share a node, alike on every
    rank. torchrun numbers ranks node by node (``RANK = node * LOCAL_WORLD_SIZE +
    LOCAL_RANK``); a rank whose environment says otherwise (another launcher, a
    sub-group, uneven nodes) reports 0, and one collective of two integers tells every
    rank whether all reported the same size. Without it the ranks count as one node.
    Only a group larger than ``max_peers + 1`` (where relays happen) pays for it.
    """
    if options.ranks_per_node or comm.world_size <= options.relay_above:
        return options
    local = local_world_size(comm.rank)
    top, neg = comm.max_ints([local, -local])
    agreed = top if top > 0 and top == -neg and comm.world_size % top == 0 else 0
    return dataclasses.replace(options, ranks_per_node=agreed) if agreed else options


def local_world_size(rank: int) -> int:
    """Ranks per node by torchrun's variables, if they number this rank node by node; else 0."""
    try:
        size = int(os.environ["LOCAL_WORLD_SIZE"])
        local = int(os.environ["LOCAL_RANK"])
        global_rank = int(os.environ["RANK"])
    except (KeyError, ValueError):
        return 0
    if size < 1 or global_rank != rank or rank % size != local:
        return 0
    return size


def _attempt(comm: SoloComm | GroupComm, storage: Storage, req: LoadRequest, manifest: mf.Manifest,
             all_specs: Sequence[Sequence[TargetSpec]], targets: list[LocalTarget], values: list[ValueSlot],
             cuda: CudaApi, t0: float, throttled0: int, source: str | None = None,
             ) -> tuple[LoadResult | None, str | None]:
    """Plan and run the load; (None, first mismatch) when a predicted DCP head was wrong
    on any rank (agreed). With a predicted manifest, the ranks exchange the heads they
    verify in a second, small gather (the first ran before the manifest was known)."""
    own: BaseException | None = None
    checked: list[spec.Checked] = []
    checks: list[spec.Head] = []
    heads: list[spec.Head] = []
    speculative = spec.is_speculative(manifest)  # alike on every rank
    if speculative:
        try:
            everything = req.transforms is not None  # its targets do not name chunks: verify all
            checks = spec.all_checks(manifest)
            mine_heads = spec.covering(checks, None if everything else {t.spec.key for t in targets})
            checked = spec.head_targets(mine_heads, [t.spec for t in targets], everything,
                                        _head_alloc(cuda, [t.tensor for t in targets]))
        except CheckpointError as e:
            own = e
    mine = targets + [c.target for c in checked]
    if speculative:  # alike on every rank: the same collective everywhere
        head_specs = gather_targets(comm, [c.target.spec for c in checked], own)
        all_specs = [[*a, *h] for a, h in zip(all_specs, head_specs)]
    plan: LoadPlan | None = None
    placement: Placement | None = None
    view: Any = None
    missing: list[str] = []
    vplan = ValuePlan()
    # on a mixed cpu:gloo,cuda:nccl group a load into CPU tensors only keeps its data on gloo
    comm.choose_data_plane(bool(cuda_devices(cuda, (t.tensor for t in mine))))  # on every rank
    try:
        if source is not None:
            same_uri(comm, storage, source)  # before any other verdict: the others follow from it
        placement = place(cuda, [t.tensor for t in mine], comm.data_device)
        view = _view(manifest, req.transforms)
        heads = spec.planned_heads(checks, all_specs) if speculative else []
        plan_manifest = spec.augment(manifest, heads) if heads else manifest
        plan_view = view if not heads else (
            IdentityView(plan_manifest) if req.transforms is None else spec.HeadsView(view, heads))
        plan = build_plan(plan_manifest, all_specs, req.options, plan_view,
                          rank=comm.rank if req.holders is None else None)
        if req.holders is not None:
            constrain_readers(plan, req.holders)
            if req.on_plan is not None:
                req.on_plan(plan)
        if req.strict:  # strict=False leaves it alone, as any key it cannot fill (warn_missing names it)
            _check_not_tensors(values, view)
        vplan = plan_values(values, manifest.values, _unloadable(manifest))
        missing = plan.missing[comm.rank] + vplan.missing
        any_missing = any(plan.missing) or bool(missing)
        if req.strict and any_missing:
            mine_missing = sorted(set(missing))
            clash = kind_clash(mine_missing, {t.spec.key for t in targets}, view.tensors, manifest.values)
            if clash is not None:
                raise IncompatibleStateDictError(clash)
            raise MissingKeysError(
                f"{len(mine_missing)} key(s) of the state_dict are not in the checkpoint {storage.describe('')}: "
                f"{', '.join(mine_missing[:10])}{' ...' if len(mine_missing) > 10 else ''}"
                f"{_why_unloadable(manifest, mine_missing)}{_near(mine_missing, manifest.tensors)}"
                f" (use strict=False to load the rest)"
                if mine_missing else "another rank's state_dict has keys missing from the checkpoint",
                missing_keys=mine_missing,
            )
        if not req.strict:
            gone = sorted(set(missing))
            warn_missing(storage.describe(""), gone, {t.spec.key for t in targets} | {v.key for v in values},
                         set(view.tensors) | set(manifest.values), _why_unloadable(manifest, gone))
    except CheckpointError as e:
        own = e
    comm.agree(own)
    if plan is None or placement is None:  # pragma: no cover - agree() raised already
        raise CheckpointError("internal: no plan after agreement")
    settle_rounds(plan, comm.max_ints)
    dest = Destinations({
        uid: t.tensor for uid, t in zip(plan.rank_targets[comm.rank], mine) if uid >= 0
    })
    t_data = time.perf_counter()
    with torch.no_grad():
        stats = Executor(plan, comm, storage, dest, progress=req.progress, placement=placement).run()
    throttled = storage.throttled_responses - throttled0
    job = requestrate.gather_job(comm, stats.requests, throttled, time.perf_counter() - t_data,
                                 _request_prefix(storage, manifest))
    if speculative:
        bad = spec.first_mismatch(checked, lambda t: _to_host(cuda, t))
        if comm.max_ints([1 if bad is not None else 0])[0]:
            return None, bad or "on another rank"
    for slot, value in vplan.assign:
        if isinstance(slot.container, tuple):  # immutable in place: the caller keeps its element
            log.debug("%s: a value inside a tuple is not replaced in place (sc.load_state returns it)", slot.key)
            continue
        slot.container[slot.name] = value
    mine_keys = {t.spec.key for t in targets} | {v.key for v in values} | vplan.used | set(vplan.missing)
    view_names = set(view.tensors)
    result = LoadResult(
        missing_keys=sorted(set(missing)),
        unexpected_keys=sorted(k for k in view_names | set(manifest.values) | _unloadable(manifest) if k not in mine_keys),
        bytes_read=stats.bytes_read,
        bytes_needed=sum(t.spec.nbytes for t in targets if t.spec.key not in missing),
        requests=stats.requests,
        bytes_sent=stats.bytes_sent,
        bytes_received=stats.bytes_received,
        seconds=time.perf_counter() - t0,
        rounds=stats.rounds,
        staging_bytes=stats.staging_bytes,
        kind=manifest.kind,
        bytes_direct=stats.bytes_direct,
        throttled_requests=throttled,
        job_requests=job.requests,
        job_throttled_requests=job.throttled,
        job_requests_per_s=job.per_second,
        request_prefix=job.prefix,
    )
    if comm.rank == 0:
        log.info("streamckpt load %s: %s", storage.describe(""), result)
        warning = requestrate.over_limit(job, requestrate.get_limit())
        if warning:
            log.warning("streamckpt load %s: %s", storage.describe(""), warning)
    return result, None


def _request_prefix(storage: Storage, manifest: mf.Manifest) -> str:
    """The key prefix the checkpoint's data files share, as a URI (``s3://bucket/ckpt/data/``):
    the same on every rank (it depends on the manifest alone)."""
    return prefix_uri(storage.uri, [storage.path(name) for name in manifest.files] or [storage.path("")])


def _head_alloc(cuda: CudaApi, tensors: Sequence[torch.Tensor]) -> Callable[[int], torch.Tensor]:
    """Where a DCP check's bytes land: this rank's GPU (through ``cuda``) when its targets are
    there, so checks take the GPU path with them; else host memory."""
    device = next((d for d in map(cuda.device_of, tensors) if d.type == "cuda"), None)
    if device is None:
        return lambda n: torch.empty(n, dtype=torch.uint8)
    return lambda n: cuda.empty(n, device, cuda.current_stream(device))


def _to_host(cuda: CudaApi, t: torch.Tensor) -> torch.Tensor:
    """A check's bytes on the host; a GPU one after the caller's stream, which follows the load."""
    device = cuda.device_of(t)
    return cuda.download(t, cuda.current_stream(device)) if device.type == "cuda" else t


def _unloadable(manifest: mf.Manifest) -> set[str]:
    """Entries a foreign checkpoint holds that cannot be restored (e.g. pickled DCP objects)."""
    keys = manifest.metadata.get("unloadable_keys", ())
    return {k for k in keys if isinstance(k, str)} if isinstance(keys, (list, tuple)) else set()


def _why_unloadable(manifest: mf.Manifest, keys: list[str]) -> str:
    """Why keys the checkpoint holds could not be restored (DCP objects outside the allow-list)."""
    reasons = manifest.metadata.get("unloadable_reasons")
    found = [(k, reasons[k]) for k in keys if k in reasons] if isinstance(reasons, dict) else []
    if not found:
        return ""
    return "; of these, stored but not restorable: " + "; ".join(f"{k}: {r}" for k, r in found[:5])


def _near(missing: list[str], names: Any) -> str:
    """Why the keys may be missing: a wrapper's prefix, or a near spelling."""
    return prefix_hint(missing, names) or close_to(missing, names)
