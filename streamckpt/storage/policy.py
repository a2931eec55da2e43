"""The fault policy, written once for every backend: how hard to try, when to give up,
and when bytes that fail their checksum mean the stored object is corrupt.

``Attempts`` is the one retry loop's bookkeeping (full-jitter backoff, attempt cap,
deadline); ``Mismatches`` is the corruption verdict: rot at rest returns the same
wrong bytes on every read, a flaky path returns different ones, so an object is
declared corrupt only when the same wrong digest comes back again.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections import Counter
import re
from dataclasses import dataclass

from ..errors import CorruptCheckpointError, Hint, StorageError
from . import endpoint
from .azure_backend import trimmed
from .backend import BackendError, NotFound, RangeNotSatisfiable, Stalled, Transient


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How hard to try before a read or write is declared failed.

    Attempts back off exponentially with full jitter; every request has a stall
    timeout and the whole operation a deadline, so an outage fails in bounded time.
    """

    max_attempts: int = 8  # requests per read/call made by this layer
    client_attempts: int = 3  # the S3 client's own attempts per request (status-level errors)
    base_delay: float = 0.1  # seconds; backoff before attempt k is uniform(0, base * 2**k)
    max_delay: float = 4.0
    request_timeout: float = 15.0  # to the response head, and between body chunks
    total_timeout: float = 45.0  # no new attempt starts after this many seconds
    checksum_retries: int = 2  # the same wrong content this many more times: the stored object is corrupt

    def __post_init__(self) -> None:
        if self.max_attempts < 1 or self.client_attempts < 1 or self.checksum_retries < 0:
            raise ValueError(f"RetryPolicy needs at least one attempt: {self}")
        if min(self.base_delay, self.max_delay) < 0 or min(self.request_timeout, self.total_timeout) <= 0:
            raise ValueError(f"RetryPolicy delays must be >= 0 and timeouts > 0: {self}")

    @staticmethod
    def from_env() -> "RetryPolicy":
        """The defaults, with ``STREAMCKPT_MAX_ATTEMPTS``, ``STREAMCKPT_REQUEST_TIMEOUT`` and
        ``STREAMCKPT_TOTAL_TIMEOUT`` (seconds) overriding theirs: the knob for calls that take
        no policy (``sc.load``, ``sc.save``, ...)."""
        fields: dict[str, float | int] = {}
        for name, var, kind in (("max_attempts", "STREAMCKPT_MAX_ATTEMPTS", int),
                                ("request_timeout", "STREAMCKPT_REQUEST_TIMEOUT", float),
                                ("total_timeout", "STREAMCKPT_TOTAL_TIMEOUT", float)):
            raw = os.environ.get(var, "").strip()
            if raw:
                try:
                    fields[name] = kind(raw)
                except ValueError:
                    raise ValueError(f"{var}={raw!r} is not a number") from None
        return RetryPolicy(**fields)  # type: ignore[arg-type]

    def delay(self, attempt: int, rng: random.Random) -> float:
        """Full-jitter backoff before retry number ``attempt`` (1-based)."""
        return rng.uniform(0, min(self.max_delay, self.base_delay * (2 ** attempt)))


def retryable(exc: BaseException) -> bool:
    """Whether a failed attempt is worth another (the backends have classified it)."""
    return isinstance(exc, (Transient, RangeNotSatisfiable, asyncio.TimeoutError, TimeoutError))


class Attempts:
    """Attempts at one operation: ``failed`` either sleeps before the next or raises
    ``StorageError`` naming ``what`` (not retryable, attempts used up, or past the deadline)."""

    def __init__(self, policy: RetryPolicy, rng: random.Random, what: str, describe: "Describer",
                 limit: int | None = None) -> None:
        self.policy = policy
        self.limit = policy.max_attempts if limit is None else limit
        self.what = what
        self._rng = rng
        self._describe = describe
        self.deadline = time.monotonic() + policy.total_timeout
        self.count = 0

    def check(self, exc: BaseException) -> None:
        """Count a failed attempt; raise ``StorageError`` when no further one may start."""
        self.count += 1
        absent = endpoint.refused(exc) or endpoint.unresolved(exc) or endpoint.not_tls(exc)  # no server to wait for
        limit = min(self.limit, endpoint.REFUSED_ATTEMPTS) if absent else self.limit
        if not retryable(exc) or self.count >= limit or time.monotonic() >= self.deadline:
            raise self._describe.failure(f"{self.what} failed after {self.count} attempt(s)", exc) from None

    async def failed(self, exc: BaseException) -> None:
        """``check``, then wait the jittered backoff (never past the deadline)."""
        self.check(exc)
        await asyncio.sleep(self.backoff())

    def backoff(self) -> float:
        return min(self.policy.delay(self.count, self._rng), max(0.0, self.deadline - time.monotonic()))


class ChecksumMismatch(Transient):
    """Bytes arrived but differ from their checksum; retried like a transit error."""


