"""What one key prefix of an object store serves per second, and the prefix a job's requests share.

S3 serves at least 3,500 PUT/COPY/POST/DELETE and 5,500 GET/HEAD requests per second per
partitioned key prefix and answers 503 SlowDown above that while it repartitions (AWS S3
User Guide, "Best practices design patterns: optimizing Amazon S3 performance"); other
stores have like limits. A fresh checkpoint's objects share one prefix, so until the store
has split it, a whole job's requests count against one limit. Loads (``loading.requestrate``)
and saves (``saving.putrate``) count their job's requests and warn above these figures.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Iterable

log = logging.getLogger(__name__)

DEFAULT_GET_LIMIT = 5500.0  # GET/HEAD per second per partitioned prefix
DEFAULT_PUT_LIMIT = 3500.0  # PUT/COPY/POST/DELETE per second per partitioned prefix
GET_LIMIT_ENV = "STREAMCKPT_GET_RATE_LIMIT"  # requests per second; 0 turns the load's warning off
PUT_LIMIT_ENV = "STREAMCKPT_PUT_RATE_LIMIT"  # requests per second; 0 turns the save's warning off


def rate_limit(env: str, default: float) -> float:
    """The per-prefix rate to warn above: ``env`` (requests per second, 0 for never) or
    ``default``. A value that is not a number is reported and the default used (raising on
    one rank only would leave the others waiting in the next collective)."""
    raw = os.environ.get(env, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value < 0 or value != value:
        log.warning("%s=%r is not a number of requests per second >= 0; using %g", env, raw, default)
        return default
    return value


def key_prefix(paths: Iterable[str]) -> str:
    """The longest prefix ending in ``/`` that every path shares (``bucket/ckpt/data/``), or
    the path's folder for one path; "" for none."""
    paths = list(paths)
    if not paths:
        return ""
    common = os.path.commonprefix(paths)
    return common[: common.rfind("/") + 1]


def prefix_uri(uri: str, paths: Iterable[str]) -> str:
    """``key_prefix(paths)`` as a URI in ``uri``'s scheme (``s3://bucket/ckpt/data/``)."""
    scheme = uri.split("://", 1)[0] if "://" in uri else "file"
    return f"{scheme}://{key_prefix(paths)}"


@dataclass(frozen=True, slots=True)
class JobRequests:
    """The whole job's requests during one load's data phase or one save's upload."""

    requests: int  # requests of every rank together
    throttled: int  # throttled responses (503 SlowDown, ...) every rank's client saw
    seconds: float  # the longest rank's phase
    prefix: str  # the key prefix every request went to (a URI: ``s3://bucket/ckpt/data/``)

    @property
    def per_second(self) -> float:
        return self.requests / self.seconds if self.seconds > 0 else 0.0
