"""The pytest plugin users get with the ``test`` extra, run as they would run it: a separate
pytest process on a small test file, the plugin found through the ``pytest11`` entry point
that pyproject.toml declares (installed here as a stand-in distribution on PYTHONPATH)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest


REPO = Path(__file__).resolve().parent.parent
PLUGIN = "streamckpt.testing.pytest_plugin"

USER_TESTS = '''
import os

import fsspec
import torch

import streamckpt as sc

SEEN = {}


def test_resume_from_s3(s3_bucket):
    opts = s3_bucket.storage_options
    sc.save({"w": torch.arange(6.0)}, f"{s3_bucket.uri}/step-100", storage_options=opts)
    out = {"w": torch.zeros(6)}
    sc.load(out, sc.latest(s3_bucket.uri, storage_options=opts), storage_options=opts)
    assert torch.equal(out["w"], torch.arange(6.0))
    SEEN["s3"] = s3_bucket


def test_resume_from_gcs(gcs_bucket):
    opts = gcs_bucket.storage_options
    assert gcs_bucket.uri.startswith("gs://") and os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] == "false"
    sc.save({"w": torch.arange(6.0)}, f"{gcs_bucket.uri}/step-100", storage_options=opts)
    out = {"w": torch.zeros(6)}
    sc.load(out, sc.latest(gcs_bucket.uri, storage_options=opts), storage_options=opts)
    assert torch.equal(out["w"], torch.arange(6.0))
    SEEN["gcs"] = gcs_bucket


def test_every_test_gets_a_fresh_empty_bucket(s3_bucket, gcs_bucket):
    for bucket, protocol in ((s3_bucket, "s3"), (gcs_bucket, "gs")):
        assert bucket.name != SEEN[bucket.api].name
        assert fsspec.filesystem(protocol, **bucket.storage_options).ls(bucket.name) == []


def test_buckets_of_finished_tests_are_removed(local_s3_server, local_gcs_server):
    s3 = fsspec.filesystem("s3", skip_instance_cache=True, **SEEN["s3"].storage_options)
    gcs = fsspec.filesystem("gs", **SEEN["gcs"].storage_options)
    assert not s3.exists(SEEN["s3"].name) and not gcs.exists(SEEN["gcs"].name)
    assert local_s3_server.endpoint_url == SEEN["s3"].endpoint_url


def test_fault_proxy_in_front_of_each_bucket(s3_bucket, gcs_bucket, fault_proxy):
    w = torch.randn(64, 32)
    for bucket in (s3_bucket, gcs_bucket):
        sc.save({"w": w}, f"{bucket.uri}/ckpt", storage_options=bucket.storage_options)
        proxy = fault_proxy(bucket, faults=["flip", "short"], rate=1.0, max_repeats=1,
                            match=lambda method, path: "data" in path)
        out = {"w": torch.zeros(64, 32)}
        sc.load(out, f"{bucket.uri}/ckpt", storage_options=proxy.storage_options)
        assert torch.equal(out["w"], w) and proxy.injected > 0, (bucket.api, proxy.counts)
'''


def _declared_entry_points() -> dict[str, str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return dict(project["entry-points"]["pytest11"])


def _install_stand_in(site: Path) -> None:
    """A distribution whose only content is pyproject's pytest11 entry points: what pip
    installs for them, found by importlib.metadata on PYTHONPATH."""
    dist = site / "streamckpt_plugin_probe-0.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: streamckpt-plugin-probe\nVersion: 0.0\n")
    lines = ["[pytest11]"] + [f"{name} = {target}" for name, target in _declared_entry_points().items()]
    (dist / "entry_points.txt").write_text("\n".join(lines) + "\n")


def _run_pytest(tmp_path: Path, *args: str, site: Path | None = None) -> subprocess.CompletedProcess[str]:
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # the rootdir: none of this repo's conftest or options
    (tmp_path / "test_user_code.py").write_text(textwrap.dedent(USER_TESTS))
    env = dict(os.environ)
    env.pop("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", None)  # the plugin sets it, as for a user
    env.pop("PYTEST_DISABLE_PLUGIN_AUTOLOAD", None)
    paths = [str(site)] if site else []
    env["PYTHONPATH"] = os.pathsep.join([*paths, str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
    )


def test_entry_point_targets_the_plugin_module() -> None:
    assert _declared_entry_points() == {PLUGIN: PLUGIN}


def test_fixtures_work_in_a_users_test_session(tmp_path: Path) -> None:
    _install_stand_in(tmp_path / "site")
    run = _run_pytest(tmp_path, "test_user_code.py", site=tmp_path / "site")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "5 passed" in run.stdout, run.stdout


@pytest.mark.slow  # a second pytest process; the entry point's name is checked fast above
def test_explicit_plugin_on_top_of_the_entry_point_registers_once(tmp_path: Path) -> None:
    """``-p streamckpt.testing.pytest_plugin`` (as docs for uninstalled checkouts say) while the
    entry point is installed too: no 'Plugin already registered' error."""
    _install_stand_in(tmp_path / "site")
    run = _run_pytest(tmp_path, "-p", PLUGIN, "test_user_code.py", "-k", "resume_from_gcs",
                      site=tmp_path / "site")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 passed" in run.stdout, run.stdout
