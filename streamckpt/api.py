"""The public functions: wiring of storage, formats, planner, pipeline and comm."""

from __future__ import annotations

import contextlib
import logging
import os
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

import torch

from .comm import SoloComm, make_comm
from .cuda.device import checked_device
from .core import dtypes, tree as trees
from .core.stateful import Expanded, Stateful, expand
from .core.manifest import MANIFEST_NAME
from .errors import CheckpointError, MissingKeysError, close_to
from .formats import read_manifest
from .formats.native import latest_committed
from .loading.loader import LoadRequest, run_load
from .loading.loader import fail_together as load_fails_together
from .manage import Calls, Manager, Restored
from .manage.copying import copy_checkpoint
from .manage.references import check_unreferenced
from .optimizers import state_of
from .plan.planner import PlanOptions
from .progress import reporter, reporting
from .results import CheckpointInfo, CopyResult, DtypeName, LoadResult, SaveResult, TensorInfo
from .saving.asyncsave import SaveHandle, start_save
from .saving.saver import fail_together as save_fails_together
from .saving.saver import run_save
from .storage import Storage

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from .transforms import Transforms

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


def _key_list(keys: Iterable[str] | None) -> list[str] | None:
    """``keys=`` as a list: one string is one key (iterating it would ask for its letters,
    and ``keys="wb"`` read the tensors ``w`` and ``b``)."""
    if keys is None:
        return None
    return [keys] if isinstance(keys, str) else list(keys)


