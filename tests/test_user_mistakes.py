"""More mistakes users make, each against the session's moto S3 server: the error is a
``CheckpointError`` subclass naming the key or URI and what to do, never a torch or
botocore exception from deep inside, and never a silently wrong result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any, Iterator

import pytest
import torch

import streamckpt as sc

from signing_moto import signing_moto


@pytest.fixture
def saved(s3_uri: str, s3_opts: dict[str, Any]) -> str:
    sc.save({"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(4), "step": 5}, s3_uri, storage_options=s3_opts)
    return s3_uri


@pytest.mark.parametrize("leaf", [None, 3, "w", [1, 2]])
def test_plain_data_where_the_checkpoint_has_a_tensor(saved: str, s3_opts: dict[str, Any], leaf: Any) -> None:
    """Was a MissingKeysError naming 'w' missing, with 'w' itself as the near spelling."""
    with pytest.raises(sc.IncompatibleStateDictError) as ei:
        sc.load({"w": leaf, "b": torch.zeros(4)}, saved, storage_options=s3_opts)
    msg = str(ei.value)  # None: kind_clash's words; any other value: the loader's _check_not_tensors's
    assert msg.startswith("w: the checkpoint holds a tensor") and "did you mean" not in msg
    if leaf is None:
        assert "holds a tensor (shape [3, 4], dtype F32) at 'w'" in msg and "put a tensor of that shape" in msg


def test_a_tensor_where_the_checkpoint_has_plain_data(saved: str, s3_opts: dict[str, Any]) -> None:
    with pytest.raises(sc.IncompatibleStateDictError, match=r"step: the checkpoint holds a plain value \(int\) "
                       r"at 'step', where the state_dict has a tensor"):
        sc.load({"w": torch.zeros(3, 4), "step": torch.zeros(())}, saved, storage_options=s3_opts)


def test_a_dict_where_the_checkpoint_has_a_tensor(saved: str, s3_opts: dict[str, Any]) -> None:
    with pytest.raises(sc.IncompatibleStateDictError, match=r"w\.x: the checkpoint holds a tensor .* at 'w', "
                       r"where the state_dict has a dict or list \(holding 'w\.x'\)"):
        sc.load({"w": {"x": torch.zeros(3, 4)}}, saved, storage_options=s3_opts)


def test_plain_data_still_loads_in_place_and_real_typos_are_still_missing(saved: str, s3_opts: dict[str, Any]) -> None:
    target = {"w": torch.zeros(3, 4), "step": 0}
    sc.load(target, saved, storage_options=s3_opts)
    assert target["step"] == 5 and torch.equal(target["w"], torch.arange(12.0).reshape(3, 4))
    with pytest.raises(sc.MissingKeysError, match=r": ww \(use strict=False"):
        sc.load({"ww": torch.zeros(3, 4)}, saved, storage_options=s3_opts)


def test_loading_into_an_expanded_view_is_refused_before_any_read(saved: str, s3_opts: dict[str, Any]) -> None:
    """Was torch's RuntimeError from deep inside the scatter, after the bytes were fetched."""
    with pytest.raises(sc.IncompatibleStateDictError, match=r"w: the target's elements share memory \(a stride-0 "
                       r"view, as expand\(\) makes\), so it cannot be filled in place: .*\(\.clone\(\)\)"):
        sc.load({"w": torch.zeros(4).expand(3, 4), "b": torch.zeros(4)}, saved, storage_options=s3_opts)
    t = torch.zeros(4, 3).t()  # a transposed (non-contiguous) view is fine: filled element by element
    sc.load({"w": t, "b": torch.zeros(4)}, saved, storage_options=s3_opts)
    assert torch.equal(t, torch.arange(12.0).reshape(3, 4))


def test_sparse_tensors_are_named_on_save_and_load(saved: str, s3_uri: str, s3_opts: dict[str, Any]) -> None:
    """Were torch's RuntimeError / NotImplementedError from the writer and the scatter."""
    with pytest.raises(sc.IncompatibleStateDictError, match=r"w: a torch.sparse_coo tensor is not supported.*"
                       r"save its \.to_dense\(\)"):
        sc.save({"w": torch.eye(3).to_sparse()}, s3_uri + "-sparse", storage_options=s3_opts)
    with pytest.raises(sc.IncompatibleStateDictError, match=r"w: a torch.sparse_coo tensor .*load into a dense"):
        sc.load({"w": torch.zeros(3, 4).to_sparse(), "b": torch.zeros(4)}, saved, storage_options=s3_opts)
    with pytest.raises(sc.CheckpointNotFoundError):  # nothing was committed
        sc.inspect(s3_uri + "-sparse", storage_options=s3_opts)


