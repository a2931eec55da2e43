"""Helpers for tests that drive examples/train_resume.py inside gloo ranks: import the
example, take a job's whole state as full (unsharded) tensors, compare two such states."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_resume.py"


def example() -> ModuleType:
    """examples/train_resume.py as a module (it is a script, not part of the package)."""
    mod = sys.modules.get("train_resume")
    if mod is None:
        spec = importlib.util.spec_from_file_location("train_resume", EXAMPLE)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules["train_resume"] = mod
        spec.loader.exec_module(mod)
    return mod


def full(value: Any) -> Any:
    """A state_dict with every DTensor gathered whole (collective: call on every rank);
    plain tensors cloned, other values as they are."""
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(value, dict):
        return {k: full(v) for k, v in value.items()}
    if isinstance(value, list):
        return [full(v) for v in value]
    if isinstance(value, DTensor):
        return value.full_tensor().detach().clone()
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return value


def differences(got: Any, want: Any, path: str = "", tol: float = 0.0) -> list[str]:
    """Where two states differ: tensors element by element (exactly, or within ``tol``),
    everything else with ``==`` and the same container types (a tuple is not a list)."""
    import torch

    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
            return [f"{path}: got {type(got).__name__} {getattr(got, 'shape', '')}, want {want.dtype} {tuple(want.shape)}"]
        if tol == 0.0:
            return [] if torch.equal(got, want) else [f"{path}: tensors differ"]
        diff = (got.double() - want.double()).abs().max().item() if want.numel() else 0.0
        return [] if diff <= tol else [f"{path}: max |difference| {diff:.3g} > {tol}"]
    if type(got) is not type(want):
        return [f"{path}: got {type(got).__name__} {got!r:.60}, want {type(want).__name__} {want!r:.60}"]
    if isinstance(want, dict):
        if set(got) != set(want):
            return [f"{path}: keys {sorted(set(got) ^ set(want))} differ"]
        return [d for k in want for d in differences(got[k], want[k], f"{path}.{k}", tol)]
    if isinstance(want, (list, tuple)):
        if len(got) != len(want):
            return [f"{path}: length {len(got)} != {len(want)}"]
        return [d for i, (a, b) in enumerate(zip(got, want)) for d in differences(a, b, f"{path}.{i}", tol)]
    if isinstance(want, float) and math.isnan(want):
        return [] if math.isnan(got) else [f"{path}: {got!r} != nan"]
    return [] if got == want else [f"{path}: {got!r} != {want!r}"]


def max_difference(got: dict[str, Any], want: dict[str, Any]) -> float:
    """Largest element-wise difference between two dicts of tensors with the same keys."""
    return max((got[k].double() - want[k].double()).abs().max().item() for k in want)
