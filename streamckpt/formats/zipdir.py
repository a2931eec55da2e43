"""The central directory of a ``torch.save`` record, parsed from the record's last bytes.

A DCP item is a ZIP whose end record (ZIP64, as torch writes it) and central
directory sit in its last few hundred bytes, which the DCP reader has already
fetched. ``zipfile.ZipFile`` would parse them too, through a file object and
with far more Python per item; for a checkpoint of thousands of items that was
most of the time spent locating tensors. This parser covers the layout torch
writes (STORED members, no archive comment, sizes below 4 GiB per member) and
returns None for anything else, so the caller falls back to ``zipfile``, which
raises the precise error for a malformed record. No I/O.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

EOCD = b"PK\x05\x06"
EOCD_LEN = 22
LOCATOR64 = b"PK\x06\x07"
LOCATOR64_LEN = 20
EOCD64 = b"PK\x06\x06"
EOCD64_LEN = 56
CENTRAL = b"PK\x01\x02"
CENTRAL_LEN = 46
STORED = 0
_UTF8_NAMES = 0x800
_CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")


@dataclass(frozen=True, slots=True)
class ZipEntry:
    """What the reader needs of one member (the names ``zipfile.ZipInfo`` uses)."""

    filename: str
    compress_type: int
    file_size: int
    header_offset: int
    CRC: int = 0


def central_directory(tail: bytes, tail_start: int) -> list[ZipEntry] | None:
    """The members of the ZIP whose last bytes are ``tail`` (``tail[0]`` is at offset
    ``tail_start`` of the record), or None when the directory is not wholly inside
    ``tail`` or not in the plain layout torch writes."""
    end = len(tail) - EOCD_LEN
    if end < 0 or tail[end:end + 4] != EOCD:
        return None
    _disk, _cd_disk, _n_here, count, cd_size, cd_offset, comment = struct.unpack("<HHHHIIH", tail[end + 4:])
    if comment:
        return None
    if tail[max(0, end - LOCATOR64_LEN):max(0, end - LOCATOR64_LEN) + 4] == LOCATOR64:
        found = _zip64_end(tail, tail_start, end)  # torch writes one; zipfile trusts it over the rest
        if found is None or not _agrees((count, cd_size, cd_offset), found[1:]):
            return None
        end, count, cd_size, cd_offset = found
    elif count == 0xFFFF or 0xFFFFFFFF in (cd_size, cd_offset):
        return None
    start = cd_offset - tail_start
    if start < 0 or start + cd_size > end or count > cd_size // CENTRAL_LEN:
        return None
    return _entries(tail, start, start + cd_size, count)


def _zip64_end(tail: bytes, tail_start: int, end: int) -> tuple[int, int, int, int] | None:
    """(where the ZIP64 end record starts in ``tail``, entries, directory size, offset)."""
    loc = end - LOCATOR64_LEN
    if loc < 0 or tail[loc:loc + 4] != LOCATOR64:
        return None
    (offset,) = struct.unpack("<Q", tail[loc + 8:loc + 16])
    at = offset - tail_start
    if at < 0 or at + EOCD64_LEN > loc or tail[at:at + 4] != EOCD64:
        return None
    _n_here, count, cd_size, cd_offset = struct.unpack("<QQQQ", tail[at + 24:at + 56])
    return at, count, cd_size, cd_offset


def _agrees(short: tuple[int, int, int], full: tuple[int, int, int]) -> bool:
    """The end record's 16/32-bit fields match the ZIP64 ones (or say "see ZIP64")."""
    return all(s in (f, 0xFFFF if i == 0 else 0xFFFFFFFF) for i, (s, f) in enumerate(zip(short, full)))


def _entries(tail: bytes, pos: int, stop: int, count: int) -> list[ZipEntry] | None:
    out = []
    for _ in range(count):
        if pos + CENTRAL_LEN > stop:
            return None
        (sig, _made, _need, flags, method, _time, _date, crc, csize, usize, name_len, extra_len, comment_len,
         _disk, _iattr, _eattr, header_offset) = _CENTRAL.unpack_from(tail, pos)
        nxt = pos + CENTRAL_LEN + name_len + extra_len + comment_len
        if sig != CENTRAL or nxt > stop or method != STORED or csize != usize or \
                0xFFFFFFFF in (csize, usize, header_offset):
            return None  # ZIP64 sizes or offsets, compression: zipfile's path handles (or refuses) them
        raw = tail[pos + CENTRAL_LEN:pos + CENTRAL_LEN + name_len]
        try:
            name = raw.decode("utf-8" if flags & _UTF8_NAMES else "cp437")
        except UnicodeDecodeError:
            return None
        out.append(ZipEntry(name, method, usize, header_offset, crc))
        pos = nxt
    return out if pos == stop else None
