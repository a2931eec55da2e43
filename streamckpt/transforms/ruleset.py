"""``Transforms``: an ordered rule list, read from YAML / dicts, applied to a checkpoint's names."""

from __future__ import annotations

import os
import re
from importlib import resources
from typing import Any, Mapping, Sequence

import yaml

from ..errors import TransformError, close_to
from .apply import Step, apply_rule
from .inverse import inverse_rules
from .pieces import leaf_tensor
from .rules import Rule, parse_rule
from .states import ViewState
from .view import SourceSpec, View


class Transforms:
    """An ordered list of parsed rules; :meth:`apply` builds the :class:`View` of a checkpoint."""

    def __init__(self, rules: Sequence[Rule]) -> None:
        self._rules = tuple(rules)

    @classmethod
    def from_rules(cls, rules: Sequence[Mapping[str, Any]]) -> "Transforms":
        """Parse and validate rule dicts (each ``{kind: {fields}}``)."""
        if isinstance(rules, Mapping) or not isinstance(rules, Sequence) or isinstance(rules, str):
            raise TransformError(f"transform rules must be a list of rule mappings, got {type(rules).__name__}")
        return cls([parse_rule(i, r) for i, r in enumerate(rules)])

    @classmethod
    def from_yaml(cls, path_or_uri: str | os.PathLike[str],
                  storage_options: dict[str, Any] | None = None) -> "Transforms":
        """Read ``{rules: [...]}`` from a YAML file at a path or fsspec URI, or a preset shipped
        with the package by its name (``"hf_llama_to_vllm"``: a name without ``/``, ``.`` or
        ``:``; :func:`presets` lists them)."""
        where = os.fspath(path_or_uri)
        if is_preset_name(where):
            text = preset_text(where)
            where = f"preset {where!r}"
        else:
            text = _read(where, storage_options)
        try:
            doc = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise TransformError(f"transforms file {where!r} is not valid YAML: {exc}") from None
        if not isinstance(doc, Mapping) or not isinstance(doc.get("rules"), list):
            raise TransformError(f"transforms file {where!r} must be a mapping with a 'rules' list")
        try:
            return cls.from_rules(doc["rules"])
        except TransformError as exc:
            raise TransformError(f"{where}: {exc}") from None

    @property
    def rules(self) -> list[dict[str, Any]]:
        """The rules as dicts (as given)."""
        return [dict(r.raw) for r in self._rules]

    def __len__(self) -> int:
        return len(self._rules)

    def __repr__(self) -> str:
        return f"Transforms({len(self._rules)} rules)"

    def to_yaml(self) -> str:
        """The rules as a YAML document that :meth:`from_yaml` reads back."""
        return yaml.safe_dump({"rules": self.rules}, sort_keys=False, default_flow_style=None)

    def apply(self, source: SourceSpec) -> View:
        """The view of a checkpoint (name -> (shape, dtype code)) after every rule, in order."""
        return View(self._run(source, None).tensors)

    def invert(self, source: SourceSpec) -> "Transforms":
        """Concrete rules that map this transform's view back to the names of ``source``.

        Undoes rename, fuse, fuse_qkv, split, split_qkv, transpose and cast (back to the
        stored dtype); dropped tensors stay absent. Needs ``source`` for the split sizes.
        """
        trace: list[Step] = []
        self._run(source, trace)
        return Transforms.from_rules(inverse_rules(trace))

    def _run(self, source: SourceSpec, trace: list[Step] | None) -> ViewState:
        view = ViewState({name: leaf_tensor(name, shape, dt) for name, (shape, dt) in source.items()})
        for rule in self._rules:
            apply_rule(rule, view, trace)
        return view


_PRESET_NAME = re.compile(r"[A-Za-z0-9_-]+")


def _presets_dir() -> Any:
    return resources.files(__package__).joinpath("presets")


def presets() -> list[str]:
    """The names of the rule files shipped in ``streamckpt/transforms/presets/``, sorted."""
    return sorted(p.name[:-len(".yaml")] for p in _presets_dir().iterdir() if p.name.endswith(".yaml"))


def is_preset_name(text: str) -> bool:
    """A bare name (letters, digits, ``_``, ``-``): a preset, never a path or a URI."""
    return _PRESET_NAME.fullmatch(text) is not None


def preset_text(name: str) -> bytes:
    """The YAML of preset ``name``; an unknown name is a TransformError listing the presets."""
    known = presets()
    if name not in known:
        raise TransformError(
            f"no transforms preset named {name!r}{close_to([name], known)}; the presets shipped with "
            f"streamckpt are {', '.join(known)}; for your own rules pass a YAML path or URI "
            f"(with a '/' or a '.': './{name}.yaml'), a list of rules or sc.Transforms")
    return _presets_dir().joinpath(f"{name}.yaml").read_bytes()


def _read(where: str, storage_options: dict[str, Any] | None) -> bytes:
    import fsspec  # local: keep the pure parts importable without touching fsspec

    try:
        with fsspec.open(where, "rb", **(storage_options or {})) as fh:
            return fh.read()
    except (OSError, ValueError) as exc:
        stem = os.path.basename(where).removesuffix(".yaml")
        hint = f" (a preset shipped with streamckpt is named {stem!r}: pass just that)" if stem in presets() else ""
        raise TransformError(f"cannot read transforms file {where!r}: {exc}{hint}") from exc


def as_transforms(obj: Any, storage_options: dict[str, Any] | None = None) -> Transforms | None:
    """None | Transforms | list of rule dicts | ``{rules: [...]}`` | YAML path/URI | preset name
    -> Transforms or None."""
    if obj is None:
        return None
    if isinstance(obj, Transforms):
        return obj
    if isinstance(obj, (str, os.PathLike)):
        return Transforms.from_yaml(obj, storage_options)
    if isinstance(obj, Mapping):
        if not isinstance(obj.get("rules"), list):
            raise TransformError("a transforms mapping must have a 'rules' list")
        return Transforms.from_rules(obj["rules"])
    if isinstance(obj, (list, tuple)):
        return Transforms.from_rules(list(obj))
    raise TransformError(
        f"transforms must be None, sc.Transforms, a list of rules, a YAML path/URI or a preset name; "
        f"got {type(obj).__name__}"
    )
