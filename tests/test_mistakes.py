"""The mistakes new users make, against the session's moto S3 server: each gets a
``CheckpointError`` subclass whose message says what is wrong and what to write instead."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
import torch

import streamckpt as sc


@pytest.fixture
def saved(s3_uri: str, s3_opts: dict[str, Any]) -> str:
    sc.save({"weight": torch.arange(12.0).reshape(3, 4), "bias": torch.ones(3)}, s3_uri, storage_options=s3_opts)
    return s3_uri


def test_a_module_instead_of_its_state_dict(saved: str, s3_opts: dict[str, Any]) -> None:
    model = torch.nn.Linear(4, 3)  # a Stateful: loaded through its state_dict() and load_state_dict()
    sc.load(model, saved, storage_options=s3_opts)
    assert torch.equal(model.weight, torch.arange(12.0).reshape(3, 4)) and torch.equal(model.bias, torch.ones(3))

    class Exporter:  # state_dict() alone: nothing to restore it through
        def state_dict(self) -> dict[str, Any]:
            return {"weight": torch.zeros(3, 4)}

    with pytest.raises(sc.IncompatibleStateDictError, match=r"got Exporter \(pass its \.state_dict\(\)\)"):
        sc.load(Exporter(), saved, storage_options=s3_opts)  # type: ignore[arg-type]


def test_storage_options_that_are_not_a_dict(saved: str) -> None:
    with pytest.raises(sc.CheckpointError, match="storage_options must be a dict of fsspec options.*not str"):
        sc.load_state(saved, storage_options="http://127.0.0.1:9000")  # type: ignore[arg-type]


def test_a_misspelt_storage_option_is_named_with_the_right_one(saved: str, s3_opts: dict[str, Any]) -> None:
    with pytest.raises(sc.StorageOptionError) as e:  # a StorageError, before any request
        sc.load_state(saved, storage_options={**s3_opts, "endpoint": s3_opts["endpoint_url"]})
    assert str(e.value).startswith(f"unknown storage option 'endpoint' for {saved}: did you mean 'endpoint_url'? ")
    assert e.value.option == "endpoint" and e.value.suggestions == ["endpoint_url"]


@pytest.mark.parametrize("kwargs", [{"memory_budget": 0}, {"memory_budget": -1.0}, {"max_concurrency": 0},
                                    {"memory_budget": "1GiB"}])
def test_budgets_are_checked_by_name(saved: str, s3_opts: dict[str, Any], kwargs: dict[str, Any]) -> None:
    (name, value), = kwargs.items()
    with pytest.raises(sc.CheckpointError, match=f"^{name} must be a positive number, got {value!r}$"):
        sc.load({"bias": torch.zeros(3)}, saved, storage_options=s3_opts, **kwargs)
    if name == "memory_budget":
        with pytest.raises(sc.CheckpointError, match=f"^{name} must be a positive number"):
            sc.load_full(saved, storage_options=s3_opts, memory_budget=value)
        with pytest.raises(sc.CheckpointError, match=f"^{name} must be a positive number"):
            sc.load_state(saved, storage_options=s3_opts, memory_budget=value)


def test_a_typo_in_keys_gets_a_did_you_mean(saved: str, s3_opts: dict[str, Any]) -> None:
    with pytest.raises(sc.MissingKeysError, match=r"wieght \(did you mean 'weight' for 'wieght'\?\)") as e:
        sc.load_full(saved, storage_options=s3_opts, keys=["wieght"])
    assert e.value.missing_keys == ["wieght"]
    with pytest.raises(sc.MissingKeysError, match=r"did you mean 'bias' for 'bais'"):
        sc.load_state(saved, storage_options=s3_opts, keys=["bais"])
    with pytest.raises(sc.MissingKeysError, match=r"wieght \(did you mean 'weight' for 'wieght'\?\)"):
        sc.load({"wieght": torch.zeros(3, 4)}, saved, storage_options=s3_opts)


def test_a_wrapper_prefix_is_recognised_both_ways(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    """DDP saves ``module.``-prefixed names; loading them into the bare model (and the reverse)
    names the prefix and the dict to pass, which fills the same tensors in place."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    wrapped = {f"module.{k}": v for k, v in model.state_dict().items()}
    sc.save(wrapped, f"{s3_uri}/ddp", storage_options=s3_opts)
    sc.save(model.state_dict(), f"{s3_uri}/bare", storage_options=s3_opts)
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    sd = fresh.state_dict()
    with pytest.raises(sc.MissingKeysError, match=r"carry the prefix 'module\.': load \{'module\.' \+ k: v for"):
        sc.load(sd, f"{s3_uri}/ddp", storage_options=s3_opts)
    with pytest.raises(sc.MissingKeysError, match=r"your keys carry the prefix 'module\.'.*removeprefix"):
        sc.load(wrapped, f"{s3_uri}/bare", storage_options=s3_opts)
    sc.load({"module." + k: v for k, v in sd.items()}, f"{s3_uri}/ddp", storage_options=s3_opts)  # the hint works
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k