def mismatch_attempts(policy: RetryPolicy, rng: random.Random, what: str, describe: "Describer") -> Attempts:
    """Re-fetches after checksum mismatches: their own count, enough for the at-rest verdict
    (``checksum_retries + 1`` equal reads) to be reached before it runs out."""
    return Attempts(policy, rng, what, describe, limit=max(policy.max_attempts, policy.checksum_retries + 2))


class Mismatches:
    """Wrong digests seen per checked span; the verdict between transit and at-rest corruption."""

    def __init__(self, policy: RetryPolicy) -> None:
        self._repeats = policy.checksum_retries + 1
        self._seen: dict[tuple[int, int], Counter[str]] = {}

    def record(self, where: str, span: tuple[int, int], digest: str, what: str) -> None:
        """Note that ``span`` (absolute ``[start, stop)``) came back with ``digest``; raise
        ``CorruptCheckpointError`` once the same wrong content has come back ``checksum_retries + 1`` times."""
        seen = self._seen.setdefault(span, Counter())
        seen[digest] += 1
        reads = sum(seen.values())
        if seen[digest] >= self._repeats:
            raise CorruptCheckpointError(
                f"checksum mismatch in {where} bytes [{span[0]}, {span[1]}){what}: the same wrong content "
                f"(digest {digest}) came back on {seen[digest]} of {reads} reads: the stored object is corrupt"
            )

    def summary(self) -> str:
        """For the error when attempts run out with mismatches that never repeated."""
        if not self._seen:
            return ""
        reads = sum(sum(c.values()) for c in self._seen.values())
        distinct = sum(len(c) for c in self._seen.values())
        return (f" ({reads} checksum mismatches with {distinct} different wrong contents: "
                "bytes corrupted in transit, not at rest)")


_SIGNATURE = re.compile(r"((?:[?&;]|\b)(?:sig|AccountKey|SharedAccessSignature)=)[^&;\s\"'<>]+", re.I)


class Describer:
    """User-facing names and messages for one storage prefix: no credentials, one vocabulary."""

    def __init__(self, public_uri: str, secrets: tuple[str, ...], request_timeout: float,
                 endpoint: str | None = None, store: str = "s3") -> None:
        self.public_uri = public_uri
        self._secrets = secrets
        self._timeout = request_timeout
        self.endpoint = endpoint
        self.store = store  # whose words the hints use: "s3" (also gs://, ...) or "azure"

    def name(self, name: str) -> str:
        if name.startswith("../"):  # a file of a sibling checkpoint (an incremental checkpoint's reference)
            parent = self.public_uri.rstrip("/").rpartition("/")[0]
            return f"{parent}/{name[3:]}"
        return f"{self.public_uri.rstrip('/')}/{name}"

    def scrub(self, text: str) -> str:
        for s in self._secrets:
            text = text.replace(s, "***")
        # A signed URL's signature and a connection string's key, wherever they come from.
        return _SIGNATURE.sub(r"\1***", text)

    def error(self, exc: BaseException) -> str:
        """The client's words for a failure (no credentials)."""
        if isinstance(exc, (Stalled, asyncio.TimeoutError, TimeoutError)):
            return f"no response for {self._timeout:g} s (stalled)"
        text = str(exc) if isinstance(exc, BackendError) else f"{type(exc).__name__}: {exc}"
        if self.store == "azure":
            text = trimmed(text)  # the Azure SDK's errors (adlfs) carry the service's whole XML body
        return self.scrub(text)

    def failure(self, what: str, exc: BaseException) -> StorageError:
        """The ``StorageError`` for a call that failed: ``what`` failed, the client's words, and
        what to check when the user can fix it (a hint each front end words in its own syntax)."""
        why = endpoint.hint(exc, self.endpoint, self.store, uri=self.public_uri)
        if why is not None:
            why = Hint(*(self.scrub(p) if isinstance(p, str) else p for p in why.parts))
        return StorageError(f"{what}: {self.error(exc)}", hint=why)


def not_found_message(describe: Describer, name: str, exc: NotFound, doing: str = "reading") -> str:
    if exc.bucket is not None:
        fix = "check the URI" if doing == "reading" else f"check the URI, or create the {exc.kind} first"
        return f"{exc.kind} {exc.bucket!r} does not exist ({doing} {describe.name(name)}): {fix}"
    return f"{describe.name(name)} does not exist"


def sibling_path(root: str, name: str, describe: Describer) -> str:
    """The store path of ``../<sibling>/<rest>`` (a file of a sibling checkpoint) seen from the
    checkpoint at ``root``: ``<parent of root>/<sibling>/<rest>``. The manifest was validated
    (one level up, then plain names); a checkpoint with no parent inside its bucket or
    directory (a bucket's root) has no siblings, and such a name is refused."""
    parent, sep, _ = root.rstrip("/").rpartition("/")
    if not sep or not parent or parent.endswith(":/") or parent.endswith(":"):
        raise CorruptCheckpointError(
            f"{describe.name('')}: file {name!r} references a sibling checkpoint, but this checkpoint is at the top "
            f"of its bucket or store and has no siblings; the manifest is damaged or hostile")
    return f"{parent}/{name[3:]}"
