"""Storage option names checked at the door, before any client is made.

A misspelt option otherwise surfaces late and in the client's words: s3fs hands names it
does not know to botocore's session, which refuses them at the first request with a
``TypeError`` ("AioSession.__init__() got an unexpected keyword argument 'enpoint_url'");
gcsfs and adlfs drop them silently (a misspelt ``endpoint_url`` then reaches the real
cloud). Here the names are checked against what the URI's client takes, read from its
signature, and a wrong one is a ``StorageOptionError`` that starts with the name it was
likely meant to be.
"""

from __future__ import annotations

import difflib
import inspect
import re
from typing import Any, Iterable

from ..errors import CLI, PYTHON, Hint, StorageOptionError
from .obstore_backend import CREDENTIAL_OPTIONS

# fsspec's own options, taken by every filesystem (its instance cache and listings cache).
FSSPEC_OPTIONS = ("skip_instance_cache", "use_listings_cache", "listings_expiry_time", "max_paths")
# Options streamckpt itself reads beside its client's: boto's names of the S3 keys (obstore
# takes them), an Azure blob endpoint.
OWN_OPTIONS = {"s3": tuple(CREDENTIAL_OPTIONS), "az": ("endpoint_url",)}
# botocore's client arguments, which s3fs takes inside client_kwargs / config_kwargs, not at the top.
NESTED = {"s3": {"region_name": "client_kwargs", "verify": "client_kwargs", "use_ssl": "client_kwargs",
                 "signature_version": "config_kwargs", "retries": "config_kwargs", "connect_timeout": "config_kwargs",
                 "read_timeout": "config_kwargs", "max_pool_connections": "config_kwargs",
                 "s3": "config_kwargs"}}
SHOWN = 12  # names listed when nothing is close


# The names each client took when this was written, so that a call whose options are all
# among them imports nothing (the obstore path never loads s3fs or adlfs, ~0.15 s); a name
# not here is looked up in the installed client's signature before it is refused.
TAKEN = {
    "s3": frozenset({
        "anon", "endpoint_url", "key", "secret", "token", "use_ssl", "client_kwargs", "requester_pays",
        "default_block_size", "default_fill_cache", "default_cache_type", "version_aware", "config_kwargs",
        "s3_additional_kwargs", "session", "username", "password", "cache_regions", "asynchronous", "loop",
        "max_concurrency", "fixed_upload_size", "session_vars", "event_hooks", "include_builtin_handlers",
        "profile", *FSSPEC_OPTIONS, *OWN_OPTIONS["s3"]}),
    "az": frozenset({
        "account_name", "account_key", "connection_string", "credential", "sas_token", "request_session",
        "socket_timeout", "blocksize", "client_id", "client_secret", "tenant_id", "anon", "location_mode", "loop",
        "asynchronous", "default_fill_cache", "default_cache_type", "version_aware", "assume_container_exists",
        "max_concurrency", "timeout", "connection_timeout", "read_timeout", "account_host", "batch_size",
        *FSSPEC_OPTIONS, *OWN_OPTIONS["az"]}),
    "gs": frozenset({
        "project", "access", "token", "block_size", "consistency", "cache_timeout", "secure_serialize",
        "check_connection", "requests_timeout", "requester_pays", "asynchronous", "session_kwargs", "loop",
        "timeout", "endpoint_url", "default_location", "version_aware", "batch_size", *FSSPEC_OPTIONS}),
}


def _family(protocol: str) -> str | None:
    return {"s3": "s3", "s3a": "s3", "gs": "gs", "gcs": "gs", "az": "az", "abfs": "az", "abfss": "az"}.get(protocol)


def known_options(protocol: str) -> list[str] | None:
    """The option names the installed client of ``protocol`` takes, its common ones first; None
    when they are not checked (a protocol whose client takes any name, or one not installed)."""
    family = _family(protocol)
    try:
        if family == "s3":
            from aiobotocore.session import AioSession
            from s3fs import S3FileSystem

            # s3fs passes the names it does not take to the session, which refuses the rest
            return _names([S3FileSystem.__init__, AioSession.__init__], FSSPEC_OPTIONS, OWN_OPTIONS["s3"])
        if family is not None:
            from fsspec import get_filesystem_class

            return _names(_chain(get_filesystem_class(protocol)), FSSPEC_OPTIONS, OWN_OPTIONS.get(family, ()))
    except (ImportError, ValueError):  # the client is not installed: opening the store says so
        return None
    return None


