"""The mistakes users make reaching a store, caught at the door and explained.

An endpoint without a scheme, nothing listening at it, no credentials, a 403: each
otherwise surfaces as a client's own words (a Rust panic, "Connection refused" after
seconds of retries, "Unable to locate credentials"). Here they are recognized in one
place, whatever the client (http.client, obstore, s3fs, gcsfs), and given a hint that
names what to check.
"""

from __future__ import annotations

import ipaddress
import logging
import re
from typing import Any
from urllib.parse import urlsplit

from ..errors import StorageError

log = logging.getLogger(__name__)

REFUSED_ATTEMPTS = 2  # a refused connection is an absent server, not a slow one: one retry at most
_REFUSED = ("connection refused", "could not connect to the endpoint", "errno 111", "actively refused",
            "connect call failed", "cannot connect to host",
            "connectionrefused")
_NO_CREDENTIALS = ("unable to locate credentials", "nocredentialserror", "no credentials")
_DENIED = ("accessdenied", "access denied", "403 forbidden", "status: 403", "permissiondenied",
           "invalidaccesskeyid", "signaturedoesnotmatch", "forbidden")


def normalize(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with a scheme-less ``endpoint_url`` (top level or in ``client_kwargs``)
    made ``http://`` when it is a loopback address; any other scheme-less one is refused."""
    out = dict(options)
    if "endpoint_url" in out:
        out["endpoint_url"] = _with_scheme(out["endpoint_url"])
    ck = out.get("client_kwargs")
    if isinstance(ck, dict) and "endpoint_url" in ck:
        out["client_kwargs"] = {**ck, "endpoint_url": _with_scheme(ck["endpoint_url"])}
    return out


def _with_scheme(endpoint: Any) -> Any:
    if not isinstance(endpoint, str) or not endpoint or "://" in endpoint:
        return endpoint
    host = urlsplit(f"//{endpoint}").hostname or ""
    if _loopback(host):
        log.info("endpoint_url %r has no scheme: using http://%s (a loopback address)", endpoint, endpoint)
        return f"http://{endpoint}"
    raise StorageError(
        f"endpoint_url {endpoint!r} has no scheme: write 'https://{endpoint}' (or 'http://{endpoint}' "
        f"for a server without TLS)"
    )


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def endpoint_of(options: dict[str, Any]) -> str | None:
    """The endpoint the options name, if any (for messages)."""
    ck = options.get("client_kwargs")
    found = options.get("endpoint_url") or (ck.get("endpoint_url") if isinstance(ck, dict) else None)
    return str(found) if found else None


def public(url: str) -> str:
    """An endpoint as messages may show it: no user:password@ part, no query string (a SAS)."""
    return re.sub(r"^([a-zA-Z][a-zA-Z0-9+.-]*://)?[^/@]*@", r"\1", str(url).split("?", 1)[0])


def _text(exc: BaseException) -> str:
    parts, e, seen = [], exc, 0
    while e is not None and seen < 8:  # the exception and what it wraps
        parts.append(f"{type(e).__name__}: {e}")
        e, seen = e.__cause__ or e.__context__, seen + 1
    return " ".join(parts).lower()


def refused(exc: BaseException) -> bool:
    """A connection the endpoint refused (nothing listening), as any client words it."""
    return isinstance(exc, ConnectionRefusedError) or any(s in _text(exc) for s in _REFUSED)


def hint(exc: BaseException, endpoint: str | None, store: str = "s3") -> str:
    """What to check, for the failures a user causes; "" for the others. ``store`` picks
    the words: ``"azure"`` names Azure's options (its backend explains denials itself)."""
    text = _text(exc)
    if refused(exc):
        where = f"at {endpoint}" if endpoint else "at the store's endpoint"
        option = ("the endpoint (endpoint_url, account_host or the BlobEndpoint of connection_string)"
                  if store == "azure" else "endpoint_url")
        return f"nothing accepted a connection {where}: check {option} (is a server listening there, on that port?)"
    if store == "azure":
        return ""
    if any(s in text for s in _NO_CREDENTIALS):
        return ("no credentials found: pass storage_options={'key': ..., 'secret': ...}, set "
                "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or anon=True for a public bucket")
    if any(s in text for s in _DENIED):
        return "access denied: check the keys (key/secret, AWS_* variables) and the bucket's permissions for this URI"
    return ""


def is_panic(exc: BaseException) -> bool:
    """A native client's panic (pyo3's ``PanicException`` derives from BaseException)."""
    return type(exc).__name__ == "PanicException"