def save(
    state_dict: Mapping[str, Any] | Stateful,
    uri: str,
    *,
    storage_options: dict[str, Any] | None = None,
    process_group: ProcessGroup | None = None,
    compression: str | None = None,
    metadata: dict[str, Any] | None = None,
    overwrite: bool = False,
    progress: Callable[[int], None] | bool | None = None,
    base: str | None = None,
) -> SaveResult:
    """Save a (sharded) state_dict as a streamckpt checkpoint at ``uri``.

    Collective when torch.distributed is initialized (or ``process_group`` is given): every
    rank of the group calls it with its own shards, each distinct shard is written once
    (replicas by one of their holders, balanced by bytes), and rank 0 writes
    ``manifest.json`` last, which commits the checkpoint. It returns on every rank after the
    commit, or raises the same error on every rank; a save that fails leaves no manifest,
    so ``latest`` never returns it and an older checkpoint stays whole.

    Args:
        state_dict: A mapping of str keys to values: ``torch.Tensor`` (a whole tensor; ranks
            that hold the same key hold replicas), ``DTensor`` (``Shard``/``Replicate``
            placements), ``sc.ShardedTensor`` (this rank's box or flat range of a global
            tensor), nested dicts (str or int keys), lists and tuples of these, and plain
            values (None, bool, int, float, str) stored in the manifest. An object with
            ``state_dict()`` and ``load_state_dict()`` (DCP's ``Stateful``: a module, an
            optimizer, a scheduler, your own) stands for its ``state_dict()`` (an optimizer whose
            model is in the same state: torch's ``get_optimizer_state_dict``, keyed by parameter
            name); a numpy array for a tensor.
        uri: Where to write: any fsspec URL (``s3://bucket/prefix``, ``gs://``, ``az://``,
            ``file://``) or a local path; a directory, not a file name.
        storage_options: Passed to fsspec unchanged (for s3fs: ``endpoint_url``, ``key``,
            ``secret``, ``client_kwargs``, ...). Default None: the environment's credentials.
        process_group: The torch.distributed group whose ranks save together. Default None:
            the default group when torch.distributed is initialized, else this process alone.
        compression: None (default: data files are valid safetensors files) or ``"zstd"``
            (independent zstd frames per checksum chunk, so a slice still costs only the
            frames that cover it).
        metadata: A JSON-serializable dict stored in the manifest (``sc.inspect(uri).metadata``).
            Default None: an empty dict.
        overwrite: Replace a committed checkpoint at ``uri``. Default False: refuse it. A
            checkpoint whose files later incremental saves reference (it was their ``base``)
            is refused even so (``CheckpointInUseError``), before anything is written.
        progress: None (default) or False: no report. A callable: called on this rank with the bytes
            this rank has just stored (each data file once uploaded, then the manifest on
            rank 0), so its calls add up to ``SaveResult.bytes_written``; when it has an
            ``add_total(nbytes)`` method, that is called first with the bytes to expect
            (uncompressed saves). True: a bar on stderr when it is a terminal, a line every
            few seconds otherwise (rank 0's bytes in a group).
        base: An incremental save's base: the URI of a committed streamckpt checkpoint under
            the same root as ``uri`` (a sibling, ``root/step-1`` for ``root/step-2``), read with
            the same ``storage_options``. A shard whose dtype, box (and flat range), codec and
            content digest (xxh3-128) equal a base shard's is not uploaded: the manifest points
            at the file that holds its bytes (never at a chain) and lists the siblings it uses.
            Shards match when both saves cut the state the same way (same layout). Default
            None: every shard is uploaded.

    Returns:
        SaveResult: this rank's ``bytes_written``, ``files``, ``seconds`` and ``bytes_reused``.

    Raises:
        CheckpointExistsError: a committed checkpoint is at ``uri`` and ``overwrite`` is False.
        CheckpointInUseError: ``overwrite`` would replace a checkpoint whose files committed
            incremental checkpoints reference (named in the message, with what to do).
        IncompatibleStateDictError: the ranks' shards do not tile every tensor exactly once
            (a gap or an overlap), or a value cannot be stored.
        CheckpointNotFoundError: the bucket or container does not exist.
        StorageError: storage kept failing after retries.
        PeerError: another rank of the group failed.
        CheckpointError: a bad argument (``compression``, ``metadata``, a file ``uri``, ``progress``),
            or a ``base`` that is not a committed streamckpt checkpoint under the same root.

    Example:
        >>> import torch, streamckpt as sc
        >>> sc.save({"w": torch.ones(4)}, "/tmp/ckpt-doc", overwrite=True).files
        ['data/00000-0000.safetensors', 'manifest.json']
    """
    comm = make_comm(process_group)
    with contextlib.ExitStack() as stack:
        try:  # a mistake here on one rank fails the save on every rank, in its first collective
            storage = Storage(uri, storage_options)
            stack.callback(storage.close)
            report = stack.enter_context(reporting(progress, "save", rank=comm.rank, world_size=comm.world_size))
            state_dict = _expanded(state_dict, for_load=False).tree
        except CheckpointError as e:
            save_fails_together(comm, e)
        return run_save(comm, storage, state_dict, compression=compression, metadata=metadata,
                        overwrite=overwrite, progress=report, base=base, storage_options=storage_options,
                        guard=check_unreferenced)


