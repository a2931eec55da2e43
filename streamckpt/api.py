"""The public functions: wiring of storage, formats, planner, pipeline and comm."""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from .comm import SoloComm, make_comm
from .core import dtypes, tree as trees
from .errors import CheckpointError, MissingKeysError, close_to
from .formats import read_manifest
from .formats.native import latest_committed
from .loading.loader import LoadRequest, run_load
from .plan.planner import PlanOptions
from .results import CheckpointInfo, DtypeName, LoadResult, SaveResult, TensorInfo
from .saving.saver import run_save
from .storage import Storage

log = logging.getLogger(__name__)


def _transforms(obj: Any, storage_options: dict[str, Any] | None) -> Any:
    if obj is None:
        return None
    from .transforms import as_transforms

    return as_transforms(obj, storage_options)


def _positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            raise CheckpointError(f"{name} must be a positive number, got {value!r}")


def save(
    state_dict: Mapping[str, Any],
    uri: str,
    *,
    storage_options: dict[str, Any] | None = None,
    process_group: Any = None,
    compression: str | None = None,
    metadata: dict[str, Any] | None = None,
    overwrite: bool = False,
) -> SaveResult:
    """Save a (sharded) state_dict to ``uri``; collective when a group is initialized."""
    comm = make_comm(process_group)
    storage = Storage(uri, storage_options)
    try:
        return run_save(comm, storage, state_dict, compression=compression, metadata=metadata, overwrite=overwrite)
    finally:
        storage.close()


def load(
    state_dict: Mapping[str, Any],
    uri: str,
    *,
    storage_options: dict[str, Any] | None = None,
    process_group: Any = None,
    transforms: Any = None,
    strict: bool = True,
    read_once: bool = True,
    memory_budget: int = 256 * 2**20,
    max_concurrency: int = 32,
    progress: Callable[[int], None] | None = None,
) -> LoadResult:
    """Fill ``state_dict``'s tensors in place from the checkpoint at ``uri``."""
    _positive(memory_budget=memory_budget, max_concurrency=max_concurrency)
    comm = make_comm(process_group)
    storage = Storage(uri, storage_options, max_concurrency=max_concurrency)
    # response bodies a native client holds before the copy count against the budget too
    staging_budget = storage.reserve_inflight(memory_budget)
    try:
        req = LoadRequest(
            state_dict=state_dict,
            strict=strict,
            options=PlanOptions(memory_budget=staging_budget, read_once=read_once),
            transforms=_transforms(transforms, storage_options),
            progress=progress,
        )
        return run_load(comm, storage, req)
    finally:
        storage.close()


