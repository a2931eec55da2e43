"""``StreamCheckpointIO``: Lightning's checkpoints to and from object storage, without pickle.

One argument switches a ``Trainer`` from ``torch.save`` files to streamckpt checkpoints::

    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from streamckpt.lightning import StreamCheckpointIO

    opts = {"endpoint_url": "http://127.0.0.1:9000"}          # s3fs options, as for sc.save
    trainer = Trainer(plugins=[StreamCheckpointIO(storage_options=opts)],
                      callbacks=[ModelCheckpoint(dirpath="s3://bucket/run/ckpts", monitor="val_loss")])
    trainer.fit(model)                                          # saves s3://bucket/run/ckpts/epoch=..ckpt
    trainer.fit(model, ckpt_path="s3://bucket/run/ckpts/epoch=3-step=400.ckpt")   # resumes

``StreamCheckpointIO(storage_options, async_save=True)`` returns from each save once the
state is staged in host memory (``sc.async_save``) and uploads while training goes on; the
next save, a load, a removal of that checkpoint and ``teardown`` (the end of ``fit``) wait
for it and raise its error. Lightning's own ``AsyncCheckpointIO(StreamCheckpointIO(...))``
works too (a thread runs the blocking save on a copy of the tensors; removing or loading a
checkpoint that thread is saving waits for its commit, so ``ModelCheckpoint`` cannot remove a
checkpoint whose upload then lands after the removal).

What a checkpoint is
  Each Lightning checkpoint "file" (``.../epoch=1-step=10.ckpt``) is a streamckpt checkpoint
  *prefix*: ``manifest.json`` (the commit, written last) and ``data/*.safetensors``.
  ``sc.load_state``, ``sc.inspect`` and ``sc.latest(dirpath)`` read it like any other;
  ``LightningModule.load_from_checkpoint`` does not (it calls ``torch.load``): load with
  ``StreamCheckpointIO(opts).load_checkpoint(path)["state_dict"]``, or give the ``Trainer``
  the plugin and ``ckpt_path`` (``fit``, ``validate``, ``test``, ``predict``).
  A save to an existing path replaces it, as Lightning expects (``last.ckpt``).
  ``remove_checkpoint`` deletes the manifest first (``streamckpt.manage.delete_checkpoint``, the
  routine ``CheckpointManager.prune`` uses), so a removal cut short leaves an
  uncommitted prefix, never a checkpoint that loads half.

What it saves (and refuses)
  Lightning's checkpoint dict is saved as it is, tree and all: optimizer states keyed by
  int, tuples (``betas``), ``inf`` (``ReduceLROnPlateau.best``), the loops' and callbacks'
  state, ``hyper_parameters``. ``load_checkpoint`` gives the same tree back; dict and list
  subclasses (``AttributeDict``, ``OrderedDict``) come back as plain ``dict`` / ``list``,
  which is all Lightning's restore needs. A value that is not a tensor or plain data (a
  ``torch.dtype``, an ``nn.Module`` or any object in ``hyper_parameters`` or a callback's
  state) is refused *before anything is written* with ``sc.IncompatibleStateDictError``
  naming its dotted key (e.g. ``hyper_parameters.act``): streamckpt never pickles, so it
  cannot restore an arbitrary object exactly, and it does not guess a lossy conversion.
  Leave such arguments out (``self.save_hyperparameters(ignore=["act"])``) or store a
  plain stand-in (a name, a list).

Loading
  ``map_location``: ``None`` (CPU, where Lightning's restore moves state to the module's
  device), a device or its name, or a dict whose targets are all one device; a callable,
  or a dict mapping to several devices, is refused (``sc.CheckpointError``): the format
  keeps no per-tensor device to remap. ``weights_only`` is accepted and has no effect:
  nothing is ever unpickled. A path without a committed checkpoint raises
  ``sc.CheckpointNotFoundError``.

Storage options and ``ModelCheckpoint``
  ``ModelCheckpoint`` itself checks names on ``dirpath`` (``exists``, a listing at setup)
  through an fsspec filesystem it makes *without* storage options, and Lightning gives a
  ``CheckpointIO`` no hook before that. So the plugin hands its options to fsspec as the
  defaults for ``fsspec_protocol`` (``"s3"``; ``"gs"`` for a GCS ``dirpath``; ``None`` leaves
  fsspec's configuration alone): each option the user has not already set in
  ``fsspec.config.conf[protocol]`` (or ``FSSPEC_S3_*``) is added there, and logged. Without
  that, ``ModelCheckpoint`` would talk to AWS itself (or fail for want of credentials) while
  the checkpoints go to your endpoint. ``save_checkpoint``'s own ``storage_options``
  (``Trainer.save_checkpoint(..., storage_options=)``) are merged over the plugin's for that save.

Distributed
  Lightning calls ``save_checkpoint`` / ``remove_checkpoint`` on global rank 0 only, with
  the whole (DDP-replicated) checkpoint; the save then runs on a one-rank group of that
  process, never as a collective of the training group (which would wait for ranks that
  never call). Strategies that shard the checkpoint themselves (FSDP, DeepSpeed) do not go
  through a ``CheckpointIO``'s full-dict path; use ``streamckpt.dcp`` there.

Needs the ``lightning`` package (``pip install 'streamckpt[lightning]'``); importing
``streamckpt`` alone never imports it.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Mapping

import torch
from lightning.fabric.plugins import CheckpointIO

from . import api
from .errors import CheckpointError, IncompatibleStateDictError
from .manage import delete_checkpoint
from .saving.asyncsave import SaveHandle
from .storage import Storage

log = logging.getLogger(__name__)

__all__ = ["StreamCheckpointIO"]

_HINT = ("; Lightning checkpoints hold only tensors and plain data with streamckpt (no pickle): "
         "leave such hyper-parameters out (self.save_hyperparameters(ignore=[...])) or store a plain "
         "stand-in for them")


class StreamCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` whose checkpoints are streamckpt checkpoints (see the module doc).

    ``Trainer(plugins=[StreamCheckpointIO(opts)], default_root_dir="s3://bucket/run")``:
    each checkpoint path becomes a checkpoint prefix, saved with ``sc.save`` (or
    ``sc.async_save``) and read back with ``sc.load_state`` (no pickle).

    Args:
        storage_options: fsspec options, as for ``sc.save``; they also become fsspec's
            defaults for ``fsspec_protocol``. Default None.
        compression: None (default) or ``"zstd"``, as in ``sc.save``.
        async_save: Upload in the background (``sc.async_save``); the next save, a load of
            the same checkpoint or ``teardown`` waits for it. Default False.
        staging_budget: Host staging bytes of a background save, as in ``sc.async_save``.
            Default None: the whole checkpoint.
        fsspec_protocol: The protocol whose fsspec defaults get ``storage_options``, so
            that ``ModelCheckpoint``'s own filesystem reaches the same store (default
            ``"s3"``; None: leave fsspec's defaults alone).
    """

    def __init__(self, storage_options: dict[str, Any] | None = None, *, compression: str | None = None,
                 async_save: bool = False, staging_budget: int | None = None,
                 fsspec_protocol: str | None = "s3") -> None:
        super().__init__()
        self.storage_options = dict(storage_options or {})
        if fsspec_protocol is not None:
            _fsspec_defaults(fsspec_protocol, self.storage_options)
        self.compression = compression
        self.async_save = async_save
        self.staging_budget = staging_budget
        self._pending: tuple[str, SaveHandle] | None = None
        self._solo: Any = None
        # saves running on any thread, by URI: Lightning's AsyncCheckpointIO saves on its own
        # thread while ModelCheckpoint removes an outranked checkpoint from the main one
        self._saving: dict[str, int] = {}
        self._saved = threading.Condition()

    # ------------------------------------------------------------------ saving

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Save Lightning's checkpoint dict as a checkpoint at the prefix ``path`` (replacing one there)."""
        uri = _uri(path)
        opts = self._options(storage_options)
        self.wait()  # surfaces the previous save's error before starting another
        with self._saved:
            self._saving[uri] = self._saving.get(uri, 0) + 1
        try:
            self._save(checkpoint, uri, opts)
        finally:
            with self._saved:
                self._saving[uri] -= 1
                if not self._saving[uri]:
                    del self._saving[uri]
                self._saved.notify_all()

    def _save(self, checkpoint: dict[str, Any], uri: str, opts: dict[str, Any]) -> None:
        kwargs: dict[str, Any] = dict(storage_options=opts, process_group=self._group(), compression=self.compression,
                                      overwrite=True)
        try:
            if self.async_save:
                handle = api.async_save(checkpoint, uri, staging_budget=self.staging_budget, **kwargs)
                self._pending = (uri, handle)
                log.info("saving the checkpoint to %s in the background", uri)
                return
            result = api.save(checkpoint, uri, **kwargs)
        except IncompatibleStateDictError as e:
            if "cannot be saved" not in str(e):
                raise
            raise IncompatibleStateDictError(f"{e}{_HINT}") from None
        log.info("saved the checkpoint to %s (%d bytes in %.2f s)", uri, result.bytes_written, result.seconds)

    def wait(self) -> None:
        """Wait for the background save in flight, if any; raises its error."""
        if self._pending is None:
            return
        uri, handle = self._pending
        self._pending = None
        result = handle.result()
        log.info("saved the checkpoint to %s (%d bytes in %.2f s)", uri, result.bytes_written, result.seconds)

    def teardown(self) -> None:
        """Lightning's end of a run: the last background save must be committed (or its error raised)."""
        self.wait()

    def _options(self, extra: Any) -> dict[str, Any]:
        if extra is None:
            return dict(self.storage_options)
        if not isinstance(extra, Mapping):
            raise CheckpointError(f"storage_options must be a dict of fsspec options, not {type(extra).__name__}")
        return {**self.storage_options, **extra}

    def _group(self) -> Any:
        """A one-rank group of this process when torch.distributed runs with several ranks:
        Lightning saves on rank 0 alone, so the save must not be a collective of the world."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return None
        if self._solo is None:
            self._solo = dist.new_group(ranks=[dist.get_rank()], backend="gloo", use_local_synchronization=True)
        return self._solo

    # ----------------------------------------------------------------- loading

    def load_checkpoint(self, path: Any, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint dict as it was saved (``weights_only`` is moot: nothing is unpickled)."""
        uri = _uri(path)
        device = _device_of(map_location)
        self.wait()
        self._wait_for(uri)
        state = api.load_state(uri, storage_options=self.storage_options, device=device)
        if not isinstance(state, dict):
            raise CheckpointError(f"{uri} holds no Lightning checkpoint dict (got {type(state).__name__})")
        log.info("loaded the checkpoint from %s", uri)
        return state

    # ---------------------------------------------------------------- removing

    def remove_checkpoint(self, path: Any) -> None:
        """Delete the checkpoint at ``path``: the manifest (its commit) first, then its other objects."""
        uri = _uri(path)
        self._wait_for(uri)
        storage = Storage(uri, self.storage_options)
        try:
            names = delete_checkpoint(storage)
        finally:
            storage.close()
        log.info("removed the checkpoint at %s (%d objects)", uri, len(names))

    def _wait_for(self, uri: str) -> None:
        """Reading or removing the checkpoint being saved must wait for its commit (removing
        another one, as ``ModelCheckpoint`` does right after a save, need not): this plugin's
        background save, or a save another thread is running (``AsyncCheckpointIO``'s; a save
        still queued in its executor is out of sight)."""
        if self._pending is not None and self._pending[0] == uri:
            self.wait()
        with self._saved:
            if self._saving.get(uri):
                log.info("waiting for the save of %s on another thread before removing or reading it", uri)
            self._saved.wait_for(lambda: not self._saving.get(uri))


