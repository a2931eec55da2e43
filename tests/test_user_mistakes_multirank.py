"""Mistakes made on one rank of a group (or differently on each), on 2 real gloo ranks against
moto: every rank raises the same ``CheckpointError``, learnt through the agreement (never a
timed-out collective), nothing wrong is committed, and the group still works afterwards."""

from __future__ import annotations

import functools
import uuid
from typing import Any, Callable

import pytest
import torch

import streamckpt as sc

from conftest import BUCKET
from distributed import ScenarioResults, run_ranks, run_scenarios

WORLD = 2
PG_TIMEOUT = 30.0
GOOD = torch.arange(12.0).reshape(3, 4)


def _targets() -> dict[str, Any]:
    return {"w": torch.zeros(3, 4), "b": torch.zeros(4)}


def save_good(root: str, opts: dict[str, Any], rank: int, world: int) -> None:
    sc.save({"w": GOOD.clone(), "b": torch.ones(4), "step": 5}, f"{root}/good", storage_options=opts)


def plain_data_on_one_rank(root: str, opts: dict[str, Any], rank: int, world: int) -> None:
    t = _targets()
    if rank == 1:
        t["w"] = None
    sc.load(t, f"{root}/good", storage_options=opts)


def expanded_view_on_one_rank(root: str, opts: dict[str, Any], rank: int, world: int) -> None:
    t = _targets()
    if rank == 1:
        t["w"] = torch.zeros(4).expand(3, 4)
    sc.load(t, f"{root}/good", storage_options=opts)


def sparse_save_on_one_rank(root: str, opts: dict[str, Any], rank: int, world: int) -> None:
    w = torch.eye(3)
    sc.save({"w": w.to_sparse() if rank == 1 else w}, f"{root}/sparse", storage_options=opts)


def load_another_uri_on_one_rank(root: str, opts: dict[str, Any], rank: int, world: int) -> None:
    sc.load(_targets(), f"{root}/good" if rank == 0 else f"{root}/other", storage_options=opts)


def save_another_uri_on_each_rank(root: str, opts: dict[str, Any], rank: int, world: int) -> None:
    sc.save({"w": torch.ones(3)}, f"{root}/uri{rank}", storage_options=opts)


def overwrite_on_one_rank(root: str, opts: dict[str, Any], rank: int, world: int) -> None:
    sc.save({"w": torch.zeros(3, 4)}, f"{root}/good", storage_options=opts, overwrite=rank == 0)


def restore_typo_on_one_rank(root: str, opts: dict[str, Any], rank: int, world: int) -> None:
    with sc.CheckpointManager(f"{root}/run", storage_options=opts) as mgr:
        mgr.save(1, {"w": GOOD.clone()})
        mgr.restore({"w": torch.zeros(3, 4)}, **({"strct": False} if rank == 1 else {}))


def save_typo_on_one_rank(root: str, opts: dict[str, Any], rank: int, world: int) -> None:
    with sc.CheckpointManager(f"{root}/run2", storage_options=opts) as mgr:
        mgr.save(1, {"w": GOOD.clone()}, **({"compresion": "zstd"} if rank == 1 else {}))


def bad_step_on_one_rank(root: str, opts: dict[str, Any], rank: int, world: int) -> None:
    with sc.CheckpointManager(f"{root}/run3", storage_options=opts) as mgr:
        mgr.save(-1 if rank == 1 else 1, {"w": GOOD.clone()})


def load_argument_on_one_rank(root: str, opts: dict[str, Any], rank: int, world: int, kind: str) -> None:
    kw: dict[str, Any] = {}
    if rank == 1:
        kw = {"budget": {"memory_budget": 0}, "transforms": {"transforms": [{"renam": {}}]},
              "option": {"storage_options": {**opts, "endpont_url": "x"}}}[kind]
    sc.load(_targets(), f"{root}/good", **{"storage_options": opts, **kw})


def save_option_on_one_rank(root: str, opts: dict[str, Any], rank: int, world: int) -> None:
    sc.save({"w": torch.ones(3)}, f"{root}/opt", storage_options={**opts, "endpont_url": "x"} if rank == 1 else opts)


