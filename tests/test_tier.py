"""The memory/peer tier's pieces, without processes: partners on other nodes, the planner's
per-file holder constraint (plans simulated rank by rank), the holdings verdicts, the local
folder's commit/retention/cleanup, local file checks, and a one-process manager that saves
locally every step and to the bucket every 5th and restores the newest local step, or the
bucket's copy of the step's bytes that its folder lost."""

from __future__ import annotations

import dataclasses
import json
import itertools
import logging
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import streamckpt as sc
from streamckpt.manage.tier.holdings import Save, candidates, missing_files, same_file, saves_of, stale
from streamckpt.manage.tier.localdir import LocalDir, run_key
from streamckpt.manage.tier.localmanifest import LOCAL_MANIFEST
from streamckpt.manage.tier.partners import topology
from streamckpt.manage.tier.verify import check_file
from streamckpt.testing.s3server import free_port
from streamckpt.plan.data import messages_of
from streamckpt.plan.holders import bytes_by_reader, constrain_readers
from streamckpt.plan.planner import PlanOptions, build_plan

from test_plan import _expected, _make_checkpoint, _make_targets, check_staging_fits, simulate


# ------------------------------------------------------------------ partners


@pytest.mark.parametrize("world,per_node,replicas", [(4, 2, 1), (8, 2, 1), (8, 2, 2), (6, 3, 1), (12, 4, 3), (4, 1, 2)])
def test_partners_lie_on_other_nodes_and_no_node_loss_loses_a_file(world: int, per_node: int, replicas: int) -> None:
    topo = topology(world, per_node)
    usable = topo.usable_replicas(replicas)
    assert usable == min(replicas, world // per_node - 1)
    keepers = {r: [r, *topo.partners(r, replicas)] for r in range(world)}
    for r, ks in keepers.items():
        assert len({topo.node_of(k) for k in ks}) == len(ks) == 1 + usable  # each copy on its own node
        assert all(r in topo.sources(p, replicas) for p in ks[1:])  # the partner expects it from r
    for lost in itertools.combinations(range(topo.nodes), usable):  # any `usable` nodes lost: no file lost
        assert all(any(topo.node_of(k) not in lost for k in ks) for ks in keepers.values())
    load = [sum(r in ks[1:] for ks in keepers.values()) for r in range(world)]
    assert load == [usable] * world  # every rank keeps as many copies as it sends


def test_one_node_has_no_partner() -> None:
    assert topology(4, 4).partners(1, 1) == [] and topology(4, 0).nodes == 1 and topology(6, 4).nodes == 1
    assert topology(4, 2).usable_replicas(5) == 1


# ------------------------------------------------------------------ the planner's holder constraint


@settings(max_examples=120, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 3), st.integers(2, 6), st.sampled_from([256, 1 << 20]),
       st.sampled_from([2, 8]))
def test_constrained_reads_come_from_holders_and_every_target_fills(seed: int, ndim: int, world: int, budget: int,
                                                                     peers: int) -> None:
    rng = random.Random(seed)
    shape = tuple(rng.randint(1, 9) for _ in range(ndim))
    manifest, files, original = _make_checkpoint(rng, shape)
    targets = _make_targets(rng, shape, world, manifest.tensors["w"].dtype)
    opts = PlanOptions(memory_budget=budget, max_peers=peers)  # max_peers=2: relayed reads at small worlds
    plan = build_plan(manifest, targets, opts)
    holders = {f: sorted(rng.sample(range(world), rng.randint(1, world))) for f in files if rng.random() < 0.8}
    constrain_readers(plan, holders)
    for r in plan.reads:
        assert r.file not in holders or r.reader in holders[r.file]
    check_staging_fits([plan] * world, opts)  # packed again: every rank's rounds within the budget
    dests, fetched = simulate(plan, files, world, targets, torch.float32)
    for rank in range(world):
        for uid, spec in zip(plan.rank_targets[rank], targets[rank]):
            assert torch.equal(dests[rank].tensors[uid], _expected(original, spec)), (rank, spec)
        own, peer, rest = bytes_by_reader(plan, rank, set(holders))
        assert own + peer + rest == sum(spec.nbytes for spec in targets[rank])