def _fsspec_defaults(protocol: str, options: Mapping[str, Any]) -> None:
    """Add ``options`` to fsspec's defaults for ``protocol`` where the user set none, so that
    filesystems Lightning makes without options (``ModelCheckpoint``'s) use the same store."""
    import fsspec.config

    if not options:
        return
    conf = fsspec.config.conf.setdefault(protocol, {})
    added = sorted(k for k in options if k not in conf)
    for key in added:
        conf[key] = options[key]
    if added:
        log.info("fsspec's default options for %s:// now include %s (from StreamCheckpointIO's storage_options), "
                 "so ModelCheckpoint reaches the same store", protocol, ", ".join(added))


def _uri(path: Any) -> str:
    """Lightning passes a str or a Path; a prefix never ends with '/' here."""
    return str(path).rstrip("/")


def _device_of(map_location: Any) -> str | torch.device:
    """The one device ``load_state`` puts every tensor on, from Lightning's/torch's ``map_location``."""
    if map_location is None:
        return "cpu"
    if isinstance(map_location, (str, torch.device)):
        return map_location
    if isinstance(map_location, Mapping):
        targets = {str(torch.device(v)) for v in map_location.values()}
        if len(targets) == 1:
            return targets.pop()
        raise CheckpointError(f"map_location {map_location!r} maps to several devices; StreamCheckpointIO loads "
                              f"every tensor onto one device: pass that device (e.g. 'cpu')")
    if callable(map_location):
        raise CheckpointError("map_location as a function is not supported by StreamCheckpointIO (the checkpoint "
                              "keeps no per-tensor device to remap): pass a device such as 'cpu' or 'cuda:0'")
    raise CheckpointError(f"map_location must be None, a device or a dict of devices, "
                          f"not {type(map_location).__name__}")
