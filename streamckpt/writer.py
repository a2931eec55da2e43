"""Writing one rank's data file: shards streamed chunk by chunk with CRC32C.

Uncompressed files are valid safetensors files (one entry per shard, named
``key@offset`` plus ``#start-stop`` for flat ranges); the header is known
before any byte is written, so the file streams. zstd files hold independent
frames back to back (one per chunk) and no header: the manifest holds every
frame's length. A CPU tensor is read in place, chunk by chunk; a GPU tensor's
bytes come to the host through two reused pinned blocks (``device.DeviceToHost``):
the next block's copy runs while the host checksums and uploads this one.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch
import zstandard

from . import dtypes
from .checksum import crc32c
from .cudaapi import CudaApi, TorchCuda
from .device import DeviceToHost
from .manifest import Shard
from .storage import Storage
from .targets import TargetSpec

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


@dataclass(slots=True)
class ShardToWrite:
    spec: TargetSpec
    tensor: torch.Tensor


def entry_name(spec: TargetSpec) -> str:
    name = f"{spec.key}@{','.join(map(str, spec.offset))}"
    if spec.flat_range is not None:
        name += f"#{spec.flat_range[0]}-{spec.flat_range[1]}"
    return name


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a tensor's elements (contiguous, on its device)."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dim() == 0:
        t = t.reshape(1)
    return t.reshape(-1).view(torch.uint8)


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
    """A shard's bytes as host spans: in place for CPU tensors, staged for GPU ones."""

    def __init__(self, cuda: CudaApi | None) -> None:
        self.cuda = cuda
        self.staging: dict[torch.device, DeviceToHost] = {}

    def spans(self, t: torch.Tensor, chunk: int) -> Iterator[torch.Tensor]:
        dev = self.cuda.device_of(t) if self.cuda is not None else t.device
        if dev.type == "cpu":
            yield _bytes_of(t)
            return
        if dev.type != "cuda" or self.cuda is None:
            yield _bytes_of(t).cpu()  # another accelerator: a plain copy
            return
        d2h = self.staging.get(dev)
        if d2h is None:
            d2h = self.staging[dev] = DeviceToHost(self.cuda, dev)
        yield from d2h.spans(t, max(chunk, (d2h.block_bytes // chunk) * chunk))

    def close(self) -> None:
        for d2h in self.staging.values():
            d2h.close()


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
    """Stream ``items`` into file ``name``; return ``(key, Shard)`` records and the file size.

    ``on_written(i)`` is called once item ``i``'s bytes have been handed to the upload (its
    tensor is no longer read: a staged copy can be freed)."""
    records: list[tuple[str, Shard]] = []
    cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL) if compression == "zstd" else None
    host = _HostBytes(cuda if cuda is not None else (TorchCuda() if torch.cuda.is_available() else None))
    size_hint = sum(it.spec.nbytes for it in items) + (1 << 20)  # zstd: at most about the raw size
    try:
        with storage.open_write(name, size_hint=size_hint) as up:
            if cctx is None:
                head, _ = _safetensors_header(items)
                up.write(head)
            for i, it in enumerate(items):
                start = up.bytes_written
                nbytes = it.tensor.numel() * it.tensor.element_size()
                chunk = chunk_size_for(nbytes, chunk_size, cctx is not None)
                crcs: list[int] = []
                frames: list[int] = []
                for span in host.spans(it.tensor, chunk):
                    for lo in range(0, span.numel(), chunk):
                        mv = memoryview(span[lo: lo + chunk].numpy())
                        if cctx is not None:
                            mv = memoryview(cctx.compress(mv))
                            frames.append(len(mv))
                        crcs.append(crc32c(mv))
                        up.write(mv)
                spec = it.spec
                records.append((spec.key, Shard(
                    offset=spec.offset, shape=spec.shape, file=name,
                    byte_offset=start, byte_length=up.bytes_written - start,
                    flat_range=spec.flat_range, codec="zstd" if cctx else "raw",
                    chunk_size=chunk, crc32c=tuple(crcs),
                    frame_lengths=tuple(frames) if cctx else None,
                )))
                if on_written is not None:
                    on_written(i)
            size = up.bytes_written
    finally:
        host.close()
    log.debug("wrote %s: %d shards, %d bytes", storage.describe(name), len(records), size)
    return records, size


def check_tensor_bytes(spec: TargetSpec, tensor: torch.Tensor) -> None:
    """The local tensor must hold exactly the spec's elements in the spec's dtype."""
    if tensor.numel() != spec.numel or dtypes.to_code(tensor.dtype, where=spec.key) != spec.dtype:
        raise ValueError(f"internal: {spec.key} tensor does not match its spec")