def test_a_read_moves_to_a_holder_that_needs_it_else_the_least_loaded_holder() -> None:
    rng = random.Random(3)
    manifest, files, original = _make_checkpoint(rng, (8, 4))
    code = manifest.tensors["w"].dtype
    from streamckpt.core.targets import TargetSpec
    targets = [[TargetSpec("w", code, (8, 4), (0, 0), (8, 4), None)], [], []]  # rank 0 needs all; 1, 2 nothing
    plan = build_plan(manifest, targets, PlanOptions())
    assert {r.reader for r in plan.reads} == {0}
    constrain_readers(plan, {f: [1, 2] for f in files})
    readers = [r.reader for r in plan.reads]
    assert set(readers) == {1, 2} and all(not r.private and list(messages_of(r, plan.targets)) == [0]
                                          for r in plan.reads)
    dests, _ = simulate(plan, files, 3, targets, torch.float32)
    assert torch.equal(dests[0].tensors[0], original)
    assert bytes_by_reader(plan, 0, set(files)) == (0, original.nbytes, 0)
    with pytest.raises(ValueError):
        constrain_readers(plan, {next(iter(files)): []})


@pytest.mark.parametrize("per_node", [0, 2])
def test_a_holder_that_needs_none_of_a_replicated_read_roots_its_relay(per_node: int) -> None:
    """Rank 0 holds the file and needs nothing of it; ranks 1-7 each need all of it (a tensor
    replicated over data-parallel ranks). The read keeps a relay with rank 0 as its root: no
    rank sends a piece to more than ``max_peers`` ranks, where going straight from the holder
    would send it 7 times; every target fills."""
    from streamckpt.core.targets import TargetSpec
    from streamckpt.plan.routes import hops_of

    rng = random.Random(5)
    manifest, files, original = _make_checkpoint(rng, (16, 8))
    code = manifest.tensors["w"].dtype
    world = 8
    targets = [[]] + [[TargetSpec("w", code, (16, 8), (0, 0), (16, 8), None)] for _ in range(world - 1)]
    opts = PlanOptions(max_peers=2, ranks_per_node=per_node)
    plan = build_plan(manifest, targets, opts)
    assert all(r.relay for r in plan.reads)
    constrain_readers(plan, {f: [0] for f in files})
    assert all(r.reader == 0 and r.root and r.relay for r in plan.reads)
    for r in plan.reads:
        sent: dict[tuple[int, int], set[int]] = {}
        for depth, src, dst, _ in hops_of(r, plan.targets):
            sent.setdefault((depth, src), set()).add(dst)
        assert max(len(v) for v in sent.values()) <= 2  # each rank, each depth: at most max_peers receivers
        assert {dst for _, _, dst, _ in hops_of(r, plan.targets)} == set(range(1, world))
    check_staging_fits([plan] * world, opts)
    dests, _ = simulate(plan, files, world, targets, torch.float32)
    for rank in range(1, world):
        assert torch.equal(dests[rank].tensors[plan.rank_targets[rank][0]], original)
    assert bytes_by_reader(plan, 3, set(files)) == (0, original.nbytes, 0)


# ------------------------------------------------------------------ holdings


def test_candidates_newest_step_first_and_a_step_s_latest_save() -> None:
    reports = [{"saves": [{"step": 7, "id": "new", "ns": 20, "files": ["a", "b"]},
                          {"step": 6, "id": "s6", "ns": 5, "files": ["a"]}]},
               {"saves": [{"step": 7, "id": "old", "ns": 10, "files": ["a", "b"]}]},  # an earlier run of step 7
               {"saves": []}]  # a replaced node
    saves = saves_of(reports)
    assert [(s.step, s.id) for s in saves] == [(7, "new"), (7, "old"), (6, "s6")]
    assert saves[0].holders == {"a": [0], "b": [0]} and saves[0].first == 0 and saves[1].first == 1
    got = candidates(saves, [5, 10])
    assert [(s, x.id if x else None) for s, x in got] == [(10, None), (7, "new"), (6, "s6"), (5, None)]
    assert [s for s, _ in candidates(saves, [5], step=6)] == [6]
    # steps 11 and 12 saved, the run went back to 10 and saved 11 again: the old 12 is stale
    again = saves_of([{"saves": [{"step": 12, "id": "old12", "ns": 120, "files": ["a"]},
                                 {"step": 11, "id": "old11", "ns": 110, "files": ["a"]},
                                 {"step": 11, "id": "new11", "ns": 200, "files": ["a"]}]}])
    assert [s.id for s in stale(again)] == ["old12"]
    assert [(s, x.id if x else None) for s, x in candidates(again, [10])] == [(11, "new11"), (10, None)]


