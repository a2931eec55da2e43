"""``streamckpt.lightning.StreamCheckpointIO``: a CPU ``Trainer`` checkpointing to the session's
moto S3 server over HTTP.

``ModelCheckpoint(dirpath="s3://...")`` keeps the top 1 (the removed checkpoint's objects are
gone, the kept one is committed), ``fit(ckpt_path=...)`` resumes to exactly the weights and
optimizer state of an uninterrupted run, sync and async, and Lightning's checkpoint tree
(int keys, tuples, inf, an ``AttributeDict``) comes back as saved. ``ModelCheckpoint``'s own
fsspec filesystem (made without options) reaches the server because the plugin hands fsspec its
options as defaults; a user's own fsspec configuration wins.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Iterator

import fsspec
import pytest
import torch

pytest.importorskip("lightning")

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins.io import AsyncCheckpointIO  # noqa: E402
from lightning.pytorch.utilities import AttributeDict  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import streamckpt as sc  # noqa: E402
from streamckpt.lightning import StreamCheckpointIO  # noqa: E402
from streamckpt.storage import Storage  # noqa: E402

STEPS_PER_EPOCH = 4


class Tiny(pl.LightningModule):
    """A two-layer regression with Adam + StepLR: resuming must restore optimizer and scheduler."""

    def __init__(self, hidden: int = 8, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        # a score that grows every epoch: top-1 keeps the newest checkpoint, removes the one before
        self.log("score", float(self.current_epoch))

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr, betas=(0.8, 0.95))
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)]


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8 * STEPS_PER_EPOCH, 4, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=8, shuffle=False)


def trainer(max_epochs: int, io: Any = None, dirpath: str | None = None) -> pl.Trainer:
    callbacks = [] if dirpath is None else [ModelCheckpoint(dirpath=dirpath, monitor="score", mode="max", save_top_k=1)]
    return pl.Trainer(
        max_epochs=max_epochs, accelerator="cpu", devices=1, plugins=[] if io is None else [io], callbacks=callbacks,
        enable_checkpointing=dirpath is not None, logger=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, deterministic=True,
    )


def fit(max_epochs: int, io: Any = None, dirpath: str | None = None, ckpt_path: str | None = None,
        seed: int = 0) -> tuple[Tiny, pl.Trainer]:
    pl.seed_everything(seed, verbose=False)
    model, t = Tiny(), trainer(max_epochs, io, dirpath)
    t.fit(model, train_dataloaders=loader(), val_dataloaders=loader(), ckpt_path=ckpt_path)
    return model, t


@pytest.fixture(autouse=True)
def fsspec_conf_restored() -> Iterator[None]:
    """The plugin adds its options to fsspec's defaults (for ModelCheckpoint's own ``_fs``):
    each test starts and leaves fsspec's configuration as it found it."""
    saved = copy.deepcopy(fsspec.config.conf)
    fsspec.config.conf.pop("s3", None)
    yield
    fsspec.config.conf.clear()
    fsspec.config.conf.update(saved)


