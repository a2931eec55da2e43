"""ListObjectsV2 for the ``http.client`` path (``httpget``): the query of each page, its XML,
and the pages followed to the end.

Why it exists: a load's first calls (a LIST of the prefix, GETs of small JSON files) are
its critical path, and building obstore's client for them cost 15–35 ms. The result is
the same list ``ObstoreBackend.listing`` gives for the same bucket: keys and common
prefixes read as object_store's ``Path::parse`` reads them (one leading and one trailing
``/`` dropped, so a common prefix has no trailing slash), common prefixes first, and a key
object_store refuses (an empty segment, ``.``, ``..``, a control character) fails the
listing as it does there.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from dataclasses import dataclass
from typing import Callable

from .backend import Permanent, Transient

DELIMITER = "/"


@dataclass(frozen=True)
class ListPage:
    """One ListObjectsV2 response."""

    keys: list[str]
    prefixes: list[str]
    next_token: str | None  # None: the last page


def object_path(key: str) -> str:
    """``key`` as object_store's ``Path::parse`` reads it; ``ValueError`` where that refuses it."""
    path = key[1:] if key.startswith(DELIMITER) else key
    if not path:
        return ""
    path = path[:-1] if path.endswith(DELIMITER) else path
    for segment in path.split(DELIMITER):
        if not segment:
            raise ValueError(f"path {key!r} contains an empty segment")
        if segment in (".", ".."):
            raise ValueError(f"path {key!r} contains the segment {segment!r}")
        bad = [c for c in segment if ord(c) < 0x20 or ord(c) == 0x7F]
        if bad:
            raise ValueError(f"path {key!r} contains the control character {bad[0]!r}")
    return path


def list_params(prefix: str, recursive: bool, token: str | None, page_keys: int | None) -> dict[str, str]:
    """The query of one ListObjectsV2 request (``prefix`` already a parsed path, "" for the bucket)."""
    params = {"list-type": "2"}
    if prefix:
        params["prefix"] = prefix + DELIMITER
    if not recursive:
        params["delimiter"] = DELIMITER
    if token is not None:
        params["continuation-token"] = token
    if page_keys is not None:
        params["max-keys"] = str(page_keys)
    return params


def parse_page(body: bytes) -> ListPage:
    """A ``ListBucketResult`` document (any or no XML namespace)."""
    try:
        root = ET.fromstring(body)
    except ET.ParseError as e:
        raise Transient(f"unreadable listing: {e}") from None
    keys: list[str] = []
    prefixes: list[str] = []
    truncated, token = False, None
    for child in root:
        tag = _local(child.tag)
        if tag == "Contents":
            keys.append(_child_text(child, "Key"))
        elif tag == "CommonPrefixes":
            prefixes.append(_child_text(child, "Prefix"))
        elif tag == "IsTruncated":
            truncated = (child.text or "").strip().lower() == "true"
        elif tag == "NextContinuationToken":
            token = child.text or ""
    if truncated and not token:
        raise Transient("a truncated listing without a NextContinuationToken")
    return ListPage(keys, prefixes, token if truncated else None)


def list_keys(get_page: Callable[[dict[str, str]], bytes], key: str, recursive: bool,
              page_keys: int | None = None) -> list[str]:
    """Keys under the prefix ``key`` (``a/b`` lists ``a/b/...``), pages fetched by ``get_page``
    (one signed GET of the bucket with that query); one level deep lists the sub-prefixes
    first, as object_store does."""
    try:
        prefix = object_path(key)
    except ValueError as e:
        raise Permanent(f"cannot list: {e}") from None
    keys: list[str] = []
    prefixes: dict[str, None] = {}
    token = None
    while True:
        page = parse_page(get_page(list_params(prefix, recursive, token, page_keys)))
        try:
            keys += map(object_path, page.keys)
            prefixes.update(dict.fromkeys(map(object_path, page.prefixes)))
        except ValueError as e:
            raise Permanent(f"a listed object has an invalid path: {e}") from None
        if page.next_token is None:
            return [*sorted(prefixes), *keys]
        token = page.next_token


def _local(tag: str) -> str:
    return tag.rpartition("}")[2]


def _child_text(elem: ET.Element, name: str) -> str:
    for c in elem:
        if _local(c.tag) == name:
            return c.text or ""
    raise Transient(f"a listing entry without <{name}>")
