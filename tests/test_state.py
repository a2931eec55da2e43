"""Plain torch training state: ``sc.save`` of any state tree, ``sc.load_state`` back as saved.

Everything against the session's moto S3 server over HTTP (DCP's own writer on local
files where DCP is the subject). Structures are compared strictly: container types,
key types (0 is not "0"), tuples vs lists, float specials, tensors element by element
with their dtypes.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

import streamckpt as sc
from distributed import run_ranks

ROOT = Path(__file__).resolve().parents[1]


def same(a: Any, b: Any, path: str = "", *, exact: bool = True) -> None:
    """Assert ``b`` is ``a`` as torch.load would give it back (dict subclasses as dict;
    ``exact=False``: ``b`` may be any dict, as a tree filled in place is)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a.cpu(), b.cpu()), path
    elif isinstance(a, dict):
        assert type(b) is dict or (not exact and isinstance(b, dict)), f"{path}: {type(b).__name__}"
        assert list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        assert [type(k) for k in a] == [type(k) for k in b], f"{path}: key types"
        for k in a:
            same(a[k], b[k], f"{path}.{k}", exact=exact)
    elif isinstance(a, (list, tuple)):
        assert type(b) is (tuple if isinstance(a, tuple) else list), f"{path}: {type(b).__name__}"
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{path}[{i}]", exact=exact)
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), path
    else:
        assert type(b) is type(a) and b == a, f"{path}: {b!r} != {a!r}"


def trained(steps: int = 2) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95))
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)  # best = inf until its first step
    step_lr = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 6)).pow(2).sum().backward()
        opt.step()
        step_lr.step()
    return model, opt, plateau, step_lr


def training_state() -> dict[str, Any]:
    model, opt, plateau, step_lr = trained()
    return {
        "model": model.state_dict(),  # an OrderedDict
        "optim": opt.state_dict(),  # state keyed by int parameter index, betas a tuple
        "plateau": plateau.state_dict(),  # best = inf
        "sched": step_lr.state_dict(),
        "epoch": 3,
        "rng": torch.get_rng_state(),
        "specials": {"nan": math.nan, "-inf": -math.inf, "none": None, "flag": True, "name": "run-1"},
        "mixed": {0: "zero", "one": 1, 7: [1, (2, 3)], -2: {3: None}},
        "dollar": {"$tensor": "not a reference", "$x": [1]},
        "pair": (torch.arange(3), 2.5),
        "list_of_tensors": [torch.ones(2, dtype=torch.bfloat16), {"inner": torch.zeros(1, dtype=torch.int64)}],
        "empty": {},
        "empty_list": [],
    }


