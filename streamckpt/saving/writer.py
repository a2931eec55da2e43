"""Writing one rank's data files: shards copied into upload buffers with a CRC32C per chunk
and an xxh3-128 digest of each shard's raw bytes (the same pass).

``write_data_files`` (what ``save`` uses) packs the shards into files of about
``UploadShape.object_bytes``, each one PUT, several in flight; ``write_data_file`` streams
one file of any size (a multipart upload). Uncompressed files are valid safetensors files
(one entry per shard, named ``key@offset`` plus ``#start-stop`` for flat ranges); the
header is known before any byte is written. zstd files hold independent
frames back to back (one per chunk) and no header: the manifest holds every
frame's length. A CPU tensor is read in place, once; a GPU tensor's
bytes come to the host through two reused pinned blocks (``device.DeviceToHost``),
pinned at the largest span's size and unpinned when the call returns: the next span's
copy (of the same item or the next one) runs while the host checksums and uploads this one.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol, Sequence

import torch
import xxhash
import zstandard

from ..core import dtypes
from ..core.checksum import crc32c
from ..core.manifest import Shard
from ..core.report import expect_total
from ..core.targets import TargetSpec
from ..cuda.device import CPU, SAVE_BLOCK_BYTES, DeviceToHost, SavePiece, host_spans
from ..cuda.runtime import CudaApi, TorchCuda
from ..storage import Storage

log = logging.getLogger(__name__)

DEFAULT_CHUNK_SIZE = 256 << 10  # the largest checksum chunk
MIN_CHUNK_SIZE = 4 << 10
MIN_ZSTD_CHUNK_SIZE = 64 << 10  # smaller frames compress poorly
CHUNKS_PER_SHARD = 512


def chunk_size_for(nbytes: int, max_chunk: int, compressed: bool) -> int:
    """Checksum chunk (zstd frame) size for a shard of ``nbytes``.

    A slice costs at most one partial chunk at each end, so small shards get small
    chunks (about 1/512 of the shard, a power of two) and large ones ``max_chunk``:
    a tensor-parallel slice reads within ~1-2 % of what it needs whatever the tensor
    size, while the manifest keeps at most ~512 checksums per small shard.
    """
    floor = MIN_ZSTD_CHUNK_SIZE if compressed else MIN_CHUNK_SIZE
    target = max(1, nbytes // CHUNKS_PER_SHARD)
    pow2 = 1 << (target.bit_length() - 1)
    return max(min(floor, max_chunk), min(max_chunk, pow2))
ZSTD_LEVEL = 3
OBJECT_BYTES = 8 << 20  # a data file's size on upload (items are cut to fit): one request each
UPLOAD_BUFFERS = 4  # data files being filled or in flight at once, per rank
RANKS_PER_DOUBLING = 128  # from 256 saving ranks on, the default data file doubles (object_bytes_for)
MAX_DEFAULT_OBJECT_BYTES = 64 << 20


def object_bytes_for(world: int) -> int:
    """The default data file size for a save by ``world`` ranks: 8 MiB up to 255 ranks, then
    doubling at 256, 512 and 1,024 ranks, to 64 MiB.

    Every file is one PUT into the checkpoint's one ``data/`` prefix, which S3 serves at
    about 3,500 PUT/s until it has split it; with 8 MiB files a save of 256 ranks asks for
    ~4,200/s and one of 2,048 ranks for ~34,000/s (docs/SCALE.md, "Saves: PUTs at scale").
    Larger files cut that in proportion, at ``UPLOAD_BUFFERS`` × the size in upload memory
    per rank (256 MiB at 64 MiB); small jobs keep 8 MiB, where the rate is far below the
    limit and memory is what matters.
    """
    steps = max(0, world // RANKS_PER_DOUBLING).bit_length() - 1  # 256 -> 1, 512 -> 2, 1024 -> 3
    return min(MAX_DEFAULT_OBJECT_BYTES, OBJECT_BYTES << max(0, steps))


@dataclass(slots=True)
class ShardToWrite:
    spec: TargetSpec
    tensor: torch.Tensor


def entry_name(spec: TargetSpec) -> str:
    name = f"{spec.key}@{','.join(map(str, spec.offset))}"
    if spec.flat_range is not None:
        name += f"#{spec.flat_range[0]}-{spec.flat_range[1]}"
    return name


def _safetensors_header(items: Sequence[ShardToWrite]) -> tuple[bytes, list[int]]:
    header: dict[str, object] = {"__metadata__": {"format": "streamckpt"}}
    offsets = []
    pos = 0
    for it in items:
        n = it.spec.nbytes
        shape = list(it.spec.shape) if it.spec.flat_range is None else [it.spec.numel]
        header[entry_name(it.spec)] = {"dtype": it.spec.dtype, "shape": shape, "data_offsets": [pos, pos + n]}
        offsets.append(pos)
        pos += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    pad = (-(len(raw) + 8)) % 64  # data starts 64-byte aligned
    raw += b" " * pad
    return len(raw).to_bytes(8, "little") + raw, offsets


class _HostBytes:
    """The shards' bytes as host spans: in place for CPU tensors, staged for GPU ones, the
    next GPU span's copy running while the host encodes this one (``device.host_spans``)."""

    def __init__(self, cuda: CudaApi | None) -> None:
        self.cuda = cuda
        self.staging: dict[torch.device, DeviceToHost] = {}
        self._spans: Iterator[tuple[int, torch.Tensor, bool]] = iter(())

    def _d2h(self, dev: torch.device) -> DeviceToHost:
        d2h = self.staging.get(dev)
        if d2h is None:
            d2h = self.staging[dev] = DeviceToHost(self.cuda, dev)  # type: ignore[arg-type]
        return d2h

    def plan(self, items: Sequence[ShardToWrite], chunks: Sequence[int]) -> None:
        """The items ``spans`` will be asked for, in that order, with their checksum chunks.

        A GPU span holds whole chunks, at most ``SAVE_BLOCK_BYTES``: items (cut to one data
        file, 8 MiB) are one span each, so item k+1's copy overlaps item k's encoding. A staged
        item (``staged``: a host copy that may not exist yet) is not looked at before its turn."""
        pieces = []
        for it, chunk in zip(items, chunks):
            staged = getattr(it, "staged", False)
            dev = CPU if staged or self.cuda is None else self.cuda.device_of(it.tensor)
            pieces.append(SavePiece(lambda it=it: it.tensor, dev, it.spec.nbytes,  # type: ignore[misc]
                                    max(chunk, (SAVE_BLOCK_BYTES // chunk) * chunk)))
        self._spans = host_spans(pieces, self._d2h)

    def spans(self, item: int) -> Iterator[torch.Tensor]:
        """Item ``item``'s spans (the next item of the plan); each valid until the next is asked for."""
        for i, span, last in self._spans:
            if i != item:
                raise RuntimeError(f"internal: asked for item {item}'s bytes, the plan has item {i} next")
            yield span
            if last:
                return

    def close(self) -> None:
        for d2h in self.staging.values():
            d2h.close()


class _Sink(Protocol):
    bytes_written: int

    def write(self, data: memoryview) -> None: ...


class _Body:
    """One object's bytes assembled in a reused upload buffer."""

    def __init__(self, buf: bytearray) -> None:
        self.buf = buf
        self.bytes_written = 0

    def write(self, data: memoryview) -> None:
        end = self.bytes_written + len(data)
        if end > len(self.buf):  # zstd frames a little larger than their input
            self.buf = self.buf[:self.bytes_written] + bytearray(max(end - self.bytes_written, len(self.buf) // 8))
        self.buf[self.bytes_written:end] = data
        self.bytes_written = end


@dataclass
class _Encoder:
    """Writes shards' bytes into a sink chunk by chunk (CRC32C per chunk, a zstd frame per
    chunk when compressing) and makes their manifest records."""

    compression: str | None
    chunk_size: int
    host: _HostBytes

    def __post_init__(self) -> None:
        self.cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL) if self.compression == "zstd" else None

    def header(self, items: Sequence[ShardToWrite]) -> bytes:
        return b"" if self.cctx is not None else _safetensors_header(items)[0]

    def chunk_of(self, it: ShardToWrite) -> int:
        return chunk_size_for(it.spec.nbytes, self.chunk_size, self.cctx is not None)

    def plan(self, items: Sequence[ShardToWrite]) -> None:
        """``shard`` will be called for ``items``, in this order (their indices)."""
        self.host.plan(items, [self.chunk_of(it) for it in items])

    def shard(self, sink: _Sink, name: str, it: ShardToWrite, index: int, digest: str | None = None) -> Shard:
        """``digest``: the shard's xxh3-128 when already known (an incremental save hashed it to
        compare with its base), so that no byte is hashed twice; None: hashed in this pass."""
        cctx = self.cctx
        start = sink.bytes_written
        chunk = self.chunk_of(it)
        crcs: list[int] = []
        frames: list[int] = []
        hasher = xxhash.xxh3_128() if digest is None else None  # of the raw bytes, in the same pass
        for span in self.host.spans(index):  # spans hold whole chunks (the last may end short)
            mv = memoryview(span.numpy())
            if hasher is not None:
                hasher.update(mv)
            if cctx is None:  # one copy per span; the checksums read the same memory chunk by chunk
                crcs += [crc32c(mv[lo:lo + chunk]) for lo in range(0, len(mv), chunk)]
                sink.write(mv)
                continue
            for lo in range(0, len(mv), chunk):
                frame = memoryview(cctx.compress(mv[lo:lo + chunk]))
                frames.append(len(frame))
                crcs.append(crc32c(frame))
                sink.write(frame)
        spec = it.spec
        return Shard(
            offset=spec.offset, shape=spec.shape, file=name,
            byte_offset=start, byte_length=sink.bytes_written - start,
            flat_range=spec.flat_range, codec="zstd" if cctx else "raw",
            chunk_size=chunk, crc32c=tuple(crcs),
            frame_lengths=tuple(frames) if cctx else None,
            digest=hasher.hexdigest() if hasher is not None else digest,
        )


def _host_for(cuda: CudaApi | None) -> _HostBytes:
    return _HostBytes(cuda if cuda is not None else (TorchCuda() if torch.cuda.is_available() else None))


def write_data_file(
    storage: Storage,
    name: str,
    items: Sequence[ShardToWrite],
    *,
    compression: str | None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    cuda: CudaApi | None = None,
    on_written: Callable[[int], None] | None = None,
) -> tuple[list[tuple[str, Shard]], int]:
    """Stream ``items`` into one file ``name`` (a multipart upload when large); return
    ``(key, Shard)`` records and the file size.

    ``on_written(i)`` is called once item ``i``'s bytes have been handed to the upload (its
    tensor is no longer read: a staged copy can be freed)."""
    records: list[tuple[str, Shard]] = []
    enc = _Encoder(compression, chunk_size, _host_for(cuda))
    size_hint = sum(it.spec.nbytes for it in items) + (1 << 20)  # zstd: at most about the raw size
    try:
        enc.plan(items)
        with storage.open_write(name, size_hint=size_hint) as up:
            up.write(enc.header(items))
            for i, it in enumerate(items):
                records.append((it.spec.key, enc.shard(up, name, it, i)))
                if on_written is not None:
                    on_written(i)
            size = up.bytes_written
    finally:
        enc.host.close()
    log.debug("wrote %s: %d shards, %d bytes", storage.describe(name), len(records), size)
    return records, size


@dataclass(frozen=True, slots=True)
class UploadShape:
    """How a rank's share goes up: data files of about ``object_bytes`` (items are cut to fit
    before), each one request, up to ``buffers`` of them being filled or in flight. The
    save's upload memory is ``buffers`` × ``object_bytes``. Environment:
    ``STREAMCKPT_UPLOAD_OBJECT_BYTES`` (default ``object_bytes_for`` the save's world size),
    ``STREAMCKPT_UPLOAD_BUFFERS``."""

    object_bytes: int = OBJECT_BYTES
    buffers: int = UPLOAD_BUFFERS

    @classmethod
    def from_env(cls, world: int = 1) -> "UploadShape":
        def num(var: str, default: int, low: int) -> int:
            raw = os.environ.get(var)
            try:
                value = int(raw) if raw else default
            except ValueError:
                raise ValueError(f"{var}={raw!r} is not a whole number") from None
            if value < low:
                raise ValueError(f"{var}={value} is below the minimum {low}")
            return value

        return cls(num("STREAMCKPT_UPLOAD_OBJECT_BYTES", object_bytes_for(world), 1 << 20),
                   num("STREAMCKPT_UPLOAD_BUFFERS", UPLOAD_BUFFERS, 1))


def pack(sizes: Sequence[int], limit: int) -> list[range]:
    """Consecutive items grouped into files of at most ``limit`` bytes (an item larger than
    that gets a file of its own)."""
    groups: list[range] = []
    start, total = 0, 0
    for i, n in enumerate(sizes):
        if i > start and total + n > limit:
            groups.append(range(start, i))
            start, total = i, 0
        total += n
    if start < len(sizes):
        groups.append(range(start, len(sizes)))
    return groups


def write_data_files(
    storage: Storage,
    name_of: Callable[[int], str],
    items: Sequence[ShardToWrite],
    *,
    compression: str | None,
    shape: UploadShape | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    cuda: CudaApi | None = None,
    on_written: Callable[[int], None] | None = None,
    progress: Callable[[int], None] | None = None,
    digests: Sequence[str | None] | None = None,
) -> tuple[list[tuple[str, Shard]], dict[str, int]]:
    """Write ``items`` as data files ``name_of(0)``, ``name_of(1)``, … of about
    ``shape.object_bytes`` each, uploaded several at once, one request per file; return the
    ``(key, Shard)`` records and every file's size. The caller's thread encodes (copy +
    CRC32C, or zstd) into a free upload buffer while earlier files are in flight; a tensor
    is read once. ``on_written`` as in ``write_data_file``; ``progress(nbytes)``: each file's
    size once uploaded (and ``progress.add_total`` first, when it has one and the sizes are
    known in advance: uncompressed). ``digests[i]``: item ``i``'s content digest when the caller
    has computed it already (not hashed again), else None. On failure the files already
    written are deleted (best effort) and the error raised."""
    shape = shape or UploadShape.from_env()
    enc = _Encoder(compression, chunk_size, _host_for(cuda))
    groups = pack([it.spec.nbytes for it in items], shape.object_bytes)
    _announce(progress, enc, items, groups)
    queue = storage.open_objects(buffers=shape.buffers, buffer_bytes=shape.object_bytes + (64 << 10),
                                 on_uploaded=progress)
    records: list[tuple[str, Shard]] = []
    sizes: dict[str, int] = {}
    try:
        enc.plan(items)
        for f, group in enumerate(groups):
            name = name_of(f)
            mine = [items[i] for i in group]
            head = enc.header(mine)
            body = _Body(queue.buffer(len(head) + sum(it.spec.nbytes for it in mine)))
            body.write(memoryview(head))
            for i, it in zip(group, mine):
                records.append((it.spec.key, enc.shard(body, name, it, i, digests[i] if digests else None)))
                if on_written is not None:
                    on_written(i)
            queue.submit(name, body.buf, body.bytes_written)
            sizes[name] = body.bytes_written
        queue.finish()
    except BaseException:
        queue.abort()
        raise
    finally:
        enc.host.close()
    log.debug("wrote %d data files under %s: %d shards, %d bytes", len(sizes), storage.describe("data"),
              len(records), sum(sizes.values()))
    return records, sizes


def _announce(progress: Callable[[int], None] | None, enc: _Encoder, items: Sequence[ShardToWrite],
              groups: Sequence[range]) -> None:
    """Tell a progress display with ``add_total`` the bytes the files will hold (uncompressed
    files' sizes are known before any byte is encoded; zstd ones are not: no total)."""
    if not hasattr(progress, "add_total") or enc.cctx is not None:
        return
    expect_total(progress, sum(len(enc.header([items[i] for i in g])) + sum(items[i].spec.nbytes for i in g)
                               for g in groups))


def check_tensor_bytes(spec: TargetSpec, tensor: torch.Tensor) -> None:
    """The local tensor must hold exactly the spec's elements in the spec's dtype."""
    if tensor.numel() != spec.numel or dtypes.to_code(tensor.dtype, where=spec.key) != spec.dtype:
        raise ValueError(f"internal: {spec.key} tensor does not match its spec")
