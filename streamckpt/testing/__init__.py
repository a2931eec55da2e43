"""Test helpers that users can reuse: a local S3 server and a fault-injecting proxy.

They need the ``test`` extra (``moto[server]``); importing this package does not.
"""

from __future__ import annotations

from .s3server import LocalS3, options_for

__all__ = ["LocalS3", "options_for", "FaultProxy"]


def __getattr__(name: str):  # lazy: the proxy module is only loaded when used
    if name == "FaultProxy":
        from .faultproxy import FaultProxy

        return FaultProxy
    raise AttributeError(name)
