"""CRC32C (Castagnoli) of byte buffers.

Uses the ``crc32c`` package: hardware-accelerated (SSE4.2 / ARMv8 CRC), accepts
any buffer (memoryviews of staging buffers without copies) and ~10 GB/s here.
"""

from __future__ import annotations

import crc32c as _crc32c


def crc32c(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """The CRC32C of ``data`` (continuing from ``value``) as an unsigned 32-bit int."""
    return _crc32c.crc32c(data, value)
