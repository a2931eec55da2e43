"""A user's typed training script passes ``mypy --strict`` against the package.

The script below is what a typed trainer writes: training objects passed as they are
(``Stateful``), ``CheckpointManager.save`` giving ``SaveResult | SaveHandle`` and
``Restored.state`` typed as the state that was passed (``assert_type`` fails on ``Any``).
A second script misuses the union, and mypy must say so: a check that cannot fail is no
check. The package is checked as an installed one is (its own modules' errors silenced,
their types used); torch and numpy come from this interpreter's environment. Needs mypy
(the ``test`` extra); skipped where it is not installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("mypy", reason="mypy is in the test extra (pip install -e '.[test]')")

REPO = Path(__file__).resolve().parents[1]

USER = '''
"""A training script as a user writes it."""
from __future__ import annotations

from typing import assert_type

import numpy as np
import torch

import streamckpt as sc


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    model = torch.nn.Linear(4, 2)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    return model, optim, torch.optim.lr_scheduler.StepLR(optim, step_size=10)


def main(root: str) -> int:
    model, optim, sched = build()
    state = {"model": model, "optim": optim, "sched": sched, "step": 0, "mask": np.ones(3)}
    sc.save(state, f"{root}/plain")
    sc.save(model, f"{root}/model")
    sc.load(model, f"{root}/model")
    handle: sc.SaveHandle = sc.async_save(state, f"{root}/async")
    handle.result()
    with sc.CheckpointManager(root) as mgr:
        out = mgr.save(1, state, metrics={"loss": 0.5})
        assert_type(out, sc.SaveResult | sc.SaveHandle)
        res = out if isinstance(out, sc.SaveResult) else out.result()
        restored = mgr.restore(state)
        if restored is None:
            return res.bytes_written
        assert_type(restored.state, dict[str, object])  # the very dict passed
        tree = mgr.restore()
        if tree is not None:
            print(tree.state["step"])
        return restored.step
'''

MISUSE = '''
import torch
import streamckpt as sc

with sc.CheckpointManager("/tmp/run") as mgr:
    print(mgr.save(1, {"model": torch.nn.Linear(2, 2)}).bytes_written)
'''

CONFIG = """
[mypy]
strict = True
[mypy-streamckpt.*]
follow_imports = silent
"""


def mypy(tmp_path: Path, **scripts: str) -> tuple[int, str]:
    for name, text in scripts.items():
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(text))
    (tmp_path / "mypy.ini").write_text(CONFIG)
    env = dict(os.environ, MYPYPATH=str(REPO))
    run = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(tmp_path / "mypy.ini"), "--python-executable",
         sys.executable, "--cache-dir", str(tmp_path / "cache"), "--no-error-summary",
         *(str(tmp_path / f"{n}.py") for n in scripts)],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=240)
    return run.returncode, run.stdout + run.stderr


def test_a_typed_training_script_passes_mypy_strict(tmp_path: Path) -> None:
    code, out = mypy(tmp_path, user=USER, misuse=MISUSE)
    lines = [line for line in out.splitlines() if line.strip()]
    assert lines == ['misuse.py:6: error: Item "SaveHandle" of "SaveResult | SaveHandle" '
                     'has no attribute "bytes_written"  [union-attr]'], out
    assert code == 1
