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
    """An ordered list of transform rules: how the model's keys are built from a checkpoint's.

    Pass one as ``transforms=`` to ``sc.load`` or ``sc.load_full`` (which also take the
    rules as a list of dicts, a YAML path or a preset's name). Rules apply in order to a view of the
    checkpoint, and the state_dict is matched against the final view; a transformed load
    still reads only the bytes its targets need. Rule kinds: ``rename``, ``fuse``,
    ``fuse_qkv``, ``split``, ``split_qkv``, ``transpose``, ``cast``, ``drop``
    (docs/TRANSFORMS.md). Build one with :meth:`from_rules` or :meth:`from_yaml`.

    Args:
        rules: Parsed rules (what :meth:`from_rules` makes from dicts); users call the
            class methods instead.

    Example:
        >>> import streamckpt as sc
        >>> tf = sc.Transforms.from_rules([
        ...     {"rename": {"from": "model.layers.{i}.mlp.down_proj.weight", "to": "layers.{i}.w2.weight"}},
        ...     {"cast": {"key": "*.norm.weight", "dtype": "float32"}},
        ... ])
        >>> len(tf)
        2
    """

    def __init__(self, rules: Sequence[Rule]) -> None:
        self._rules = tuple(rules)

    @classmethod
    def from_rules(cls, rules: Sequence[Mapping[str, Any]]) -> "Transforms":
        """Parse and validate rule dicts.

        Args:
            rules: A list of ``{kind: {fields}}`` dicts, e.g.
                ``{"fuse": {"from": [q, k, v], "to": "...wqkv.weight", "dim": 0}}``.

        Returns:
            Transforms: the rules, in order.

        Raises:
            TransformError: ``rules`` is not a list, or a rule is invalid (names the rule).
        """
        if isinstance(rules, Mapping) or not isinstance(rules, Sequence) or isinstance(rules, str):
            raise TransformError(f"transform rules must be a list of rule mappings, got {type(rules).__name__}")
        return cls([parse_rule(i, r) for i, r in enumerate(rules)])

    @classmethod
    def from_yaml(cls, path_or_uri: str | os.PathLike[str],
                  storage_options: dict[str, Any] | None = None) -> "Transforms":
        """Read ``{rules: [...]}`` from a YAML file, or a preset shipped with the package.

        Args:
            path_or_uri: A local path or fsspec URI of the YAML file, or the name of a preset
                shipped in the package (``"hf_llama_to_vllm"``: a bare name, no ``/`` or ``.``;
                :func:`presets` lists them; ``configs/transforms/`` of a checkout links to them).
            storage_options: fsspec options to read a file with. Default None.

        Returns:
            Transforms: the file's rules, in order.

        Raises:
            TransformError: the file cannot be read, is not YAML, has no ``rules`` list, or a
                rule is invalid; no preset has that name (the message lists them).
        """
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
        """The rules as dicts (as given to :meth:`from_rules`)."""
        return [dict(r.raw) for r in self._rules]

    def __len__(self) -> int:
        return len(self._rules)

    def __repr__(self) -> str:
        return f"Transforms({len(self._rules)} rules)"

    def to_yaml(self) -> str:
        """The rules as a YAML document that :meth:`from_yaml` reads back.

        Returns:
            str: ``rules: [...]`` as YAML.
        """
        return yaml.safe_dump({"rules": self.rules}, sort_keys=False, default_flow_style=None)

    def apply(self, source: SourceSpec) -> View:
        """The view of a checkpoint after every rule, in order.

        Args:
            source: The checkpoint's tensors: name to ``(shape, dtype code)``.

        Returns:
            View: the transformed names, shapes and dtypes (``.tensors``), and how each
            region of them maps back to the source.

        Raises:
            TransformError: a rule does not fit ``source`` (a missing key, a shape mismatch).
        """
        return View(self._run(source, None).tensors)

    def invert(self, source: SourceSpec) -> "Transforms":
        """Concrete rules that map this transform's view back to the names of ``source``.

        Undoes rename, fuse, fuse_qkv, split, split_qkv, transpose and cast (back to the
        stored dtype); dropped tensors stay absent. Needs ``source`` for the split sizes.

        Args:
            source: The checkpoint's tensors: name to ``(shape, dtype code)``.

        Returns:
            Transforms: rules from this view back to ``source``'s names.

        Raises:
            TransformError: a rule does not fit ``source``.
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
