"""The mistakes users make reaching a store, caught at the door and explained.

An endpoint without a scheme, nothing listening at it, no credentials, a 403: each
otherwise surfaces as a client's own words (a Rust panic, "Connection refused" after
seconds of retries, "Unable to locate credentials"). Here they are recognized in one
place, whatever the client (http.client, obstore, s3fs, gcsfs), and given a hint that
names what to check.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import re
import socket
from typing import Any, Awaitable, TypeVar
from urllib.parse import urlsplit

from ..errors import CLI, PYTHON, Hint, Phrase, StorageError, options
from .backend import Transient

log = logging.getLogger(__name__)
T = TypeVar("T")

REFUSED_ATTEMPTS = 2  # a refused connection is an absent server, not a slow one: one retry at most
_REFUSED = ("connection refused", "could not connect to the endpoint", "errno 111", "actively refused",
            "connect call failed", "cannot connect to host",
            "connectionrefused")
_UNRESOLVED = ("name or service not known", "nodename nor servname", "no address associated with hostname",
               "getaddrinfo failed", "failed to lookup address", "dns error")  # a name DNS does not know
_NOT_TLS = ("wrong_version_number", "wrong version number", "record layer failure", "unknown protocol",
            "http request to an https server", "packet length too long")  # https:// to a plain-HTTP server
_NO_CREDENTIALS = ("unable to locate credentials", "nocredentialserror", "no credentials")
AZURE_DENIED_HINT = ("access denied: check the credentials (account_name with account_key or sas_token, the "
                     "AccountKey= or SharedAccessSignature= of connection_string, or the AZURE_STORAGE_* variables) "
                     "and the container's permissions for this URI")
_AZURE_DENIED = ("failed to authenticate", "authorizationfailure", "authenticationfailed",
                 "authorizationpermissionmismatch", "403", "forbidden")
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


def unresolved(exc: BaseException) -> bool:
    """A host name that DNS does not know (a typo'd endpoint, or no network): retrying won't help."""
    return any(s in _text(exc) for s in _UNRESOLVED)


def not_tls(exc: BaseException) -> bool:
    """A TLS handshake the server answered in plain HTTP: ``https://`` for a server without TLS."""
    return any(s in _text(exc) for s in _NOT_TLS)


def refused(exc: BaseException) -> bool:
    """A connection the endpoint refused (nothing listening), as any client words it."""
    return isinstance(exc, ConnectionRefusedError) or any(s in _text(exc) for s in _REFUSED)


# What to pass, in the caller's words: ``storage_options=...`` in Python, flags on the command line.
_ENDPOINT_OPTION: Phrase = {PYTHON: "endpoint_url", CLI: "--endpoint-url"}
_KEYS: Phrase = {PYTHON: "key/secret", CLI: "--storage-option key=... --storage-option secret=..."}
_ANON: Phrase = {PYTHON: "anon=True", CLI: "--storage-option anon=true"}
NO_CREDENTIALS_HINT = Hint("no credentials found: pass ", options(key=..., secret=...), ", set AWS_ACCESS_KEY_ID and "
                           "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or ", _ANON, " for a public bucket")
DENIED_HINT = Hint("access denied: check the keys (", _KEYS, ", AWS_* variables) and the bucket's permissions "
                   "for this URI")


def hint(exc: BaseException, endpoint: str | None, store: str = "s3", uri: str = "") -> Hint | None:
    """What to check, for the failures a user causes; None for the others. ``store`` picks
    the words: ``"azure"`` names Azure's options (its backend explains denials itself);
    ``uri`` (the checkpoint's) tells an ``s3://`` one, whose default endpoint is AWS's."""
    text = _text(exc)
    aws = uri.startswith(("s3://", "s3a://"))
    endpoint = endpoint or (os.environ.get("AWS_ENDPOINT_URL") if aws else None)
    if not_tls(exc):
        where = f"the server at {endpoint}" if endpoint else "the server"
        plain = f"'{endpoint.replace('https://', 'http://', 1)}'" if endpoint else "http://"
        return Hint(f"{where} does not speak TLS: for a server without TLS write {plain} in ", _ENDPOINT_OPTION)
    if unresolved(exc):
        if endpoint:
            return Hint(f"could not resolve the host name of {endpoint}: check ", _ENDPOINT_OPTION,
                        " (its host name) and this machine's DNS")
        if aws:
            return Hint("could not resolve the store's host name: with no ", _ENDPOINT_OPTION, " (nor "
                        "AWS_ENDPOINT_URL) this is AWS S3 (s3.amazonaws.com); check the network, or set ",
                        _ENDPOINT_OPTION, " for another S3-compatible server")
        return Hint("could not resolve the store's host name: check the network and this machine's DNS")
    if refused(exc):
        where = f"at {endpoint}" if endpoint else "at the store's endpoint"
        if store == "azure":
            return Hint(f"nothing accepted a connection {where}: check the endpoint (endpoint_url, account_host or "
                        f"the BlobEndpoint of connection_string) (is a server listening there, on that port?)")
        return Hint(f"nothing accepted a connection {where}: check ", _ENDPOINT_OPTION,
                    " (is a server listening there, on that port?)")
    if store == "azure":
        denied = any(s in text for s in _AZURE_DENIED) and AZURE_DENIED_HINT.lower() not in text
        return Hint(AZURE_DENIED_HINT) if denied else None
    if any(s in text for s in _NO_CREDENTIALS):
        return NO_CREDENTIALS_HINT
    if any(s in text for s in _DENIED):
        return DENIED_HINT
    return None


def is_panic(exc: BaseException) -> bool:
    """A native client's panic (pyo3's ``PanicException`` derives from BaseException)."""
    return type(exc).__name__ == "PanicException"


# ------------------------------------------------------------------ the refused-connection probe


class EndpointProbe:
    """A plain TCP connect to the endpoint beside a client's calls until the endpoint has
    answered once, so that a refused connection fails in milliseconds.

    Why: gcsfs retries a refused connect inside each call for 30 s and more, and cannot be
    told that "refused" is not a slow store. The probe runs concurrently (it costs the first
    call nothing) and only for an explicit endpoint; once it connects, calls run bare.
    """

    def __init__(self, endpoint: str | None, timeout: float) -> None:
        self.endpoint = endpoint
        self._timeout = timeout
        self._address = _address(endpoint)
        self._answered = self._address is None
        self._pending: asyncio.Future[bool | None] | None = None

    async def guard(self, call: Awaitable[T]) -> T:
        """Await ``call``; raise ``Transient`` (a refused connection) instead if the probe is refused first."""
        if self._answered:
            return await call
        task = asyncio.ensure_future(call)
        probe = self._probe()
        try:
            done, _ = await asyncio.wait({task, probe}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            await _cancel(task)
            raise
        if task not in done and probe.result() is False:
            await _cancel(task)
            raise Transient("ConnectionRefusedError: connection refused")
        return await task

    def _probe(self) -> "asyncio.Future[bool | None]":
        if self._pending is None:
            self._pending = asyncio.ensure_future(self._connect())
        return self._pending

    async def _connect(self) -> bool | None:
        """True: connected; False: every address refused; None: could not tell (the client will)."""
        if self._address is None:
            return None
        host, port = self._address
        try:
            found = await asyncio.wait_for(_connect_any(host, port), self._timeout)
        except Exception:  # noqa: BLE001 - the probe only helps: without an answer the client tells
            found = None
        if found:
            self._answered = True
        else:
            self._pending = None  # ask again on the next call: the server may have come up
        return found


def _address(endpoint: str | None) -> tuple[str, int] | None:
    if not endpoint:
        return None
    try:
        url = urlsplit(endpoint)
        port = url.port or (443 if url.scheme == "https" else 80)
    except ValueError:
        return None
    return (url.hostname, port) if url.hostname else None


async def _connect_any(host: str, port: int) -> bool | None:
    """Connect to each address of ``host``; False only when all of them refuse."""
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return None
    refusals = 0
    for family, kind, proto, _, addr in infos:
        sock = socket.socket(family, kind, proto)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, addr)
            return True
        except ConnectionRefusedError:
            refusals += 1
        except OSError:
            pass
        finally:
            sock.close()
    return False if infos and refusals == len(infos) else None


async def _cancel(task: "asyncio.Future[Any]") -> None:
    """Cancel a client call and wait for it to end, its outcome retrieved."""
    task.cancel()
    await asyncio.wait([task])
    if not task.cancelled():
        task.exception()