def async_budget_on_one_rank(root: str, opts: dict[str, Any], rank: int, world: int) -> None:
    sc.async_save({"w": torch.ones(3)}, f"{root}/async", storage_options=opts,
                  staging_budget=-1 if rank == 1 else None).result(timeout=60)


def merge_option_on_one_rank(root: str, opts: dict[str, Any], rank: int, world: int) -> None:
    sc.merge(f"{root}/good", f"{root}/hf", storage_options={**opts, "endpont_url": "x"} if rank == 1 else opts)


def good_load_after(root: str, opts: dict[str, Any], rank: int, world: int) -> list[float]:
    t = _targets()
    sc.load(t, f"{root}/good", storage_options=opts)
    return t["w"].flatten().tolist()


SCENARIOS: list[tuple[str, Callable[..., Any]]] = [
    ("save_good", save_good),
    ("plain_data_on_one_rank", plain_data_on_one_rank),
    ("expanded_view_on_one_rank", expanded_view_on_one_rank),
    ("sparse_save_on_one_rank", sparse_save_on_one_rank),
    ("load_another_uri_on_one_rank", load_another_uri_on_one_rank),
    ("save_another_uri_on_each_rank", save_another_uri_on_each_rank),
    ("overwrite_on_one_rank", overwrite_on_one_rank),
    ("restore_typo_on_one_rank", restore_typo_on_one_rank),
    ("save_typo_on_one_rank", save_typo_on_one_rank),
    ("bad_step_on_one_rank", bad_step_on_one_rank),
    ("load_budget_on_one_rank", functools.partial(load_argument_on_one_rank, kind="budget")),
    ("load_transforms_on_one_rank", functools.partial(load_argument_on_one_rank, kind="transforms")),
    ("load_option_on_one_rank", functools.partial(load_argument_on_one_rank, kind="option")),
    ("save_option_on_one_rank", save_option_on_one_rank),
    ("async_budget_on_one_rank", async_budget_on_one_rank),
    ("merge_option_on_one_rank", merge_option_on_one_rank),
    ("good_load_after", good_load_after),
]


def worker(rank: int, world: int, root: str, opts: dict[str, Any]) -> dict[str, Any]:
    return run_scenarios(rank, world, [(n, functools.partial(f, root, opts)) for n, f in SCENARIOS])


@pytest.fixture(scope="module")
def root(local_s3: Any) -> str:
    return f"s3://{BUCKET}/mistakes-mr-{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="module")
def runs(root: str, local_s3: Any) -> ScenarioResults:
    ranks = run_ranks(WORLD, worker, kwargs={"root": root, "opts": local_s3.storage_options}, timeout=240,
                      pg_timeout=PG_TIMEOUT)
    results = ScenarioResults(ranks, [n for n, _ in SCENARIOS])
    results.values("save_good")
    return results


def agreed(runs: ScenarioResults, name: str, cls: str, *needles: str) -> None:
    """Both ranks raised ``cls`` with every needle in the message, through the agreement."""
    for rank, e in enumerate(runs.errors(name)):
        assert e is not None, f"{name}: rank {rank} did not raise"
        assert e.cls == cls and e.cls != "PeerError", f"{name}: rank {rank} raised {e}\n{e.tb}"
        for needle in needles:
            assert needle in e.msg, f"{name}: rank {rank}: {needle!r} not in {e.msg!r}"


def test_plain_data_on_one_rank_raises_incompatible_on_both(runs: ScenarioResults) -> None:
    agreed(runs, "plain_data_on_one_rank", "IncompatibleStateDictError",
           "w: the checkpoint holds a tensor (shape [3, 4], dtype F32) at 'w'")
    assert runs.errors("plain_data_on_one_rank")[0].msg.startswith("rank 1 failed: ")  # type: ignore[union-attr]


def test_an_expanded_view_on_one_rank_raises_on_both(runs: ScenarioResults) -> None:
    agreed(runs, "expanded_view_on_one_rank", "IncompatibleStateDictError", "share memory", "(.clone())")


