"""A root that cannot mean what its options say (issue 44 item 8): a path without a scheme
given an object store's options wrote to the local disk; a ``//`` in a store's key names a
prefix other than the one meant. Both are refused on every entry point, before anything is
written, naming the URI to write instead."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import streamckpt as sc
from streamckpt.errors import CheckpointError, StorageOptionError

S3_OPTS = {"endpoint_url": "http://127.0.0.1:9", "key": "k", "secret": "s"}


def _entry_points(uri: str, opts: dict[str, Any]) -> dict[str, Any]:
    sd = {"w": torch.arange(4.0)}
    return {
        "save": lambda: sc.save(sd, uri, storage_options=opts),
        "async_save": lambda: sc.async_save(sd, uri, storage_options=opts).result(),
        "load": lambda: sc.load({"w": torch.zeros(4)}, uri, storage_options=opts),
        "load_state": lambda: sc.load_state(uri, storage_options=opts),
        "latest": lambda: sc.latest(uri, storage_options=opts),
        "manager": lambda: sc.CheckpointManager(uri, storage_options=opts).steps(),
        "copy": lambda: sc.copy(uri, uri + "-copy", storage_options=opts),
    }


@pytest.mark.parametrize("call", list(_entry_points("x", {})))
def test_a_path_without_a_scheme_given_s3_options_is_refused(call: str, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(StorageOptionError) as e:
        _entry_points("bucket/run", S3_OPTS)[call]()
    msg = str(e.value)
    assert "'bucket/run'" in msg and "s3://bucket/run" in msg and "'endpoint_url'" in msg, msg
    assert e.value.suggestions == ["s3://bucket/run"]
    assert list(tmp_path.iterdir()) == []  # nothing written to the local disk


def test_options_name_the_store_they_belong_to_and_a_local_path_without_options_works(tmp_path: Path) -> None:
    with pytest.raises(StorageOptionError) as e:
        sc.save({"w": torch.ones(2)}, str(tmp_path / "run"), storage_options={"account_name": "devstoreaccount1"})
    assert "<bucket>/<prefix>" in str(e.value) and e.value.suggestions == ["az://<bucket>/<prefix>"]
    with pytest.raises(StorageOptionError) as e:
        sc.save({"w": torch.ones(2)}, "bkt/run", storage_options={"project": "p"})
    assert e.value.suggestions == ["gs://bkt/run"]
    # fsspec's own options and LocalFileSystem's are a local path's to take
    sc.save({"w": torch.ones(2)}, str(tmp_path / "ok"), storage_options={"auto_mkdir": True,
                                                                         "skip_instance_cache": True})
    assert torch.equal(sc.load_state(str(tmp_path / "ok"))["w"], torch.ones(2))


@pytest.mark.parametrize("uri,fixed", [("s3://bkt//run", "s3://bkt/run"), ("s3:///bkt/run", "s3://bkt/run"),
                                       ("gs://bkt/a//b/", "gs://bkt/a/b"), ("az://c//x", "az://c/x")])
@pytest.mark.parametrize("call", ["save", "load_state", "latest", "manager"])
def test_a_double_slash_in_a_store_key_is_refused(uri: str, fixed: str, call: str) -> None:
    with pytest.raises(CheckpointError) as e:
        _entry_points(uri, S3_OPTS)[call]()
    assert "empty path segment" in str(e.value) and repr(fixed) in str(e.value), str(e.value)


def test_a_trailing_slash_and_a_local_double_slash_are_fine(tmp_path: Path) -> None:
    sc.save({"w": torch.ones(3)}, f"{tmp_path}//run/", storage_options=None)
    assert torch.equal(sc.load_state(str(tmp_path / "run"))["w"], torch.ones(3))


def test_the_cli_refuses_a_scheme_less_root_with_an_endpoint(tmp_path: Path) -> None:
    p = subprocess.run([sys.executable, "-m", "streamckpt", "ls", "bucket/run", "--endpoint-url", "http://127.0.0.1:9"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert p.returncode == 2, p
    assert "s3://bucket/run" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert list(tmp_path.iterdir()) == []


def test_copy_and_merge_from_a_bucket_to_a_local_directory_take_the_options_for_the_bucket(
        tmp_path: Path, s3_uri: str, s3_opts: dict[str, Any]) -> None:
    """The destination's options default to the source's, but not for a local destination
    (they cannot apply to it): copying or exporting a bucket's checkpoint to disk still works."""
    sd = {"w": torch.arange(12.0).reshape(3, 4)}
    sc.save(sd, s3_uri, storage_options=s3_opts)
    copied = sc.copy(s3_uri, str(tmp_path / "copy"), storage_options=s3_opts)
    assert copied.bytes_written > 0 and torch.equal(sc.load_state(str(tmp_path / "copy"))["w"], sd["w"])
    sc.merge(s3_uri, str(tmp_path / "hf"), storage_options=s3_opts)
    assert any(p.suffix == ".safetensors" for p in (tmp_path / "hf").iterdir())
    p = subprocess.run([sys.executable, "-m", "streamckpt", "merge", s3_uri, str(tmp_path / "hf2"), "--quiet",
                        "--endpoint-url", s3_opts["endpoint_url"], "--storage-option", f"key={s3_opts['key']}",
                        "--storage-option", f"secret={s3_opts['secret']}"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert any(p.suffix == ".safetensors" for p in (tmp_path / "hf2").iterdir())
