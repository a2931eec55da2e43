"""``streamckpt ls``, ``prune`` and ``gc`` on a run's root (moto over HTTP): in process through
``main`` (output and status), and the console script once, into a pipe closed early."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from typing import Any

import pytest
import torch

import streamckpt as sc
from streamckpt.cli import EXIT_BROKEN_PIPE, main, parse_duration
from streamckpt.storage import Storage

from test_cli import ROOT, _script, s3_flags


@pytest.fixture
def run(s3_uri: str, s3_opts: dict[str, Any]) -> str:
    with sc.CheckpointManager(s3_uri, storage_options=s3_opts) as mgr:
        for step in (10, 20, 30, 40):
            mgr.save(step, {"w": torch.ones(256, 64) * step}, metrics={"loss": 4.0 / step})
    return s3_uri


def _main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    status = main(list(args))
    out, err = capsys.readouterr()
    return status, out, err


def test_ls_prune_gc(run: str, s3_opts: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    flags = s3_flags(s3_opts)
    status, out, err = _main(capsys, "ls", run, *flags, "--keep-last", "2", "--keep-every", "20")
    assert status == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].split() == ["step", "name", "committed", "(UTC)", "size", "files", "metrics", "policy"]
    assert [ln.split()[:2] for ln in lines[1:]] == [["10", "step-10"], ["20", "step-20"], ["30", "step-30"],
                                                    ["40", "step-40"]]
    assert [ln.split("  ")[-1].strip() for ln in lines[1:]] == ["prune", "keep (every)", "keep (last)",
                                                                "keep (last, every)"]
    assert "64.8 KiB" in lines[1] and "loss=0.4" in lines[1]  # manifest (with its digests) and data file
    status, out, _ = _main(capsys, "ls", run, *flags, "--json")
    found = json.loads(out)
    assert status == 0 and [(r["step"], r["files"], r["metrics"]) for r in found] == [
        (10, 2, {"loss": 0.4}), (20, 2, {"loss": 0.2}), (30, 2, {"loss": 4.0 / 30}), (40, 2, {"loss": 0.1})]
    assert all(256 * 64 * 4 < r["bytes"] < 256 * 64 * 4 + 4096 for r in found) and "keep" not in found[0]

    status, out, _ = _main(capsys, "prune", run, *flags, "--keep-last", "1", "--keep-every", "20", "--dry-run")
    assert status == 0 and out.splitlines() == [f"would delete {run}/step-10", f"would delete {run}/step-30"]
    status, out, _ = _main(capsys, "prune", run, *flags, "--keep-last", "1", "--keep-every", "20")
    assert status == 0 and out.splitlines() == [f"deleted {run}/step-10", f"deleted {run}/step-30"]
    assert sc.CheckpointManager(run, storage_options=s3_opts).steps() == [20, 40]
    status, out, err = _main(capsys, "prune", run, *flags, "--keep-last", "1", "--keep-every", "20")
    assert (status, out) == (1, "") and err.strip() == f"nothing to prune under {run}"

    Storage(run, s3_opts).write_bytes("step-50/data/00000-0000.safetensors", b"\0" * 3000)  # a dead save
    status, out, err = _main(capsys, "gc", run, *flags)
    assert (status, out) == (1, "") and err.strip() == f"no garbage older than 3600 s under {run}"
    status, out, _ = _main(capsys, "gc", run, *flags, "--older-than", "0s", "--dry-run")
    assert status == 0 and out.splitlines() == [f"would remove {run}/step-50/data/00000-0000.safetensors (2.9 KiB)"]
    status, out, _ = _main(capsys, "gc", run, *flags, "--older-than", "0")
    assert status == 0 and out.splitlines() == [f"removed {run}/step-50/data/00000-0000.safetensors (2.9 KiB)"]
    assert sorted({n.split("/")[0] for n in Storage(run, s3_opts).list("", recursive=True)}) == ["step-20", "step-40"]


def test_prune_and_ls_take_keep_best_like_the_manager(run: str, s3_opts: dict[str, Any],
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    flags = s3_flags(s3_opts)  # losses: 10 -> 0.4, 20 -> 0.2, 30 -> 0.133, 40 -> 0.1
    status, out, _ = _main(capsys, "ls", run, *flags, "--keep-best", "loss:max:2")
    assert status == 0 and [ln.split("  ")[-1].strip() for ln in out.splitlines()[1:]] == [
        "keep (best)", "keep (best)", "prune", "keep (newest)"]
    status, out, _ = _main(capsys, "prune", run, *flags, "--keep-best", "loss:max:1", "--keep-every", "30")
    assert status == 0 and out.splitlines() == [f"deleted {run}/step-20"]
    assert sc.CheckpointManager(run, storage_options=s3_opts).steps() == [10, 30, 40]
    status, out, _ = _main(capsys, "prune", run, *flags, "--keep-best", "my:metric:min:1")  # a metric with a colon
    assert status == 0 and out.splitlines() == [f"deleted {run}/step-10", f"deleted {run}/step-30"]


def test_ls_of_an_empty_root_and_bad_arguments(s3_uri: str, s3_opts: dict[str, Any],
                                               capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = _main(capsys, "ls", s3_uri, *s3_flags(s3_opts))
    assert (status, out) == (1, "") and err.strip() == f"no committed checkpoint under {s3_uri}"
    status, out, err = _main(capsys, "prune", s3_uri, *s3_flags(s3_opts))  # no rule: a prune never guesses one
    assert (status, out) == (2, "") and err.startswith("prune needs a rule to keep by: --keep-last N, --keep-every K")
    for bad in ("loss", "loss:min", "loss:lowest:2", "loss:min:0", ":min:2", "loss:min:two"):
        with pytest.raises(SystemExit) as ei:
            main(["prune", s3_uri, "--keep-best", bad])
        assert ei.value.code == 2 and f"not METRIC:min|max:K: {bad!r}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["gc", s3_uri, "--older-than", "soon"])
    assert "not a duration: 'soon'" in capsys.readouterr().err
    assert [parse_duration(t) for t in ("90", "90s", "15m", "1h", "2d", "0.5h")] == [90, 90, 900, 3600, 172800, 1800]


def test_ls_into_a_pipe_closed_early(run: str, s3_opts: dict[str, Any]) -> None:
    cmd = shlex.join([_script(), "ls", run, *s3_flags(s3_opts)])
    r = subprocess.run(["bash", "-c", f'{cmd} | head -2; echo "status=${{PIPESTATUS[0]}}"'], capture_output=True,
                       text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    lines = r.stdout.splitlines()
    assert lines[0].startswith("step") and lines[1].split()[:2] == ["10", "step-10"], r.stdout
    assert lines[2] in ("status=0", f"status={EXIT_BROKEN_PIPE}") and r.stderr == ""
