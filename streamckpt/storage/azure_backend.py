"""Azure Blob Storage (``az://``, ``abfs://``, ``abfss://``) through obstore's ``AzureStore``.

Why native: through adlfs every call goes through the Azure SDK's pipeline, whose own
retries (an initial 15 s backoff) hid a refused connection for 45 s and cannot be turned
off from adlfs's options; adlfs also cannot reach an emulator from ``account_name`` /
``account_key`` (it forces ``https://{account}.blob.core.windows.net``). obstore makes one
request per attempt under the policy's budget, like the S3 backend it subclasses.

Selection: ``STREAMCKPT_AZURE_BACKEND`` = ``auto`` (the default), ``obstore`` or ``adlfs``.
``auto`` and ``obstore`` use obstore whenever every storage option maps onto it
(``azure_config``); otherwise adlfs does everything (with a warning when ``obstore`` was
asked for), with the SDK's own retries off (``quiet_sdk_retries``). adlfs-style options
are understood by both: ``connection_string`` (``AccountName``, ``AccountKey``,
``SharedAccessSignature``, ``BlobEndpoint``, ``UseDevelopmentStorage``), ``account_name`` +
``account_key`` or ``sas_token``, ``account_host``, ``anon``, ``client_id`` /
``client_secret`` / ``tenant_id``, the ``AZURE_STORAGE_*`` environment variables, and
``endpoint_url`` (a blob endpoint such as Azurite's ``http://127.0.0.1:10000/devstoreaccount1``).

Azure ETags are not MD5s: a whole-object read asks for the blob through a signed URL
(``obstore.sign`` with an account key, the SAS itself, or none when anonymous) over
``http.client`` so that its ``Content-MD5`` comes back with it, and returns that digest
as the "ETag" the policy checks (``reads._md5_mismatch``). A blob without one (a block
list upload) or a credential that cannot sign (a bearer token) reads through obstore,
unchecked but for its length.
"""

from __future__ import annotations

import base64
import http.client
import logging
import os
import re
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import quote, urlsplit

from . import endpoint
from .backend import BackendError, NotFound, Permanent, RangeNotSatisfiable, Stalled, TooLarge, Transient
from .httpstatus import classified
from .obstore_backend import NotConfigurable, ObstoreBackend

log = logging.getLogger(__name__)

BACKEND_ENV = "STREAMCKPT_AZURE_BACKEND"
BACKENDS = ("auto", "obstore", "adlfs")
PROTOCOLS = ("az", "abfs", "abfss")
SECRET_OPTIONS = ("connection_string", "account_key", "sas_token", "credential", "client_secret")
EMULATOR_ACCOUNT = "devstoreaccount1"
# Azurite's documented development key (public, the same on every machine).
EMULATOR_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
SIGNED_URL_LIFETIME = timedelta(minutes=15)

# adlfs options that change nothing about the requests (caches, block sizes, its own knobs).
_IGNORED = frozenset({
    "skip_instance_cache", "use_listings_cache", "listings_expiry_time", "max_paths", "blocksize",
    "default_fill_cache", "default_cache_type", "asynchronous", "loop", "max_concurrency", "assume_container_exists",
    "timeout", "connection_timeout", "read_timeout", "socket_timeout",
})
_ENV = {  # adlfs's environment variables, read when the option is not given
    "connection_string": "AZURE_STORAGE_CONNECTION_STRING", "account_name": "AZURE_STORAGE_ACCOUNT_NAME",
    "account_key": "AZURE_STORAGE_ACCOUNT_KEY", "sas_token": "AZURE_STORAGE_SAS_TOKEN",
    "client_id": "AZURE_STORAGE_CLIENT_ID", "client_secret": "AZURE_STORAGE_CLIENT_SECRET",
    "tenant_id": "AZURE_STORAGE_TENANT_ID",
}
_TRANSIENT_CODES = frozenset({"ServerBusy", "OperationTimedOut", "InternalError", "ServiceUnavailable"})
DENIED_HINT = endpoint.AZURE_DENIED_HINT


def requested_backend() -> str:
    value = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if value not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={value!r}: choose one of {', '.join(BACKENDS)}")
    return value


def parse_connection_string(text: str) -> dict[str, str]:
    """``Key=value;...`` pairs (a value may itself hold ``=``, as keys and SAS tokens do)."""
    out: dict[str, str] = {}
    for part in str(text).split(";"):
        name, sep, value = part.strip().partition("=")
        if sep and name:
            out[name.strip()] = value.strip()
    return out


def _option(options: dict[str, Any], name: str) -> Any:
    value = options.get(name)
    return value if value not in (None, "") else os.environ.get(_ENV.get(name, ""), None) or None


