"""Non-tensor state of DCP checkpoints (optimizer ``param_groups``, step counters,
scheduler state) restored through the allow-list unpickler into the structure the
caller passed, so that ``set_state_dict`` accepts it.

DCP flattens a list of dicts into one pickled item per leaf
(``optim.param_groups.0.lr``); ``sc.load`` rebuilds the caller's list from them.
Items outside the allow-list stay unloadable and are named (strict error, or
missing keys and a warning). The multi-rank test reads, strict, with 3 gloo ranks
a DCP checkpoint that 4 FSDP2 ranks wrote and that was uploaded as is to moto.
"""

from __future__ import annotations

import logging
import math
import warnings
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch

import streamckpt as sc
from streamckpt.core import manifest as mf, values
from streamckpt.core.targets import collect
from streamckpt.errors import CorruptCheckpointError, MissingKeysError

from distributed import run_ranks
from fsdp_job import differences, example, full

INF = float("inf")


def _dcp_save(state: dict[str, Any], path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=str(path))


# ------------------------------------------------------------------ pure parts


def test_tagged_values_survive_the_manifest_json() -> None:
    vals = {
        "betas": (0.9, 0.999), "best": INF, "worse": -INF, "nan": float("nan"),
        "nested": [(1, [2, (3.5, None)]), {"a": (True, "x")}], "dollar": {"$tuple": [1]}, "plain": {"$x": 1, "y": 2},
        "ints": [0, -7, 2**70], "empty": (),
    }
    m = mf.Manifest(tensors={}, files={}, values=vals, kind="dcp")
    back = mf.from_json(mf.to_json(m)).values
    assert math.isnan(back.pop("nan")) and math.isnan(vals["nan"])
    assert differences(back, {k: v for k, v in vals.items() if k != "nan"}) == []
    native = mf.from_json(mf.to_json(mf.Manifest(tensors={}, files={}, values={"v": {"$tuple": [1]}})))
    assert native.values == {"v": {"$tuple": [1]}}  # a native manifest's values are the user's JSON, untouched


@pytest.mark.parametrize("doc, match", [
    ({"$float": "huge"}, r"values\.k: malformed \$float"),
    ({"$tuple": {"a": 1}}, r"malformed \$tuple"),
    ([{"$dict": 3}], r"malformed \$dict"),
])
def test_malformed_tags_are_corrupt(doc: Any, match: str) -> None:
    raw = mf.to_json(mf.Manifest(tensors={}, files={}, values={}, kind="dcp")).replace(
        b'"values":{}', b'"values":{"k":' + __import__("json").dumps(doc).encode() + b"}")
    with pytest.raises(CorruptCheckpointError, match=match):
        mf.from_json(raw)


def test_unrestorable_names_the_type() -> None:
    assert values.unrestorable({"lr": 0.1, "betas": (0.9, 0.99), "params": ["a.w"], "f": None, "b": INF}) is None
    assert values.unrestorable({1, 2}) == "a set value"
    assert values.unrestorable([1, {"a": b"x"}]) == "a bytes value"
    assert values.unrestorable({1: "a"}) == "a dict with non-string keys"
    deep: Any = 0
    for _ in range(values.MAX_DEPTH + 2):
        deep = [deep]
    assert "nested deeper" in (values.unrestorable(deep) or "")


def test_flattened_param_groups_rebuilt_in_the_callers_structure() -> None:
    stored = {
        "optim.param_groups.0.lr": 0.5, "optim.param_groups.0.betas": (0.8, 0.9),
        "optim.param_groups.0.params": ["a.w", "a.b"],
        "optim.param_groups.1.lr": 0.25, "optim.param_groups.1.params": ["c.w"],
        "optim.param_groups.1.initial_lr": 1.0,  # the caller's group has no such key: not invented
        "optim.state.a.w.step": 7.0, "step": 3,
    }
    sd = {"optim": {"param_groups": [{"lr": 0.0, "betas": (0.0, 0.0), "params": []}, {"lr": 0.0, "params": []}],
                    "state": {"a.w": {"step": 0.0}}}, "step": 0, "absent": "x"}
    _, slots = collect(sd)
    plan = values.plan_values(slots, stored, unloadable=["optim.param_groups.0.odd"])
    for slot, value in plan.assign:
        slot.container[slot.name] = value
    assert differences(sd, {
        "optim": {"param_groups": [{"lr": 0.5, "betas": (0.8, 0.9), "params": ["a.w", "a.b"]},
                                   {"lr": 0.25, "params": ["c.w"]}],
                  "state": {"a.w": {"step": 7.0}}}, "step": 3, "absent": "x"}) == []
    assert plan.missing == ["absent"]
    assert plan.used == set(stored) - {"optim.param_groups.1.initial_lr"}


def test_partial_structures_report_the_missing_leaf() -> None:
    stored = {"g.0.lr": 0.5, "g.1.lr": 0.25}
    _, slots = collect({"g": [{"lr": 0.0, "eps": 1e-8}, {"lr": 0.0}, {"lr": 9.0}]})
    plan = values.plan_values(slots, stored)
    assert plan.missing == ["g.0.eps", "g.2"]
    (slot, value), = plan.assign
    assert value == [{"lr": 0.5, "eps": 1e-8}, {"lr": 0.25}, {"lr": 9.0}]  # the caller's where nothing is stored


