"""Error classes: every failure a user can see is a ``CheckpointError`` subclass.

Messages say what failed, where (key / object / byte range / field) and, where it
helps, what to do about it.
"""

from __future__ import annotations

import difflib
import json
from typing import Any, Iterable, Mapping, Union

PYTHON = "python"  # the fronts a hint is worded for: the library's calls ...
CLI = "cli"  # ... and the ``streamckpt`` command line

Phrase = Mapping[str, str]  # one phrase per front ({PYTHON: ..., CLI: ...}); PYTHON is the fallback


class Hint:
    """What to do about an error, kept apart from its message so that each front end words it
    in its own syntax: ``parts`` are plain text and phrases (``{front: words}``), such as the
    storage options to pass, ``storage_options={'key': ...}`` in Python and
    ``--storage-option key=...`` on the command line (``options``)."""

    def __init__(self, *parts: Union[str, Phrase]) -> None:
        self.parts = parts

    def render(self, front: str = PYTHON) -> str:
        return "".join(p if isinstance(p, str) else p.get(front, p[PYTHON]) for p in self.parts)

    def __repr__(self) -> str:
        return f"Hint({self.render()!r})"


def options(**values: Any) -> Phrase:
    """Storage options to pass, as a phrase: ``storage_options={'key': ...}`` /
    ``--storage-option key=...`` (``...``: a value for the user to fill in)."""
    py = ", ".join(f"{k!r}: {'...' if v is ... else repr(v)}" for k, v in values.items())
    cli = " ".join(f"--storage-option {k}={'...' if v is ... else json.dumps(v) if not isinstance(v, str) else v}"
                   for k, v in values.items())
    return {PYTHON: f"storage_options={{{py}}}", CLI: cli}


class CheckpointError(Exception):
    """Base class of every error streamckpt raises on purpose."""

    hint: Hint | None = None

    def __init__(self, *args: Any, hint: Hint | None = None) -> None:
        if hint is not None:
            self.hint, self._head = hint, str(args[0]) if args else ""
            args = (self._worded(PYTHON), *args[1:])
        super().__init__(*args)

    def _worded(self, front: str) -> str:
        assert self.hint is not None
        return f"{self._head}: {self.hint.render(front)}" if self._head else self.hint.render(front)

    def render(self, front: str = PYTHON) -> str:
        """The message with its hint worded for ``front`` (``PYTHON``: ``str(self)``; ``CLI``:
        storage options as ``--storage-option`` flags, calls as ``streamckpt`` commands)."""
        return str(self) if self.hint is None else self._worded(front)


class CheckpointNotFoundError(CheckpointError):
    """No checkpoint (manifest, safetensors or DCP metadata) at the given URI."""


class CorruptCheckpointError(CheckpointError):
    """Stored bytes or metadata are invalid: bad manifest, checksum mismatch,
    truncated object, offsets out of bounds, hostile header."""


class UnsupportedVersionError(CorruptCheckpointError):
    """The manifest declares a format version this library does not read."""


class IncompatibleStateDictError(CheckpointError):
    """The state_dict does not fit the checkpoint: shape, dtype or layout mismatch."""


class MissingKeysError(CheckpointError):
    """``strict=True`` and the checkpoint lacks keys the state_dict asks for (or ``keys=`` of
    ``load_full``/``load_state`` names what it does not hold). ``missing_keys``: those keys."""

    def __init__(self, message: str, missing_keys: list[str] | None = None) -> None:
        super().__init__(message)
        self.missing_keys = list(missing_keys or [])


class StorageError(CheckpointError):
    """Storage kept failing after retries (names object and byte range)."""


class StorageOptionError(StorageError):
    """A storage option that the URI's client does not take (a misspelt name, most often):
    names the option, the URI and the option it was likely meant to be."""

    def __init__(self, message: str, option: str = "", suggestions: Iterable[str] = (),
                 hint: Hint | None = None) -> None:
        super().__init__(message, hint=hint)
        self.option = option
        self.suggestions = list(suggestions)


class TransformError(CheckpointError):
    """A transform rule is invalid or does not fit the checkpoint (names the rule)."""


class CheckpointExistsError(CheckpointError):
    """A committed checkpoint already exists at the URI and ``overwrite`` is False."""


class CheckpointInUseError(CheckpointError):
    """Writing at the URI would destroy bytes that other committed checkpoints (incremental
    saves that used it as their base) reference; names them and what to do."""


class StagingMemoryError(CheckpointError):
    """A rank could not allocate the pinned or device memory a load stages through
    (names the rank, the memory and the bytes asked for)."""


class PeerError(CheckpointError):
    """Another rank of the process group failed; this rank stopped with it."""


__all__ = [
    "CheckpointError",
    "StorageOptionError",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "UnsupportedVersionError",
    "IncompatibleStateDictError",
    "MissingKeysError",
    "StorageError",
    "TransformError",
    "CheckpointExistsError",
    "StagingMemoryError",
    "PeerError",
]


def near_names(name: str, known: Iterable[str], n: int = 3) -> list[str]:
    """Up to ``n`` names of ``known`` spelled close to ``name``, closest first."""
    return difflib.get_close_matches(name, list(known), n=n, cutoff=0.75)


def close_to(absent: list[str], known: Iterable[str], *, limit: int = 3) -> str:
    """``" (did you mean 'x'?)"`` for the first absent name with near spellings among ``known``
    (a typo'd key or option is the commonest way to miss one), else ``""``."""
    names = list(known)
    for name in absent[:limit]:
        near = [n for n in near_names(name, names) if n != name]
        if near:
            return f" (did you mean {' or '.join(repr(n) for n in near)} for {name!r}?)"
    return ""


def prefix_hint(absent: list[str], known: Iterable[str], *, sample: int = 20) -> str:
    """A hint when the absent keys differ from the known names by one leading prefix, as a
    DDP (``module.``) or ``torch.compile`` (``_orig_mod.``) wrapper adds or drops it."""
    names = set(known)
    if not absent or not names:
        return ""
    first, rest = absent[0], absent[1:sample]
    for name in sorted(names):
        if name.endswith("." + first):
            p = name[: -len(first)]
            if all(p + k in names for k in rest):
                return (f" (the checkpoint's names carry the prefix {p!r}: load "
                        f"{{{p!r} + k: v for k, v in state_dict.items()}}, the same tensors, filled in place)")
    head, _, tail = first.partition(".")
    if tail in names:
        p = head + "."
        if all(k.startswith(p) and k[len(p):] in names for k in rest):
            return (f" (your keys carry the prefix {p!r}, which the checkpoint's names lack: load "
                    f"{{k.removeprefix({p!r}): v for k, v in state_dict.items()}}, the same tensors, filled in place)")
    return ""
