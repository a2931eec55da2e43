"""Bytes in and out of any store, under one fault policy.

Layout (one idea per module):

* ``backend``  — the small interface every client sits behind (one attempt per call,
  failures as a few kinds) and the plain data it returns;
* ``httpget``, ``obstore_backend``, ``s3fs_backend``, ``fsspec_backend``, ``local_backend`` — the clients,
  each only translating its calls and errors;
* ``policy``   — retries with jittered backoff and a deadline, the corruption verdict,
  messages without secrets;
* ``reads``    — range reads: pieces, admission (``gate``), length and checksum checks;
* ``uploads``  — the writer policy: parts in flight, retries, abort on error;
* ``store``    — ``Storage``, the one object the rest of streamckpt uses.

See docs/RELIABILITY.md for the policy and what each fault turns into.
"""

from __future__ import annotations

from .backend import Backend, Fetched, NotFound, ObjectInfo, PartSink, Permanent, RangeNotSatisfiable, Stalled, Transient
from .policy import RetryPolicy
from .reads import Landing, RangeRead
from .store import Storage
from .uploads import Upload

__all__ = [
    "Backend", "Fetched", "Landing", "NotFound", "ObjectInfo", "PartSink", "Permanent", "RangeNotSatisfiable", "RangeRead",
    "RetryPolicy", "Stalled", "Storage", "Transient", "Upload",
]