def test_json_lists_come_back_as_the_callers_tuples() -> None:
    assert values.conform((0.0, 0.0), [0.9, 0.95]) == (0.9, 0.95)
    assert values.conform([(0, 0)], [[1, 2]]) == [(1, 2)]
    assert values.conform({"b": (0, 0)}, {"b": [1, 2], "c": [3]}) == {"b": (1, 2), "c": [3]}
    assert values.conform([], [1, 2]) == [1, 2] and values.conform(None, [1]) == [1]


# ------------------------------------------------------- one process, local DCP


def _job(seed: int, lr: Any = 0.1) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.8, 0.9), foreach=False)
    warm = torch.optim.lr_scheduler.LinearLR(optim, start_factor=0.5, total_iters=5)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optim, patience=3)
    return model, optim, warm, plateau


def _state(model: torch.nn.Module, optim: torch.optim.Optimizer, warm: Any, plateau: Any, step: int) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optim)
    return {"model": msd, "optim": osd, "warm": warm.state_dict(), "plateau": plateau.state_dict(), "step": step}


def _trained(seed: int) -> tuple[Any, ...]:
    model, optim, warm, plateau = job = _job(seed)
    for i in range(3):
        model(torch.randn(2, 4)).square().sum().backward()
        optim.step()
        optim.zero_grad()
        warm.step()
        plateau.step(1.0 - i)
    return job


