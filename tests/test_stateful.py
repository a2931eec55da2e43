"""Training objects as users pass them (torch DCP's ``Stateful`` convention).

``{"model": model, "optim": optimizer, "sched": scheduler, "step": 7}`` saves what each
object's ``state_dict()`` returns and restores in place through ``load_state_dict()``:
bit-exact, optimizer state included, into freshly built objects (an optimizer that has
not stepped has no state to fill until one is made for it). Against the session's moto
S3 server; FSDP2 on gloo ranks, saved on 2 and restored on 3 (uneven shards).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import streamckpt as sc
from distributed import run_ranks
from fsdp_job import differences, example, full


def build(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
    return model, optim, sched


def trained(steps: int = 3) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    model, optim, sched = build()
    for i in range(steps):
        torch.manual_seed(100 + i)
        model(torch.randn(5, 6)).square().sum().backward()
        optim.step()
        optim.zero_grad()
        sched.step()
    return model, optim, sched


def assert_same_objects(a: tuple[Any, ...], b: tuple[Any, ...]) -> None:
    """Model, optimizer (state tensors and param_groups) and scheduler equal exactly."""
    (m1, o1, s1), (m2, o2, s2) = a, b
    for (k1, v1), (k2, v2) in zip(m1.state_dict().items(), m2.state_dict().items(), strict=True):
        assert k1 == k2 and torch.equal(v1, v2), k1
    sd1, sd2 = o1.state_dict(), o2.state_dict()
    assert sd1["param_groups"] == sd2["param_groups"]
    assert sorted(sd1["state"]) == sorted(sd2["state"]) == [0, 1, 2, 3]
    for p in sd1["state"]:
        assert sorted(sd1["state"][p]) == sorted(sd2["state"][p]) == ["exp_avg", "exp_avg_sq", "step"]
        for name, v in sd1["state"][p].items():
            assert torch.equal(v, sd2["state"][p][name]), (p, name)
    assert s1.state_dict() == s2.state_dict()
    assert o1.param_groups[0]["lr"] == o2.param_groups[0]["lr"] == 5e-3


def test_stateful_objects_round_trip_into_fresh_ones(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    saved = trained()
    model, optim, sched = saved
    arr = np.arange(6, dtype=np.float32).reshape(2, 3) / 7
    sc.save({"model": model, "optim": optim, "sched": sched, "step": 7, "data": {"arr": arr}}, s3_uri,
            storage_options=s3_opts)
    # the tree as stored: the optimizer's state keyed by parameter name, tensors as tensors
    stored = sc.load_state(s3_uri, storage_options=s3_opts)
    assert sorted(stored["optim"]["state"]) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert torch.equal(stored["data"]["arr"], torch.from_numpy(arr)) and stored["step"] == 7

    fresh = build(seed=1)
    assert fresh[1].state_dict()["state"] == {}  # nothing to fill yet
    into = np.zeros((2, 3), dtype=np.float32)
    state = {"model": fresh[0], "optim": fresh[1], "sched": fresh[2], "step": 0, "data": {"arr": into}}
    res = sc.load(state, s3_uri, storage_options=s3_opts)
    assert res.missing_keys == [] and res.unexpected_keys == []
    assert_same_objects(saved, fresh)
    assert state["step"] == 7 and state["model"] is fresh[0]  # the caller's dict, its plain values replaced
    assert type(state["data"]["arr"]) is np.ndarray and state["data"]["arr"] is into
    assert np.array_equal(into, arr)


def test_async_save_stages_the_objects_state(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    saved = trained()
    model, optim, sched = saved
    handle = sc.async_save({"model": model, "optim": optim, "sched": sched}, s3_uri, storage_options=s3_opts)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model[0].weight.add_(1.0)  # free to train on once staged
    handle.result(timeout=60)
    fresh = build(seed=1)
    sc.load({"model": fresh[0], "optim": fresh[1], "sched": fresh[2]}, s3_uri, storage_options=s3_opts)
    with torch.no_grad():
        model[0].weight.copy_(want["0.weight"])
    assert torch.equal(fresh[0][0].weight, want["0.weight"])
    assert_same_objects(saved, fresh)


def test_optimizer_without_its_model_and_a_module_at_the_root(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    """An optimizer alone keeps index keys (a fresh one still gets state to fill); a module
    passed as the whole state saves and loads as its state dict."""
    saved = trained()
    sc.save({"optim": saved[1], "sched": saved[2]}, f"{s3_uri}/o", storage_options=s3_opts)
    sc.save(saved[0], f"{s3_uri}/m", storage_options=s3_opts)
    assert sorted(sc.load_state(f"{s3_uri}/o", storage_options=s3_opts)["optim"]["state"]) == [0, 1, 2, 3]
    fresh = build(seed=1)
    sc.load({"optim": fresh[1], "sched": fresh[2]}, f"{s3_uri}/o", storage_options=s3_opts)
    sc.load(fresh[0], f"{s3_uri}/m", storage_options=s3_opts)
    assert_same_objects(saved, fresh)
    # in a tuple too (the tuple's plain values stay the caller's, as for any tuple)
    sc.save({"pair": (saved[0], 3)}, f"{s3_uri}/t", storage_options=s3_opts)
    other = build(seed=2)[0]
    pair = (other, 0)
    state = {"pair": pair}
    sc.load(state, f"{s3_uri}/t", storage_options=s3_opts)
    assert state["pair"] is pair  # the caller's tuple, its module restored in place
    assert all(torch.equal(a, b) for a, b in zip(saved[0].state_dict().values(), other.state_dict().values()))


class Wrapped(torch.optim.Adam):
    """An optimizer with a state_dict of its own (as torchtitan's OptimizersContainer has)."""

    def state_dict(self) -> dict[str, Any]:
        return {"wrapped": super().state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict["wrapped"])


def test_an_optimizer_with_its_own_state_dict_keeps_it(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optim = Wrapped(model.parameters())
    model(torch.randn(2, 3)).sum().backward()
    optim.step()
    sc.save({"model": model, "optim": optim}, s3_uri, storage_options=s3_opts)
    assert sorted(sc.load_state(s3_uri, storage_options=s3_opts)["optim"]["wrapped"]["state"]) == [0, 1]
    model2 = torch.nn.Linear(3, 2)
    optim2 = Wrapped(model2.parameters())
    model2(torch.randn(2, 3)).sum().backward()
    optim2.step()  # its own methods fill only a stepped optimizer
    sc.load({"model": model2, "optim": optim2}, s3_uri, storage_options=s3_opts)
    for p in (0, 1):
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(optim2.state[model2.weight if p == 0 else model2.bias][name],
                               optim.state[model.weight if p == 0 else model.bias][name])


def test_through_the_manager(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    saved = trained()
    with sc.CheckpointManager(s3_uri, storage_options=s3_opts) as mgr:
        mgr.save(3, {"model": saved[0], "optim": saved[1], "sched": saved[2], "step": 3}, metrics={"loss": 0.5})
        with pytest.raises(sc.CheckpointError, match="metric 'loss' has 2 elements"):
            mgr.save(4, {"model": saved[0]}, metrics={"loss": torch.tensor([0.5, 0.25])})
        fresh = build(seed=1)
        state = {"model": fresh[0], "optim": fresh[1], "sched": fresh[2], "step": 0}
        restored = mgr.restore(state)
    assert restored is not None and restored.step == 3 and restored.state is state and state["step"] == 3
    assert_same_objects(saved, fresh)
    assert mgr.steps() == [3]


def test_what_cannot_be_saved_says_state_dict(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    class OnlySaves:  # state_dict() but no load_state_dict(): not Stateful, not data
        def state_dict(self) -> dict[str, Any]:
            return {"x": 1}

    with pytest.raises(sc.IncompatibleStateDictError, match=r"extra: a value of type OnlySaves .*\.state_dict\(\)"):
        sc.save({"extra": OnlySaves()}, s3_uri, storage_options=s3_opts)

    class Broken:
        def state_dict(self) -> dict[str, Any]:
            raise RuntimeError("disk on fire")

        def load_state_dict(self, sd: dict[str, Any]) -> None:
            pass

    with pytest.raises(sc.IncompatibleStateDictError, match="loader: RuntimeError from state_dict.*disk on fire"):
        sc.save({"loader": Broken()}, s3_uri, storage_options=s3_opts)


class Broken:
    """A Stateful whose state_dict() fails (a data loader whose worker died)."""

    def state_dict(self) -> dict[str, Any]:
        raise RuntimeError("worker died")

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        pass


def broken_on_rank_1(rank: int, world: int, uri: str, opts: dict[str, Any]) -> dict[str, str]:
    out = {}
    for call in ("save", "async_save", "load"):
        state = {"w": torch.ones(4), "loader": Broken() if rank == 1 else torch.nn.Linear(2, 2)}
        try:
            if call == "async_save":
                sc.async_save(state, f"{uri}/{call}", storage_options=opts).result(timeout=60)
            else:
                getattr(sc, call)(state, f"{uri}/{call}", storage_options=opts)
            out[call] = "ok"
        except sc.CheckpointError as e:
            out[call] = f"{type(e).__name__}: {e}"
    return out


def test_a_failing_state_dict_on_one_rank_fails_every_rank(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    got = [r.unwrap() for r in run_ranks(2, broken_on_rank_1, kwargs={"uri": s3_uri, "opts": s3_opts}, timeout=120)]
    for call in ("save", "async_save", "load"):
        assert all("loader: RuntimeError from state_dict() of a Broken: worker died" in g[call] for g in got), got


# ------------------------------------------------------------------- FSDP2, 2 -> 3 ranks


def fsdp_save(rank: int, world: int, uri: str, opts: dict[str, Any], ref: str, tier: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    job = example().Job.create(init_device_mesh("cpu", (world,)))
    for _ in range(3):
        job.train_step()
    state = {"model": job.model, "optim": job.optim, "sched": job.sched, "step": job.step}
    sc.save(state, f"{uri}/plain", storage_options=opts)
    with sc.CheckpointManager(f"{uri}/run", storage_options=opts) as mgr:
        mgr.save(job.step, state)
    with sc.CheckpointManager(f"{uri}/tier", storage_options=opts, local_dir=f"{tier}/node{rank}", local_every=1,
                              save_every=100) as mgr:
        mgr.save(job.step, state)  # the tier's step alone: not in the bucket
    want = full(job.state_dict())  # DCP's own view: FQN-keyed, whole tensors
    if rank == 0:
        torch.save(want, ref)


def fsdp_load(rank: int, world: int, uri: str, opts: dict[str, Any], ref: str, tier: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    want = torch.load(ref)
    out: dict[str, Any] = {}
    for how in ("load", "manager", "tier"):
        job = example().Job.create(init_device_mesh("cpu", (world,)))
        state = {"model": job.model, "optim": job.optim, "sched": job.sched, "step": 0}
        if how == "load":
            sc.load(state, f"{uri}/plain", storage_options=opts)
        elif how == "manager":
            with sc.CheckpointManager(f"{uri}/run", storage_options=opts) as mgr:
                mgr.restore(state)
        else:  # rank 2's folder is empty (a node that was not there): its bytes come from the others'
            with sc.CheckpointManager(f"{uri}/tier", storage_options=opts, local_dir=f"{tier}/node{rank}",
                                      local_every=1, save_every=100) as mgr:
                got = mgr.restore(state)
            out["tier source"] = (got.source, got.step) if got is not None else None
        job.step = state["step"]
        out[how] = differences(full(job.state_dict()), want, how)
    return out


@pytest.mark.slow
def test_fsdp2_saved_on_two_ranks_restores_on_three_from_the_bucket_and_the_tier(tmp_path: Path, s3_uri: str,
                                                                                   s3_opts: dict[str, Any]) -> None:
    kw = {"uri": s3_uri, "opts": s3_opts, "ref": str(tmp_path / "ref.pt"), "tier": str(tmp_path / "tier")}
    [r.unwrap() for r in run_ranks(2, fsdp_save, kwargs=kw, timeout=150)]
    want = torch.load(kw["ref"])
    assert want["step"] == 3 and len(want["optim"]["state"]) > 0
    loaded = [r.unwrap() for r in run_ranks(3, fsdp_load, kwargs=kw, timeout=150)]
    assert loaded == [{"load": [], "manager": [], "tier": [], "tier source": ["local", 3]}] * 3
    # the optimizer's state is stored by parameter name, sharded like its parameters
    info = sc.inspect(f"{s3_uri}/plain", storage_options=s3_opts)
    assert any(k.startswith("optim.state.") and k.endswith(".weight.exp_avg") for k in info.tensors), list(info.tensors)