def test_a_bucket_without_its_scheme(s3_opts: dict[str, Any], tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(sc.StorageOptionError) as e:  # S3's options on a local path: refused before a read
        sc.load({"w": torch.zeros(1)}, "streamckpt-test/run/step-1", storage_options=s3_opts)
    assert "name it: 's3://streamckpt-test/run/step-1'" in str(e.value)
    with pytest.raises(sc.CheckpointNotFoundError) as e:  # without options: the hint of a missing path
        sc.load({"w": torch.zeros(1)}, "streamckpt-test/run/step-1")
    where = os.path.join(tmp_path, "streamckpt-test/run/step-1")
    assert str(e.value).endswith(f"(a local path, and there is no '{where}' here; "
                                 f"for a bucket, write its scheme: s3://streamckpt-test/run/step-1)")
    with pytest.raises(sc.CheckpointNotFoundError) as e:
        sc.load_state(str(tmp_path / "nothing"))
    assert str(e.value).endswith(f"(a local path, and there is no '{tmp_path / 'nothing'}' here)")
    with pytest.raises(sc.CheckpointNotFoundError) as e:
        sc.load_state(str(tmp_path))  # a directory that exists: no hint
    assert str(e.value).endswith("or .metadata (PyTorch DCP)")


@pytest.mark.parametrize("budget", [0, -5, "1GiB"])
def test_a_bad_staging_budget_is_named(s3_uri: str, s3_opts: dict[str, Any], budget: Any) -> None:
    with pytest.raises(sc.CheckpointError, match=f"^staging_budget must be a positive number of bytes or None, "
                                                 f"got {budget!r}$"):
        sc.async_save({"w": torch.ones(3)}, s3_uri, storage_options=s3_opts, staging_budget=budget)


def test_every_error_class_is_catchable_from_the_top_level() -> None:
    """``except sc.StagingMemoryError`` works without importing ``streamckpt.errors``; every
    exported error is a ``CheckpointError``."""
    import streamckpt.errors as errors

    names = [n for n in sc.__all__ if n.endswith("Error")]
    assert "StagingMemoryError" in names and "PeerError" in names
    for n in names:
        assert getattr(sc, n) is getattr(errors, n) and issubclass(getattr(sc, n), sc.CheckpointError), n


def test_latests_none_passed_on_says_what_it_is(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    """``sc.latest`` of a run with nothing committed is None; loading that names it, not a path 'None'."""
    uri = sc.latest(s3_uri, storage_options=s3_opts)
    assert uri is None
    calls = [lambda: sc.load_state(uri, storage_options=s3_opts),
             lambda: sc.load({"w": torch.zeros(1)}, uri, storage_options=s3_opts),
             lambda: sc.load_full(uri, storage_options=s3_opts),
             lambda: sc.inspect(uri, storage_options=s3_opts)]  # type: ignore[arg-type]
    for call in calls:
        with pytest.raises(sc.CheckpointNotFoundError, match=r"^the checkpoint URI is None \(sc\.latest returns "
                                                             r"None when no checkpoint is committed"):
            call()


def test_storage_options_in_the_uris_place_are_refused_without_their_secret(s3_opts: dict[str, Any]) -> None:
    with pytest.raises(sc.CheckpointError) as e:
        sc.load({"w": torch.zeros(1)}, s3_opts)  # type: ignore[arg-type]
    assert str(e.value) == ("a checkpoint URI is a str (s3://bucket/prefix, a local path), not a dict "
                            "(storage options go in storage_options=)")
    assert s3_opts["secret"] not in str(e.value)


@pytest.mark.parametrize("name", ["manifest.json", ".metadata"])
def test_a_uri_naming_the_metadata_object_names_the_prefix(saved: str, s3_opts: dict[str, Any], name: str) -> None:
    with pytest.raises(sc.CheckpointNotFoundError) as e:
        sc.load_state(f"{saved}/{name}", storage_options=s3_opts)
    assert str(e.value).endswith(f"(that URI names the checkpoint's {name}: give its prefix, {saved})")


def test_an_s3_server_addressed_by_its_http_url_says_to_write_s3(saved: str, s3_opts: dict[str, Any]) -> None:
    """``http://host:port/bucket/prefix`` goes to fsspec's HTTP client, which takes no endpoint_url."""
    bucket_path = saved.removeprefix("s3://")
    with pytest.raises(sc.StorageError) as e:
        sc.load_state(f"{s3_opts['endpoint_url']}/{bucket_path}", storage_options=s3_opts)
    msg = str(e.value)
    assert ("storage_options has 'endpoint_url', an option of s3:// URIs that this client (http) does not take; "
            "for an S3-compatible server write the URI as s3://BUCKET/PREFIX, with endpoint_url in storage_options"
            in msg), msg
    assert "did you mean" not in msg and s3_opts["secret"] not in msg


def test_a_launched_rank_that_never_joined_its_group_is_told_to(s3_uri: str, s3_opts: dict[str, Any],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torchrun without ``init_process_group`` each process saves alone: its half of a
    tensor leaves holes, and the error says why (WORLD_SIZE is set, no group is)."""
    half = {"w": sc.ShardedTensor(torch.ones(2, 2), (4, 2), (0, 0))}
    with pytest.raises(sc.IncompatibleStateDictError) as e:
        sc.save(half, s3_uri, storage_options=s3_opts)
    assert str(e.value).endswith("distinct shards may not overlap")  # no launcher: no hint
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(sc.IncompatibleStateDictError) as e:
        sc.save(half, s3_uri, storage_options=s3_opts)
    assert str(e.value).endswith("; this process ran alone, as rank 0 of 1: torch.distributed is not initialized, "
                                 "yet WORLD_SIZE=2 (torchrun?): call torch.distributed.init_process_group() first, "
                                 "so that the ranks save and load together")
    with pytest.raises(sc.CheckpointNotFoundError):  # nothing committed
        sc.inspect(s3_uri, storage_options=s3_opts)


def test_a_numpy_target_is_filled_in_place(saved: str, s3_opts: dict[str, Any]) -> None:
    leaf = np.zeros((3, 4), dtype=np.float32)
    sc.load({"weight": leaf, "bias": torch.zeros(3)}, saved, storage_options=s3_opts)
    assert np.array_equal(leaf, np.arange(12.0, dtype=np.float32).reshape(3, 4))


@pytest.mark.parametrize("leaf", [[0.0] * 12, (0.0,) * 12])
def test_a_target_that_is_no_tensor_is_not_called_missing(saved: str, s3_opts: dict[str, Any], leaf: Any) -> None:
    with pytest.raises(sc.IncompatibleStateDictError) as e:
        sc.load({"weight": leaf, "bias": torch.zeros(3)}, saved, storage_options=s3_opts)
    assert str(e.value) == (f"weight: the checkpoint holds a tensor here (F32 [3, 4]), the state_dict a "
                            f"{type(leaf).__name__}: pass a torch tensor to fill in place (torch.from_numpy(array) "
                            f"shares an array's memory), or read it with sc.load_state / sc.load_full")
    bias = torch.zeros(3)
    sc.load({"weight": leaf, "bias": bias}, saved, storage_options=s3_opts, strict=False)  # loads the rest
    assert torch.equal(bias, torch.ones(3))
    if isinstance(leaf, np.ndarray):  # what the message says works
        sc.load({"weight": torch.from_numpy(leaf), "bias": bias}, saved, storage_options=s3_opts)
        assert np.array_equal(leaf, np.arange(12.0, dtype=np.float32).reshape(3, 4))


def test_an_expanded_target_is_refused_by_name(saved: str, s3_opts: dict[str, Any]) -> None:
    with pytest.raises(sc.IncompatibleStateDictError, match=r"^weight: the target's elements share memory \(a "
                                                            r"stride-0 view, as expand\(\) makes\)"):
        sc.load({"weight": torch.zeros(4).expand(3, 4), "bias": torch.zeros(3)}, saved, storage_options=s3_opts)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("call", ["load_full", "load_state"])
def test_cuda_on_a_machine_without_it_is_named_before_any_read(saved: str, s3_opts: dict[str, Any], call: str) -> None:
    why = "this torch is a CPU-only build" if not torch.backends.cuda.is_built() else "0 CUDA device(s) are visible"
    with pytest.raises(sc.CheckpointError, match=rf"^device='cuda': {why}; load to 'cpu' \(the default\)"):
        getattr(sc, call)(saved, storage_options=s3_opts, device="cuda")
    with pytest.raises(sc.CheckpointError, match=r"^device='tpu' is not a torch device"):
        getattr(sc, call)(saved, storage_options=s3_opts, device="tpu")


def test_latest_of_a_checkpoint_instead_of_its_root_warns(saved: str, s3_opts: dict[str, Any],
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """None from ``sc.latest`` means "start fresh" in a resume; given the checkpoint itself it
    still returns None (nothing under it), and says which root was meant."""
    with caplog.at_level("WARNING", logger="streamckpt"):
        assert sc.latest(saved, storage_options=s3_opts) is None
    root = saved.rpartition("/")[0]
    assert [r.getMessage() for r in caplog.records] == [
        f"latest: {saved} is itself a committed checkpoint, not a run's root: latest looks at the checkpoints "
        f"directly under a root (this one's is {root}); taking this None for 'start fresh' would pass over it"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="streamckpt"):
        assert sc.latest(root, storage_options=s3_opts) == saved
        assert sc.latest(f"{saved}-none", storage_options=s3_opts) is None  # an empty prefix: no warning
    assert not caplog.records


def test_a_hugging_face_hub_model_id(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """'org/name' that is neither a local path nor written as a bucket may be a Hub model id:
    the message says streamckpt reads storage, not the Hub, and how to get the files."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(sc.CheckpointNotFoundError) as e:
        sc.load_full("meta-llama/Llama-3.1-8B")
    assert str(e.value).endswith(
        "for a bucket, write its scheme: s3://meta-llama/Llama-3.1-8B; for a Hugging Face Hub model id: streamckpt "
        "reads storage, not the Hub: download it first (huggingface-cli download meta-llama/Llama-3.1-8B "
        "--local-dir DIR) and pass DIR, or copy it to your bucket and pass that URI)")
    with pytest.raises(sc.CheckpointNotFoundError) as e:
        sc.load_full("bucket/run/step-1")  # two slashes: a bucket's prefix, not a model id
    assert "Hugging Face Hub" not in str(e.value)