def test_missing_and_same_files(tmp_path: Path) -> None:
    sc.save({"w": torch.arange(8.0)}, str(tmp_path / "a"))
    sc.save({"w": torch.arange(8.0)}, str(tmp_path / "b"))
    sc.save({"w": torch.arange(8.0) + 1}, str(tmp_path / "c"))
    from streamckpt.formats import read_manifest
    from streamckpt.storage import Storage
    a, b, c = (read_manifest(Storage(str(tmp_path / n))) for n in "abc")
    name = next(iter(a.files))
    assert same_file(a, b, name) and not same_file(a, c, name) and not same_file(a, b, "data/nope")
    assert missing_files(a, {name: [0]}) == [] and missing_files(a, {name: []}) == [name]


# ------------------------------------------------------------------ the local folder and its checks


def _manager(tmp_path: Path, **kw: Any) -> Any:
    return sc.CheckpointManager(str(tmp_path / "bucket"), save_every=5, local_dir=str(tmp_path / "node"),
                                local_every=1, **kw)


def _state(step: int) -> dict[str, Any]:
    return {"w": torch.arange(64, dtype=torch.float32).reshape(8, 8) * step, "n": step}


def test_local_steps_commit_retain_and_clean(tmp_path: Path, caplog: Any) -> None:
    root = str(tmp_path / "bucket")
    folder = LocalDir(str(tmp_path / "node"), root)
    other = Path(folder.tier) / run_key("s3://another/run") / "step-3"
    other.mkdir(parents=True)
    with caplog.at_level(logging.WARNING), _manager(tmp_path, local_keep=2) as mgr:
        for step in range(1, 8):
            mgr.save(step, _state(step))
            if step == 4:  # a save of step 8 that never committed (files, no manifest)
                (folder.step_dir(8) / "data").mkdir(parents=True)
                (folder.step_dir(8) / "data" / "00000-0000.safetensors").write_bytes(b"x" * 10)
        assert mgr.steps() == [5]
    assert sorted(folder.committed()) == [6, 7] and sorted(folder.folders()) == [6, 7]
    assert not other.exists()  # another run's local files: removed
    seven = folder.committed()[7]
    assert (seven.root, seven.step) == (root, 7) and seven.keepers == {f: [0] for f in seven.manifest.files}
    assert "replicas=1 asked for, 0 kept" not in caplog.text  # one process: nothing to say
    # a manifest naming another root or step is no step of this run
    (folder.step_dir(9)).mkdir()
    (folder.step_dir(9) / LOCAL_MANIFEST).write_bytes(seven.blob)
    assert sorted(folder.committed()) == [6, 7]
    assert LocalDir(str(tmp_path / "node"), "s3://x/y").committed() == {}


def test_check_file_finds_a_flipped_byte_a_wrong_digest_and_a_short_file(tmp_path: Path) -> None:
    with _manager(tmp_path) as mgr:
        mgr.save(1, _state(1))
    folder = LocalDir(str(tmp_path / "node"), str(tmp_path / "bucket"))
    one = folder.committed()[1]
    (name, shards), = one.shards_by_file().items()
    path, size = folder.step_dir(1) / name, one.manifest.files[name]
    assert check_file(path, size, shards) is None
    raw = bytearray(path.read_bytes())
    key, itemsize, s = shards[0]
    wrong = [(key, itemsize, dataclasses.replace(s, digest="0" * 32))]
    assert "does not match its digest" in (check_file(path, size, wrong) or "")
    raw[s.byte_offset + 3] ^= 1
    path.write_bytes(bytes(raw))
    assert "fails its CRC32C" in (check_file(path, size, shards) or "")
    path.write_bytes(bytes(raw[:-1]))
    assert f"is {size - 1} bytes" in (check_file(path, size, shards) or "")


# ------------------------------------------------------------------ one process, end to end


