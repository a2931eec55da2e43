"""Small front-door rough edges (issue #33, part 6), each as a user meets it: the
packaging metadata setuptools reads, ``python -m streamckpt.testing.s3server`` in a
real subprocess, and the CLI (real subprocesses) and Python API against the session's
moto server over HTTP."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tomllib
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import streamckpt as sc
from conftest import BUCKET
from streamckpt.errors import CLI
from streamckpt.storage.obstore_backend import BACKEND_ENV

ROOT = Path(__file__).resolve().parents[1]
S3_BACKENDS = ("auto", "http", "obstore", "s3fs")


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The ``streamckpt`` command in its own process, as a user runs it."""
    env = dict(os.environ if env is None else env, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "streamckpt.cli", *args], capture_output=True, text=True,
                          timeout=120, env=env)


def s3_flags(opts: dict[str, Any]) -> list[str]:
    return ["--endpoint-url", opts["endpoint_url"], "--storage-option", f"key={opts['key']}",
            "--storage-option", f"secret={opts['secret']}"]


# ------------------------------------------------------------------ packaging


def test_the_license_is_an_spdx_expression_that_setuptools_reads_without_a_warning() -> None:
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = apply_configuration(Distribution(), ROOT / "pyproject.toml")
    assert [str(w.message) for w in caught] == []  # was: "`project.license` as a TOML table is deprecated"
    assert dist.metadata.license_expression == "Apache-2.0"
    with open(ROOT / "pyproject.toml", "rb") as f:
        requires = tomllib.load(f)["build-system"]["requires"]
    assert requires == ["setuptools>=77"]  # the first setuptools that reads an SPDX string


# ------------------------------------------------------- python -m ...s3server


def test_the_s3server_module_runs_without_a_runtime_warning() -> None:
    """``python -m streamckpt.testing.s3server`` once printed runpy's RuntimeWarning ("found in
    sys.modules after import of package 'streamckpt.testing', but prior to execution"): the
    package imported the module that ``-m`` was about to run."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.Popen([sys.executable, "-W", "default", "-m", "streamckpt.testing.s3server", "--port", "0",
                             "--bucket", "bucket"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=60)
    assert re.fullmatch(r"endpoint_url=http://127\.0\.0\.1:\d+ key=\S+ secret=\S+\n", line), (line, out, err)
    assert "RuntimeWarning" not in err and "Traceback" not in err, err


def test_the_s3server_on_a_port_in_use_says_so_and_exits() -> None:
    """moto's server thread exits when it cannot bind, and ``ThreadedMotoServer.start`` then
    waited forever: the README's server block, run a second time, hung after werkzeug's message."""
    from streamckpt.testing import LocalS3

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        p = subprocess.run([sys.executable, "-m", "streamckpt.testing.s3server", "--port", str(port), "--bucket", "b"],
                           capture_output=True, text=True, env=env, timeout=120)
        assert p.returncode == 2 and p.stdout == "", (p.returncode, p.stdout, p.stderr)
        assert p.stderr == (f"python -m streamckpt.testing.s3server: error: cannot listen on 127.0.0.1:{port} "
                            f"(Address already in use): if it is a local S3 server started earlier, use it or stop "
                            f"it; or pass another port (0: a free one) and write that one in endpoint_url\n")
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}"):
            LocalS3(port=port).start()


# ----------------------------------------------------------- no credentials


NO_KEYS_PY = ("no credentials found: pass storage_options={'key': ..., 'secret': ...}, set AWS_ACCESS_KEY_ID and "
              "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or anon=True for a public bucket")
NO_KEYS_CLI = ("no credentials found: pass --storage-option key=... --storage-option secret=..., set AWS_ACCESS_KEY_ID "
               "and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or --storage-option anon=true for a public bucket")


def no_aws_credentials(home: Path) -> dict[str, str]:
    """An environment where botocore finds no credentials: no AWS_* keys, no ~/.aws, no instance metadata."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AWS_ACCESS", "AWS_SECRET", "AWS_SESSION", "AWS_PROFILE", "AWS_DEFAULT_PROFILE",
                                "AWS_CONTAINER", "AWS_WEB_IDENTITY", "AWS_ROLE"))}
    env.update(HOME=str(home), AWS_SHARED_CREDENTIALS_FILE=str(home / "none"), AWS_CONFIG_FILE=str(home / "none"),
               AWS_EC2_METADATA_DISABLED="true")
    return env


def test_the_cli_without_credentials_names_its_own_flags(tmp_path: Path, s3_opts: dict[str, Any]) -> None:
    uri = f"s3://{BUCKET}/x"
    r = cli("inspect", uri, "--storage-option", f"endpoint_url={s3_opts['endpoint_url']}",
            env=no_aws_credentials(tmp_path))
    assert r.returncode == 2, r
    assert r.stderr.startswith(f"streamckpt inspect: error: reading {uri}/manifest.json failed after 1 attempt(s): ")
    assert r.stderr.endswith(f": {NO_KEYS_CLI}\n"), r.stderr
    assert "storage_options" not in r.stderr and "anon=True" not in r.stderr