def test_any_torch_state_tree_comes_back_as_saved(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    state = training_state()
    assert math.isinf(state["plateau"]["best"])
    sc.save(state, s3_uri, storage_options=s3_opts)
    back = sc.load_state(s3_uri, storage_options=s3_opts)
    same(state, back)
    assert list(back["optim"]["state"]) == [0, 1, 2, 3]
    # what the manifest holds: the tree as data, no pickle
    raw = sc.inspect(s3_uri, storage_options=s3_opts)
    assert raw.values["plateau.best"] == math.inf and raw.values["optim.param_groups"][0]["betas"] == (0.8, 0.95)


def test_load_state_keys_reads_only_those_subtrees(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    state = training_state()
    sc.save(state, s3_uri, storage_options=s3_opts)
    part = sc.load_state(s3_uri, storage_options=s3_opts, keys=["optim.state", "epoch"])
    same({"optim": {"state": state["optim"]["state"]}, "epoch": 3}, part)
    one = sc.load_state(s3_uri, storage_options=s3_opts, keys=["model.0.weight"])
    same({"model": {"0.weight": state["model"]["0.weight"]}}, one)
    with pytest.raises(sc.MissingKeysError) as e:
        sc.load_state(s3_uri, storage_options=s3_opts, keys=["model", "optimizer"])
    assert e.value.missing_keys == ["optimizer"] and s3_uri in str(e.value)


def test_load_fills_an_int_keyed_optimizer_state_in_place(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    model, opt, _, _ = trained()
    sc.save({"model": model.state_dict(), "optim": opt.state_dict()}, s3_uri, storage_options=s3_opts)
    model2, opt2, _, _ = trained(steps=1)  # same shapes, other values, state exists
    target = {"model": model2.state_dict(), "optim": opt2.state_dict()}
    result = sc.load(target, s3_uri, storage_options=s3_opts)
    assert result.missing_keys == [] and result.unexpected_keys == []
    same({"model": model.state_dict(), "optim": opt.state_dict()}, target, exact=False)


def test_tuple_values_stay_with_the_caller_in_place(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    sc.save({"pair": (torch.arange(3), 2.5)}, s3_uri, storage_options=s3_opts)
    target = {"pair": (torch.zeros(3, dtype=torch.int64), 9.0)}
    sc.load(target, s3_uri, storage_options=s3_opts)
    assert torch.equal(target["pair"][0], torch.arange(3)) and target["pair"][1] == 9.0  # a tuple is immutable
    same({"pair": (torch.arange(3), 2.5)}, sc.load_state(s3_uri, storage_options=s3_opts))


@pytest.mark.parametrize("value, what", [
    ({1, 2}, "a value of type set"),
    (object(), "a value of type object"),
    ([1, {2.5: "x"}], "a dict key 2.5 of type float"),
])
def test_unsavable_values_are_named(s3_uri: str, s3_opts: dict[str, Any], value: Any, what: str) -> None:
    with pytest.raises(sc.IncompatibleStateDictError) as e:
        sc.save({"w": torch.ones(1), "extra": {"bad": value}}, s3_uri, storage_options=s3_opts)
    assert "extra.bad" in str(e.value) and what in str(e.value) and "convert it first" in str(e.value)


def test_a_key_that_is_neither_str_nor_int_is_named(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    with pytest.raises(sc.IncompatibleStateDictError) as e:
        sc.save({"optim": {"state": {(0, 1): torch.ones(1)}}}, s3_uri, storage_options=s3_opts)
    assert "(0, 1)" in str(e.value) and "'optim.state.'" in str(e.value) and "strings or ints" in str(e.value)


def test_keys_that_join_alike_are_refused(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    with pytest.raises(sc.IncompatibleStateDictError) as e:
        sc.save({"m": {0: torch.ones(1), "0": torch.zeros(1)}}, s3_uri, storage_options=s3_opts)
    assert "'m.0' appears twice" in str(e.value)


def test_a_tree_naming_what_is_not_stored_is_corrupt(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    import s3fs

    sc.save({"w": torch.ones(2)}, s3_uri, storage_options=s3_opts)
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3_opts)
    path = s3_uri.removeprefix("s3://") + "/manifest.json"
    doc = json.loads(fs.cat(path))
    doc["tree"] = {"w": {"$tensor": "w"}, "v": {"$tensor": "gone"}}
    fs.pipe(path, json.dumps(doc).encode())
    with pytest.raises(sc.CorruptCheckpointError) as e:
        sc.load_state(s3_uri, storage_options=s3_opts)
    assert "tree.v refers to 'gone'" in str(e.value) and "manifest.json" in str(e.value)


# ------------------------------------------------------------- resume, bit-exact

_TRAIN = textwrap.dedent('''
    import sys, torch, streamckpt as sc
    from safetensors.torch import save_file
    uri, opts, out, mode = sys.argv[1], {"endpoint_url": sys.argv[2], "key": "testing", "secret": "testing"}, sys.argv[3], sys.argv[4]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    def train(n):
        for _ in range(n):
            opt.zero_grad(); model(torch.randn(8, 6)).pow(2).mean().backward(); opt.step(); sched.step()
    if mode == "first":
        train(3)
        sc.save({"model": model.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict(),
                 "epoch": 3, "rng": torch.get_rng_state()}, uri, storage_options=opts)
    else:
        state = sc.load_state(uri, storage_options=opts)
        model.load_state_dict(state["model"]); opt.load_state_dict(state["optim"])
        sched.load_state_dict(state["sched"]); torch.set_rng_state(state["rng"])
        assert state["epoch"] == 3
    train(3)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, out)
''')


def test_a_fresh_process_resumes_training_bit_exactly(s3_uri: str, s3_opts: dict[str, Any], tmp_path: Path) -> None:
    from safetensors.torch import load_file

    script = tmp_path / "train.py"
    script.write_text(_TRAIN)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    for mode in ("first", "resumed"):
        subprocess.run([sys.executable, str(script), s3_uri, s3_opts["endpoint_url"], str(tmp_path / f"{mode}.st"), mode],
                       check=True, env=env, timeout=120)
    first, resumed = load_file(tmp_path / "first.st"), load_file(tmp_path / "resumed.st")
    assert list(first) == list(resumed)
    for k in first:
        assert torch.equal(first[k], resumed[k]), k


# ------------------------------------------------------------------ many ranks


def _pipeline_stage_worker(rank: int, world: int, uri: str, opts: dict[str, Any]) -> Any:
    torch.manual_seed(rank)
    stage = {f"layers.{rank}.weight": torch.randn(3, 2)}  # each stage holds its own layers
    state = {"model": stage, "optim": {"state": {rank: {"exp_avg": torch.full((2,), float(rank))}}},
             "step": 5, "rank_note": f"from rank {rank}"}
    sc.save(state, uri, storage_options=opts)
    return {"weight": stage[f"layers.{rank}.weight"].tolist()}


def test_a_pipeline_parallel_save_records_every_stage(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    ranks = run_ranks(2, _pipeline_stage_worker, kwargs={"uri": s3_uri, "opts": s3_opts}, timeout=120)
    for r in ranks:
        assert r.error is None, r.error
    back = sc.load_state(s3_uri, storage_options=s3_opts)
    assert list(back["model"]) == ["layers.0.weight", "layers.1.weight"]
    for rank, r in enumerate(ranks):
        assert back["model"][f"layers.{rank}.weight"].tolist() == r.value["weight"]
    assert list(back["optim"]["state"]) == [0, 1]
    assert torch.equal(back["optim"]["state"][1]["exp_avg"], torch.full((2,), 1.0))
    assert back["step"] == 5 and back["rank_note"] == "from rank 0"  # values are rank 0's, as DCP keeps one


def test_async_save_records_the_tree_as_of_the_call(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    state = {"optim": {"state": {0: {"exp_avg": torch.ones(3)}}, "param_groups": [{"lr": 0.1, "params": [0]}]}}
    handle = sc.async_save(state, s3_uri, storage_options=s3_opts)
    state["optim"]["param_groups"][0]["lr"] = 0.5  # changed after the call: not what was saved
    state["optim"]["state"][0]["exp_avg"].fill_(7.0)
    handle.result(timeout=60)
    same({"optim": {"state": {0: {"exp_avg": torch.ones(3)}}, "param_groups": [{"lr": 0.1, "params": [0]}]}},
         sc.load_state(s3_uri, storage_options=s3_opts))


# ------------------------------------------------------------- other formats


def test_load_state_of_a_dcp_checkpoint_rebuilds_it_as_dcp_does(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    model, opt, _, _ = trained()
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "epoch": 4}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "ck")), no_dist=True)
    dcp_to_torch_save(str(tmp_path / "ck"), str(tmp_path / "ref.pt"))
    reference = torch.load(tmp_path / "ref.pt", weights_only=False)  # DCP's own rebuild of its nesting
    back = sc.load_state(str(tmp_path / "ck"))
    assert list(back["optim"]["state"]) == ["0", "1", "2", "3"]  # DCP keeps int keys as strings
    _same_loosely(reference, back)


def _same_loosely(a: Any, b: Any, path: str = "") -> None:
    """Equal nesting and leaves; DCP's own rebuild returns lists where the state held tuples."""
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(map(str, a)) == sorted(map(str, b)), path
        for k in a:
            _same_loosely(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _same_loosely(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


def test_load_state_of_a_huggingface_file_is_a_flat_dict(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    import s3fs
    from safetensors.torch import save as st_save

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3_opts)
    tensors = {"embed.weight": torch.arange(12.0).reshape(3, 4), "norm.weight": torch.ones(4, dtype=torch.float16)}
    fs.pipe(s3_uri.removeprefix("s3://") + "/model.safetensors", st_save(tensors))
    same(tensors, sc.load_state(s3_uri, storage_options=s3_opts))


# ------------------------------------------------------------ HF file URIs


def test_a_uri_naming_a_safetensors_file_or_index_loads_it(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    import s3fs
    from safetensors.torch import save as st_save

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3_opts)
    base = s3_uri.removeprefix("s3://")
    a, b = {"a": torch.arange(6.0).reshape(2, 3)}, {"b": torch.ones(2, dtype=torch.int32)}
    fs.pipe(f"{base}/model-00001-of-00002.safetensors", st_save(a))
    fs.pipe(f"{base}/model-00002-of-00002.safetensors", st_save(b))
    fs.pipe(f"{base}/extra.safetensors", st_save({"c": torch.zeros(1)}))
    index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                            "b": "model-00002-of-00002.safetensors"}}
    fs.pipe(f"{base}/model.safetensors.index.json", json.dumps(index).encode())

    same(a, sc.load_full(f"{s3_uri}/model-00001-of-00002.safetensors", storage_options=s3_opts))
    same({"c": torch.zeros(1)}, sc.load_full(f"{s3_uri}/extra.safetensors", storage_options=s3_opts))
    same({**a, **b}, sc.load_full(f"{s3_uri}/model.safetensors.index.json", storage_options=s3_opts))
    info = sc.inspect(f"{s3_uri}/extra.safetensors", storage_options=s3_opts)
    assert info.kind == "safetensors" and list(info.tensors) == ["c"]
    target = {"b": torch.zeros(2, dtype=torch.int32)}
    sc.load(target, f"{s3_uri}/model-00002-of-00002.safetensors", storage_options=s3_opts)
    assert torch.equal(target["b"], b["b"])

    with pytest.raises(sc.CheckpointNotFoundError) as e:
        sc.load_full(f"{s3_uri}/missing.safetensors", storage_options=s3_opts)
    assert f"{s3_uri}/missing.safetensors" in str(e.value)
    with pytest.raises(sc.CheckpointError) as e2:
        sc.save({"x": torch.ones(1)}, f"{s3_uri}/out.safetensors", storage_options=s3_opts)
    assert "names one file" in str(e2.value) and "directory URI" in str(e2.value)
    assert not fs.exists(f"{base}/manifest.json")


# --------------------------------------------------------------------- latest


@pytest.mark.parametrize("order", [("step-9", "step-10"), ("step-10", "step-9")])
def test_latest_is_the_newest_commit_within_one_second(s3_uri: str, s3_opts: dict[str, Any],
                                                        order: tuple[str, str]) -> None:
    for name in order:  # well within one second of each other on loopback
        sc.save({"w": torch.ones(1)}, f"{s3_uri}/{name}", storage_options=s3_opts)
    assert sc.latest(s3_uri, storage_options=s3_opts) == f"{s3_uri}/{order[-1]}"


def test_latest_skips_uncommitted_and_orders_ties_by_natural_name() -> None:
    from streamckpt.formats.native import natural_key

    assert sorted(["step-10", "step-9", "step-100", "a"], key=natural_key) == ["a", "step-9", "step-10", "step-100"]


# ---------------------------------------------------------------------- merge


@pytest.fixture
def counting_endpoint(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """A loopback listener set as every default S3 endpoint: counts connections, answers none."""
    sock = socket.create_server(("127.0.0.1", 0))
    sock.settimeout(0.2)
    hits: list[int] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = sock.accept()
            except OSError:
                continue
            hits.append(1)
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    for var in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT"):
        monkeypatch.setenv(var, url)
    yield hits
    stop.set()
    thread.join(timeout=5)
    sock.close()


def test_merge_writes_where_it_reads(s3_uri: str, s3_opts: dict[str, Any], counting_endpoint: list[int]) -> None:
    state = {"a": torch.arange(10.0), "b": torch.ones(3, 3, dtype=torch.bfloat16)}
    sc.save(state, f"{s3_uri}/ck", storage_options=s3_opts)
    sc.merge(f"{s3_uri}/ck", f"{s3_uri}/export", storage_options=s3_opts)
    same(state, sc.load_full(f"{s3_uri}/export", storage_options=s3_opts))
    time.sleep(0.3)
    assert counting_endpoint == []  # nothing went to the environment's (or AWS's) endpoint