def test_optimizer_and_schedulers_restored_exactly(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    saved = _state(*_trained(0), step=3)
    assert saved["plateau"]["mode_worse"] == INF
    _dcp_save(saved, tmp_path / "ck")
    model, optim, warm, plateau = _job(1)
    target = _state(model, optim, warm, plateau, step=0)
    res = sc.load(target, str(tmp_path / "ck"))  # strict
    assert (res.missing_keys, res.unexpected_keys) == ([], [])
    assert differences(target, saved) == []
    set_state_dict(model, optim, model_state_dict=target["model"], optim_state_dict=target["optim"])
    warm.load_state_dict(target["warm"])
    plateau.load_state_dict(target["plateau"])
    assert differences(_state(model, optim, warm, plateau, step=3), saved) == []
    info = sc.inspect(str(tmp_path / "ck"))
    assert info.values["optim.param_groups.0.betas"] == (0.8, 0.9) and info.values["plateau.mode_worse"] == INF


def test_float_step_counters(tmp_path: Path) -> None:
    """``optim.state.<fqn>.step`` as plain floats (older or custom optimizers): restored as values."""
    saved = {"optim": {"state": {"l.weight": {"step": 12.0, "exp_avg": torch.arange(6.0)}},
                       "param_groups": [{"lr": 1e-3, "params": ["l.weight"]}]}}
    _dcp_save(saved, tmp_path / "ck")
    target = {"optim": {"state": {"l.weight": {"step": 0.0, "exp_avg": torch.zeros(6)}},
                        "param_groups": [{"lr": 0.0, "params": []}]}}
    sc.load(target, str(tmp_path / "ck"))
    assert differences(target, saved) == []


def test_tensor_learning_rate_in_param_groups(tmp_path: Path) -> None:
    """A tensor ``lr`` makes DCP split ``param_groups`` into a tensor item and value items;
    the state_dict's list is split the same way (for streamckpt's own format too)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    def job(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = torch.nn.Linear(4, 3)
        return model, torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.1), foreach=False)

    model, optim = job(0)
    model(torch.randn(2, 4)).sum().backward()
    optim.step()
    optim.param_groups[0]["lr"].fill_(0.05)
    msd, osd = get_state_dict(model, optim)
    saved = {"model": msd, "optim": osd}
    _dcp_save(saved, tmp_path / "dcp")
    assert "optim.param_groups.0.lr" in sc.inspect(str(tmp_path / "dcp")).tensors
    sc.save(saved, str(tmp_path / "native"))
    for ck in ("dcp", "native"):
        target = dict(zip(("model", "optim"), get_state_dict(*job(1))))
        res = sc.load(target, str(tmp_path / ck))
        assert (res.missing_keys, res.unexpected_keys) == ([], []), ck
        assert differences(target, saved) == [], ck
        assert target["optim"]["param_groups"][0]["lr"].item() == pytest.approx(0.05)


class Opaque:
    """Not on any allow-list: a DCP item holding one cannot be restored."""

    def __init__(self, n: int) -> None:
        self.n = n


def test_unloadable_items_are_named(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    saved = {"w": torch.arange(4.0), "cfg": {"tags": {"a", "b"}, "obj": Opaque(3), "lr": 0.5}}
    _dcp_save(saved, tmp_path / "ck")
    uri = str(tmp_path / "ck")
    with pytest.raises(MissingKeysError) as err:
        sc.load({"w": torch.zeros(4), "cfg": {"tags": set(), "obj": None, "lr": 0.0}}, uri)
    msg = str(err.value)
    assert "cfg.obj" in msg and "cfg.tags" in msg and "stored but not restorable" in msg
    assert "a set value is not JSON-safe" in msg and "Opaque, which is not on the allow-list" in msg
    assert sorted(err.value.missing_keys) == ["cfg.obj", "cfg.tags"]
    target = {"w": torch.zeros(4), "cfg": {"tags": set(), "obj": None, "lr": 0.0}}
    with caplog.at_level(logging.WARNING, logger="streamckpt"):
        res = sc.load(target, uri, strict=False)
    assert torch.equal(target["w"], saved["w"]) and target["cfg"] == {"tags": set(), "obj": None, "lr": 0.5}
    assert (res.missing_keys, res.unexpected_keys) == (["cfg.obj", "cfg.tags"], [])
    assert "cfg.obj" in caplog.text and "not restorable" in caplog.text
    res = sc.load({"w": torch.zeros(4)}, uri)  # not asked for: reported as unexpected
    assert res.unexpected_keys == ["cfg.lr", "cfg.obj", "cfg.tags"]


def test_native_checkpoint_gives_back_tuples(tmp_uri: str) -> None:
    """The same caller-structure rule for streamckpt's own format (JSON lists on disk)."""
    saved = _state(*_trained(0), step=3)
    saved.pop("plateau")  # its infinities are not JSON: native values are plain JSON
    sc.save(saved, tmp_uri)
    target = _state(*_job(1), step=0)
    target.pop("plateau")
    sc.load(target, tmp_uri)
    assert differences(target, saved) == []


# ------------------------------------------- 4 FSDP2 ranks write, 3 ranks read


def dcp_save_fsdp(rank: int, world: int, path: str, ref: str) -> int:
    """Train the example's FSDP2 job 3 steps and ``dcp.save`` model + optimizer + schedules."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    job = example().Job.create(init_device_mesh("cpu", (world,)))
    for _ in range(3):
        job.train_step()
    state = job.state_dict()
    state["plateau"] = torch.optim.lr_scheduler.ReduceLROnPlateau(job.optim, patience=2).state_dict()
    dcp.save(state, checkpoint_id=path)
    want = full(state)
    if rank == 0:
        torch.save(want, ref)
    return len(state["optim"]["state"])


def sc_load_fsdp(rank: int, world: int, uri: str, opts: dict[str, Any], ref: str) -> dict[str, Any]:
    """A fresh FSDP2 job on another world size: strict ``sc.load`` of the DCP checkpoint."""
    from torch.distributed.checkpoint.state_dict import set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    job = example().Job.create(init_device_mesh("cpu", (world,)))
    state = job.state_dict()
    state["plateau"] = torch.optim.lr_scheduler.ReduceLROnPlateau(job.optim).state_dict()
    res = sc.load(state, uri, storage_options=opts)
    want = torch.load(ref)
    loaded = differences(full(state), want, "loaded")
    set_state_dict(job.model, job.optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    job.sched.load_state_dict(state["sched"])
    job.step = state["step"]
    after = job.state_dict()
    after["plateau"] = state["plateau"]
    return {
        "kind": res.kind, "missing": res.missing_keys, "unexpected": res.unexpected_keys,
        "loaded": loaded, "installed": differences(full(after), want, "installed"),
        "groups": [sorted(g) for g in state["optim"]["param_groups"]], "best": repr(state["plateau"]["best"]),
        "lr": job.optim.param_groups[0]["lr"], "want_lr": want["optim"]["param_groups"][0]["lr"],
    }


def test_fsdp2_dcp_checkpoint_read_strict_by_three_ranks(tmp_path: Path, s3_uri: str, s3_opts: dict[str, Any]) -> None:
    ref = str(tmp_path / "ref.pt")
    local = tmp_path / "dcp"
    saved = [r.unwrap() for r in run_ranks(4, dcp_save_fsdp, kwargs={"path": str(local), "ref": ref}, timeout=240)]
    assert saved == [6] * 4  # 3 Linear layers: 6 parameters with optimizer state
    assert sorted(p.name for p in local.iterdir()) == [".metadata", *(f"__{r}_0.distcp" for r in range(4))]
    fs = fsspec.filesystem("s3", **s3_opts)
    for p in sorted(local.iterdir()):
        fs.put_file(str(p), f"{s3_uri}/{p.name}")
    out = [r.unwrap() for r in run_ranks(3, sc_load_fsdp, kwargs={"uri": s3_uri, "opts": s3_opts, "ref": ref},
                                         timeout=240)]
    for r in out:
        assert (r["kind"], r["missing"], r["unexpected"]) == ("dcp", [], [])
        assert r["loaded"] == [] and r["installed"] == [], (r["loaded"], r["installed"])
        assert r["groups"] == [sorted(["lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach",
                                       "capturable", "differentiable", "fused", "decoupled_weight_decay",
                                       "initial_lr", "params"])]
        assert r["best"] == "inf"
        assert r["lr"] == r["want_lr"] != 1e-2 * 0.25  # the warm-up had moved it; the saved value is back