def test_the_api_without_credentials_names_storage_options(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                            s3_opts: dict[str, Any]) -> None:
    for var in set(os.environ) - set(no_aws_credentials(tmp_path)):
        monkeypatch.delenv(var)
    for var, value in no_aws_credentials(tmp_path).items():
        monkeypatch.setenv(var, value)
    with pytest.raises(sc.StorageError) as e:
        sc.inspect(f"s3://{BUCKET}/x", storage_options={"endpoint_url": s3_opts["endpoint_url"]})
    assert str(e.value).endswith(f": {NO_KEYS_PY}"), str(e.value)
    assert e.value.render(CLI).endswith(f": {NO_KEYS_CLI}")  # what the CLI prints, from the same error
    assert e.value.render(CLI).removesuffix(NO_KEYS_CLI) == str(e.value).removesuffix(NO_KEYS_PY)


# ---------------------------------------------------------- a run's prefix


@pytest.fixture
def run(s3_uri: str, s3_opts: dict[str, Any]) -> str:
    """A run's root holding two committed checkpoints and an uncommitted one."""
    for step in (3, 6):
        sc.save({"w": torch.full((4,), float(step))}, f"{s3_uri}/step-{step}", storage_options=s3_opts)
    sc.save({"w": torch.ones(2)}, f"{s3_uri}/step-9", storage_options=s3_opts)
    from streamckpt.storage import Storage

    st = Storage(f"{s3_uri}/step-9", s3_opts)
    try:
        st.delete("manifest.json")  # step-9 is a save that never committed
    finally:
        st.close()
    return s3_uri


def test_the_cli_says_a_run_prefix_is_one_and_how_to_find_its_newest(run: str, s3_opts: dict[str, Any]) -> None:
    for given in (run, run + "/"):
        r = cli("inspect", given, *s3_flags(s3_opts))
        assert (r.returncode, r.stdout) == (2, ""), r
        assert r.stderr == (f"streamckpt inspect: error: no checkpoint at {run}/: it is a run prefix holding 2 "
                            f"checkpoints (step-3, step-6; newest: {run}/step-6): give the URI of one of them "
                            f"('streamckpt latest {run}' prints the newest)\n"), r.stderr
    r = cli("latest", run, *s3_flags(s3_opts))  # the command it names
    assert (r.returncode, r.stdout) == (0, f"{run}/step-6\n"), r
    r = cli("inspect", f"{run}/step-6", *s3_flags(s3_opts))
    assert r.returncode == 0 and "w" in r.stdout, r


def test_the_api_says_a_run_prefix_is_one_and_names_sc_latest(run: str, s3_opts: dict[str, Any]) -> None:
    with pytest.raises(sc.CheckpointNotFoundError) as e:
        sc.inspect(run, storage_options=s3_opts)
    assert str(e.value) == (f"no checkpoint at {run}/: it is a run prefix holding 2 checkpoints (step-3, step-6; "
                            f"newest: {run}/step-6): give the URI of one of them (sc.latest({run!r}) returns the "
                            f"newest)")
    assert sc.latest(run, storage_options=s3_opts) == f"{run}/step-6"
    with pytest.raises(sc.CheckpointNotFoundError, match="it is a run prefix holding 2 checkpoints"):
        sc.load({"w": torch.zeros(4)}, run, storage_options=s3_opts)


