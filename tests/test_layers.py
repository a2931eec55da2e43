"""The package tree is the architecture: each layer imports only the layers below it.

Read from the source (every import, module level or inside a function), not from
``sys.modules``, so a lazy import that crosses a layer is caught as well. The
checker is run on the real package (no violations) and on the package with one
forbidden import added (exactly that violation): a rule that cannot fail is no rule.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

PKG = "streamckpt"
ROOT = Path(__file__).resolve().parents[1] / PKG

# Lower numbers sit lower; a layer imports only layers ranked strictly below it (and
# itself). Modules not named here (api, merging, cli, demo, loadbench, progress, spawn,
# testing, the package's __init__) are the wiring on top: they may import anything, and
# no ranked layer may import them.
RANK = {
    "errors": 0,
    "core": 1,
    "storage": 2, "plan": 2, "transforms": 2, "results": 2,
    "formats": 3, "cuda": 3,
    "comm": 4,
    "loading": 5, "saving": 5,
    "manage": 6,
}
PURE = ("core", "plan")  # no I/O, no process groups
IO_CLIENTS = ("fsspec", "s3fs", "gcsfs", "adlfs", "obstore", "botocore", "aiobotocore", "socket", "http",
              "urllib3", "requests", "aiohttp")
# torch's stream/event API: only cuda/ may call it (everyone else goes through cuda.runtime.CudaApi)
STREAM_EVENT = {"Stream", "Event", "ExternalStream", "StreamContext", "stream", "current_stream",
                "default_stream", "set_stream", "synchronize"}


@dataclass(frozen=True)
class Violation:
    module: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.module}:{self.line}: {self.what}"


def package_sources(root: Path = ROOT) -> dict[str, tuple[str, bool]]:
    """``{module name: (source, is a package __init__)}`` for every module of the package."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        ispkg = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if ispkg else parts)
        out[name] = (path.read_text(), ispkg)
    return out


def layer_of(module: str) -> str | None:
    """The layer a module of the package belongs to (None: the wiring on top)."""
    parts = module.split(".")
    head = parts[1] if len(parts) > 1 else ""
    return head if head in RANK else None


def _imports(module: str, source: str, ispkg: bool, known: set[str]) -> list[tuple[int, str]]:
    """Every module ``module`` imports, resolved to an absolute name, with its line."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if ispkg else module.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for a in node.names:  # ``from . import dtypes`` imports a module, not a name
                sub = f"{target}.{a.name}"
                out.append((node.lineno, sub if sub in known else target))
    return out


def _stream_event_uses(source: str) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in STREAM_EVENT:
            chain = ast.unparse(node.value)
            if chain == "torch.cuda" or (chain == "torch" and node.attr in ("Stream", "Event")):
                out.append((node.lineno, f"{chain}.{node.attr}"))
        elif isinstance(node, ast.ImportFrom) and node.module == "torch.cuda":
            out += [(node.lineno, f"torch.cuda.{a.name}") for a in node.names if a.name in STREAM_EVENT]
    return out


def violations(sources: dict[str, tuple[str, bool]]) -> list[Violation]:
    known = set(sources)
    found: list[Violation] = []
    for module, (source, ispkg) in sources.items():
        mine = layer_of(module)
        for line, target in _imports(module, source, ispkg, known):
            if target == PKG or target.startswith(PKG + "."):
                theirs = layer_of(target)
                if mine is None or theirs == mine:
                    continue
                if theirs is None:
                    found.append(Violation(module, line, f"layer {mine!r} imports the wiring module {target}"))
                elif RANK[theirs] >= RANK[mine]:
                    found.append(Violation(module, line, f"layer {mine!r} imports {target} "
                                                         f"(layer {theirs!r} is not below it)"))
            elif mine in PURE:
                top = target.split(".")[0]
                if target.startswith("torch.distributed") and not target.startswith("torch.distributed.tensor"):
                    found.append(Violation(module, line, f"pure layer {mine!r} imports {target}"))
                elif top in IO_CLIENTS:
                    found.append(Violation(module, line, f"pure layer {mine!r} imports the I/O client {target}"))
            if mine == "storage" and target.split(".")[0] == "torch":
                found.append(Violation(module, line, f"storage (bytes) imports {target}"))
        if mine != "cuda":
            found += [Violation(module, line, f"{what} outside cuda/") for line, what in _stream_event_uses(source)]
    return found


def test_the_package_respects_its_layers() -> None:
    sources = package_sources()
    assert {layer_of(m) for m in sources} >= set(RANK) - {"errors", "results", "comm"} | {None}
    assert violations(sources) == []


def test_every_top_level_module_is_a_layer_or_wiring() -> None:
    """What stays at the top level is what a reader looks for first (and ``errors``/``results``)."""
    top = {m.split(".")[1] for m in package_sources() if m.count(".") >= 1}
    assert top == {"__main__", "api", "cli", "comm", "core", "cuda", "dcp", "demo", "errors", "formats", "lightning", "loadbench",
                   "loading", "manage", "merging", "optimizers", "plan", "progress", "results", "saving", "spawn", "storage", "testing",
                   "transforms"}


@pytest.mark.parametrize("module, added, expected", [
    ("streamckpt.core.regions", "from ..storage import Storage", "layer 'core' imports streamckpt.storage"),
    ("streamckpt.core.targets", "import torch.distributed as dist", "pure layer 'core' imports torch.distributed"),
    ("streamckpt.plan.needs", "from ..loading import pipeline", "layer 'plan' imports streamckpt.loading.pipeline"),
    ("streamckpt.plan.rounds", "from torch.distributed import all_reduce",
     "pure layer 'plan' imports torch.distributed"),
    ("streamckpt.plan.rounds", "import fsspec", "pure layer 'plan' imports the I/O client fsspec"),
    ("streamckpt.storage.reads", "from ..plan.data import Read", "layer 'storage' imports streamckpt.plan.data"),
    ("streamckpt.storage.reads", "from .. import comm", "layer 'storage' imports streamckpt.comm"),
    ("streamckpt.storage.reads", "import torch", "storage (bytes) imports torch"),
    ("streamckpt.loading.pipeline", "from ..saving import writer", "layer 'loading' imports streamckpt.saving.writer"),
    ("streamckpt.core.manifest", "from .. import api", "layer 'core' imports the wiring module streamckpt.api"),
    ("streamckpt.loading.pipeline", "s = torch.cuda.Stream()", "torch.cuda.Stream outside cuda/"),
    ("streamckpt.comm", "from torch.cuda import current_stream", "torch.cuda.current_stream outside cuda/"),
    ("streamckpt.manage.retention", "from .. import api", "layer 'manage' imports the wiring module streamckpt.api"),
    ("streamckpt.saving.saver", "from ..manage import index", "layer 'saving' imports streamckpt.manage.index"),
])
def test_a_crossed_layer_is_caught(module: str, added: str, expected: str) -> None:
    sources = package_sources()
    source, ispkg = sources[module]
    sources[module] = (source + f"\n\ndef _crossing():\n    {added}\n", ispkg)
    found = violations(sources)
    assert len(found) == 1, found
    assert found[0].module == module and expected in found[0].what, found[0]