def split_root(root: str) -> tuple[str, str | None]:
    """``container/prefix`` and the account named by an ``abfs://container@account.host/...`` URI, if any."""
    head, sep, rest = root.partition("/")
    if "@" in head:
        container, _, host = head.partition("@")
        return f"{container}{sep}{rest}".rstrip("/"), host.split(".", 1)[0] or None
    return root, None


def azure_config(options: dict[str, Any], account_from_uri: str | None = None) -> dict[str, Any]:
    """obstore ``AzureConfig`` equivalent to adlfs ``options``; ``NotConfigurable`` if some option has none."""
    for name in options:
        if name not in _IGNORED and name not in (*_ENV, "account_host", "endpoint_url", "anon", "credential",
                                                 "location_mode"):
            raise NotConfigurable(f"option {name!r}")
    if options.get("location_mode") not in (None, "primary"):
        raise NotConfigurable("location_mode other than 'primary'")
    config: dict[str, Any] = {}
    parts = parse_connection_string(_option(options, "connection_string") or "")
    if parts.get("UseDevelopmentStorage", "").lower() == "true":
        parts = {"AccountName": EMULATOR_ACCOUNT, "AccountKey": EMULATOR_KEY,
                 "BlobEndpoint": f"http://127.0.0.1:10000/{EMULATOR_ACCOUNT}", **parts}
    account = parts.get("AccountName") or _option(options, "account_name") or account_from_uri
    if not account:
        raise NotConfigurable("no account name (account_name, connection_string or AZURE_STORAGE_ACCOUNT_NAME)")
    config["account_name"] = str(account)
    key = parts.get("AccountKey") or _option(options, "account_key")
    sas = parts.get("SharedAccessSignature") or _option(options, "sas_token")
    credential = options.get("credential")
    if credential is not None:
        if not isinstance(credential, str):
            raise NotConfigurable("a credential object")
        if "sig=" in credential:
            sas = sas or credential
        else:
            key = key or credential
    if key:
        config["account_key"] = str(key)
    elif sas:
        config["sas_key"] = str(sas).lstrip("?")
    elif _option(options, "client_secret"):
        for name in ("client_id", "client_secret", "tenant_id"):
            if _option(options, name):
                config[name] = str(_option(options, name))
    elif options.get("anon") or os.environ.get("AZURE_STORAGE_ANON", "false").lower() not in ("false", "0", "f", ""):
        config["skip_signature"] = True
    else:
        # adlfs would try DefaultAzureCredential (CLI, managed identity, ...), which object_store does not mirror.
        raise NotConfigurable("no explicit credentials (account_key, sas_token, connection_string or anon)")
    config["endpoint"] = blob_endpoint(options, parts, config["account_name"])
    return config


def blob_endpoint(options: dict[str, Any], parts: dict[str, str], account: str) -> str:
    """The account's blob endpoint, as adlfs and the SDK would derive it (``endpoint_url`` first)."""
    explicit = options.get("endpoint_url") or parts.get("BlobEndpoint")
    if explicit:
        return str(explicit).rstrip("/")
    host = options.get("account_host")
    if host:
        return str(host).rstrip("/") if "://" in str(host) else f"https://{str(host).rstrip('/')}"
    scheme = parts.get("DefaultEndpointsProtocol", "https")
    suffix = parts.get("EndpointSuffix", "core.windows.net")
    return f"{scheme}://{account}.blob.{suffix}"


def endpoint_of(options: dict[str, Any], account_from_uri: str | None = None) -> str | None:
    """The public blob endpoint the options reach (for messages and the refused-connection probe)."""
    parts = parse_connection_string(_option(options, "connection_string") or "")
    account = parts.get("AccountName") or _option(options, "account_name") or account_from_uri
    if not account and not options.get("endpoint_url") and not parts.get("BlobEndpoint"):
        return None
    return endpoint.public(blob_endpoint(options, parts, str(account)))


def adlfs_options(options: dict[str, Any]) -> dict[str, Any]:
    """The options for adlfs: an ``endpoint_url`` (which adlfs does not know; or an ``account_host``
    with a scheme, which it would break) becomes the
    ``BlobEndpoint`` of a connection string with the account's credentials, so both
    backends reach the same server."""
    out = {k: v for k, v in options.items() if k != "endpoint_url"}
    ep = options.get("endpoint_url")
    host = str(options.get("account_host") or "")
    if not ep and "://" in host:  # adlfs would put https:// in front of it
        ep = host
        out.pop("account_host")
    if not ep or "connection_string" in options:
        return out
    parts = [f"AccountName={out.pop('account_name', None) or os.environ.get(_ENV['account_name'], '')}",
             f"BlobEndpoint={str(ep).rstrip('/')}"]
    key, sas = out.pop("account_key", None), out.pop("sas_token", None)
    if key:
        parts.append(f"AccountKey={key}")
    elif sas:
        parts.append(f"SharedAccessSignature={str(sas).lstrip('?')}")
    out["connection_string"] = ";".join(parts)
    return out