def test_an_empty_prefix_is_still_just_no_checkpoint(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    with pytest.raises(sc.CheckpointNotFoundError) as e:
        sc.inspect(s3_uri, storage_options=s3_opts)
    assert str(e.value).startswith(f"no checkpoint at {s3_uri}/: expected manifest.json (streamckpt)")


# -------------------------------------------------------- misspelt options


@pytest.mark.parametrize("backend", S3_BACKENDS)
@pytest.mark.parametrize("wrong, meant", [("endpoint", "endpoint_url"), ("enpoint_url", "endpoint_url"),
                                          ("secrte", "secret")])
def test_a_misspelt_s3_option_starts_with_the_one_meant(backend: str, wrong: str, meant: str, s3_uri: str,
                                                        s3_opts: dict[str, Any],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BACKEND_ENV, backend)
    opts = {**s3_opts, wrong: s3_opts[meant]}
    del opts[meant]
    with pytest.raises(sc.StorageOptionError) as e:
        sc.inspect(s3_uri, storage_options=opts)
    assert str(e.value) == (f"unknown storage option {wrong!r} for {s3_uri}: did you mean {meant!r}? "
                            f"(s3:// options go to s3fs.S3FileSystem)")
    assert isinstance(e.value, sc.StorageError) and (e.value.option, e.value.suggestions) == (wrong, [meant])
    assert "TypeError" not in str(e.value)


def test_the_cli_names_a_misspelt_option_first(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    r = cli("inspect", s3_uri, "--storage-option", f"enpoint_url={s3_opts['endpoint_url']}",
            "--storage-option", f"key={s3_opts['key']}", "--storage-option", f"secret={s3_opts['secret']}")
    assert (r.returncode, r.stderr) == (2, f"streamckpt inspect: error: unknown storage option 'enpoint_url' for "
                                           f"{s3_uri}: did you mean 'endpoint_url'? (s3:// options go to "
                                           f"s3fs.S3FileSystem)\n"), r


def test_a_botocore_argument_at_the_top_is_shown_where_it_goes(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    with pytest.raises(sc.StorageOptionError) as e:
        sc.inspect(s3_uri, storage_options={**s3_opts, "region_name": "us-east-1"})
    head = f"unknown storage option 'region_name' for {s3_uri}: did you mean "
    tail = "? (s3fs hands client_kwargs to botocore, which takes 'region_name' there)"
    assert str(e.value) == f"{head}storage_options={{..., 'client_kwargs': {{'region_name': ...}}}}{tail}"
    r = cli("inspect", s3_uri, *s3_flags(s3_opts), "--storage-option", "region_name=us-east-1")
    assert (r.returncode, r.stderr) == (2, f"streamckpt inspect: error: {head}--storage-option "
                                           f"client_kwargs.region_name=...{tail}\n"), r


def test_an_unknown_option_with_nothing_close_lists_the_options(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    with pytest.raises(sc.StorageOptionError) as e:
        sc.inspect(s3_uri, storage_options={**s3_opts, "flavour": "vanilla"})
    assert str(e.value).startswith(f"unknown storage option 'flavour' for {s3_uri}: s3:// options go to "
                                   f"s3fs.S3FileSystem, which takes none by that name (its options: anon, "
                                   f"endpoint_url, key, secret, token, ")


@pytest.mark.parametrize("uri, opts, message", [
    ("gs://b/x", {"token": "anon", "endpoint_urll": "http://127.0.0.1:9"},
     "unknown storage option 'endpoint_urll' for gs://b/x: did you mean 'endpoint_url'? (gs:// options go to "
     "gcsfs.GCSFileSystem)"),
    ("az://c/x", {"acount_name": "devstoreaccount1", "anon": True},
     "unknown storage option 'acount_name' for az://c/x: did you mean 'account_name'? (az:// options go to "
     "adlfs.AzureBlobFileSystem)"),
])
def test_a_misspelt_gcs_or_azure_option_is_refused_not_dropped(uri: str, opts: dict[str, Any], message: str) -> None:
    """gcsfs and adlfs drop names they do not know: the typo used to reach the real cloud, unseen."""
    with pytest.raises(sc.StorageOptionError) as e:
        sc.inspect(uri, storage_options=opts)
    assert str(e.value) == message


@pytest.mark.parametrize("extra", [{"profile": None}, {"skip_instance_cache": True}, {"use_listings_cache": False},
                                   {"max_concurrency": 8}, {"client_kwargs": {}}])
def test_the_options_s3fs_takes_still_pass(extra: dict[str, Any], s3_uri: str, s3_opts: dict[str, Any]) -> None:
    sc.save({"w": torch.arange(3)}, s3_uri, storage_options={**s3_opts, **extra})
    assert sc.inspect(s3_uri, storage_options={**s3_opts, **extra}).total_bytes == 24


def test_boto_key_names_still_reach_obstore(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    sc.save({"w": torch.arange(3)}, s3_uri, storage_options=s3_opts)
    opts = {"endpoint_url": s3_opts["endpoint_url"], "aws_access_key_id": s3_opts["key"],
            "aws_secret_access_key": s3_opts["secret"]}
    assert sc.inspect(s3_uri, storage_options=opts).total_bytes == 24


@pytest.mark.parametrize("family", ["s3", "gs", "az"])
def test_the_names_known_without_importing_the_client_are_all_its_own(family: str) -> None:
    from streamckpt.storage.optionnames import TAKEN, known_options

    assert TAKEN[family] <= set(known_options(family) or ())


def test_checking_the_names_loads_no_client_the_call_does_not_need(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    """The obstore path never loads s3fs (~0.15 s): neither may the option check, for names it knows."""
    sc.save({"w": torch.arange(3)}, s3_uri, storage_options=s3_opts)
    code = ("import sys, json, streamckpt as sc; "
            f"sc.inspect({s3_uri!r}, storage_options=json.loads(sys.argv[1])); print('s3fs' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code, json.dumps(s3_opts)], capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT), **{BACKEND_ENV: "auto"}))
    assert (r.returncode, r.stdout) == (0, "False\n"), r