def async_save(
    state_dict: Mapping[str, Any] | Stateful,
    uri: str,
    *,
    storage_options: dict[str, Any] | None = None,
    process_group: ProcessGroup | None = None,
    compression: str | None = None,
    metadata: dict[str, Any] | None = None,
    overwrite: bool = False,
    staging_budget: int | None = None,
    progress: Callable[[int], None] | bool | None = None,
    base: str | None = None,
) -> SaveHandle:
    """Save like ``save``, but return once this rank's share of the state is staged.

    The same arguments write the same checkpoint. The call validates the state and agrees
    with the other ranks on who writes what (errors found then raise from ``async_save``
    itself, on every rank), copies this rank's share into host buffers it owns and returns:
    the caller may change or free its tensors at once and keep training while a background
    thread uploads, commits the manifest and agrees on the outcome over a gloo group of its
    own (never the training group's collectives). At most one async save is in flight per
    process group: a second call first waits for the previous one to end. A process that
    ends with a save in flight (end of script, exception, Ctrl-C) cancels it: nothing is
    committed and what it uploaded is deleted, with one warning line; call ``result()``
    first to keep it (a ``CheckpointManager``'s save is finished instead at a normal end of
    the script). Under SIGTERM nothing is committed and the objects already uploaded
    are left as garbage (no manifest lists them).

    Args:
        state_dict: As in ``save``.
        uri: As in ``save``: where the checkpoint is written.
        storage_options: As in ``save``. Default None.
        process_group: As in ``save``. Default None: the default group when initialized,
            else this process alone.
        compression: None (default) or ``"zstd"``, as in ``save``.
        metadata: A JSON-serializable dict stored in the manifest. Default None.
        overwrite: Replace a committed checkpoint at ``uri``. Default False: refuse it
            (``CheckpointExistsError`` from this call). As in ``save``, never one that
            incremental checkpoints reference (``CheckpointInUseError`` from this call).
        staging_budget: Host bytes this rank may stage through (page-locked for CUDA
            tensors), kept for the next save until ``SaveHandle.release_staging()``. None
            (default): the size of this rank's share. With a smaller budget, items are cut to
            fit and the call returns only once the rest is staged, as the upload frees room.
            Must be positive.
        progress: As in ``save``: a callable receiving the bytes this rank has just stored
            (called from the upload thread; they add up to ``SaveResult.bytes_written``),
            True for a bar or periodic line on stderr (closed when the save ends), None
            (default) for nothing.
        base: As in ``save``: an incremental save's base checkpoint (a committed sibling
            under the same root). The digests are computed in the background from the staged
            copies. Items are cut by ``staging_budget``, so shards match a base saved with the
            same budget (or by ``save`` when the budget is None). Default None.

    Returns:
        SaveHandle: ``result()`` waits for the commit and returns the ``SaveResult``.

    Raises:
        CheckpointExistsError, CheckpointInUseError, IncompatibleStateDictError, CheckpointError: from the call,
            as in ``save`` (also for a bad ``staging_budget``, ``progress`` or ``base``).
        StorageError, PeerError: from ``SaveHandle.result()``, as in ``save``.

    Example:
        >>> import torch, streamckpt as sc
        >>> handle = sc.async_save({"w": torch.ones(4)}, "/tmp/ckpt-doc-async", overwrite=True)
        >>> handle.result(timeout=60).files[-1]
        'manifest.json'
    """
    comm = make_comm(process_group)
    report, bar, failed = None, None, None
    try:
        report, bar = reporter(progress, "async_save", rank=comm.rank, world_size=comm.world_size)
    except CheckpointError as e:  # raised by start_save on every rank, once they can agree on it
        failed = e
    try:
        state_dict = _expanded(state_dict, for_load=False).tree
    except CheckpointError as e:
        failed = failed or e
    try:
        handle = start_save(state_dict, uri, storage_options=storage_options, process_group=process_group,
                            compression=compression, metadata=metadata, overwrite=overwrite,
                            staging_budget=staging_budget, progress=report, base=base, guard=check_unreferenced,
                            failed=failed)
    except BaseException:
        if bar is not None:
            bar.close(failed=True)
        raise
    if bar is not None:
        handle.add_done_callback(lambda h: bar.close(failed=not _committed(h)))
    return handle


def _committed(handle: SaveHandle) -> bool:
    """Whether a save that has ended committed its checkpoint."""
    try:
        handle.result(timeout=0)
    except BaseException:  # noqa: BLE001 - its owner sees the error through result()
        return False
    return True