def secrets_of(options: dict[str, Any]) -> list[str]:
    """The secret parts of Azure options and of the environment they fall back on (for scrubbing)."""
    found: list[str] = []
    for name in SECRET_OPTIONS:
        value = options.get(name) or os.environ.get(_ENV.get(name, ""), "")
        if isinstance(value, str) and value:
            found.append(value)
    cs = options.get("connection_string") or os.environ.get(_ENV["connection_string"], "")
    if isinstance(cs, str):
        parts = parse_connection_string(cs)
        found += [parts[k] for k in ("AccountKey", "SharedAccessSignature") if parts.get(k)]
    sas = [s.lstrip("?") for s in found if "sig=" in s]
    found += [v for s in sas for k, v in (p.partition("=")[::2] for p in s.split("&")) if k == "sig" and v]
    return [s for s in found if len(s) >= 4]


def quiet_sdk_retries(fs: Any) -> None:
    """Switch off the Azure SDK's own retries in an adlfs filesystem: the policy is the only one.

    adlfs offers no option for it; the pipeline's retry policy object is shared by every
    container and blob client made from the service client, so setting its counts once holds."""
    client = getattr(fs, "service_client", None)
    policy = getattr(getattr(client, "_config", None), "retry_policy", None)
    if policy is None or not hasattr(policy, "total_retries"):
        log.debug("adlfs: no Azure SDK retry policy found to switch off")
        return
    for name in ("total_retries", "connect_retries", "read_retries", "status_retries"):
        if hasattr(policy, name):
            setattr(policy, name, 0)


# ------------------------------------------------------------------ errors


def _tag(text: str, name: str) -> str | None:
    m = re.search(f"<{name}>(.*?)</{name}>", text, re.S)
    return m.group(1).strip().splitlines()[0].strip() if m and m.group(1).strip() else None


def trimmed(text: str) -> str:
    """An error text without the service's XML body (its Code and first Message line kept)
    and without obstore's debug dump."""
    head = text.split("\n\nDebug source:", 1)[0]
    code, message = _tag(head, "Code"), _tag(head, "Message")
    head = re.split(r"\s*<\?xml|\s*<Error>", head, maxsplit=1)[0].rstrip(": \n")
    head = head.splitlines()[0] if head else ""
    extra = " ".join(x for x in (code, f"({message})" if message else None) if x)
    return f"{head}: {extra}" if extra else head


def translate(e: BaseException, container: str) -> BackendError:
    """obstore's exceptions on Azure as the policy's kinds, messages trimmed."""
    from obstore import exceptions as ox

    full = str(e)
    text = trimmed(full)
    low = full.lower()
    if "containernotfound" in low:
        return NotFound(f"container {container!r} does not exist", bucket=container, kind="container")
    if isinstance(e, (ox.NotFoundError, FileNotFoundError)):
        return NotFound(text)
    if isinstance(e, (ox.PermissionDeniedError, ox.UnauthenticatedError, PermissionError)) or (
            "403 forbidden" in low or "authorizationfailure" in low or "authenticationfailed" in low):
        return Permanent(f"{text}: {DENIED_HINT}")
    if isinstance(e, (ox.InvalidPathError, ox.UnknownConfigurationKeyError, ox.NotSupportedError, ValueError)):
        return Permanent(text)
    if "416" in full or "invalidrange" in low:
        return RangeNotSatisfiable(text)
    if "timed out" in low:
        return Stalled(f"{type(e).__name__}: {text}")
    if endpoint.refused(e):
        return Transient(f"{type(e).__name__}: {text} (connection refused)")
    if "400 bad request" in low:
        return Permanent(text)
    return Transient(f"{type(e).__name__}: {text}")