def objects(uri: str, opts: dict[str, Any]) -> list[str]:
    storage = Storage(uri, opts)
    try:
        return storage.list("", recursive=True)
    finally:
        storage.close()


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def optimizer_tensors(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    sd = opt.state_dict()
    return {f"{i}.{name}": v for i, st in sd["state"].items() for name, v in st.items()}


def check_top1(dirpath: str, opts: dict[str, Any], t: pl.Trainer, model: Tiny) -> str:
    """The first epoch's checkpoint is gone, the second's is committed and holds the final weights."""
    first = f"{dirpath}/epoch=0-step={STEPS_PER_EPOCH}.ckpt"
    kept = f"{dirpath}/epoch=1-step={2 * STEPS_PER_EPOCH}.ckpt"
    assert t.checkpoint_callback.best_model_path == kept
    assert objects(first, opts) == []
    assert "manifest.json" in objects(kept, opts)
    assert sc.latest(dirpath, storage_options=opts) == kept
    assert [n.rsplit("/", 1)[-1] for n in objects(dirpath, opts) if n.endswith("manifest.json")] == ["manifest.json"]
    state = StreamCheckpointIO(opts).load_checkpoint(kept)
    assert_same_tensors(state["state_dict"], model.state_dict())
    assert state["epoch"] == 1 and state["global_step"] == 2 * STEPS_PER_EPOCH
    assert state["hyper_parameters"] == {"hidden": 8, "lr": 0.05}
    return kept


def resume_matches_uninterrupted(kept: str, opts: dict[str, Any], io: Any) -> None:
    """Resuming from ``kept`` (in a model initialized differently) ends where a straight run ends;
    the resumed ModelCheckpoint (its state restored from ``kept``) goes on keeping the top 1."""
    dirpath = kept.rsplit("/", 1)[0]
    resumed, t_resumed = fit(4, io, dirpath, ckpt_path=kept, seed=123)
    straight, t_straight = fit(4)
    assert t_resumed.global_step == t_straight.global_step == 4 * STEPS_PER_EPOCH
    assert_same_tensors(resumed.state_dict(), straight.state_dict())
    assert_same_tensors(optimizer_tensors(t_resumed.optimizers[0]), optimizer_tensors(t_straight.optimizers[0]))
    sched = [t.lr_scheduler_configs[0].scheduler.state_dict() for t in (t_resumed, t_straight)]
    assert sched[0] == sched[1]
    last = f"{dirpath}/epoch=3-step={4 * STEPS_PER_EPOCH}.ckpt"
    assert t_resumed.checkpoint_callback.best_model_path == last
    assert sc.latest(dirpath, storage_options=opts) == last
    assert objects(kept, opts) == []  # the checkpoint resumed from was outranked and removed


def test_top1_on_s3_and_resume_equals_uninterrupted(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    dirpath = f"{s3_uri}/ckpts"
    model, t = fit(2, StreamCheckpointIO(storage_options=s3_opts), dirpath)
    kept = check_top1(dirpath, s3_opts, t, model)
    resume_matches_uninterrupted(kept, s3_opts, StreamCheckpointIO(storage_options=s3_opts))


@pytest.mark.parametrize("form", ["async_save", "AsyncCheckpointIO"])
def test_async_forms(form: str, s3_uri: str, s3_opts: dict[str, Any]) -> None:
    io: Any = (StreamCheckpointIO(s3_opts, async_save=True, compression="zstd") if form == "async_save"
               else AsyncCheckpointIO(StreamCheckpointIO(s3_opts)))
    dirpath = f"{s3_uri}/ckpts"
    model, t = fit(2, io, dirpath)  # fit's teardown waits for the last upload
    kept = check_top1(dirpath, s3_opts, t, model)
    if form == "async_save":
        assert sc.inspect(kept, storage_options=s3_opts).kind == "streamckpt"
        resume_matches_uninterrupted(kept, s3_opts, StreamCheckpointIO(s3_opts, async_save=True))


def test_async_save_returns_staged_and_wait_commits(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    """The caller may change its tensors once save_checkpoint returns: the checkpoint holds the
    values as of the call; ``wait`` (and so the next save, a load, teardown) sees it committed."""
    io = StreamCheckpointIO(s3_opts, async_save=True)
    w = torch.arange(1000.0)
    io.save_checkpoint({"state_dict": {"w": w}, "global_step": 1}, f"{s3_uri}/a.ckpt")
    w.fill_(-1.0)
    io.save_checkpoint({"state_dict": {"w": w}, "global_step": 2}, f"{s3_uri}/b.ckpt")  # waits for a.ckpt
    assert "manifest.json" in objects(f"{s3_uri}/a.ckpt", s3_opts)
    io.teardown()
    a, b = io.load_checkpoint(f"{s3_uri}/a.ckpt"), io.load_checkpoint(f"{s3_uri}/b.ckpt")
    assert torch.equal(a["state_dict"]["w"], torch.arange(1000.0)) and a["global_step"] == 1
    assert torch.equal(b["state_dict"]["w"], torch.full((1000,), -1.0)) and b["global_step"] == 2


def test_missing_checkpoint_raises_not_found(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    missing = f"{s3_uri}/ckpts/epoch=9-step=99.ckpt"
    with pytest.raises(sc.CheckpointNotFoundError):
        StreamCheckpointIO(s3_opts).load_checkpoint(missing)
    with pytest.raises(sc.CheckpointNotFoundError):
        trainer(1, StreamCheckpointIO(s3_opts)).fit(Tiny(), train_dataloaders=loader(), ckpt_path=missing)


def test_plugin_gives_fsspec_its_options_where_the_user_set_none(s3_opts: dict[str, Any]) -> None:
    """What ModelCheckpoint needs (above, end to end); here: the user's own settings win, and
    ``fsspec_protocol=None`` leaves fsspec's configuration alone."""
    fsspec.config.conf["s3"] = {"endpoint_url": "http://127.0.0.1:1"}
    StreamCheckpointIO({**s3_opts, "use_listings_cache": False})
    assert fsspec.config.conf["s3"] == {**s3_opts, "use_listings_cache": False, "endpoint_url": "http://127.0.0.1:1"}
    fsspec.config.conf.clear()
    StreamCheckpointIO(s3_opts, fsspec_protocol=None)
    assert fsspec.config.conf == {}
    StreamCheckpointIO(s3_opts, fsspec_protocol="gs")
    assert fsspec.config.conf == {"gs": s3_opts}


def lightning_like_checkpoint() -> dict[str, Any]:
    """The awkward parts of a real Lightning checkpoint: int-keyed optimizer state, tuples, inf,
    an AttributeDict, dotted and empty loop state, callback keys full of punctuation."""
    return {
        "epoch": 3, "global_step": 40, "pytorch-lightning_version": "2.6.6",
        "state_dict": {"net.0.weight": torch.arange(6.0).reshape(2, 3), "net.0.bias": torch.zeros(2)},
        "optimizer_states": [{"state": {0: {"step": torch.tensor(40.0), "exp_avg": torch.ones(2, 3)}},
                              "param_groups": [{"lr": 0.01, "betas": (0.8, 0.95), "params": [0], "foreach": None}]}],
        "lr_schedulers": [{"best": math.inf, "last_epoch": 3, "_last_lr": [0.01]}],
        "loops": {"fit_loop": {"state_dict": {}, "epoch_loop.batch_progress": {"total": {"ready": 40}}}},
        "callbacks": {"ModelCheckpoint{'monitor': 'score', 'mode': 'max', 'every_n_train_steps': 0}":
                      {"best_model_score": torch.tensor(2.5),
                       "best_k_models": {"s3://b/r/epoch=3.ckpt": torch.tensor(2.5)}}},
        "hparams_name": "kwargs",
        "hyper_parameters": AttributeDict(hidden=8, lr=0.05, layers=(4, 8, 1)),
    }


def test_checkpoint_tree_round_trips_exactly(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    ckpt = lightning_like_checkpoint()
    io = StreamCheckpointIO(s3_opts, compression="zstd")
    io.save_checkpoint(ckpt, f"{s3_uri}/x.ckpt")
    io.save_checkpoint(ckpt, f"{s3_uri}/x.ckpt")  # a save to the same path replaces it (last.ckpt)
    back = io.load_checkpoint(f"{s3_uri}/x.ckpt", map_location={"cuda:0": "cpu"})
    assert type(back["hyper_parameters"]) is dict and back["hyper_parameters"] == dict(ckpt["hyper_parameters"])
    assert back["hyper_parameters"]["layers"] == (4, 8, 1)
    opt = back["optimizer_states"][0]
    assert list(opt["state"]) == [0] and torch.equal(opt["state"][0]["exp_avg"], torch.ones(2, 3))
    assert opt["param_groups"][0]["betas"] == (0.8, 0.95) and opt["param_groups"][0]["foreach"] is None
    assert back["lr_schedulers"][0]["best"] == math.inf
    assert back["loops"] == ckpt["loops"]
    (cb,) = back["callbacks"].values()
    assert list(back["callbacks"]) == list(ckpt["callbacks"])
    assert torch.equal(cb["best_k_models"]["s3://b/r/epoch=3.ckpt"], torch.tensor(2.5))
    assert_same_tensors(back["state_dict"], ckpt["state_dict"])
    assert [k for k in back if k not in ckpt] == [] and list(back) == list(ckpt)


def test_unsavable_hyper_parameter_is_refused_by_key(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    ckpt = lightning_like_checkpoint()
    ckpt["hyper_parameters"]["dtype"] = torch.bfloat16
    with pytest.raises(sc.IncompatibleStateDictError, match=r"hyper_parameters\.dtype.*save_hyperparameters\(ignore"):
        StreamCheckpointIO(s3_opts).save_checkpoint(ckpt, f"{s3_uri}/x.ckpt")
    assert objects(f"{s3_uri}/x.ckpt", s3_opts) == []  # refused before anything was written


def test_remove_leaves_a_sibling_with_a_longer_name(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    io = StreamCheckpointIO(s3_opts)
    sd = {"state_dict": {"w": torch.arange(4.0)}}
    io.save_checkpoint(sd, f"{s3_uri}/e.ckpt")
    io.save_checkpoint(sd, f"{s3_uri}/e.ckpt-v1")
    io.remove_checkpoint(f"{s3_uri}/e.ckpt")
    assert objects(f"{s3_uri}/e.ckpt", s3_opts) == []
    assert torch.equal(io.load_checkpoint(f"{s3_uri}/e.ckpt-v1")["state_dict"]["w"], torch.arange(4.0))
    with pytest.raises(sc.CheckpointNotFoundError):
        io.load_checkpoint(f"{s3_uri}/e.ckpt")


def test_map_location_that_cannot_be_honoured_is_refused(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    io = StreamCheckpointIO(s3_opts)
    with pytest.raises(sc.CheckpointError, match="function"):
        io.load_checkpoint(f"{s3_uri}/x.ckpt", map_location=lambda storage, loc: storage)
    with pytest.raises(sc.CheckpointError, match="several devices"):
        io.load_checkpoint(f"{s3_uri}/x.ckpt", map_location={"cuda:0": "cpu", "cuda:1": "meta"})


def _rank_zero_saves_worker(rank: int, world_size: int, uri: str, opts: dict[str, Any]) -> dict[str, Any]:
    """As Lightning's DDP strategy does: only global rank 0 saves and removes; every rank loads."""
    import torch.distributed as dist

    for async_save in (False, True):
        io = StreamCheckpointIO(opts, async_save=async_save)
        if rank == 0:
            io.save_checkpoint({"state_dict": {"w": torch.arange(6.0)}, "step": 1}, f"{uri}/old-{async_save}.ckpt")
            io.save_checkpoint({"state_dict": {"w": torch.arange(6.0) * 2}, "step": 2}, f"{uri}/new-{async_save}.ckpt")
            io.remove_checkpoint(f"{uri}/old-{async_save}.ckpt")
            io.teardown()
        dist.barrier()
    back = StreamCheckpointIO(opts).load_checkpoint(f"{uri}/new-True.ckpt")
    return {"w": back["state_dict"]["w"].tolist(), "step": back["step"]}


def test_rank_zero_alone_saves_under_torch_distributed(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    """With a 2-rank group up, a save on rank 0 alone must not wait for rank 1 (no collective)."""
    from distributed import run_ranks

    ranks = run_ranks(2, _rank_zero_saves_worker, kwargs={"uri": s3_uri, "opts": s3_opts}, timeout=120, pg_timeout=30)
    for r in ranks:
        assert r.error is None, r.error
        assert r.value == {"w": [0.0, 2.0, 4.0, 6.0, 8.0, 10.0], "step": 2}
    for flag in ("False", "True"):
        assert objects(f"{s3_uri}/old-{flag}.ckpt", s3_opts) == []
        assert "manifest.json" in objects(f"{s3_uri}/new-{flag}.ckpt", s3_opts)


def test_removing_a_checkpoint_another_thread_is_saving_waits_for_its_commit(
        s3_uri: str, proxy_factory: Any) -> None:
    """Lightning's AsyncCheckpointIO saves on its own thread while ModelCheckpoint removes an
    outranked checkpoint from the main thread: a removal of the checkpoint being saved must
    wait for the save, or the upload lands after it and the checkpoint stays (seen in a full
    CI run on a loaded machine). The data PUT is held back 1.5 s by a proxy, so the removal
    surely comes while the save is in flight."""
    import threading

    proxy = proxy_factory(faults=["stall"], rate=1.0, stall_seconds=1.5, max_repeats=1, methods=("PUT",),
                          match=lambda method, path: "/data/" in path)
    io = StreamCheckpointIO(proxy.storage_options)
    uri = f"{s3_uri}/ckpts/epoch=0.ckpt"
    errors: list[BaseException] = []

    def save() -> None:
        try:
            io.save_checkpoint({"state_dict": {"w": torch.arange(1000.0)}, "epoch": 0}, uri)
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)

    saver = threading.Thread(target=save)
    saver.start()
    for _ in range(500):  # until the data PUT is being held back
        if proxy.counts.get("stall"):
            break
        threading.Event().wait(0.01)
    assert proxy.counts.get("stall") == 1
    io.remove_checkpoint(uri)
    assert not saver.is_alive()  # the removal waited for the save
    saver.join()
    assert errors == []
    assert objects(uri, proxy.storage_options) == []