def load(
    state_dict: Mapping[str, Any] | Stateful,
    uri: str,
    *,
    storage_options: dict[str, Any] | None = None,
    process_group: ProcessGroup | None = None,
    transforms: Transforms | str | os.PathLike[str] | Sequence[Mapping[str, Any]] | Mapping[str, Any] | None = None,
    strict: bool = True,
    read_once: bool = True,
    memory_budget: int = 256 * 2**20,
    max_concurrency: int = 32,
    progress: Callable[[int], None] | bool | None = None,
) -> LoadResult:
    """Fill ``state_dict``'s tensors (and plain values) in place from the checkpoint at ``uri``.

    The checkpoint may be a streamckpt checkpoint, a Hugging Face safetensors directory
    (or one ``*.safetensors`` file or ``*.safetensors.index.json``) or a PyTorch DCP
    directory, saved with any layout: each rank fetches byte ranges of only the slices its
    targets (or a peer it serves) need. Collective when torch.distributed is initialized
    (or ``process_group`` is given): every rank calls it with its own targets, and a failure
    on one rank raises on every rank. Every byte is checksum-verified before the call
    returns; if it raises, the targets' contents are unspecified.

    Args:
        state_dict: The targets, filled in place: ``torch.Tensor`` (the whole tensor),
            ``DTensor``, ``sc.ShardedTensor`` (a box or flat range of a global tensor),
            nested dicts, lists and tuples of these, and plain values (replaced in dicts
            and lists). CPU or CUDA tensors. An object with ``state_dict()`` and
            ``load_state_dict()`` (a module, an optimizer, a scheduler, ...) is restored in place:
            its state dict is filled, then given back through ``load_state_dict()`` (an optimizer
            whose model is in the same state through torch's ``set_optimizer_state_dict``; one
            that has not stepped yet gets its state first). A numpy array is filled in place.
        uri: The checkpoint: any fsspec URL or local path.
        storage_options: Passed to fsspec unchanged (e.g. s3fs ``endpoint_url``, ``key``,
            ``secret``). Default None: the environment's credentials.
        process_group: The torch.distributed group whose ranks load together. Default None:
            the default group when torch.distributed is initialized, else this process alone.
        transforms: How the model's keys are built from the checkpoint's (rename, fuse,
            fuse_qkv, split, transpose, cast, drop; see docs/TRANSFORMS.md): an
            ``sc.Transforms``, the name of a preset shipped with the package
            (``"hf_llama_to_megatron_gqa"``; ``streamckpt.transforms.presets()`` lists them),
            the path or URI of a YAML file (read with ``storage_options``), a list of rule
            dicts, or ``{"rules": [...]}``. Default None: keys match as stored.
        strict: True (default): raise ``MissingKeysError`` when a key of the state_dict is
            not in the checkpoint (on any rank), before any data is read. False: load the
            keys that are there, leave the others as they were, list them in
            ``LoadResult.missing_keys`` and log a WARNING naming them (with near spellings
            among the checkpoint's names), a louder one when no key matched at all.
        read_once: True (default): each needed byte is fetched from storage by exactly one
            rank, which sends it to the other ranks that need it (replicated tensors are read
            1/N by each of N ranks). False: every rank reads all it needs itself, with no
            exchange (more storage traffic, no peer traffic).
        memory_budget: Staging bytes per rank for all buffers together (default 256 MiB):
            the double-buffered rounds of range reads, exchange messages and, for clients
            that hold response bodies (obstore), a share for bodies in flight. Reads that
            land straight in the targets use no staging. A budget below about four checksum
            chunks (1 MiB by default) is exceeded, with a warning. Must be positive.
        max_concurrency: Range requests in flight per rank (default 32); also bounds the
            I/O worker threads of thread-based clients (at most 16). Must be positive.
        progress: None (default) or False: no report. A callable: called on this rank with the bytes
            just read from storage, so its calls add up to ``LoadResult.bytes_read``; when it
            has an ``add_total(nbytes)`` method, that is called first with the bytes the
            plan will read (again for a retried plan). True: a bar on stderr when it is a
            terminal, a line every few seconds otherwise (rank 0's bytes in a group).

    Returns:
        LoadResult: this rank's statistics, ``missing_keys`` and ``unexpected_keys``.

    Raises:
        CheckpointNotFoundError: nothing that looks like a checkpoint is at ``uri``.
        MissingKeysError: ``strict`` and keys are missing (``.missing_keys`` lists them).
        IncompatibleStateDictError: a target's shape, dtype or layout does not fit the
            checkpoint's tensor.
        CorruptCheckpointError: a bad manifest or header, a checksum that fails twice, a
            truncated object (``UnsupportedVersionError`` for an unknown format version).
        TransformError: a transform rule is invalid or does not fit the checkpoint.
        StagingMemoryError: a rank could not allocate its staging memory.
        StorageError: storage kept failing after retries.
        PeerError: another rank of the group failed.
        CheckpointError: a bad argument (a non-positive ``memory_budget``, ``progress``).

    Example:
        >>> import torch, streamckpt as sc
        >>> sc.save({"w": torch.arange(4.0)}, "/tmp/ckpt-doc", overwrite=True).uri != ""
        True
        >>> target = {"w": torch.zeros(4)}
        >>> sc.load(target, "/tmp/ckpt-doc").missing_keys, target["w"].tolist()
        ([], [0.0, 1.0, 2.0, 3.0])
    """
    comm = make_comm(process_group)
    with contextlib.ExitStack() as stack:
        try:  # a mistake here on one rank fails the load on every rank, in its first collective
            _positive(memory_budget=memory_budget, max_concurrency=max_concurrency)
            storage = Storage(uri, storage_options, max_concurrency=max_concurrency)
            stack.callback(storage.close)
            # response bodies a native client holds before the copy count against the budget too
            staging_budget = storage.reserve_inflight(memory_budget)
            report = stack.enter_context(reporting(progress, "load", rank=comm.rank, world_size=comm.world_size))
            tf = _transforms(transforms, storage_options)
            expanded = _expanded(state_dict, for_load=True)
        except CheckpointError as e:
            load_fails_together(comm, e)
        req = LoadRequest(
            state_dict=expanded.tree,
            strict=strict,
            options=PlanOptions(memory_budget=staging_budget, read_once=read_once),
            transforms=tf,
            progress=report,
        )
        result = run_load(comm, storage, req)
        expanded.finish()
        return result


