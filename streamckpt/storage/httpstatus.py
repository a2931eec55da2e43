"""What an S3 response or a client-side exception of the ``http.client`` path (``httpget``)
means for the retry policy: the failure kinds of ``backend``, from the status and S3's
error code, as obstore's and botocore's clients classify them."""

from __future__ import annotations

import email.utils
import http.client
import re
import socket
import ssl

from .backend import NotFound, Permanent, RangeNotSatisfiable, Stalled, Transient

_PERMANENT_CODES = frozenset({"RequestTimeTooSkewed", "ExpiredToken", "InvalidToken", "TokenRefreshRequired"})
_TRANSIENT_CODES = frozenset({"RequestTimeout", "SlowDown", "InternalError", "ServiceUnavailable", "Throttling"})


def http_date(value: str | None) -> float | None:
    """POSIX seconds from a ``Last-Modified`` header (None when absent or unreadable)."""
    if not value:
        return None
    try:
        return email.utils.parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError):
        return None


class StatusFailure(Transient):
    """An error status worth another attempt, or a refused connection: nothing was written."""


def classified(e: BaseException, timeout: float) -> BaseException:
    """A client-side exception as the policy's kind (others, e.g. cancellation, pass as they are)."""
    if isinstance(e, ConnectionRefusedError):
        return StatusFailure(f"{type(e).__name__}: {e}")
    if isinstance(e, (TimeoutError, socket.timeout)):
        return Stalled(f"no response within {timeout:g} s")
    if isinstance(e, ssl.SSLCertVerificationError):
        return Permanent(f"TLS: {e}")
    if isinstance(e, (OSError, http.client.HTTPException)):
        return Transient(f"{type(e).__name__}: {e}")
    return e


def content_range(value: str | None) -> tuple[int, int | None]:
    """(first byte, total size or None) from ``Content-Range: bytes a-b/total``."""
    m = re.fullmatch(r"\s*bytes\s+(\d+)-(\d+)/(\d+|\*)\s*", value or "")
    if m is None:
        raise Transient(f"206 with Content-Range {value!r}")
    return int(m.group(1)), None if m.group(3) == "*" else int(m.group(3))


_REASONS = {401: "Unauthorized", 403: "Forbidden"}  # worded as the hints look for them


def failure(status: int, body: bytes, bucket: str) -> Exception:
    """An error response as the policy's kind, from its status and S3 error code."""
    text = body.decode("utf-8", "replace")
    code, message = _tag(text, "Code"), _tag(text, "Message")
    what = f"HTTP {status}" + (f" {code}" if code else "") + (f": {message}" if message else "")
    if not code and status in _REASONS:  # a HEAD's reply has no body: its status is all there is to go by
        what = f"HTTP {status} {_REASONS[status]}"
    if code == "NoSuchBucket":
        return NotFound(f"bucket {bucket!r} does not exist", bucket=bucket)
    if status == 404:
        return NotFound(what)
    if status == 416 or code == "InvalidRange":
        return RangeNotSatisfiable(what)
    if code in _TRANSIENT_CODES or status in (408, 429) or status >= 500:
        return StatusFailure(what)
    if code in _PERMANENT_CODES or 300 <= status < 500:
        return Permanent(what)  # credentials, permissions, a wrong region (301), bad requests
    return Transient(what)


def _tag(text: str, name: str) -> str | None:
    m = re.search(f"<{name}>(.*?)</{name}>", text, re.S)
    return m.group(1).strip() if m else None