def load_full(
    uri: str,
    *,
    keys: Iterable[str] | None = None,
    storage_options: dict[str, Any] | None = None,
    transforms: Any = None,
    memory_budget: int = 256 * 2**20,
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """Every tensor (or ``keys``) of a checkpoint, whole, in this process."""
    _positive(memory_budget=memory_budget)
    storage = Storage(uri, storage_options)
    try:
        manifest = read_manifest(storage)
        tf = _transforms(transforms, storage_options)
        if tf is not None:
            view = tf.apply({k: (t.shape, t.dtype) for k, t in manifest.tensors.items()})
            shapes = {k: (tuple(v.shape), v.dtype) for k, v in view.tensors.items()}
        else:
            shapes = {k: (t.shape, t.dtype) for k, t in manifest.tensors.items()}
        wanted = list(shapes) if keys is None else list(keys)
        absent = [k for k in wanted if k not in shapes]
        if absent:
            raise MissingKeysError(
                f"{len(absent)} key(s) not in {storage.describe('')}: {', '.join(absent[:10])}"
                f"{close_to(absent, shapes)}", missing_keys=absent
            )
        return _read_whole(storage, manifest, {k: shapes[k] for k in wanted}, device, memory_budget, tf)
    finally:
        storage.close()


def load_state(
    uri: str,
    *,
    storage_options: dict[str, Any] | None = None,
    device: str | torch.device = "cpu",
    keys: Iterable[str] | None = None,
    memory_budget: int = 256 * 2**20,
) -> Any:
    """The checkpoint as it was saved, the streaming twin of ``torch.load`` (no pickle).

    The same nesting, key types (str and int), tuples vs lists and values, every tensor
    whole on ``device``, whatever rank layout saved it. ``keys``: dotted prefixes (such
    as ``["model"]`` or ``["optim.state"]``) to read only those subtrees. A checkpoint
    that recorded no structure (Hugging Face files, an older native checkpoint) comes back
    as one flat dict of its dotted keys; a DCP checkpoint is rebuilt from its planner's
    paths as DCP rebuilds it (dict keys as strings, list indices as lists)."""
    _positive(memory_budget=memory_budget)
    storage = Storage(uri, storage_options)
    try:
        manifest = read_manifest(storage)
        doc = manifest.tree if manifest.tree is not None else trees.flat(manifest.tensors, manifest.values)
        doc = trees.select(doc, keys, where=storage.describe(""))
        shapes = {k: (manifest.tensors[k].shape, manifest.tensors[k].dtype) for k in trees.tensor_keys(doc)}
        tensors = _read_whole(storage, manifest, shapes, device, memory_budget, None)
        return trees.build(doc, tensors, manifest.values)
    finally:
        storage.close()


def _read_whole(storage: Storage, manifest: Any, shapes: Mapping[str, tuple[Sequence[int], str]],
                device: str | torch.device, memory_budget: int, transforms: Any) -> dict[str, torch.Tensor]:
    """Tensors of the given (view) shapes, whole, in this process."""
    out = {k: torch.empty(tuple(shape), dtype=dtypes.to_torch(dt), device=device) for k, (shape, dt) in shapes.items()}
    options = PlanOptions(memory_budget=storage.reserve_inflight(memory_budget))
    request = LoadRequest(out, strict=True, options=options, transforms=transforms, manifest=manifest)
    run_load(SoloComm(), storage, request)
    return out


def inspect(uri: str, *, storage_options: dict[str, Any] | None = None) -> CheckpointInfo:
    """Describe a checkpoint (any supported kind) from its metadata alone."""
    storage = Storage(uri, storage_options)
    try:
        m = read_manifest(storage)
    finally:
        storage.close()
    tensors = {
        k: TensorInfo(shape=tuple(t.shape), dtype=DtypeName(t.dtype), shards=len(t.shards), bytes=t.nbytes)
        for k, t in m.tensors.items()
    }
    return CheckpointInfo(
        uri=storage.describe("").rstrip("/"), kind=m.kind, tensors=tensors, total_bytes=m.total_bytes,
        metadata=m.metadata, values=m.values, files=dict(m.files),
    )


def latest(root_uri: str, *, storage_options: dict[str, Any] | None = None) -> str | None:
    """The newest committed checkpoint directly under ``root_uri`` (by manifest time), or None."""
    storage = Storage(root_uri, storage_options)
    try:
        child = latest_committed(storage)
    finally:
        storage.close()
    return None if child is None else f"{str(root_uri).rstrip('/')}/{child}"


def merge(
    uri: str,
    out_uri: str,
    *,
    max_shard_bytes: int = 5 * 2**30,
    skip: Sequence[str] = (),
    storage_options: dict[str, Any] | None = None,
    out_storage_options: dict[str, Any] | None = None,
    process_group: Any = None,
) -> None:
    """Write a checkpoint as a Hugging Face safetensors directory (see streamckpt.merging); the output
    reuses ``storage_options`` unless ``out_storage_options`` are given."""
    from .merging import merge as _merge

    _merge(uri, out_uri, max_shard_bytes=max_shard_bytes, skip=skip, storage_options=storage_options,
           out_storage_options=out_storage_options, process_group=process_group)
