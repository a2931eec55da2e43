"""The GPU check's install step, as on the lent machine's image (issue 26), on this machine's Python.

That image has torch, numpy, pytest and a few light packages, but not streamckpt's compiled and S3
dependencies; ``benchmarks/gpu_wheels.sh`` fetches those as wheels, ``benchmarks/gpu_check.sh``
installs them with ``pip install --no-index --no-deps --target``. Here the same script fetches this
machine's (``--python-version`` of the running Python) wheels, and ``gpu_check.sh --install-only``
installs them into a bare interpreter: a venv made ``--without-pip`` whose only site entry is a
folder of links to the distributions the image has (``IMAGE_HAS``, from the device tool's
KINDS.md), taken from this venv. So a dependency missing from the wheel list fails here, as it
would there. Then ``import streamckpt`` and collection of the GPU tests must succeed.

Needs the network for ``pip download`` (cached between runs); skips with a message when offline.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from importlib import metadata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# What the image holds that the check's imports reach (names as KINDS.md lists them, 2026-11-17);
# torch's own needs are in that list too. Everything else must come from the wheels.
IMAGE_HAS = [
    "torch", "numpy", "typing-extensions", "filelock", "sympy", "mpmath", "networkx", "jinja2", "markupsafe",
    "setuptools", "pip", "fsspec", "safetensors", "pyyaml", "tqdm", "psutil", "packaging",
    "pytest", "pluggy", "iniconfig", "pygments", "pytest-timeout", "hypothesis", "attrs", "sortedcontainers",
    "aiohttp", "aiosignal", "aiohappyeyeballs", "frozenlist", "multidict", "yarl", "propcache", "idna",
    "wrapt", "urllib3", "python-dateutil", "six",
]
OFFLINE = re.compile(r"NewConnectionError|ConnectTimeout|Temporary failure in name resolution|Network is unreachable|"
                     r"ProxyError|Max retries exceeded|Name or service not known|ReadTimeout")


def _top_levels(dist: metadata.Distribution) -> set[str]:
    """The site-packages entries a distribution installed (packages, modules, its dist-info)."""
    tops = set()
    for f in dist.files or []:
        parts = Path(f).parts
        if parts and parts[0] != ".." and not parts[0].endswith(".pth") and parts[0] != "__pycache__":
            tops.add(parts[0])
    return tops


def image_like_site(where: Path) -> Path:
    """A folder of links to this venv's copies of ``IMAGE_HAS`` only."""
    site = where / "image-site"
    site.mkdir()
    for name in sorted(set(IMAGE_HAS)):
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # not in this venv either: then nothing here may need it
        base = Path(str(dist.locate_file("")))
        for top in _top_levels(dist):
            link = site / top
            if (base / top).exists() and not link.exists():
                link.symlink_to(base / top)
    return site


def bare_python(where: Path, site: Path) -> Path:
    """A venv without pip whose one extra site entry is ``site``."""
    venv = where / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    py = venv / "bin" / "python"
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True, timeout=60).stdout.strip()
    Path(purelib, "image.pth").write_text(f"{site}\n")
    return py


def fetch_wheels(dest: Path) -> None:
    """This machine's wheels, by the script the GPU check uses; skips when offline."""
    pyver = f"{sys.version_info.major}.{sys.version_info.minor}"
    env = {**os.environ, "PYTHON": sys.executable, "PIP_RETRIES": "0", "PIP_TIMEOUT": "10"}
    proc = subprocess.run(["bash", str(REPO / "benchmarks/gpu_wheels.sh"), "--python-version", pyver,
                           "--dest", str(dest)], capture_output=True, text=True, env=env, timeout=300)
    if proc.returncode != 0:
        said = OFFLINE.search(proc.stdout + proc.stderr)
        unreachable = said.group(0) if said else index_unreachable()
        if unreachable:
            pytest.skip(f"no network for pip download: {unreachable}")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def index_unreachable() -> str:
    """Why pip's package index cannot be reached from here, or "" when it can."""
    index = os.environ.get("PIP_INDEX_URL") or subprocess.run(
        [sys.executable, "-m", "pip", "config", "get", "global.index-url"], capture_output=True, text=True,
        timeout=60).stdout.strip() or "https://pypi.org/simple"
    try:
        urllib.request.urlopen(index.rstrip("/") + "/pip/", timeout=10).close()
    except urllib.error.HTTPError:
        return ""  # it answered
    except OSError as e:
        return f"{index}: {e}"
    return ""


@pytest.mark.slow  # 25-65 s here (2 shared cores): a pip download, a pip install, torch imports
def test_install_step_on_a_bare_python_gives_streamckpt_and_the_gpu_tests(tmp_path: Path) -> None:
    wheels = Path(tempfile.gettempdir()) / f"streamckpt-gpu-wheels-cp{sys.version_info.major}{sys.version_info.minor}"
    fetch_wheels(wheels)
    py = bare_python(tmp_path, image_like_site(tmp_path))
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    absent = subprocess.run([str(py), "-c", "import zstandard"], capture_output=True, text=True, env=clean, timeout=60)
    assert "No module named 'zstandard'" in absent.stderr  # the bare Python really lacks it

    env = {**clean, "PYTHON": str(py), "WHEELS": str(wheels), "SITE": str(tmp_path / "site"),
           "OUT": str(tmp_path / "out")}
    inst = subprocess.run(["bash", str(REPO / "benchmarks/gpu_check.sh"), "--install-only"], capture_output=True,
                          text=True, env=env, timeout=300)
    log = (tmp_path / "out" / "gpu_check.log").read_text()
    assert inst.returncode == 0, inst.stdout + inst.stderr
    summary = (tmp_path / "out" / "gpu_summary.txt").read_text()
    assert re.search(r"^PASS install: \d+ wheels into ", summary, re.M), summary
    assert re.search(r"^PASS import: streamckpt 0\.1\.0 .*zstandard, crc32c, obstore, s3fs", summary, re.M), summary
    assert "FAIL" not in summary and "PASS import" in log

    env_run = {**clean, "PYTHONPATH": f"{REPO}:{tmp_path / 'site'}"}
    collect = subprocess.run([str(py), "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                              "tests/test_gpu.py"], cwd=REPO, capture_output=True, text=True, env=env_run, timeout=120)
    assert collect.returncode == 0, collect.stdout + collect.stderr
    assert re.search(r"^tests/test_gpu\.py::test_single_gpu_load_after_pending_init_kernels\[zstd\]$",
                     collect.stdout, re.M), collect.stdout
    show = "import streamckpt, zstandard; print(streamckpt.__file__, zstandard.__file__)"
    where = subprocess.run([str(py), "-c", show], cwd=tmp_path, capture_output=True, text=True, env=env_run, timeout=60)
    assert where.returncode == 0, where.stderr
    got_sc, got_zstd = where.stdout.split()
    assert got_sc == str(REPO / "streamckpt" / "__init__.py")
    assert got_zstd.startswith(str(tmp_path / "site")), got_zstd