def _chain(cls: type) -> list[Any]:
    """The ``__init__`` of ``cls`` and of the bases it hands its ``**kwargs`` on to, up to fsspec's
    ``AbstractFileSystem`` (which takes any name and uses only ``FSSPEC_OPTIONS``)."""
    from fsspec import AbstractFileSystem

    inits = []
    for base in cls.__mro__:
        if base is AbstractFileSystem or base is object:
            break
        if "__init__" in base.__dict__:
            inits.append(base.__init__)
            params = inspect.signature(base.__init__).parameters.values()
            if not any(p.kind is p.VAR_KEYWORD for p in params):
                break
    return inits


def _names(inits: Iterable[Any], *extra: Iterable[str]) -> list[str]:
    out: list[str] = []
    for init in inits:
        for p in inspect.signature(init).parameters.values():
            if p.name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name not in out:
                out.append(p.name)
    for names in extra:
        out += [n for n in names if n not in out]
    return out


def check_option_names(protocol: str, options: dict[str, Any], where: str) -> None:
    """Raise ``StorageOptionError`` for the first option (top level) that the client of
    ``protocol`` does not take, starting with the name it was likely meant to be."""
    family = _family(protocol)
    if family is None or all(name in TAKEN[family] for name in options):
        return
    known = known_options(protocol)
    if known is None:
        return
    s3 = family == "s3"
    client = "s3fs.S3FileSystem" if s3 else "gcsfs.GCSFileSystem" if protocol in ("gs", "gcs") else \
        "adlfs.AzureBlobFileSystem"
    for name in map(str, options):
        if name in known:
            continue
        inside = NESTED.get(family, {}).get(name)
        if inside is not None:
            raise StorageOptionError(
                f"unknown storage option {name!r} for {where}", option=name, suggestions=[f"{inside}.{name}"],
                hint=Hint("did you mean ", {PYTHON: f"storage_options={{..., {inside!r}: {{{name!r}: ...}}}}",
                                            CLI: f"--storage-option {inside}.{name}=..."},
                          f"? (s3fs hands {inside} to botocore, which takes {name!r} there)"))
        near = difflib.get_close_matches(name, known, n=3, cutoff=0.75)
        if near:
            raise StorageOptionError(
                f"unknown storage option {name!r} for {where}: did you mean {' or '.join(map(repr, near))}? "
                f"({protocol}:// options go to {client})", option=name, suggestions=near)
        listed = ", ".join(known[:SHOWN]) + (", ..." if len(known) > SHOWN else "")
        raise StorageOptionError(
            f"unknown storage option {name!r} for {where}: {protocol}:// options go to {client}, which takes "
            f"none by that name (its options: {listed})", option=name)


# What a local path's client (fsspec's LocalFileSystem) takes; anything else was meant for a store.
LOCAL_TAKEN = frozenset({"auto_mkdir", *FSSPEC_OPTIONS})
_STORE_OF = (("s3://", TAKEN["s3"]), ("gs://", TAKEN["gs"]), ("az://", TAKEN["az"]))


def check_local_options(uri: str, options: dict[str, Any]) -> None:
    """A local path given an object store's options (``bucket/run`` with ``endpoint_url``, the
    scheme forgotten) would write to the local disk while the caller expects the bucket: refused,
    suggesting the scheme whose client takes those options."""
    foreign = [str(n) for n in options if n not in LOCAL_TAKEN]
    if not foreign:
        return
    scheme = next((s for s, taken in _STORE_OF if all(n in taken for n in foreign)), "s3://")
    path = uri.split("://", 1)[-1] if uri.startswith(("file://", "local://")) else uri
    one_slash = re.match(r"([A-Za-z][\w+.-]*):/(?!/)(.*)", path)  # s3:/bucket/x: the scheme is there, half of it
    if one_slash:
        scheme, path = f"{one_slash[1].lower()}://", one_slash[2]
    path = "/".join(p for p in path.split("/") if p not in ("", "."))
    if uri.startswith(("/", "file://", "local://")) or not path:  # an absolute path names no bucket
        path = "<bucket>/<prefix>"
    raise StorageOptionError(
        f"storage options {', '.join(map(repr, foreign[:4]))} are for an object store, but {uri!r} has no "
        f"store scheme: it is a local path, and the options cannot apply to it",
        option=foreign[0], suggestions=[scheme + path],
        hint=Hint("to write to the store, name it: ", {PYTHON: repr(scheme + path), CLI: scheme + path},
                  "; for a local directory, drop the storage options"))