def failure(status: int, body: bytes, headers: http.client.HTTPMessage, container: str) -> BackendError:
    """An error response of the ``http.client`` whole-object GET as the policy's kind."""
    text = body.decode("utf-8", "replace")
    code = headers.get("x-ms-error-code") or _tag(text, "Code")
    message = _tag(text, "Message")
    what = f"HTTP {status}" + (f" {code}" if code else "") + (f" ({message})" if message else "")
    if code == "ContainerNotFound":
        return NotFound(f"container {container!r} does not exist", bucket=container, kind="container")
    if status == 404:
        return NotFound(what)
    if status in (401, 403):
        return Permanent(f"{what}: {DENIED_HINT}")
    if code in _TRANSIENT_CODES or status in (408, 429) or status >= 500:
        return Transient(what)
    return Permanent(what)


# ------------------------------------------------------------------ the backend


@dataclass(frozen=True, slots=True)
class Probe:
    """Where a TCP probe goes before the first request (None: nothing to probe)."""

    host: str
    port: int

    @staticmethod
    def of(url: str) -> "Probe | None":
        parts = urlsplit(url)
        if not parts.hostname:
            return None
        return Probe(parts.hostname, parts.port or (443 if parts.scheme == "https" else 80))


class AzureBackend(ObstoreBackend):
    """One ``AzureStore`` per container; single-attempt calls in worker threads (see ``ObstoreBackend``).

    Until the endpoint has accepted one connection, each call first makes a plain TCP
    connect to it: a refused one fails in milliseconds, named, instead of after the
    client's retries (its writes have the policy's whole budget)."""

    client_label = "the Azure client"
    error_store = "azure"
    bulk_delete = False  # one DELETE per blob (Azurite has no Blob Batch)

    def __init__(self, config: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self.endpoint = str(config["endpoint"])
        self._probe = Probe.of(self.endpoint)

    def _make_store(self, bucket: str, writes: bool = False) -> Any:
        from obstore.store import AzureStore

        self._check_listening()
        client = self.client_options()
        client["allow_http"] = self.endpoint.startswith("http://")
        return AzureStore(bucket, config=dict(self.config), client_options=client,
                          retry_config=self.retry_config(writes))

    def _check_listening(self) -> None:
        probe = self._probe
        if probe is None:
            return
        try:
            socket.create_connection((probe.host, probe.port), timeout=min(5.0, self.request_timeout)).close()
        except ConnectionRefusedError:
            raise Transient("ConnectionRefusedError: connection refused") from None
        except OSError:
            return  # could not tell: the client will
        self._probe = None

    def translate(self, e: BaseException, bucket: str) -> BackendError:
        return translate(e, bucket)

    async def get_whole(self, path: str, max_bytes: int | None) -> tuple[bytes, str | None]:
        """The blob through a signed URL, with its ``Content-MD5`` as the checked digest."""
        if self.config.get("token") or self.config.get("client_secret"):
            return await super().get_whole(path, max_bytes)
        bucket, _, key = path.partition("/")
        return await self.in_thread(
            bucket, lambda: _get_whole(self._signed_url(bucket, key), bucket, max_bytes, self.request_timeout))

    def _signed_url(self, container: str, key: str) -> str:
        import obstore

        if "account_key" in self.config:
            return obstore.sign(self.store(container), "GET", key, SIGNED_URL_LIFETIME)
        self._check_listening()
        url = f"{self.endpoint}/{quote(container, safe='')}/{quote(key, safe='/~')}"
        sas = self.config.get("sas_key")
        return f"{url}?{sas}" if sas else url


def _get_whole(url: str, container: str, max_bytes: int | None, timeout: float) -> tuple[bytes, str | None]:
    """One GET of a whole blob over ``http.client``: its bytes and the hex of its Content-MD5."""
    parts = urlsplit(url)
    conn_type = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = conn_type(parts.hostname or "", parts.port, timeout=timeout)
    target = parts.path + (f"?{parts.query}" if parts.query else "")
    try:
        try:
            conn.request("GET", target, headers={"x-ms-version": "2023-11-03"})
            resp = conn.getresponse()
            if resp.status != 200:
                raise failure(resp.status, resp.read(64 << 10), resp.headers, container)
            size = int(resp.headers.get("Content-Length") or -1)
            if size < 0:
                raise Transient("response without a Content-Length")
            if max_bytes is not None and size > max_bytes:
                raise TooLarge(size)
            data = resp.read(size)
        except BackendError:
            raise
        except Exception as e:  # noqa: BLE001 - client-side failures classified
            raise classified(e, timeout) from None
    finally:
        conn.close()
    if len(data) != size:
        raise Transient(f"short body: {len(data)} of {size} bytes")
    return data, _md5_hex(resp.headers.get("Content-MD5"))


def _md5_hex(value: str | None) -> str | None:
    if not value:
        return None
    try:
        raw = base64.b64decode(value, validate=True)
    except ValueError:
        return None
    return raw.hex() if len(raw) == 16 else None