@pytest.mark.parametrize("read", [sc.load_full, sc.load_state])
def test_one_string_as_keys_is_one_key_not_its_letters(saved: str, s3_opts: dict[str, Any], read: Any) -> None:
    """``keys="wb"`` read the tensors 'w' and 'b' (the string's letters): silently the wrong set."""
    with pytest.raises(sc.MissingKeysError, match=r"1 key\(s\) not in .*: wb"):
        read(saved, storage_options=s3_opts, keys="wb")
    got = read(saved, storage_options=s3_opts, keys="b")
    assert list(got) == ["b"] and torch.equal(got["b"], torch.ones(4))


@pytest.mark.parametrize("device", ["tpu", "cuda:99"] + ([] if torch.cuda.is_available() else ["cuda"]))
@pytest.mark.parametrize("read", [sc.load_full, sc.load_state])
def test_a_device_this_process_lacks_is_named_before_any_read(saved: str, s3_opts: dict[str, Any], read: Any,
                                                               device: str) -> None:
    """Were torch's RuntimeError ('Expected one of cpu, cuda, ...') and AssertionError ('Torch not
    compiled with CUDA enabled') from allocating the outputs, after the manifest was read."""
    with pytest.raises(sc.CheckpointError, match=rf"device='{device}'(: | is not a torch device).*load to 'cpu'"):
        read(saved, storage_options=s3_opts, device=device)


@pytest.fixture(scope="module")
def signed_s3() -> Iterator[dict[str, str]]:
    """A moto server that checks signatures; yields its user's storage options."""
    with signing_moto() as (_, opts):
        yield opts


@pytest.mark.parametrize("wrong", [{"secret": "wrong"}, {"key": "AKIANOSUCHKEY"}])
def test_a_save_with_wrong_credentials_says_access_denied(signed_s3: dict[str, str], wrong: dict[str, str]) -> None:
    """The save's first request is a HEAD of manifest.json, whose 403 has no body: it said
    only 'HTTP 403', with nothing about the credentials."""
    sc.save({"w": torch.ones(2)}, "s3://signed/ok", storage_options=signed_s3, overwrite=True)  # right keys work
    with pytest.raises(sc.StorageError) as ei:
        sc.save({"w": torch.ones(2)}, "s3://signed/ck", storage_options={**signed_s3, **wrong})
    msg = str(ei.value)
    assert "s3://signed/ck/manifest.json" in msg and "HTTP 403 Forbidden" in msg
    assert "access denied: check the keys (key/secret, AWS_* variables)" in msg and "wrong" not in msg


def test_a_save_under_a_file_names_the_directory_it_cannot_make(tmp_path: Any) -> None:
    """Was CheckpointNotFoundError '<path>/data/00000-0000.safetensors does not exist'."""
    (tmp_path / "notes.txt").write_text("a file, not a directory")
    with pytest.raises(sc.StorageError, match=r"cannot make the directory .*notes\.txt/ck/data: NotADirectoryError.*"
                       r"a part of the path is a file.*check the path"):
        sc.save({"w": torch.ones(2)}, str(tmp_path / "notes.txt" / "ck"))
    assert (tmp_path / "notes.txt").read_text() == "a file, not a directory"


def test_a_managers_misspelt_passthrough_argument_is_named_with_the_one_meant(s3_uri: str,
                                                                              s3_opts: dict[str, Any]) -> None:
    """Were TypeErrors naming load() / save(), which the caller never called."""
    state = {"w": torch.arange(4.0)}
    with sc.CheckpointManager(s3_uri, storage_options=s3_opts) as mgr:
        with pytest.raises(sc.CheckpointError, match=r"CheckpointManager\.save: unknown argument 'compresion' "
                           r"\(did you mean 'compression'\?\); it passes on to sc\.save only .*base"):
            mgr.save(1, state, compresion="zstd")
        assert mgr.steps() == []  # refused before anything was written
        mgr.save(1, state)
        target = {"w": torch.zeros(4)}
        with pytest.raises(sc.CheckpointError, match=r"CheckpointManager\.restore: unknown argument 'strct' "
                           r"\(did you mean 'strict'\?\); it passes on to sc\.load only"):
            mgr.restore(target, strct=False)
        with pytest.raises(sc.CheckpointError, match=r"restore: unknown argument 'devce' \(did you mean 'device'\?\); "
                           r"it passes on to sc\.load_state only"):
            mgr.restore(devce="cpu")
        with pytest.raises(sc.CheckpointError, match=r"restore: process_group= is set by the manager"):
            mgr.restore(target, process_group=None)
        assert mgr.restore(target, strict=False).step == 1 and torch.equal(target["w"], torch.arange(4.0))


