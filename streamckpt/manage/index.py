"""What a run's root holds: its committed checkpoints, read from their manifests.

One recursive LIST of the root (sizes and times included) finds every object; the
manifests of the committed children are then read concurrently, and only those that are
new or changed since the last listing (a cache keyed by each manifest's size, ETag and
time), so listing a root again costs one LIST. Only the fields the manager needs are
parsed here (format, step, metrics, commit time, files); a load validates the rest.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import posixpath
from dataclasses import dataclass, field
from typing import Any

from ..core.manifest import FORMAT_NAME, MANIFEST_NAME, MAX_MANIFEST_BYTES
from ..errors import CheckpointError, CorruptCheckpointError
from ..storage import ObjectInfo, Storage

log = logging.getLogger(__name__)

STEP_KEY = "step"  # the manifest's metadata keys the manager writes
METRICS_KEY = "metrics"
READERS = 16  # manifests read at once


@dataclass(frozen=True, slots=True)
class Entry:
    """One committed checkpoint under the root.

    ``step`` is None for a checkpoint the manager did not write (no step in its metadata)
    and for one whose manifest cannot be read (``error`` says why): neither is ever pruned,
    and garbage collection leaves everything under them alone.
    """

    name: str  # the child of the root: ``step-12``
    step: int | None
    committed_ns: int  # from the manifest; its LastModified when it records none
    metrics: dict[str, Any] = field(default_factory=dict)
    objects: dict[str, int] = field(default_factory=dict)  # name relative to the root -> size: manifest + data
    error: str | None = None
    modified_ns: int = 0  # the manifest's LastModified (the store's clock, whole seconds on S3)

    @property
    def size(self) -> int:
        return sum(self.objects.values())

    @property
    def own_bytes(self) -> int:
        """Bytes stored under the checkpoint's own prefix (its manifest and the data it uploaded)."""
        return sum(n for name, n in self.objects.items() if name.startswith(self.name + "/"))

    @property
    def shared_bytes(self) -> int:
        """Bytes of the files it references in sibling checkpoints (an incremental save's base)."""
        return self.size - self.own_bytes

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "step": self.step, "committed_ns": self.committed_ns, "metrics": self.metrics,
                "objects": self.objects, "error": self.error, "modified_ns": self.modified_ns}

    @staticmethod
    def from_json(d: dict[str, Any]) -> "Entry":
        return Entry(d["name"], d["step"], d["committed_ns"], d["metrics"], d["objects"], d["error"], d["modified_ns"])


@dataclass(slots=True)
class Listing:
    """The root at one moment: its committed checkpoints and (on the listing rank) every object."""

    entries: list[Entry]
    objects: dict[str, ObjectInfo] = field(default_factory=dict)

    def managed(self) -> list[Entry]:
        """The readable checkpoints with a step, ascending; of two with one step, the later commit."""
        by_step: dict[int, Entry] = {}
        for e in sorted(self.entries, key=lambda e: e.committed_ns):
            if e.step is not None and e.error is None:
                by_step[e.step] = e
        return [by_step[s] for s in sorted(by_step)]

    def steps(self) -> list[int]:
        return [e.step for e in self.managed()]  # type: ignore[misc]  # managed() has steps

    def referenced(self) -> set[str]:
        return {name for e in self.entries for name in e.objects}

    def users_of(self, child: str) -> list[str]:
        """The other committed checkpoints that reference objects under ``child``'s prefix
        (incremental saves that used it as base; a pruned base's shared files included)."""
        own = child + "/"
        return [e.name for e in self.entries if e.name != child and any(o.startswith(own) for o in e.objects)]

    def to_json(self) -> bytes:
        return json.dumps([e.to_json() for e in self.entries]).encode()

    @staticmethod
    def from_json(data: bytes) -> "Listing":
        return Listing([Entry.from_json(d) for d in json.loads(data)])


class Index:
    """Lists a root and remembers the manifests it has read (see the module docstring)."""

    def __init__(self) -> None:
        self._cache: dict[str, tuple[tuple[Any, ...], Entry]] = {}

    def list(self, storage: Storage) -> Listing:
        objects = storage.list_info("")
        manifests = {name.partition("/")[0]: info for name, info in objects.items()
                     if name.count("/") == 1 and name.endswith("/" + MANIFEST_NAME)}
        fresh = {child: info for child, info in manifests.items()
                 if self._cache.get(child, ((),))[0] != _key(info)}
        if fresh:
            with cf.ThreadPoolExecutor(min(READERS, len(fresh)), thread_name_prefix="streamckpt-list") as pool:
                read = dict(zip(fresh, pool.map(lambda c: _read_entry(storage, c, fresh[c]), fresh)))
            for child, entry in read.items():
                if entry is not None:
                    self._cache[child] = (_key(fresh[child]), entry)
        for gone in set(self._cache) - set(manifests):
            del self._cache[gone]
        return Listing([e for child, (_, e) in sorted(self._cache.items()) if child in manifests], objects)

    def forget(self, child: str) -> None:
        self._cache.pop(child, None)


def _key(info: ObjectInfo) -> tuple[Any, ...]:
    return (info.size, info.etag, info.modified)


def _read_entry(storage: Storage, child: str, info: ObjectInfo) -> Entry | None:
    """The entry of one committed child; None when its manifest vanished meanwhile."""
    name = f"{child}/{MANIFEST_NAME}"
    when = int((info.modified or 0.0) * 1e9)
    try:
        data = storage.read_bytes(name, max_bytes=MAX_MANIFEST_BYTES)
    except CheckpointError as e:
        if storage.modified(name) is None:
            return None
        return Entry(child, None, when, error=f"its manifest cannot be read: {e}", modified_ns=when)
    try:
        return parse_entry(child, data, when)
    except CorruptCheckpointError as e:
        return Entry(child, None, when, error=str(e), modified_ns=when)


def parse_entry(child: str, data: bytes, modified_ns: int) -> Entry:
    """The manager's fields of a manifest; ``CorruptCheckpointError`` when they do not parse."""
    where = f"{child}/{MANIFEST_NAME}"
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptCheckpointError(f"{where} is not valid JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise CorruptCheckpointError(f"{where} is not a {FORMAT_NAME} manifest")
    meta = doc.get("metadata") or {}
    files = doc.get("files")
    if not isinstance(meta, dict) or not isinstance(files, dict):
        raise CorruptCheckpointError(f"{where}: 'metadata' and 'files' must be objects")
    objects = {where: len(data)}
    for f, v in files.items():
        ref = posixpath.normpath(posixpath.join(child, str(f)))
        if ref.startswith("../") or posixpath.isabs(ref):
            raise CorruptCheckpointError(f"{where}: file {f!r} lies outside the root")
        objects[ref] = int(v.get("size", 0)) if isinstance(v, dict) else 0
    step = meta.get(STEP_KEY)
    step = step if isinstance(step, int) and not isinstance(step, bool) else None
    found = meta.get(METRICS_KEY)
    metrics: dict[str, Any] = found if isinstance(found, dict) else {}
    committed = doc.get("committed_ns")
    committed = committed if isinstance(committed, int) and not isinstance(committed, bool) else modified_ns
    return Entry(child, step, committed, metrics, objects, modified_ns=modified_ns)
