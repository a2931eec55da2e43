"""What the public calls return: plain dataclasses with readable ``__str__``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def plural(n: int, word: str, many: str | None = None) -> str:
    """``"1 file"``, ``"2 files"``: a count with its noun in the right number
    (``many`` where the plural is not ``word + "s"``)."""
    return f"{n} {word if n == 1 else many or word + 's'}"


ABBREVIATE_AT = 60


def abbreviate(text: str, width: int = ABBREVIATE_AT) -> str:
    """``text`` cut to at most ``width`` characters, ending in ``...`` when cut, so
    that one long value (a list of 10k ids) does not flood a listing."""
    return text if len(text) <= width else text[: width - 3] + "..."


@dataclass(slots=True)
class LoadResult:
    """What one ``sc.load`` did on this rank: the keys that did not match, and its statistics.

    Attributes:
        missing_keys: Keys of this rank's state_dict the checkpoint lacks (sorted); with
            ``strict=False`` they were left as they were.
        unexpected_keys: Names in the checkpoint (after transforms) that this rank's
            state_dict does not ask for (sorted).
        bytes_read: Bytes this rank fetched from storage.
        bytes_needed: Bytes of this rank's targets that were filled.
        requests: Range requests this rank made.
        bytes_sent: Bytes this rank sent to other ranks (``read_once``).
        bytes_received: Bytes this rank received from other ranks.
        seconds: Wall time of the call on this rank.
        rounds: Staging rounds of the plan (each bounded by the memory budget).
        staging_bytes: Staging buffer bytes this rank allocated.
        kind: The checkpoint's kind: ``"streamckpt"``, ``"safetensors"`` or ``"dcp"``.
        bytes_direct: Of ``bytes_read``, the bytes that landed straight in this rank's
            targets, with no staging copy.
        throttled_requests: Responses this rank's storage client saw that throttled it (S3's
            503 SlowDown, 429, Azure's ServerBusy), each retried (or failing the load when
            retries ran out). The default S3 client counts every one; through obstore, s3fs
            and others only those that outlast the client's own retries.
        job_requests: Range requests of every rank of the load together (``requests`` summed;
            alone: ``requests``).
        job_throttled_requests: ``throttled_requests`` summed over every rank.
        job_requests_per_s: ``job_requests`` divided by the longest rank's data phase: the
            average GET rate on ``request_prefix``, the figure S3 limits (5,500/s per prefix);
            rank 0 logs a warning when it passes ``STREAMCKPT_GET_RATE_LIMIT`` (default 5500).
        request_prefix: The longest key prefix (a URI ending in ``/``) that every data file of
            the checkpoint shares: the partition that takes the job's requests until the store
            splits it.
    """

    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)
    bytes_read: int = 0
    bytes_needed: int = 0
    requests: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0
    rounds: int = 0
    staging_bytes: int = 0
    kind: str = "streamckpt"
    bytes_direct: int = 0  # of bytes_read: landed straight in this rank's targets, no staging copy
    throttled_requests: int = 0
    job_requests: int = 0
    job_throttled_requests: int = 0
    job_requests_per_s: float = 0.0
    request_prefix: str = ""

    @property
    def read_amplification(self) -> float:
        """``bytes_read / bytes_needed`` (0.0 when nothing was needed): above 1 when reads
        cover more than the targets (whole checksum chunks, coalesced gaps, bytes read for
        other ranks)."""
        return self.bytes_read / self.bytes_needed if self.bytes_needed else 0.0

    def __str__(self) -> str:
        mbps = self.bytes_needed / self.seconds / 1e6 if self.seconds else 0.0
        return (
            f"LoadResult(needed={human_bytes(self.bytes_needed)}, read={human_bytes(self.bytes_read)}, "
            f"requests={self.requests}, sent={human_bytes(self.bytes_sent)}, "
            f"received={human_bytes(self.bytes_received)}, rounds={self.rounds}, "
            f"seconds={self.seconds:.3f}, {mbps:.1f} MB/s, missing={len(self.missing_keys)}, "
            f"unexpected={len(self.unexpected_keys)})"
        )


@dataclass(slots=True)
class SaveResult:
    """What one ``sc.save`` (or an ``sc.async_save``'s ``SaveHandle.result()``) did on this rank.

    Attributes:
        bytes_written: Bytes this rank stored (its data files, and on rank 0 the manifest).
        files: The objects this rank wrote, relative to the checkpoint URI
            (``data/00000-0000.safetensors``, ..., ``manifest.json`` on rank 0).
        seconds: Wall time from the call until the commit, on this rank.
        uri: The checkpoint's URI.
        bytes_reused: Stored bytes of this rank's shards that an incremental save did not
            upload because its base holds them (the manifest references them); 0 without a base.
        requests: PUT requests this rank made: one per object in ``files`` (a retried PUT
            counts once).
        job_requests: PUTs of every rank of the save together (the same on every rank).
        job_requests_per_s: ``job_requests`` ÷ the longest rank's upload, seconds: the rate the
            checkpoint's key prefix took. Above ``STREAMCKPT_PUT_RATE_LIMIT`` (default 3500,
            S3's documented PUT rate per prefix; 0: off) rank 0 logs a warning saying what to do.
        request_prefix: The key prefix every data file of the save shares, as a URI
            (``s3://bucket/run/step-100/data/``): the partition that took those PUTs.
    """

    bytes_written: int = 0
    files: list[str] = field(default_factory=list)
    seconds: float = 0.0
    uri: str = ""
    bytes_reused: int = 0
    requests: int = 0
    job_requests: int = 0
    job_requests_per_s: float = 0.0
    request_prefix: str = ""


@dataclass
class CopyResult:
    """What one ``sc.copy`` did.

    Attributes:
        uri: What was copied: a checkpoint, or a run's root.
        out_uri: Where the copy is.
        checkpoints: The checkpoints copied, relative to ``uri``: ``[""]`` for one checkpoint;
            of a run, each committed child (``"step-100"``), oldest step first.
        files: The objects written, relative to ``out_uri`` (manifests last).
        bytes_written: Bytes written (data files and manifests); each was read once and checked.
        seconds: Wall time of the copy.
        skipped: Of a run: ``(child, why)`` for each checkpoint whose manifest could not be read
            (left out, with a warning).
    """

    uri: str = ""
    out_uri: str = ""
    checkpoints: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    bytes_written: int = 0
    seconds: float = 0.0
    skipped: list[tuple[str, str]] = field(default_factory=list)


class DtypeName(str):
    """A stored dtype code (``"BF16"``) that also compares equal to its torch dtype
    (``torch.bfloat16``) and torch's names (``"bfloat16"``, ``"torch.bfloat16"``)."""

    __slots__ = ()

    @property
    def torch(self) -> Any:
        """The torch dtype of this code."""
        from .core import dtypes

        return dtypes.to_torch(str(self))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, str):
            if str.__eq__(self, other):
                return True
            try:
                return str(self.torch).removeprefix("torch.") == other.removeprefix("torch.")
            except Exception:  # noqa: BLE001 - an unknown code equals nothing else
                return False
        try:
            import torch

            if isinstance(other, torch.dtype):
                return bool(self.torch == other)
        except ImportError:  # pragma: no cover
            pass
        return NotImplemented

    def __ne__(self, other: object) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    __hash__ = str.__hash__


class TensorInfo(NamedTuple):
    """One tensor of a checkpoint, in ``CheckpointInfo.tensors``: unpacks as ``shape, dtype, shards, bytes``.

    Attributes:
        shape: The global shape.
        dtype: The stored dtype code (``"BF16"``, ``"F32"``), which also compares equal to
            the torch dtype (``torch.bfloat16``) and torch's names (``"bfloat16"``).
        shards: How many stored pieces make up the tensor.
        bytes: The tensor's size in bytes (uncompressed).
    """

    shape: tuple[int, ...]
    dtype: DtypeName
    shards: int
    bytes: int


@dataclass(slots=True)
class CheckpointInfo:
    """What ``sc.inspect`` reports about a checkpoint, without reading tensor data;
    ``str()`` of it is a readable table.

    Attributes:
        uri: The checkpoint's URI.
        kind: ``"streamckpt"``, ``"safetensors"`` (Hugging Face) or ``"dcp"`` (PyTorch DCP).
        tensors: Name to ``TensorInfo`` (shape, dtype, shards, bytes), in stored order.
        total_bytes: Bytes of tensor data (uncompressed).
        metadata: The user metadata stored with the checkpoint (``save(metadata=...)``).
        values: The non-tensor values (dotted name to value).
        files: Data file name to its stored size in bytes.
    """

    uri: str
    kind: str
    tensors: dict[str, TensorInfo]
    total_bytes: int
    metadata: dict[str, Any]
    values: dict[str, Any] = field(default_factory=dict)
    files: dict[str, int] = field(default_factory=dict)

    @property
    def stored_bytes(self) -> int:
        """Bytes of the data files as stored (compressed, with headers)."""
        return sum(self.files.values())

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serializable dict of everything above (shapes as lists, values whole)."""
        return {
            "uri": self.uri,
            "kind": self.kind,
            "total_bytes": self.total_bytes,
            "stored_bytes": self.stored_bytes,
            "tensors": {
                k: {"shape": list(t.shape), "dtype": t.dtype, "shards": t.shards, "bytes": t.bytes}
                for k, t in self.tensors.items()
            },
            "files": self.files,
            "values": self.values,
            "metadata": self.metadata,
        }

    def __str__(self) -> str:
        lines = [
            f"{self.uri}  [{self.kind}]",
            f"{plural(len(self.tensors), 'tensor')}, {human_bytes(self.total_bytes)} of tensor data, "
            f"{plural(len(self.files), 'file')} ({human_bytes(self.stored_bytes)} stored)",
        ]
        lines += self._tensor_lines()
        lines += self._value_lines()
        if self.metadata:
            lines.append(f"metadata: {self.metadata}")
        return "\n".join(lines)

    def _tensor_lines(self) -> list[str]:
        if not self.tensors:
            return []
        width = min(60, max(4, max(len(k) for k in self.tensors)))
        lines = [f"{'name':<{width}}  {'dtype':<8} {'shape':<22} {'shards':>6} {'bytes':>11}"]
        for k, t in self.tensors.items():
            shape = "x".join(map(str, t.shape)) or "()"
            lines.append(f"{k:<{width}}  {t.dtype:<8} {shape:<22} {t.shards:>6} {human_bytes(t.bytes):>11}")
        return lines

    def _value_lines(self) -> list[str]:
        """Each non-tensor value beside its name (``repr``, abbreviated: ``to_dict`` has them whole)."""
        if not self.values:
            return []
        width = min(60, max(len(k) for k in self.values))
        return [f"{plural(len(self.values), 'value')}:"] + [
            f"  {k:<{width}} = {abbreviate(repr(v))}" for k, v in self.values.items()
        ]
