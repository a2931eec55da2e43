"""CheckpointManager on a real S3 server (moto over HTTP): retention after each commit,
deletion order (recorded through the fault proxy), restore past a broken newest."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
import torch

import streamckpt as sc
from streamckpt.manage import delete_checkpoint
from streamckpt.manage.lease import LEASE_NAME
from streamckpt.storage import Storage


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(64, 32, generator=g)}, "step": step}


def _kept(saved: list[int], last: int, every: int) -> list[int]:
    """What keep_last/keep_every leave of ``saved`` (worked out independently of the library)."""
    return sorted(set(saved[-last:]) | {s for s in saved if s % every == 0})


def _objects(uri: str, opts: dict[str, Any]) -> list[str]:
    return Storage(uri, opts).list("", recursive=True)


def test_training_loop_keeps_last_two_and_every_fifth(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    saved: list[int] = []
    with sc.CheckpointManager(s3_uri, storage_options=s3_opts, keep_last=2, keep_every=5, save_every=1) as mgr:
        for step in range(1, 13):
            assert mgr.should_save(step)
            mgr.save(step, _state(step), metrics={"loss": 1.0 / step})
            saved.append(step)
            assert mgr.steps() == _kept(saved, 2, 5), step  # pruned right after each commit
        assert mgr.steps() == [5, 10, 11, 12]
        assert mgr.latest_step() == 12
        assert mgr.metrics(10) == {"loss": 0.1}
    # nothing but the kept checkpoints' objects is left: every pruned one went whole
    names = _objects(s3_uri, s3_opts)
    assert sorted({n.split("/")[0] for n in names}) == ["step-10", "step-11", "step-12", "step-5"]
    assert len(names) == 8  # a manifest and one data file each
    info = sc.inspect(f"{s3_uri}/step-11", storage_options=s3_opts)
    assert info.metadata == {"step": 11, "metrics": {"loss": 1.0 / 11}}
    # the steps come from the manifests: a new manager sees the same
    assert sc.CheckpointManager(s3_uri, storage_options=s3_opts).steps() == [5, 10, 11, 12]


def test_save_every_and_existing_step(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    mgr = sc.CheckpointManager(s3_uri, storage_options=s3_opts, save_every=3, name="ckpt_{step:06d}")
    assert [s for s in range(1, 10) if mgr.should_save(s)] == [3, 6, 9]
    mgr.save(3, _state(3))
    with pytest.raises(sc.CheckpointExistsError, match="step 3 is already committed.*force=True"):
        mgr.save(3, _state(4))
    mgr.save(3, _state(4), force=True)
    back = mgr.restore()
    assert back is not None and back.step == 3 and back.uri == f"{s3_uri}/ckpt_000003"
    assert torch.equal(back.state["model"]["w"], _state(4)["model"]["w"]) and back.state["step"] == 4
    with pytest.raises(sc.CheckpointError, match="metadata keys"):
        mgr.save(6, _state(6), metadata={"step": 1})
    with pytest.raises(sc.CheckpointError, match="keep_best"):
        sc.CheckpointManager(s3_uri, keep_best=("loss", "lowest", 2))
    mgr.close()
    with pytest.raises(sc.CheckpointError, match="closed"):
        mgr.save(9, _state(9))


def test_keep_best_by_loss(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    losses = {1: 0.9, 2: 0.3, 3: 0.5, 4: 0.2, 5: None, 6: 0.7, 7: 0.6}
    with sc.CheckpointManager(s3_uri, storage_options=s3_opts, keep_best=("loss", "min", 2), keep_last=1) as mgr:
        for step, loss in losses.items():
            mgr.save(step, _state(step), metrics={} if loss is None else {"loss": torch.tensor(loss)})
        assert mgr.steps() == [2, 4, 7]  # the two lowest losses and the newest
        assert mgr.metrics(4) == {"loss": pytest.approx(0.2)}
    with sc.CheckpointManager(s3_uri, storage_options=s3_opts, keep_best=("loss", "max", 1)) as mgr:
        assert mgr.prune(dry_run=True) == [f"{s3_uri}/step-2", f"{s3_uri}/step-4"]
        assert mgr.steps() == [2, 4, 7]
        assert mgr.prune() == [f"{s3_uri}/step-2", f"{s3_uri}/step-4"]
        assert mgr.steps() == [7]  # the highest loss of those left, and the newest


def test_async_saves_prune_after_each_commit(s3_uri: str, s3_opts: dict[str, Any], proxy_factory: Any) -> None:
    proxy = proxy_factory(rate=0.0)
    with sc.CheckpointManager(s3_uri, storage_options=proxy.storage_options, keep_last=2, async_save=True) as mgr:
        for step in range(1, 6):
            handle = mgr.save(step, _state(step))
            assert isinstance(handle, sc.SaveHandle)
            mgr.wait()
            assert mgr.steps() == list(range(max(1, step - 1), step + 1))
    # each old checkpoint is deleted (manifest first) only after a newer one committed: the
    # proxy's history holds the PUTs of the manifests, ``deleted`` the deletes, both in order
    puts = [p.split("?")[0] for m, p, _ in proxy.history if m == "PUT" and p.split("?")[0].endswith("/manifest.json")]
    assert [p.split("/")[-2] for p in puts] == [f"step-{s}" for s in range(1, 6)]
    key = s3_uri.split("/", 2)[-1]
    assert [d for d in proxy.deleted if not d.endswith(LEASE_NAME)] == [f"{key}/step-{s}/{n}" for s in (1, 2, 3)
                             for n in ("manifest.json", "data/00000-0000.safetensors")]
    events = [("put", p.split("/")[-2]) if m == "PUT" else ("delete", p)
              for m, p, _ in proxy.history if (m == "PUT" and p.split("?")[0].endswith("/manifest.json"))
              or (m in ("DELETE", "POST") and "delete" in p)]
    first_delete = next(i for i, e in enumerate(events) if e[0] == "delete")
    assert events[:first_delete] == [("put", "step-1"), ("put", "step-2"), ("put", "step-3")]
    back = {"model": {"w": torch.zeros(64, 32)}, "step": 0}
    restored = sc.CheckpointManager(s3_uri, storage_options=s3_opts).restore(back)
    assert restored is not None and restored.step == 5 and restored.skipped == []
    assert torch.equal(back["model"]["w"], _state(5)["model"]["w"]) and back["step"] == 5


def test_prune_deletes_the_manifest_first(s3_uri: str, s3_opts: dict[str, Any], proxy_factory: Any) -> None:
    with sc.CheckpointManager(s3_uri, storage_options=s3_opts) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state(step), compression="zstd")
    proxy = proxy_factory(rate=0.0)
    with sc.CheckpointManager(s3_uri, storage_options=proxy.storage_options, keep_last=1) as mgr:
        assert mgr.prune() == [f"{s3_uri}/step-1", f"{s3_uri}/step-2"]
    key = s3_uri.split("/", 2)[-1]
    assert [d for d in proxy.deleted if not d.endswith(LEASE_NAME)] == [f"{key}/step-1/manifest.json", f"{key}/step-1/data/00000-0000.zst",
                             f"{key}/step-2/manifest.json", f"{key}/step-2/data/00000-0000.zst"]


def test_refused_data_delete_leaves_no_committed_checkpoint(s3_uri: str, s3_opts: dict[str, Any],
                                                             proxy_factory: Any) -> None:
    """The one deletion routine (prune's and the Lightning plug-in's): a data object whose
    DELETE is refused leaves the checkpoint uncommitted, never half-loadable."""
    for step in (1, 2):
        sc.save(_state(step), f"{s3_uri}/step-{step}", storage_options=s3_opts)
    # no bulk delete here (a server may lack it: one DELETE per object), and the data object's refused
    proxy = proxy_factory(rate=0.0, unsupported=lambda m, p: (m == "POST" and p.endswith("?delete"))
                          or (m == "DELETE" and "/step-2/data/" in p))
    st = Storage(f"{s3_uri}/step-2", proxy.storage_options)
    with pytest.raises(sc.StorageError, match="could not be deleted.*collect_garbage"):
        delete_checkpoint(st)  # as StreamCheckpointIO.remove_checkpoint calls it
    key = s3_uri.split("/", 2)[-1]
    assert [d for d in proxy.deleted if not d.endswith(LEASE_NAME)] == [f"{key}/step-2/manifest.json"]  # what the server was asked and did
    assert proxy.refused >= 2  # the bulk deletes, then (at least once) the data object's own DELETE
    assert sc.latest(s3_uri, storage_options=s3_opts) == f"{s3_uri}/step-1"
    assert _objects(f"{s3_uri}/step-2", s3_opts) == ["data/00000-0000.safetensors"]
    mgr = sc.CheckpointManager(s3_uri, storage_options=s3_opts)
    assert mgr.steps() == []  # sc.save wrote no step: not the manager's, and step-2 is no checkpoint now
    assert mgr.collect_garbage(older_than=0) == [f"{s3_uri}/step-2/data/00000-0000.safetensors (8.1 KiB)"]
    assert _objects(f"{s3_uri}/step-2", s3_opts) == []
    assert mgr.collect_garbage(older_than=0) == []


def _rot(uri: str, opts: dict[str, Any], name: str) -> None:
    st = Storage(uri, opts)
    data = bytearray(st.read_bytes(name))
    data[-100] ^= 0x10  # inside the last tensor's bytes
    st.write_bytes(name, bytes(data))


def test_restore_falls_back_past_broken_newest(s3_uri: str, s3_opts: dict[str, Any],
                                               caplog: pytest.LogCaptureFixture) -> None:
    mgr = sc.CheckpointManager(s3_uri, storage_options=s3_opts)
    for step in (1, 2, 3, 4):
        mgr.save(step, _state(step))
    Storage(f"{s3_uri}/step-4", s3_opts).delete("data/00000-0000.safetensors")  # deleted by hand
    _rot(f"{s3_uri}/step-3", s3_opts, "data/00000-0000.safetensors")  # rotten at rest
    back = {"model": {"w": torch.zeros(64, 32)}, "step": 0}
    with caplog.at_level(logging.WARNING, logger="streamckpt.manage"):
        restored = mgr.restore(back)
    assert restored is not None and restored.step == 2 and restored.uri == f"{s3_uri}/step-2"
    assert torch.equal(back["model"]["w"], _state(2)["model"]["w"]) and back["step"] == 2
    assert [u for u, _ in restored.skipped] == [f"{s3_uri}/step-4", f"{s3_uri}/step-3"]
    assert restored.skipped[0][1].startswith("CorruptCheckpointError") and "does not exist" in restored.skipped[0][1]
    assert restored.skipped[1][1].startswith("CorruptCheckpointError") and "checksum mismatch" in restored.skipped[1][1]
    assert sum("passing over" in r.getMessage() for r in caplog.records) == 2
    tree = mgr.restore()  # without a state_dict: the saved tree, through sc.load_state
    assert tree is not None and tree.step == 2 and torch.equal(tree.state["model"]["w"], _state(2)["model"]["w"])
    # the caller's own mistake raises at once, never falls back
    with pytest.raises(sc.IncompatibleStateDictError):
        mgr.restore({"model": {"w": torch.zeros(32, 64)}, "step": 0})
    with pytest.raises(sc.CorruptCheckpointError, match="does not exist"):  # a step given: no fallback
        mgr.restore(back, step=4)
    with pytest.raises(sc.CorruptCheckpointError, match="passed over 2"):
        mgr.restore(back, max_fallbacks=1)
    with pytest.raises(sc.CheckpointNotFoundError, match="committed steps: 1, 2, 3, 4"):
        mgr.restore(back, step=7)


def test_restore_passes_over_an_unparsable_manifest(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    mgr = sc.CheckpointManager(s3_uri, storage_options=s3_opts)
    assert mgr.restore() is None and mgr.steps() == [] and mgr.latest_step() is None
    mgr.save(1, _state(1))
    mgr.save(2, _state(2))
    Storage(f"{s3_uri}/step-2", s3_opts).write_bytes("manifest.json", b'{"format": "streamckpt", "vers')
    assert mgr.steps() == [1]
    restored = mgr.restore()
    assert restored is not None and restored.step == 1
    assert restored.skipped[0][0] == f"{s3_uri}/step-2" and "not valid JSON" in restored.skipped[0][1]
    # a checkpoint whose manifest cannot be read is never collected as garbage
    assert mgr.collect_garbage(older_than=0, dry_run=True) == []
    doc = json.loads(Storage(f"{s3_uri}/step-1", s3_opts).read_bytes("manifest.json"))
    assert doc["metadata"] == {"step": 1, "metrics": {}}


def test_local_root(tmp_path: Any) -> None:
    """The same on local files (sizes and times from ``os.stat``, deletes one file at a time)."""
    root = str(tmp_path / "run")
    with sc.CheckpointManager(root, keep_last=1, save_every=2) as mgr:
        for step in range(1, 7):
            if mgr.should_save(step):
                mgr.save(step, _state(step))
        assert mgr.steps() == [6]
        stray = tmp_path / "run" / "step-8" / "data" / "00000-0000.safetensors.tmp-1234"
        stray.parent.mkdir(parents=True)
        stray.write_bytes(b"\0" * 10)  # what a local save killed mid-write leaves
        assert mgr.collect_garbage(older_than=0) == [f"{root}/step-8/data/00000-0000.safetensors.tmp-1234 (10 B)"]
        assert not stray.exists()
        back = mgr.restore()
        assert back is not None and back.step == 6 and torch.equal(back.state["model"]["w"], _state(6)["model"]["w"])
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["step-6"]  # no empty folder per deleted step