def test_two_managers_on_one_root_get_the_managers_words(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    """The second writer of a step got sc.save's 'pass overwrite=True', which the manager refuses."""
    state = {"w": torch.arange(4.0)}
    with sc.CheckpointManager(s3_uri, storage_options=s3_opts) as first, \
            sc.CheckpointManager(s3_uri, storage_options=s3_opts) as second:
        assert second.steps() == []  # it has looked
        first.save(3, state)
        with pytest.raises(sc.CheckpointExistsError, match=r"step 3 is already committed .*by another writer .*"
                           r"pass force=True to replace it, or give each run a root of its own") as ei:
            second.save(3, {"w": torch.zeros(4)})
        assert "overwrite" not in str(ei.value)
        assert torch.equal(sc.load_full(f"{s3_uri}/step-3", storage_options=s3_opts)["w"], torch.arange(4.0))


def test_an_async_result_that_times_out_says_so_and_the_save_goes_on(proxy_factory: Any, s3_uri: str,
                                                                      s3_opts: dict[str, Any]) -> None:
    """Was concurrent.futures' TimeoutError with an empty message."""
    from streamckpt.testing import options_for

    proxy = proxy_factory(faults={"stall": 1.0}, rate=1.0, stall_seconds=1.5, methods=("PUT", "POST"))
    handle = sc.async_save({"w": torch.arange(8.0)}, s3_uri, storage_options=options_for(proxy.endpoint_url))
    with pytest.raises(TimeoutError, match=r"the async save has not committed within timeout=0 s; it goes on: "
                       r"call result\(\) again to wait longer, or done\(\) to poll"):
        handle.result(timeout=0)
    assert handle.result(timeout=120).files[-1] == "manifest.json"
    assert torch.equal(sc.load_full(s3_uri, storage_options=s3_opts)["w"], torch.arange(8.0))


@pytest.mark.parametrize("group", ["gloo", object()])
def test_a_process_group_without_torch_distributed_is_named(saved: str, s3_opts: dict[str, Any], group: Any) -> None:
    """Was torch's ValueError 'Default process group has not been initialized' (or an
    AttributeError), from deep inside the group's set-up."""
    with pytest.raises(sc.CheckpointError, match=r"process_group must be a torch.distributed ProcessGroup"):
        sc.load({"w": torch.zeros(3, 4)}, saved, storage_options=s3_opts, process_group=group)


def test_a_process_group_before_init_process_group_is_named(saved: str, s3_opts: dict[str, Any]) -> None:
    import torch.distributed as dist

    if dist.is_initialized():  # pragma: no cover - the suite never initializes it in-process
        pytest.skip("torch.distributed is initialized in this process")
    group = dist.ProcessGroup.__new__(dist.ProcessGroup)  # a group kept past destroy_process_group()
    with pytest.raises(sc.CheckpointError, match=r"torch.distributed is not initialized in this process: call "
                       r"torch.distributed.init_process_group\(\) first, or pass process_group=None"):
        sc.save({"w": torch.ones(2)}, saved + "-pg", storage_options=s3_opts, process_group=group)


def test_copy_says_what_is_there_instead_of_a_manifest(saved: str, s3_uri: str, s3_opts: dict[str, Any]) -> None:
    """Was '<uri>/manifest.json does not exist' for all three."""
    with pytest.raises(sc.CheckpointNotFoundError, match=r"no checkpoint at .*-nothing/: expected manifest\.json"):
        sc.copy(s3_uri + "-nothing", s3_uri + "-out", storage_options=s3_opts)
    sc.merge(saved, saved + "-hf", storage_options=s3_opts)
    with pytest.raises(sc.CheckpointError, match=r"-hf/ holds a safetensors checkpoint, and copy copies streamckpt "
                       r"checkpoints .*sc\.merge"):
        sc.copy(saved + "-hf", s3_uri + "-out", storage_options=s3_opts)
    sc.copy(saved, s3_uri + "-out", storage_options=s3_opts)  # the right URI still copies
    assert torch.equal(sc.load_full(s3_uri + "-out", storage_options=s3_opts)["w"], torch.arange(12.0).reshape(3, 4))


@pytest.mark.parametrize("typo, meant", [
    ("S3://{bucket_path}", "s3://{bucket_path}"),     # Protocol not known: S3
    (" {uri}", "{uri}"),                            # pasted with a space before
    ("{uri} ", "{uri}"),                            # ... or after: 'no checkpoint at .../ck /'
    ("s3:/{bucket_path}", "s3://{bucket_path}"),     # suggested 'write its scheme: s3://s3:/...'
])
def test_a_mistyped_uri_gets_the_uri_meant(saved: str, s3_opts: dict[str, Any], typo: str, meant: str) -> None:
    bucket_path = saved.split("://", 1)[1]
    typo, meant = (x.format(uri=saved, bucket_path=bucket_path) for x in (typo, meant))
    with pytest.raises(sc.CheckpointError) as ei:
        sc.load_state(typo, storage_options=s3_opts)
    assert meant in str(ei.value) and "s3://s3:" not in str(ei.value)
    assert torch.equal(sc.load_state(meant, storage_options=s3_opts)["b"], torch.ones(4))


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m streamckpt ...`` (works without the console script installed)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    full = dict(os.environ, PYTHONPATH=root, **(env or {}))
    return subprocess.run([sys.executable, "-m", "streamckpt", *args], capture_output=True, text=True, timeout=120,
                          env=full)


def test_python_dash_m_streamckpt_is_the_command_line() -> None:
    """'No module named streamckpt.__main__' before."""
    r = _cli()
    assert r.returncode == 2 and r.stderr.splitlines()[-1] == \
        "streamckpt: error: the following arguments are required: COMMAND"
    r = _cli("inspet", "s3://x/y")
    assert r.returncode == 2 and "invalid choice: 'inspet'" in r.stderr and "Traceback" not in r.stderr


def test_a_cli_run_that_fails_before_any_byte_prints_one_line(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    """verify printed 'verify: stopped at 0 B in 0.02 s, 0.0 MB/s' above the error."""
    env = {"AWS_ENDPOINT_URL": s3_opts["endpoint_url"], "AWS_ACCESS_KEY_ID": s3_opts["key"],
           "AWS_SECRET_ACCESS_KEY": s3_opts["secret"]}
    r = _cli("verify", s3_uri, env=env)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.splitlines() == [f"streamckpt verify: error: no checkpoint at {s3_uri}/: expected manifest.json "
                                     f"(streamckpt), *.safetensors (Hugging Face) or .metadata (PyTorch DCP)"]


def test_metrics_without_keep_bests_metric_are_warned_about(s3_uri: str, s3_opts: dict[str, Any],
                                                            caplog: pytest.LogCaptureFixture) -> None:
    """keep_best=('loss', ...) with metrics={'val_loss': ...}: the rule kept nothing and every
    step but the newest was pruned, without a word."""
    with sc.CheckpointManager(s3_uri, storage_options=s3_opts, keep_best=("loss", "min", 2)) as mgr:
        with caplog.at_level("WARNING", logger="streamckpt.manage.manager"):
            mgr.save(1, {"w": torch.ones(2)}, metrics={"val_loss": 0.5})
        assert "step 1's metrics (val_loss) lack 'loss', by which keep_best ranks the steps (did you mean " \
               "'val_loss'?): keep_best will not keep it" in caplog.text
        caplog.clear()
        with caplog.at_level("WARNING", logger="streamckpt.manage.manager"):
            mgr.save(2, {"w": torch.ones(2)}, metrics={"loss": 0.4})
            mgr.save(3, {"w": torch.ones(2)})  # no metrics at all: a step between evaluations, no warning
        assert "keep_best" not in caplog.text
        assert mgr.steps() == [2, 3]


def test_copy_to_a_missing_bucket_says_create_it_and_nothing_else(saved: str, s3_opts: dict[str, Any],
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """Was StorageError 'writing ... failed: bucket ... does not exist' after a WARNING that the
    upload could not be aborted (there was none to abort)."""
    with caplog.at_level("WARNING"):
        with pytest.raises(sc.CheckpointNotFoundError, match=r"bucket 'no-such-bucket-x' does not exist \(writing "
                           r"s3://no-such-bucket-x/ck/data/.*check the URI, or create the bucket first"):
            sc.copy(saved, "s3://no-such-bucket-x/ck", storage_options=s3_opts)
    assert "abort" not in caplog.text


@pytest.mark.parametrize("command", ["ls"])  # latest: sc.latest warns (test_mistakes.py)
def test_the_cli_given_a_checkpoint_for_its_run_names_the_run(saved: str, s3_opts: dict[str, Any],
                                                               command: str) -> None:
    """Said only 'no committed checkpoint under <checkpoint>'."""
    env = {"AWS_ENDPOINT_URL": s3_opts["endpoint_url"], "AWS_ACCESS_KEY_ID": s3_opts["key"],
           "AWS_SECRET_ACCESS_KEY": s3_opts["secret"]}
    run = saved.rsplit("/", 1)[0]
    r = _cli(command, saved, env=env)
    assert r.returncode == 1 and r.stderr.splitlines() == [
        f"no committed checkpoint under {saved}: it is itself a checkpoint; its run is {run} "
        f"(streamckpt {command} {run})"]
    r = _cli(command, saved + "-none", env=env)  # an empty prefix: the plain line
    assert r.returncode == 1 and r.stderr.splitlines() == [f"no committed checkpoint under {saved}-none"]


@pytest.mark.parametrize("uri", ["", "   ", None, 5])
def test_an_empty_or_missing_uri_is_refused_not_the_current_directory(uri: Any, tmp_path: Any,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """sc.save(sd, os.environ.get('CKPT', '')) wrote manifest.json and data/ into the current
    directory; None or a number read 'None/' or '5/' there."""
    monkeypatch.chdir(tmp_path)
    for call in (lambda: sc.save({"w": torch.ones(2)}, uri), lambda: sc.load_state(uri),
                 lambda: sc.CheckpointManager(uri)):
        with pytest.raises(sc.CheckpointError, match=r"the checkpoint URI is empty .*'\.' for the current directory|"
                           r"the checkpoint URI is None|a checkpoint URI is a str \(s3://bucket/prefix, a local "
                           r"path\), not a int"):
            call()
    assert list(tmp_path.iterdir()) == []
    sc.save({"w": torch.ones(2)}, tmp_path / "ck")  # a path object is a URI
    assert torch.equal(sc.load_state(tmp_path / "ck")["w"], torch.ones(2))


def test_a_step_that_is_not_an_int_is_named_and_a_nan_loss_still_saves(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    """restore(step='1') said 'no committed checkpoint of step 1 ... (committed steps: 1)';
    a nan metric failed the save with 'metadata must be a JSON-serializable dict'."""
    with sc.CheckpointManager(s3_uri, storage_options=s3_opts, keep_best=("loss", "min", 1)) as mgr:
        mgr.save(1, {"w": torch.ones(2)}, metrics={"loss": torch.tensor(0.5)})
        for call in (lambda: mgr.restore(step="1"), lambda: mgr.should_save("5"), lambda: mgr.restore(step=-1)):
            with pytest.raises(sc.CheckpointError, match=r"step must be an int >= 0, got"):
                call()
        mgr.save(2, {"w": torch.ones(2)}, metrics={"loss": float("nan")})  # diverged: saved, never "best"
        assert mgr.metrics(2) == {"loss": "nan"}
        mgr.save(3, {"w": torch.ones(2)}, metrics={"loss": float("-inf")})
        assert mgr.metrics(3) == {"loss": "-inf"}
        assert mgr.steps() == [1, 3]  # step 1 is the best by a number, 3 the newest


def test_merge_into_the_checkpoint_itself_is_refused(saved: str, s3_opts: dict[str, Any]) -> None:
    """Wrote model-*.safetensors and the index beside the checkpoint's own files."""
    with pytest.raises(sc.CheckpointError, match=r"merge .* into itself: .*pass another out_uri"):
        sc.merge(saved, saved + "/", storage_options=s3_opts)
    assert sorted(sc.inspect(saved, storage_options=s3_opts).files) == ["data/00000-0000.safetensors"]
