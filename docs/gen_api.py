"""Generate docs/API.md, the API reference, from the public signatures and docstrings.

    python docs/gen_api.py           # rewrite docs/API.md
    python docs/gen_api.py --check   # exit 1 if docs/API.md is not what this would write

tests/test_apidoc.py runs the check, so the page cannot go stale: change a public
signature or docstring, then run the first command and commit the page with it.

Docstrings are Google style: a summary, then sections (``Args:``, ``Returns:``,
``Raises:``, ``Attributes:``, ``Example:``) whose entries are ``name: text`` lines, wrapped
lines indented further. This script renders them as Markdown and does nothing else: what
the page says is what ``help()`` says.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import re
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "API.md"
COMMAND = "python docs/gen_api.py"

SECTIONS = ("Args", "Returns", "Raises", "Attributes", "Example", "Examples", "Yields", "Note")
ENTRY_SECTIONS = ("Args", "Raises", "Attributes")
WIDTH = 100  # a signature longer than this is written one parameter per line


class Item(NamedTuple):
    """One documented object: the name users write, and the object."""

    name: str
    obj: Any


class Group(NamedTuple):
    title: str
    intro: str
    items: list[Item]


# ------------------------------------------------------------------ what is public


def _module(name: str) -> Any:
    return importlib.import_module(name)


def groups() -> list[Group]:
    """Every public object, in the order the page shows them."""
    sc = _module("streamckpt")
    functions = [Item(f"sc.{n}", getattr(sc, n)) for n in sc.__all__ if inspect.isfunction(getattr(sc, n))]
    errors = [n for n in sc.__all__ if inspect.isclass(getattr(sc, n)) and issubclass(getattr(sc, n), Exception)]
    classes = [n for n in sc.__all__ if inspect.isclass(getattr(sc, n)) and n not in errors]
    testing = _module("streamckpt.testing")
    out = [
        Group("Functions", "`import streamckpt as sc`. Collective calls say so; the others run in this "
              "process alone.", functions),
        Group("Classes", "What the functions take and return.",
              [Item(f"sc.{n}", getattr(sc, n)) for n in classes] + [Item("sc.Transforms", sc.Transforms)]),
        Group("Errors", "Every error streamckpt raises on purpose is a `sc.CheckpointError`; messages say "
              "what failed, where and what to do.", [Item(f"sc.{n}", getattr(sc, n)) for n in errors]),
        Group("Integrations", "Optional extras: the same storage layer and guarantees behind other "
              "libraries' interfaces.", _integrations()),
        Group("Testing helpers", "`streamckpt.testing` (needs the `test` extra): local storage servers and a "
              "fault-injecting proxy for your own tests.",
              [Item(f"streamckpt.testing.{n}", getattr(testing, n)) for n in testing.__all__]),
    ]
    return out


def _integrations() -> list[Item]:
    items = []
    for module, names in (("streamckpt.dcp", ("StorageWriter", "StorageReader")),
                          ("streamckpt.lightning", ("StreamCheckpointIO",))):
        try:
            mod = _module(module)
        except ImportError:  # pragma: no cover - the extra is not installed: the page would differ
            raise SystemExit(f"{module} does not import here: install streamckpt[test] to generate the page")
        items += [Item(f"{module}.{n}", getattr(mod, n)) for n in names]
    return items


def members(cls: type) -> list[tuple[str, Any]]:
    """The public methods and properties of a class, its own and those of its streamckpt
    bases, in source order (a base's first); for a plug-in, the hooks of the interface it
    implements are left to that interface's documentation (``interface_hooks``)."""
    hooks = set(interface_hooks(cls))
    found: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        if not klass.__module__.startswith("streamckpt") or issubclass(klass, BaseException):
            continue
        for name, value in vars(klass).items():
            if name.startswith("_") or name in hooks:
                continue
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            if inspect.isfunction(value) or isinstance(value, property):
                found[name] = value
    return list(found.items())


def interface_hooks(cls: type) -> list[str]:
    """Methods ``cls`` overrides from a base class defined outside streamckpt (torch's DCP
    ``StorageReader``, Lightning's ``CheckpointIO``): that library calls them."""
    foreign = [b for b in cls.__mro__[1:] if not b.__module__.startswith("streamckpt") and b is not object]
    return [n for n in vars(cls) if not n.startswith("_") and any(n in vars(b) for b in foreign)]


def fields(cls: type) -> list[str]:
    """A dataclass's or NamedTuple's fields (what ``Attributes:`` must list)."""
    if dataclasses.is_dataclass(cls):
        return [f.name for f in dataclasses.fields(cls)]
    if issubclass(cls, tuple) and hasattr(cls, "_fields"):
        return list(cls._fields)
    return []


def parameters(obj: Callable[..., Any]) -> list[str]:
    """The parameters a docstring must name: all but ``self``/``cls`` and ``*args``/``**kwargs``."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return []
    skip = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return [p.name for p in sig.parameters.values() if p.name not in ("self", "cls") and p.kind not in skip]


def documented() -> Iterator[tuple[str, Any, str, list[str]]]:
    """``(name, object, its docstring, the names that docstring must mention)`` for every
    public function, class (its constructor's parameters and its fields) and method."""
    for group in groups():
        for item in group.items:
            obj = item.obj
            if inspect.isclass(obj):
                names = [] if issubclass(obj, Exception) else parameters(obj) + fields(obj)
                yield item.name, obj, class_doc(obj), list(dict.fromkeys(names))
                for mname, member in members(obj):
                    func = member.fget if isinstance(member, property) else member
                    yield f"{item.name}.{mname}", member, inspect.getdoc(func) or "", parameters(func)
            else:
                yield item.name, obj, inspect.getdoc(obj) or "", parameters(obj)


def class_doc(cls: type) -> str:
    """The class docstring, with the constructor's own docstring after it when it has one."""
    doc = inspect.getdoc(cls) or ""
    init = getattr(cls, "__init__", None)
    init_doc = inspect.getdoc(init) if init is not None and init.__doc__ else ""
    return f"{doc}\n\n{init_doc}".strip() if init_doc else doc


# ------------------------------------------------------------------ signatures


def _annotation(a: Any) -> str:
    if a is inspect.Parameter.empty:
        return ""
    if isinstance(a, str):
        return a
    return inspect.formatannotation(a)


def _default(value: Any) -> str:
    """A default as source would write it: ``256 * 2**20`` rather than ``268435456``."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1 << 20:
        for power in (30, 20):
            if value % (1 << power) == 0:
                return f"{value >> power} * 2**{power}"
    return repr(value)


def signature(name: str, obj: Any) -> str:
    """``name(a: int, *, b: str = 'x') -> R``, one parameter per line when long."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return name
    parts: list[str] = []
    star_done = False
    for p in sig.parameters.values():
        if p.name in ("self", "cls"):
            continue
        if p.kind is inspect.Parameter.KEYWORD_ONLY and not star_done:
            parts.append("*")
            star_done = True
        if p.kind is inspect.Parameter.VAR_POSITIONAL:
            star_done = True
        prefix = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}.get(p.kind, "")
        text = prefix + p.name
        ann = _annotation(p.annotation)
        if ann:
            text += f": {ann}"
        if p.default is not inspect.Parameter.empty:
            text += f" = {_default(p.default)}" if ann else f"={_default(p.default)}"
        parts.append(text)
    ret = _annotation(sig.return_annotation)
    tail = f" -> {ret}" if ret else ""
    one = f"{name}({', '.join(parts)}){tail}"
    if len(one) <= WIDTH:
        return one
    return f"{name}(\n" + "".join(f"    {p},\n" for p in parts) + f"){tail}"


# ------------------------------------------------------------------ docstrings


def split_sections(doc: str) -> list[tuple[str, str]]:
    """``[("", summary), ("Args", body), ...]``; bodies dedented."""
    out: list[tuple[str, list[str]]] = [("", [])]
    for line in doc.splitlines():
        m = re.fullmatch(r"(%s):\s*" % "|".join(SECTIONS), line)
        if m:
            out.append((m.group(1), []))
        else:
            out[-1][1].append(line)
    return [(title, textwrap.dedent("\n".join(body)).strip("\n")) for title, body in out]


def entries(body: str) -> list[tuple[str, str]]:
    """``name: text`` entries of an Args/Raises/Attributes body (wrapped lines joined)."""
    out: list[tuple[str, list[str]]] = []
    for line in body.splitlines():
        m = re.match(r"([\w.*, ]+?)( \([^)]*\))?:\s+(.*)", line) if not line.startswith(" ") else None
        if m:
            out.append((m.group(1), [m.group(3)]))
        elif out:
            out[-1][1].append(line.strip())
        elif line.strip():
            out.append(("", [line.strip()]))
    return [(name, " ".join(words)) for name, words in out]


def markdown(doc: str) -> str:
    """A docstring as Markdown: prose as it is, entries as lists, examples as code."""
    blocks = []
    for title, body in split_sections(doc):
        if not body:
            continue
        if title == "":
            blocks.append(body)
        elif title in ENTRY_SECTIONS:
            lines = [f"- `{n}`: {t}" if n else f"- {t}" for n, t in entries(body)]
            blocks.append(f"**{title}:**\n\n" + "\n".join(lines))
        elif title in ("Example", "Examples"):
            blocks.append(f"**{title}:**\n\n```python\n{body}\n```")
        else:
            blocks.append(f"**{title}:** " + " ".join(body.split()))
    return "\n\n".join(blocks)


def _anchor(name: str) -> str:
    return re.sub(r"[^a-z0-9_-]", "", name.lower().replace(" ", "-"))


def render_item(item: Item) -> str:
    obj = item.obj
    short = item.name.rsplit(".", 1)[-1]
    if inspect.isclass(obj):
        kind = "exception" if issubclass(obj, Exception) else "class"
        bases = ", ".join(b.__name__ for b in obj.__bases__ if b is not object)
        head = f"### `{item.name}`\n\n*{kind}*" + (f" (subclass of `{bases}`)" if bases else "")
        sig = "" if issubclass(obj, Exception) else f"\n\n```python\n{signature(short, obj)}\n```"
        parts = [head + sig, markdown(class_doc(obj))]
        hooks = interface_hooks(obj)
        if hooks:
            parts.append("Implements " + ", ".join(f"`{h}`" for h in hooks) + " of the interface it "
                         "plugs into (called by that library, documented there).")
        for mname, member in members(obj):
            func = member.fget if isinstance(member, property) else member
            label = f"{short}.{mname}"
            code = f"{label}  (property)" if isinstance(member, property) else signature(label, func)
            parts.append(f"#### `{label}`\n\n```python\n{code}\n```\n\n{markdown(inspect.getdoc(func) or '')}")
        return "\n\n".join(p for p in parts if p)
    return f"### `{item.name}`\n\n```python\n{signature(short, obj)}\n```\n\n{markdown(inspect.getdoc(obj) or '')}"


def render() -> str:
    gs = groups()
    lines = [
        "# streamckpt API reference",
        "",
        f"<!-- Generated by `{COMMAND}` from the signatures and docstrings: do not edit by hand. -->",
        "",
        "Everything here is importable as written (`import streamckpt as sc`). The same text is",
        "what `help()` shows. URIs are fsspec URLs (`s3://`, `gs://`, `az://`, `file://`) or local",
        "paths; `storage_options` go to fsspec unchanged.",
        "",
        "## Contents",
        "",
    ]
    for g in gs:
        lines.append(f"- [{g.title}](#{_anchor(g.title)}): " + ", ".join(
            f"[`{it.name.rsplit('.', 1)[-1]}`](#{_anchor(it.name)})" for it in g.items))
    for g in gs:
        lines += ["", f"## {g.title}", "", g.intro]
        for it in g.items:
            lines += ["", render_item(it)]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/API.md differs from what this writes")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))  # document this checkout, whatever is installed
    text = render()
    if args.check:
        current = PAGE.read_text(encoding="utf-8") if PAGE.exists() else ""
        if current != text:
            print(f"{PAGE.relative_to(ROOT)} is stale: run `{COMMAND}` to update it", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text, encoding="utf-8")
    print(f"wrote {PAGE.relative_to(ROOT)} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