def test_restore_takes_the_newest_local_step_and_the_bucket_for_lost_bytes(tmp_path: Path, caplog: Any) -> None:
    with _manager(tmp_path, local_keep=3) as mgr:
        assert [mgr.should_save(s) for s in (1, 5)] == [True, True]
        for step in range(1, 11):
            mgr.save(step, _state(step))
        assert mgr.steps() == [5, 10]
    folder = LocalDir(str(tmp_path / "node"), str(tmp_path / "bucket"))
    assert sorted(folder.committed()) == [8, 9, 10]
    target = {"w": torch.zeros(8, 8), "n": -1}
    with _manager(tmp_path) as mgr:
        got = mgr.restore(target)
    assert (got.step, got.source, target["n"], got.bytes_local, got.bytes_bucket) == (10, "local", 10, 256, 0)
    assert torch.equal(target["w"], _state(10)["w"])
    # step 10's local file corrupt: the bucket's step 10 holds the same bytes: only they are fetched
    name = next(iter(folder.committed()[10].manifest.files))
    path = folder.step_dir(10) / name
    raw = bytearray(path.read_bytes())
    raw[-2] ^= 0x40
    path.write_bytes(bytes(raw))
    target = {"w": torch.zeros(8, 8), "n": -1}
    with caplog.at_level(logging.WARNING), _manager(tmp_path) as mgr:
        got = mgr.restore(target)
    assert (got.step, got.source, got.bytes_local, got.bytes_bucket, got.bucket_bytes_read) == \
        (10, "local", 0, 256, 256)
    assert torch.equal(target["w"], _state(10)["w"]) and name in caplog.text and "is not used" in caplog.text
    # found by the load's own CRC32C check (sizes alone were checked first), then every copy in full
    assert "the load of local step 10 failed (CorruptCheckpointError" in caplog.text
    assert "checking every local copy in full" in caplog.text
    # step 9 is newest locally once 10 is gone from both: the bucket's newest (5) is older
    folder.remove_step(10)
    import shutil
    shutil.rmtree(tmp_path / "bucket" / "step-10")
    target = {"w": torch.zeros(8, 8), "n": -1}
    with _manager(tmp_path) as mgr:
        got = mgr.restore(target)
    assert (got.step, got.source, target["n"]) == (9, "local", 9) and torch.equal(target["w"], _state(9)["w"])
    # a local step whose only copy of a file is corrupt, which the bucket lacks, is passed over
    nine = folder.step_dir(9) / name
    raw = bytearray(nine.read_bytes())
    raw[-1] ^= 1
    nine.write_bytes(bytes(raw))
    target = {"w": torch.zeros(8, 8), "n": -1}
    with _manager(tmp_path) as mgr:
        got = mgr.restore(target)
    assert (got.step, got.source) == (8, "local") and torch.equal(target["w"], _state(8)["w"])
    assert got.skipped == [(str(folder.step_dir(9)), f"no surviving rank holds {name}")]
    # no local step left: the bucket's newest, and its counters
    shutil.rmtree(tmp_path / "node")
    target = {"w": torch.zeros(8, 8), "n": -1}
    with _manager(tmp_path) as mgr:
        got = mgr.restore(target)
    assert (got.step, got.source, got.bytes_local, got.bytes_peers, got.bytes_bucket, got.bucket_bytes_read) == \
        (5, "bucket", 0, 0, 256, 256) and torch.equal(target["w"], _state(5)["w"])


def test_tier_arguments_are_checked(tmp_path: Path) -> None:
    for kw in ({"local_keep": 0}, {"replicas": -1}, {"local_every": 0}, {"local_dir": "s3://b/x"},
               {"local_keep": True}):
        with pytest.raises(sc.CheckpointError):
            sc.CheckpointManager(str(tmp_path / "b"), **{"local_dir": str(tmp_path / "n"), **kw})


