"""Small front-door rough edges (issue #33, part 6), each as a user meets it: the
packaging metadata setuptools reads, ``python -m streamckpt.testing.s3server`` in a
real subprocess, and the CLI (real subprocesses) and Python API against the session's
moto server over HTTP."""

from __future__ import annotations

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