def test_a_sparse_tensor_saved_on_one_rank_raises_on_both(runs: ScenarioResults, root: str, s3_opts: dict[str, Any]) -> None:
    agreed(runs, "sparse_save_on_one_rank", "IncompatibleStateDictError", "torch.sparse_coo", ".to_dense()")
    with pytest.raises(sc.CheckpointNotFoundError):
        sc.inspect(f"{root}/sparse", storage_options=s3_opts)


def test_a_load_given_another_uri_on_one_rank_names_both(runs: ScenarioResults, root: str) -> None:
    """Rank 1 read its data files from its own prefix under rank 0's manifest: 'does not exist,
    but the checkpoint's manifest lists it', a CorruptCheckpointError about a sound checkpoint."""
    agreed(runs, "load_another_uri_on_one_rank", "CheckpointError",
           f"rank 1 was given uri {root}/other/, rank 0 {root}/good/", "pass the same uri on every rank")


def test_a_save_given_another_uri_on_each_rank_commits_nothing(runs: ScenarioResults, root: str,
                                                               s3_opts: dict[str, Any]) -> None:
    """Both returned normally: rank 0 committed a manifest listing the data file rank 1 wrote
    under its own prefix."""
    agreed(runs, "save_another_uri_on_each_rank", "CheckpointError",
           f"uri='{root}/uri0/' on rank 0 but '{root}/uri1/' on rank 1", "(nothing was written)")
    for rank in range(WORLD):
        with pytest.raises(sc.CheckpointNotFoundError):
            sc.inspect(f"{root}/uri{rank}", storage_options=s3_opts)


def test_overwrite_on_one_rank_only_replaces_nothing(runs: ScenarioResults) -> None:
    agreed(runs, "overwrite_on_one_rank", "CheckpointError", "overwrite=True on rank 0 but False on rank 1")
    assert runs.values("good_load_after") == [GOOD.flatten().tolist()] * WORLD  # still the original


def test_a_restore_typo_on_one_rank_raises_on_both(runs: ScenarioResults) -> None:
    """Hung: rank 1 failed before sc.load while rank 0 went into the load's collectives, until
    the process group's timeout broke the group."""
    agreed(runs, "restore_typo_on_one_rank", "CheckpointError", "unknown argument 'strct' (did you mean 'strict'?)")


def test_a_manager_save_mistake_on_one_rank_raises_on_both(runs: ScenarioResults, root: str,
                                                           s3_opts: dict[str, Any]) -> None:
    agreed(runs, "save_typo_on_one_rank", "CheckpointError", "unknown argument 'compresion'")
    agreed(runs, "bad_step_on_one_rank", "CheckpointError", "step must be an int >= 0, got -1")
    for run in ("run2", "run3"):
        assert sc.latest(f"{root}/{run}", storage_options=s3_opts) is None  # nothing committed


@pytest.mark.parametrize("name, cls, needle", [
    ("load_budget_on_one_rank", "CheckpointError", "memory_budget must be a positive number, got 0"),
    ("load_transforms_on_one_rank", "TransformError", "unknown rule 'renam'"),
    ("load_option_on_one_rank", "StorageOptionError", "unknown storage option 'endpont_url'"),
    ("save_option_on_one_rank", "StorageOptionError", "unknown storage option 'endpont_url'"),
    ("async_budget_on_one_rank", "CheckpointError", "staging_budget must be a positive number of bytes or None, got -1"),
    ("merge_option_on_one_rank", "StorageOptionError", "unknown storage option 'endpont_url'"),
])
def test_an_argument_refused_on_one_rank_fails_every_rank(runs: ScenarioResults, name: str, cls: str,
                                                           needle: str) -> None:
    """Hung: the rank raised before the call's first collective, the others waited in it until
    the process group's timeout."""
    agreed(runs, name, cls, needle)
    assert runs.errors(name)[0].msg.startswith("rank 1 failed: ")  # type: ignore[union-attr]
