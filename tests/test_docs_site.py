"""The docs site (mkdocs + material, ``make docs``) builds with ``--strict``: every link and anchor
of README.md, the guides and the reference pages resolves, on the site as on GitHub."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytest.importorskip("mkdocs")
pytest.importorskip("material")


def _build(root: Path, site: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=root, capture_output=True, text=True, env=env, timeout=300)


def _copy(tmp_path: Path) -> Path:
    """What the site is built from: mkdocs.yml, docs/, the root pages and the example it links."""
    root = tmp_path / "repo"
    shutil.copytree(REPO / "docs", root / "docs", ignore=shutil.ignore_patterns("__pycache__"))
    (root / "examples").mkdir()
    for name in ("mkdocs.yml", "README.md", "BENCHMARKS.md", "BENCHMARKS-1GiB.md", "examples/train_resume.py"):
        shutil.copy(REPO / name, root / name)
    return root


def test_the_site_builds_strict_with_readme_as_index(tmp_path: Path) -> None:
    p = _build(REPO, tmp_path / "site")
    assert p.returncode == 0, p.stdout + p.stderr
    index = (tmp_path / "site" / "index.html").read_text(encoding="utf-8")
    assert "Save to a bucket, load a slice back" in index
    assert 'href="quickstart/"' in index  # README's docs/quickstart.md, as the site lays it out
    for page in ("quickstart", "manager", "API", "FORMAT", "BENCHMARKS", "running-benchmarks"):
        assert (tmp_path / "site" / page / "index.html").is_file(), page
    assert (tmp_path / "site" / "examples" / "train_resume.py").is_file()


def test_a_broken_link_or_anchor_fails_the_build(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    assert _build(root, tmp_path / "ok").returncode == 0
    guide = root / "docs" / "cli.md"
    guide.write_text(guide.read_text() + "\nSee [the format](FORMAT.md#no-such-section).\n")
    p = _build(root, tmp_path / "anchor")
    assert p.returncode != 0 and "does not contain an anchor '#no-such-section'" in p.stderr, p.stderr
    readme = root / "README.md"
    readme.write_text(readme.read_text() + "\n[gone](docs/gone.md)\n")
    guide.write_text(guide.read_text().replace("(FORMAT.md#no-such-section)", "(FORMAT.md)"))
    p = _build(root, tmp_path / "link")
    assert p.returncode != 0 and "'gone.md', but the target is not found" in p.stderr, p.stderr