def _expanded(state_dict: Any, *, for_load: bool) -> Expanded:
    """The state with its stateful objects (modules, optimizers, ...) as their state dicts."""
    return expand(state_dict, state_of, for_load=for_load)


def load_full(
    uri: str,
    *,
    keys: Iterable[str] | None = None,
    storage_options: dict[str, Any] | None = None,
    transforms: Transforms | str | os.PathLike[str] | Sequence[Mapping[str, Any]] | Mapping[str, Any] | None = None,
    memory_budget: int = 256 * 2**20,
    device: str | torch.device = "cpu",
    progress: Callable[[int], None] | bool | None = None,
) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint (or those named by ``keys``), whole, in this process.

    Not collective: this process reads everything it returns. Non-tensor values are not
    returned (``load_state`` returns the whole saved tree).

    Args:
        uri: The checkpoint (any supported kind): an fsspec URL or local path.
        keys: The exact tensor names to read (after ``transforms``); one str is one name.
            Default None: all.
        storage_options: Passed to fsspec unchanged. Default None.
        transforms: As in ``load``: the returned names and shapes are the transformed ones.
            Default None.
        memory_budget: Staging bytes for the reads (default 256 MiB), as in ``load``.
        device: Where the tensors are allocated (default ``"cpu"``).
        progress: As in ``load``: a callable receiving the bytes just read (they add up to
            the bytes read from storage), True for a bar or periodic line on stderr, None
            (default) for nothing.

    Returns:
        dict[str, torch.Tensor]: name to tensor, in checkpoint (or ``keys``) order.

    Raises:
        MissingKeysError: a name in ``keys`` is not in the checkpoint (with near spellings).
        CheckpointNotFoundError, CorruptCheckpointError, TransformError, StorageError: as in
            ``load``.
        CheckpointError: a non-positive ``memory_budget``, a bad ``progress``, or a ``device``
            this machine lacks (``"cuda"`` on a CPU-only torch).
    """
    _positive(memory_budget=memory_budget)
    device, keys = checked_device(device), _key_list(keys)
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
        with reporting(progress, "load_full") as report:
            return _read_whole(storage, manifest, {k: shapes[k] for k in wanted}, device, memory_budget, tf, report)
    finally:
        storage.close()


def load_state(
    uri: str,
    *,
    storage_options: dict[str, Any] | None = None,
    device: str | torch.device = "cpu",
    keys: Iterable[str] | None = None,
    memory_budget: int = 256 * 2**20,
    progress: Callable[[int], None] | bool | None = None,
) -> Any:
    """The checkpoint as it was saved, the streaming twin of ``torch.load`` (no pickle).

    The same nesting, key types (str and int), tuples vs lists and values, every tensor
    whole on ``device``, whatever rank layout saved it. A checkpoint that recorded no
    structure (Hugging Face files, an older native checkpoint) comes back as one flat dict
    of its dotted keys; a DCP checkpoint is rebuilt from its planner's paths as DCP
    rebuilds it (dict keys as strings, list indices as lists). Not collective.

    Args:
        uri: The checkpoint (any supported kind): an fsspec URL or local path.
        storage_options: Passed to fsspec unchanged. Default None.
        device: Where the tensors are allocated (default ``"cpu"``).
        keys: Dotted prefixes (such as ``["model"]`` or ``["optim.state"]``) to read only
            those subtrees; one str is one prefix. Default None: everything.
        memory_budget: Staging bytes for the reads (default 256 MiB), as in ``load``.
        progress: As in ``load``: a callable receiving the bytes just read (they add up to
            the bytes read from storage), True for a bar or periodic line on stderr, None
            (default) for nothing.

    Returns:
        The saved object: nested dicts, lists and tuples of tensors and plain values.

    Raises:
        MissingKeysError: a prefix in ``keys`` matches nothing in the checkpoint.
        CheckpointNotFoundError, CorruptCheckpointError, StorageError: as in ``load``.
        CheckpointError: a non-positive ``memory_budget``, a bad ``progress``, or a ``device``
            this machine lacks (``"cuda"`` on a CPU-only torch).

    Example:
        >>> import torch, streamckpt as sc
        >>> _ = sc.save({"model": {"w": torch.ones(2)}, "step": 7}, "/tmp/ckpt-doc", overwrite=True)
        >>> sc.load_state("/tmp/ckpt-doc")["step"]
        7
    """
    _positive(memory_budget=memory_budget)
    device, keys = checked_device(device), _key_list(keys)
    storage = Storage(uri, storage_options)
    try:
        manifest = read_manifest(storage)
        doc = manifest.tree if manifest.tree is not None else trees.flat(manifest.tensors, manifest.values)
        doc = trees.select(doc, keys, where=storage.describe(""))
        shapes = {k: (manifest.tensors[k].shape, manifest.tensors[k].dtype) for k in trees.tensor_keys(doc)}
        with reporting(progress, "load_state") as report:
            tensors = _read_whole(storage, manifest, shapes, device, memory_budget, None, report)
        return trees.build(doc, tensors, manifest.values)
    finally:
        storage.close()


def _read_whole(storage: Storage, manifest: Any, shapes: Mapping[str, tuple[Sequence[int], str]],
                device: str | torch.device, memory_budget: int, transforms: Any,
                progress: Callable[[int], None] | None) -> dict[str, torch.Tensor]:
    """Tensors of the given (view) shapes, whole, in this process."""
    out = {k: torch.empty(tuple(shape), dtype=dtypes.to_torch(dt), device=device) for k, (shape, dt) in shapes.items()}
    options = PlanOptions(memory_budget=storage.reserve_inflight(memory_budget))
    request = LoadRequest(out, strict=True, options=options, transforms=transforms, manifest=manifest,
                          progress=progress)
    run_load(SoloComm(), storage, request)
    return out


def inspect(uri: str, *, storage_options: dict[str, Any] | None = None) -> CheckpointInfo:
    """Describe a checkpoint (any supported kind) from its metadata alone: no tensor data is read.

    Args:
        uri: The checkpoint: an fsspec URL or local path (a streamckpt, Hugging Face
            safetensors or DCP checkpoint).
        storage_options: Passed to fsspec unchanged. Default None.

    Returns:
        CheckpointInfo: its kind, tensors (shape, dtype, shards, bytes), sizes, values and
        metadata; ``print`` it for a table.

    Raises:
        CheckpointNotFoundError: nothing that looks like a checkpoint is at ``uri``.
        CorruptCheckpointError: its manifest or headers are invalid.
        StorageError: storage kept failing after retries.

    Example:
        >>> import torch, streamckpt as sc
        >>> _ = sc.save({"w": torch.ones(2, 3)}, "/tmp/ckpt-doc", overwrite=True)
        >>> info = sc.inspect("/tmp/ckpt-doc")
        >>> info.kind, info.tensors["w"].shape, info.total_bytes
        ('streamckpt', (2, 3), 24)
    """
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
    """The newest committed checkpoint directly under ``root_uri`` (by manifest time), or None.

    Only checkpoints whose ``manifest.json`` exists count, so a save that died half-way is
    never returned.

    Args:
        root_uri: The prefix that holds one checkpoint per child (``.../run-1`` holding
            ``step-100``, ``step-200``, ...).
        storage_options: Passed to fsspec unchanged. Default None.

    Returns:
        str | None: ``root_uri`` joined with the newest committed child, or None when there is none.

    Raises:
        StorageError: storage kept failing after retries.
    """
    storage = Storage(root_uri, storage_options)
    try:
        child = latest_committed(storage)
        if child is None and storage.modified(MANIFEST_NAME) is not None:  # a checkpoint, not a run's root
            root = storage.describe("").rstrip("/")
            log.warning("latest: %s is itself a committed checkpoint, not a run's root: latest looks at the "
                        "checkpoints directly under a root (this one's is %s); taking this None for 'start "
                        "fresh' would pass over it", root, root.rpartition("/")[0])
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
    process_group: ProcessGroup | None = None,
    progress: Callable[[int], None] | bool | None = None,
) -> None:
    """Write the checkpoint at ``uri`` as a Hugging Face safetensors directory at ``out_uri``.

    The output is ``model-00001-of-0000N.safetensors`` files plus
    ``model.safetensors.index.json`` (``metadata.total_size`` and ``weight_map``), which
    ``transformers`` and ``safetensors`` open. Tensors are streamed through bounded memory,
    never a whole file. Collective when torch.distributed is initialized (or
    ``process_group`` is given): the output files are shared out among the ranks and rank
    0 writes the index after every file is committed.

    Args:
        uri: The checkpoint to merge (any supported kind).
        out_uri: The output directory: an fsspec URL or local path.
        max_shard_bytes: Largest output file in tensor bytes (default 5 GiB); a larger
            tensor gets a file of its own.
        skip: Key suffixes to leave out (e.g. ``(".rotary_emb.inv_freq",)``); a str is one
            suffix. Default: keep everything.
        storage_options: fsspec options for reading ``uri``. Default None.
        out_storage_options: fsspec options for writing ``out_uri``. Default None: the same
            as ``storage_options`` (the same store), never a default endpoint.
        process_group: The torch.distributed group whose ranks merge together. Default None:
            the default group when initialized, else this process alone.
        progress: None (default) or False: no report. A callable: called on this rank with the tensor
            bytes it has just written, so its calls add up to this rank's share of the
            tensors' bytes. True: a bar on stderr when it is a terminal, a line every few
            seconds otherwise (rank 0's bytes in a group).

    Returns:
        None.

    Raises:
        CheckpointNotFoundError: nothing that looks like a checkpoint is at ``uri``.
        CorruptCheckpointError, StorageError: as in ``load``.
        PeerError: another rank of the group failed.
        CheckpointError: ``out_uri`` names a file, ``skip`` leaves no tensor, or a bad ``progress``.
    """
    from .merging import merge as _merge

    comm = make_comm(process_group)
    with reporting(progress, "merge", rank=comm.rank, world_size=comm.world_size) as report:
        _merge(uri, out_uri, max_shard_bytes=max_shard_bytes, skip=skip, storage_options=storage_options,
               out_storage_options=out_storage_options, process_group=process_group, progress=report)


def copy(
    uri: str,
    out_uri: str,
    *,
    storage_options: dict[str, Any] | None = None,
    out_storage_options: dict[str, Any] | None = None,
) -> CopyResult:
    """Copy the streamckpt checkpoint at ``uri`` to ``out_uri`` as a self-contained checkpoint,
    or the run whose root ``uri`` is, whole.

    The files an incremental checkpoint references in sibling checkpoints are copied too
    (under ``shared/<sibling>/`` in the copy) and the copy's manifest has no references, so
    it loads after the original root is gone, from another bucket or store. Files are
    streamed in blocks of about 8 MiB (bounded memory) and every checksum chunk is verified
    as it passes; the manifest is written last, so a copy cut short is not committed.
    One process (not collective).

    Given a run's root (no checkpoint of its own; committed checkpoints under it, as
    ``CheckpointManager`` writes them), every committed checkpoint is copied under its own
    name, references kept shared between them as in the source (a pruned base's files
    included), the manifests written last, oldest step first; a checkpoint whose manifest
    cannot be read is left out with a warning (``CopyResult.skipped``).

    Args:
        uri: The checkpoint to copy (a streamckpt checkpoint, full or incremental), or a run's root.
        out_uri: Where to write the copy: an fsspec URL or local path, not holding a
            committed checkpoint.
        storage_options: fsspec options for reading ``uri``. Default None: the environment's
            credentials.
        out_storage_options: fsspec options for writing ``out_uri``. Default None: the same
            as ``storage_options``.

    Returns:
        CopyResult: the checkpoints and files written, bytes and seconds.

    Raises:
        CheckpointNotFoundError: no committed streamckpt checkpoint at ``uri`` nor under it.
        CheckpointExistsError: a committed checkpoint is at ``out_uri`` (delete it first); of a
            run, one of the same name under ``out_uri``.
        CorruptCheckpointError: a bad manifest, or a source chunk failing its checksum twice.
        StorageError: storage kept failing after retries.
        CheckpointError: ``out_uri`` is ``uri`` or inside it.

    Example:
        >>> import torch, streamckpt as sc
        >>> _ = sc.save({"w": torch.ones(4)}, "/tmp/ckpt-doc-src", overwrite=True)
        >>> import shutil; shutil.rmtree("/tmp/ckpt-doc-copy", ignore_errors=True)
        >>> sc.copy("/tmp/ckpt-doc-src", "/tmp/ckpt-doc-copy").bytes_written > 16
        True
        >>> sc.load_full("/tmp/ckpt-doc-copy")["w"].tolist()
        [1.0, 1.0, 1.0, 1.0]
    """
    return copy_checkpoint(uri, out_uri, storage_options=storage_options, out_storage_options=out_storage_options)


class CheckpointManager(Manager):
    __doc__ = Manager.__doc__
    _calls = Calls(save=save, async_save=async_save, load=load, load_state=load_state, expand=_expanded)


__all__ = ["save", "async_save", "load", "load_full", "load_state", "inspect", "latest", "merge", "copy",
           "CheckpointManager", "Restored"]