def test_cli_ls_local_shows_the_run_s_local_steps(tmp_path: Path, capsys: Any) -> None:
    from streamckpt.cli import main
    root = str(tmp_path / "bucket")
    with _manager(tmp_path) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state(step), metrics={"loss": 1.0 / step})
    folder = LocalDir(str(tmp_path / "node"), root)
    (folder.step_dir(4) / "data").mkdir(parents=True)  # a local save that did not commit
    (folder.step_dir(4) / "data" / "00000-0000.safetensors").write_bytes(b"x" * 100)
    assert main(["ls", root, "--local", str(tmp_path / "node")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:5] == ["step", "state", "committed", "(UTC)", "files"]
    assert [ln.split()[:2] for ln in lines[1:]] == [["2", "committed"], ["3", "committed"], ["4", "uncommitted"]]
    assert "1 of 1" in lines[2] and lines[2].endswith("loss=0.333333") and "100 B" in lines[3]
    assert main(["ls", root, "--local", str(tmp_path / "node"), "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["state"], r["files"], r["of"]) for r in found] == [
        (2, "committed", 1, 1), (3, "committed", 1, 1), (4, "uncommitted", 1, None)]
    assert found[1]["keepers"] == {"data/00000-0000.safetensors": [0]} and found[1]["bytes"] > 256
    assert main(["ls", "s3://another/run", "--local", str(tmp_path / "node")]) == 1
    assert "no local steps of s3://another/run" in capsys.readouterr().err


def test_zstd_local_steps_are_checked_and_restored(tmp_path: Path) -> None:
    with _manager(tmp_path) as mgr:
        for step in (1, 2):
            mgr.save(step, _state(step), compression="zstd")
    folder = LocalDir(str(tmp_path / "node"), str(tmp_path / "bucket"))
    two = folder.committed()[2]
    (name, shards), = two.shards_by_file().items()
    assert name.endswith(".zst") and shards[0][2].codec == "zstd" and shards[0][2].frame_lengths
    assert check_file(folder.step_dir(2) / name, two.manifest.files[name], shards) is None
    target = {"w": torch.zeros(8, 8), "n": -1}
    with _manager(tmp_path) as mgr:
        got = mgr.restore(target)
    assert (got.step, got.source, target["n"]) == (2, "local", 2) and torch.equal(target["w"], _state(2)["w"])


def test_a_bucket_that_cannot_be_listed_leaves_the_local_tier_to_choose(tmp_path: Path, s3_uri: str,
                                                                         s3_opts: dict[str, Any], monkeypatch: Any,
                                                                         caplog: Any) -> None:
    def manager(opts: dict[str, Any]) -> Any:
        return sc.CheckpointManager(s3_uri, storage_options=opts, save_every=5, local_dir=str(tmp_path / "node"))

    with manager(s3_opts) as mgr:
        for step in (4, 5, 6):
            mgr.save(step, _state(step))
    monkeypatch.setenv("STREAMCKPT_MAX_ATTEMPTS", "1")
    down = {**s3_opts, "endpoint_url": f"http://127.0.0.1:{free_port()}"}  # nothing listens there
    target = {"w": torch.zeros(8, 8), "n": -1}
    with caplog.at_level(logging.WARNING), manager(down) as mgr:
        got = mgr.restore(target)
        assert (got.step, got.source, target["n"]) == (6, "local", 6) and "cannot be listed" in caplog.text
        LocalDir(str(tmp_path / "node"), s3_uri).remove_step(6)
        LocalDir(str(tmp_path / "node"), s3_uri).remove_step(5)
        with pytest.raises(sc.StorageError):  # nothing local left: the bucket's error, as without the tier
            mgr.restore(target)


def test_a_failing_local_save_does_not_keep_a_step_from_the_bucket(tmp_path: Path, caplog: Any) -> None:
    blocker = tmp_path / "node"
    blocker.write_bytes(b"a file where the local folder should be")
    with caplog.at_level(logging.WARNING), _manager(tmp_path) as mgr:
        with pytest.raises(sc.CheckpointError, match="local tier: cannot prepare"):
            mgr.save(4, _state(4))  # a local step only: its failure is the save's
        mgr.save(5, _state(5))  # also the bucket's: saved there, the local failure logged
        assert mgr.steps() == [5] and "the local save of step 5 failed" in caplog.text


def test_training_objects_save_locally_and_restore_in_place_from_the_tier(tmp_path: Path) -> None:
    """A module, its optimizer and a plain value, as users pass them (issue 45's Stateful dict)
    through the tier (a step only the tier keeps): restored from the local step, in place.
    Was: the local save refused the Linear ("a value of type Linear cannot be saved")."""
    torch.manual_seed(3)
    model = torch.nn.Linear(4, 3)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    optim.step()
    kw = dict(local_dir=tmp_path / "local", local_every=1, save_every=5)
    with sc.CheckpointManager(str(tmp_path / "run"), **kw) as mgr:  # type: ignore[arg-type]
        saved = mgr.save(1, {"model": model, "optim": optim, "step": 1})
    assert isinstance(saved, sc.SaveResult) and not list((tmp_path / "run").glob("step-*"))  # the tier's alone
    model2 = torch.nn.Linear(4, 3)
    optim2 = torch.optim.Adam(model2.parameters(), lr=0.1)
    state = {"model": model2, "optim": optim2, "step": 0}
    with sc.CheckpointManager(str(tmp_path / "run"), **kw) as mgr:  # type: ignore[arg-type]
        got = mgr.restore(state)
    assert got is not None and got.source == "local" and got.step == 1 and state["step"] == 1
    assert torch.equal(model2.weight, model.weight) and torch.equal(model2.bias, model.bias)
    want, have = optim.state_dict(), optim2.state_dict()
    for i in want["state"]:
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(have["state"][i][k], want["state"][i][k]), (i, k)
    assert have["param_groups"] == want["param_groups"]


def test_async_local_saves_return_once_staged_and_commit_in_the_background(tmp_path: Path) -> None:
    """``async_save=True``: a local step returns a handle as soon as the state is staged; the
    tensors the caller then overwrites do not reach the step. On a bucket step both saves are
    in flight at once; ``wait`` ends both."""
    w = torch.zeros(8, 8)
    kinds = []
    with _manager(tmp_path, async_save=True) as mgr:
        for step in range(1, 6):
            w.copy_(_state(step)["w"])
            kinds.append(type(mgr.save(step, {"w": w, "n": step})).__name__)
            w.fill_(-1.0)  # training goes on
        mgr.wait()
        assert mgr.steps() == [5]
    assert kinds == ["SaveHandle"] * 5
    folder = LocalDir(str(tmp_path / "node"), str(tmp_path / "bucket"))
    assert sorted(folder.committed()) == [4, 5]  # local_keep=2, applied by the background save
    for step in (5, 4):
        target = {"w": torch.zeros(8, 8), "n": -1}
        with _manager(tmp_path) as mgr:
            got = mgr.restore(target, step=step)
        assert (got.step, got.source, target["n"]) == (step, "local", step)
        assert torch.equal(target["w"], _state(step)["w"])


_EXIT_SCRIPT = """
import sys, torch, streamckpt as sc
mgr = sc.CheckpointManager(sys.argv[1], local_dir=sys.argv[2], local_every=1, save_every=100, async_save=True)
state = {"w": torch.arange(1 << 24, dtype=torch.float32), "n": 7}
handle = mgr.save(7, state)
print(type(handle).__name__, handle.done(), flush=True)
if sys.argv[3] == "raise":
    raise RuntimeError("the training loop failed")
"""


@pytest.mark.parametrize("end", ["normal", "raise"])
def test_a_local_save_in_flight_at_exit_commits_on_a_normal_end_only(tmp_path: Path, end: str) -> None:
    """A script that ends with a local save in flight (no ``close``): a normal end finishes
    and commits it, as a bucket save of a manager's; an uncaught exception cancels it."""
    import subprocess
    import sys

    root, node = str(tmp_path / "bucket"), str(tmp_path / "node")
    p = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, root, node, end], capture_output=True, text=True,
                       timeout=120)
    assert p.stdout.split() == ["SaveHandle", "False"], p.stderr
    folder = LocalDir(node, root)
    if end == "normal":
        assert p.returncode == 0 and sorted(folder.committed()) == [7], p.stderr
        target = {"w": torch.zeros(1 << 24), "n": -1}
        with sc.CheckpointManager(root, local_dir=node) as mgr:
            got = mgr.restore(target)
        assert (got.step, got.source, target["n"]) == (7, "local", 7)
        assert torch.equal(target["w"], torch.arange(1 << 24, dtype=torch.float32))
    else:
        assert p.returncode == 1 and folder.committed() == {} and "cancelling it" in p.stderr, p.stderr
