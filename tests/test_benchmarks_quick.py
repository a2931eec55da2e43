"""The benchmark's --quick mode runs end to end, so benchmarks/ cannot rot.

It runs in the package's own venv: without localbucket the harness falls back to
moto and says so in the report. Figures are not asserted (they mean nothing at
this size); what is asserted is that every scenario ran, every loaded tensor
matched the generated data, and the report has its parts.
"""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _run_quick(tmp_path: Path, scenarios: str) -> str:
    out = tmp_path / "BENCH.md"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--quick", "--scenario", scenarios,
         "--data-dir", str(tmp_path / "data"), "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=410 if scenarios == "all" else 230,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = out.read_text()
    assert f"python -m benchmarks.run --quick --scenario {scenarios}" in text
    assert "## Machine" in text and "cores" in text
    for sc in "abcdefgs" if scenarios == "all" else scenarios.replace(",", ""):
        if sc == "g":
            for sub in ("g1", "g2"):
                _check_load_section(text, sub, ("streamckpt", "streamckpt.no_read_once", "naive"))
            continue
        if sc == "s":
            _check_save_section(text.split("## (s)", 1)[1].split("\n## ", 1)[0])
            continue
        if sc == "f":
            section = text.split("## (f)", 1)[1].split("\n## ", 1)[0]
            assert "| 64 |" in section and "error" not in section, section
            continue
        _check_load_section(text, sc, ("streamckpt", "naive", "ceiling"))
    if find_spec("localbucket") is None:
        assert "moto" in text.split("## Notes", 1)[1]
    return text


def _check_load_section(text: str, sc: str, loaders: tuple[str, ...]) -> None:
    """Every loader has a row that is neither an error nor n/a; the loaders (not the ceiling) loaded right."""
    section = text.split(f"# ({sc})", 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]
    rows = {line.split("|")[1].strip(): line for line in section.splitlines() if line.startswith("| ")}
    for loader in loaders:
        assert loader in rows, f"({sc}) has no {loader} row:\n{section}"
        assert "error" not in rows[loader] and "n/a" not in rows[loader].split("|")[2], rows[loader]
        if not loader.startswith("ceiling"):
            assert rows[loader].rstrip(" |").endswith("yes"), rows[loader]


def _check_save_section(section: str) -> None:
    """(s): every --quick saver has a row; what ran saved a checkpoint that reads back right."""
    rows = {tuple(c.strip() for c in line.split("|")[1:3]): line for line in section.splitlines()
            if line.startswith("| ") and not line.startswith("| saver")}
    one = {k[0]: v for k, v in rows.items() if not k[1].isdigit()}
    for saver in ("streamckpt", "streamckpt.async", "dcp-s3", "naive", "ceiling.obstore"):
        assert saver in one, f"(s) has no {saver} row:\n{section}"
        assert "error" not in one[saver], one[saver]
    for saver in ("streamckpt", "naive"):
        assert one[saver].rstrip(" |").endswith("yes"), one[saver]
    ddp = rows.get(("streamckpt", "2"))
    assert ddp is not None and ddp.rstrip(" |").endswith("yes"), section


@pytest.mark.timeout(240)
def test_quick_benchmark_single_rank_multi_rank_compressed_and_planner(tmp_path: Path) -> None:
    """(a) one process, (c) 4 saving ranks -> 2 loading ranks on gloo, (e) zstd, (f) the planner."""
    _run_quick(tmp_path, "a,c,e,f")


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_quick_benchmark_every_scenario(tmp_path: Path) -> None:
    _run_quick(tmp_path, "all")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_quick_benchmark_save(tmp_path: Path) -> None:
    """(s) alone: sc.save, sc.async_save, dcp.save + S3StorageWriter, naive, the ceiling, DDP on 2 ranks."""
    _run_quick(tmp_path, "s")
