"""The API reference cannot go stale, and every public name explains its parameters.

docs/API.md is generated from the signatures and docstrings by docs/gen_api.py; this
regenerates it and compares. Every public function, class (its constructor's parameters
and its fields) and method is checked for a docstring that names each parameter.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
import tomllib
from pathlib import Path
from types import ModuleType

import pytest

import streamckpt as sc

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def gen_api() -> ModuleType:
    """docs/gen_api.py (a tool script beside the page it writes, not part of the package)."""
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        return importlib.import_module("gen_api")
    finally:
        sys.path.remove(str(ROOT / "docs"))


def test_api_page_is_current(gen_api: ModuleType) -> None:
    page = ROOT / "docs" / "API.md"
    if not page.exists() or page.read_text(encoding="utf-8") != gen_api.render():
        pytest.fail(f"docs/API.md is stale: run `{gen_api.COMMAND}` to update it, and commit it")


def _mentions(doc: str, name: str) -> bool:
    return re.search(rf"(?<![\w.]){re.escape(name)}\b", doc) is not None


def test_every_public_object_names_each_parameter(gen_api: ModuleType) -> None:
    problems = []
    seen = set()
    for name, _obj, doc, params in gen_api.documented():
        seen.add(name)
        if not doc.strip():
            problems.append(f"{name}: no docstring")
            continue
        absent = [p for p in params if not _mentions(doc, p)]
        if absent:
            problems.append(f"{name}: the docstring does not mention {absent}")
    assert problems == []
    assert {f"sc.{n}" for n in sc.__all__} | {"sc.Transforms", "streamckpt.dcp.StorageReader",
                                               "streamckpt.dcp.StorageWriter",
                                               "streamckpt.lightning.StreamCheckpointIO",
                                               "sc.SaveHandle.result", "sc.LoadResult.read_amplification"} <= seen


@pytest.mark.parametrize("name", [n for n in sc.__all__ if inspect.isfunction(getattr(sc, n))])
def test_public_functions_say_what_they_return_and_raise(gen_api: ModuleType, name: str) -> None:
    doc = inspect.getdoc(getattr(sc, name)) or ""
    titles = [t for t, _ in gen_api.split_sections(doc)]
    assert {"Args", "Returns", "Raises"} <= set(titles), f"sc.{name}: sections {titles}"
    entries = dict(gen_api.entries(dict(gen_api.split_sections(doc))["Args"]))
    assert list(entries) == gen_api.parameters(getattr(sc, name)), f"sc.{name}: Args out of step with the signature"


def test_help_of_load_explains_its_knobs() -> None:
    doc = inspect.getdoc(sc.load) or ""
    for knob in ("read_once", "memory_budget", "max_concurrency", "transforms", "progress", "strict"):
        assert re.search(rf"^    {knob}: \S", doc, re.M), knob
    assert "256 MiB" in doc and "(default 32)" in doc and "MissingKeysError" in doc


def test_public_signatures_are_typed() -> None:
    for name in sc.__all__:
        obj = getattr(sc, name)
        if not inspect.isfunction(obj):
            continue
        sig = inspect.signature(obj)
        assert sig.return_annotation is not inspect.Signature.empty, name
        for p in sig.parameters.values():
            assert p.annotation not in (inspect.Parameter.empty, "Any"), f"sc.{name}({p.name}) is untyped"


def test_py_typed_ships_with_the_package() -> None:
    assert (Path(sc.__file__).parent / "py.typed").is_file()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert "py.typed" in project["tool"]["setuptools"]["package-data"]["streamckpt"]
