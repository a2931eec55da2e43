"""Small front-door rough edges (issue #33, part 6), each as a user meets it: the
packaging metadata setuptools reads, ``python -m streamckpt.testing.s3server`` in a
real subprocess, and the CLI (real subprocesses) and Python API against the session's
moto server over HTTP."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
