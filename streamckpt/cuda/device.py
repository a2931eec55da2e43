"""Where a load's (or save's) bytes live, and in what order the GPU touches them.

Every rule of the GPU path lives here, once:

* **Backends.** A group's backend string may be ``"nccl"``, ``"gloo"``,
  ``"cpu:gloo,cuda:nccl"`` or ``"undefined"`` (``init_process_group()`` without a
  backend); ``parse_backends`` maps it to device type -> backend. Small collectives
  (metadata, failure agreement) use host tensors when the group has a CPU backend;
  the rounds' data goes over NCCL when the group has NCCL for CUDA tensors.
* **Device choice** (``choose_device``): the group's bound device, else the targets'
  device, else ``LOCAL_RANK``, else the current device; streams, events, pinned and
  device buffers are all created on that one device, never on the current one.
* **Arena reuse** (``DeviceStage.acquire``): nothing writes into a staging arena
  (a fetch, a decode, a pack or a receive) before the host has waited on the event
  recorded after that arena's last copies, in every round, reads or not.
* **Caller's stream first** (``DeviceStage.begin``): the side stream waits on the
  caller's current stream before any target write, so pending init kernels
  (``to_empty`` + ``reset_parameters``, a ``fill_``) land before the loaded bytes;
  at the end the caller's stream waits on the side stream — not after a failed load that
  exchanged over NCCL, and NCCL's completion (``work.wait()``) orders the side stream, never
  the caller's: a dead peer's receive must not hang the caller's next kernel.
* **Allocator safety**: device scratch is allocated on the side stream that uses it;
  NCCL's send/recv buffers are views of two exchange arenas allocated once in the
  current stream's order (NCCL's), reused under the host arenas' events, and recorded
  on the side stream that reads them.
* **Pinned memory for saves** (``pin_host``): exactly the bytes asked (``CudaApi.pin``); where
  CUDA refuses to lock host memory, torch's pinned allocator (or pageable memory), one warning.
* **No allocation between agreements**: every arena is allocated when the stage is
  made; a failure is a ``StagingMemoryError`` naming the memory and the bytes, which
  the executor agrees on before any collective (so no rank blocks on one that failed).

The CUDA calls go through a ``runtime.CudaApi``; ``HostStage`` is the CPU path with
the same interface, so the executor has one code path.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Collection, Iterable, Iterator, Sequence

import torch

from ..errors import CheckpointError, IncompatibleStateDictError, StagingMemoryError
from ..plan.data import ALIGN  # a piece keeps its address modulo this on the device
from .runtime import CudaApi, PinRefused

log = logging.getLogger(__name__)

CPU = torch.device("cpu")
SAVE_BLOCK_BYTES = 32 << 20  # each of the two pinned blocks a save stages device bytes through


# ------------------------------------------------------------------ backends and device choice


_SINGLE = {"nccl": {"cuda": "nccl"}, "gloo": {"cpu": "gloo", "cuda": "gloo"}, "mpi": {"cpu": "mpi", "cuda": "mpi"}}


def checked_device(device: Any) -> torch.device:
    """``device`` as a torch.device, refused by name before any byte is read when it cannot
    hold tensors here (a CUDA device on a CPU-only build, or one that is not visible):
    torch itself would say only ``AssertionError: Torch not compiled with CUDA enabled``."""
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise CheckpointError(f"device={device!r} is not a torch device ({e}); load to 'cpu' (the default) or "
                              f"'cuda:N'") from None
    if d.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0 or (d.index is not None and d.index >= count):
            why = ("this torch is a CPU-only build" if not torch.backends.cuda.is_built()
                   else f"{count} CUDA device(s) are visible")
            raise CheckpointError(f"device={device!r}: {why}; load to 'cpu' (the default) or a device that exists")
    return d


def parse_backends(text: str) -> dict[str, str]:
    """Device type -> backend for a backend string; ``{}`` when it says nothing ("undefined")."""
    text = text.strip().lower()
    if not text or text == "undefined":
        return {}
    if ":" not in text:
        return dict(_SINGLE.get(text, {"cpu": text}))
    out: dict[str, str] = {}
    for part in text.split(","):
        dev, sep, backend = part.strip().partition(":")
        if not sep or not dev or not backend:
            raise CheckpointError(f"process group backend {text!r}: cannot read {part!r} (expected device:backend)")
        out[dev.strip()] = backend.strip()
    return out


def group_backends(dist: Any, group: Any) -> dict[str, str]:
    """The group's device type -> backend map, from torch's config when it has one."""
    for ask in (getattr(dist, "get_backend_config", None), dist.get_backend):
        if ask is None:
            continue
        try:
            found = parse_backends(str(ask(group)))
        except (RuntimeError, ValueError, AttributeError):
            continue
        if found:
            return found
    raise CheckpointError(
        f"cannot tell which backend the process group uses (torch reports {dist.get_backend(group)!r}); "
        f"pass backend='gloo', 'nccl' or 'cpu:gloo,cuda:nccl' to init_process_group"
    )


def bound_device(dist: Any, group: Any) -> torch.device | None:
    """The device the group was bound to (``init_process_group(device_id=...)``), if any."""
    for g in (group, getattr(dist.group, "WORLD", None)):
        dev = getattr(g, "bound_device_id", None) if g is not None else None
        if isinstance(dev, torch.device) and dev.type == "cuda":
            return dev
    return None


def choose_device(
    *,
    bound: torch.device | None,
    targets: Collection[torch.device],
    local_rank: str | None,
    current: int,
    count: int,
) -> torch.device:
    """This rank's GPU: the group's bound device, else its targets' device, else
    ``LOCAL_RANK`` (when it names a visible GPU), else the current device."""
    if bound is not None and bound.type == "cuda" and bound.index is not None:
        return bound
    cuda = sorted({d for d in targets if d.type == "cuda"}, key=lambda d: d.index or 0)
    if len(cuda) > 1:
        raise IncompatibleStateDictError(
            f"this rank's tensors are on {len(cuda)} GPUs ({', '.join(map(str, cuda))}); one rank loads into one GPU"
        )
    if cuda:
        return cuda[0] if cuda[0].index is not None else torch.device("cuda", current)
    try:
        lr = int(local_rank) if local_rank is not None else -1
    except ValueError:
        lr = -1
    if 0 <= lr < count:
        return torch.device("cuda", lr)
    return torch.device("cuda", current)


@dataclass(frozen=True, slots=True)
class Transport:
    """Which tensors a group's collectives carry."""

    control: torch.device  # metadata, failure agreement, barriers
    data: torch.device  # the rounds' send/recv buffers


def transport(backends: dict[str, str], gpu: Callable[[], torch.device]) -> Transport:
    """Host tensors for small collectives when the group has a CPU backend, else this rank's
    GPU; the rounds' data on this rank's GPU when CUDA tensors go over NCCL, else host
    tensors. ``gpu`` (``choose_device``) is asked only when a GPU is used."""
    control = CPU if "cpu" in backends else gpu()
    data = (control if control.type == "cuda" else gpu()) if backends.get("cuda") == "nccl" else CPU
    return Transport(control, data)


def cuda_devices(api: CudaApi, tensors: Iterable[torch.Tensor]) -> set[torch.device]:
    return {d for d in (api.device_of(t) for t in tensors) if d.type == "cuda"}


# ------------------------------------------------------------------ placement of one load


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one rank's load stages its bytes: host only, or through one GPU."""

    api: CudaApi
    device: torch.device | None  # the GPU this rank stages through; None: host only
    data_on_device: bool = False  # exchange buffers on ``device`` (NCCL), not in host arenas

    def is_device(self, t: torch.Tensor) -> bool:
        return self.device is not None and self.api.device_of(t).type == "cuda"

    def stage(self, sizes: Sequence[int], exchange: Sequence[int] = ()) -> "HostStage | DeviceStage":
        """The arenas (and, for NCCL, the device exchange arenas of ``exchange`` bytes), allocated
        now; a failed allocation raises ``StagingMemoryError`` naming the memory and its bytes."""
        if self.device is None:
            return HostStage(sizes)
        return DeviceStage(self.api, self.device, sizes, exchange if self.data_on_device else ())


def place(api: CudaApi, tensors: Sequence[torch.Tensor], data_device: torch.device) -> Placement:
    """This rank's placement; a conflict raises (before the ranks agree, so on every rank)."""
    found = cuda_devices(api, tensors)
    if len(found) > 1:
        raise IncompatibleStateDictError(
            f"this rank's tensors are on {len(found)} GPUs ({', '.join(sorted(map(str, found)))}); "
            f"one rank loads into one GPU"
        )
    target = next(iter(found), None)
    if data_device.type == "cuda":
        if target is not None and target != data_device:
            raise CheckpointError(
                f"this rank's tensors are on {target} but its process group exchanges data on {data_device}; "
                f"bind the group to the tensors' GPU (init_process_group(device_id=...)) or torch.cuda.set_device it"
            )
        return Placement(api, data_device, True)
    return Placement(api, target, False)


# ------------------------------------------------------------------ staging: the rules


class HostStage:
    """The CPU path: plain host arenas, every copy done on the spot."""

    def __init__(self, sizes: Sequence[int]) -> None:
        self.arenas = allocate("host memory for 2 staging arenas", sizes, CPU,
                               lambda n: torch.empty(n, dtype=torch.uint8))

    def begin(self) -> None:
        return None

    def acquire(self, slot: int) -> None:
        return None

    def release(self, slot: int) -> None:
        return None

    def finish(self, failed: bool = False, hold: Sequence[torch.Tensor] = ()) -> None:
        return None

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        return host

    def download(self, buf: torch.Tensor) -> torch.Tensor:
        return buf

    def write(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def realign(self, raw: torch.Tensor) -> torch.Tensor:
        return raw.clone()


class DeviceStage:
    """Pinned arenas and a side stream on one GPU, with the ordering rules of the module doc.

    Round k: ``acquire(k % 2)`` before any write into that arena; ``upload`` raw
    spans to device scratch and ``write`` strided/permuted/cast pieces into targets,
    all on the side stream; for NCCL, ``send_buffer``/``recv_buffer`` are views of
    exchange arena ``k % 2`` (``fill_send`` copies on the current stream) and
    ``received`` comes after ``work.wait()``, before reading them; ``release(k % 2)``
    records the event that the arena's next ``acquire`` waits on (and so gates the
    exchange arena's reuse too).
    """

    def __init__(self, api: CudaApi, device: torch.device, sizes: Sequence[int], exchange: Sequence[int] = ()) -> None:
        self.api = api
        self.device = device
        self.arenas = allocate("pinned host memory for 2 staging arenas", sizes, device,
                               lambda n: api.pinned(n, device))
        self.stream = api.new_stream(device)
        self.events: list[Any] = [None] * len(self.arenas)
        self.exchanged = False  # an NCCL exchange was posted (``posted``)
        # NCCL's send/recv buffers: one device arena per host arena, allocated once in the current
        # stream's order (NCCL's), so no allocation can fail between two ranks' matching posts
        cur = self._current()
        self.exchange = allocate("GPU memory for 2 exchange arenas", exchange, device,
                                 lambda n: api.empty(n, device, cur))

    def _current(self) -> Any:
        return self.api.current_stream(self.device)

    def begin(self) -> None:
        """The caller's pending work on its stream (init kernels on the targets) comes first."""
        self.api.wait_stream(self.stream, self._current())

    def acquire(self, slot: int) -> None:
        """Block until the copies that last read arena ``slot`` are done: call before ANY write into it."""
        ev = self.events[slot]
        if ev is not None:
            self.api.host_wait(ev)
            self.events[slot] = None

    def release(self, slot: int) -> None:
        """Arena ``slot``'s round is enqueued: record the event its next ``acquire`` waits on."""
        self.api.wait_stream(self.stream, self._current())  # NCCL send copies read the arena on the current stream
        ev = self.api.new_event(self.device)
        self.api.record(ev, self.stream)
        self.events[slot] = ev

    def finish(self, failed: bool = False, hold: Sequence[torch.Tensor] = ()) -> None:
        """The caller's stream follows the load; the host returns once the side stream is done.

        After a failure the host does not wait: the side stream may be stuck behind an NCCL
        receive from a dead peer, and the error must reach the caller. If this load exchanged
        over NCCL, the caller's stream does not wait on the side stream either (it would hang
        behind that receive: every later kernel of the caller's, a ``.item()``, a collective);
        the targets (``hold``), whose contents are unspecified after a failure, are recorded on
        the side stream instead, so that the allocator does not hand their memory out while it
        may still write into them.
        """
        if failed and self.exchanged:
            for t in hold:
                if self.api.device_of(t).type == "cuda":
                    self.api.record_stream(t, self.stream)
            return
        self.api.wait_stream(self._current(), self.stream)
        if not failed:
            self.api.stream_sync(self.stream)

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        """Raw bytes of a pinned span on the device (side stream), at the same address modulo ALIGN."""
        shift = host.data_ptr() % ALIGN
        buf = self._scratch(host.numel() + shift)[shift:]
        self.api.copy(buf, host, self.stream)
        return buf

    def download(self, dev: torch.Tensor) -> torch.Tensor:
        """Device bytes on the host, for a CPU target fed from a device buffer (rare, blocking)."""
        return self.api.download(dev, self.stream)

    def write(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """One piece into a target: view/stride/permute/cast run on the GPU, on the side stream."""
        if self.api.device_of(dst).type == "cuda":
            self.api.copy(dst, src, self.stream)
        else:
            dst.copy_(src)

    def realign(self, raw: torch.Tensor) -> torch.Tensor:
        """A misaligned piece's bytes moved to an aligned device buffer (side stream)."""
        if self.api.device_of(raw).type != "cuda":
            return raw.clone()
        buf = self._scratch(raw.numel())
        self.api.copy(buf, raw, self.stream)
        return buf

    def _scratch(self, nbytes: int) -> torch.Tensor:
        return allocate("GPU scratch", [nbytes], self.device, lambda n: self.api.empty(n, self.device, self.stream))[0]

    def send_buffer(self, slot: int, at: int, nbytes: int) -> torch.Tensor:
        """Bytes [at, at + nbytes) of exchange arena ``slot``: a message NCCL sends."""
        return self.exchange[slot][at: at + nbytes]

    def fill_send(self, buf: torch.Tensor, host: torch.Tensor) -> None:
        """A message's bytes into its send buffer on the current stream, which NCCL's stream waits on."""
        self.api.copy(buf, host, self._current())

    def recv_buffer(self, slot: int, at: int, nbytes: int) -> torch.Tensor:
        """Bytes [at, at + nbytes) of exchange arena ``slot``: a message NCCL receives. Its
        previous round's readers are done: ``acquire(slot)`` waited on them."""
        return self.exchange[slot][at: at + nbytes]

    def posted(self, sends: Sequence[torch.Tensor], recvs: Sequence[torch.Tensor]) -> None:
        self.exchanged = True  # the side stream may from now on wait behind NCCL
        self.api.exchange_posted(self.device, sends, recvs)

    def keep(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """A relayed piece for its next NCCL hop, device to device on the side stream (never through
        the host): ``src`` a received buffer (readable there after ``received``) or this round's
        send buffer (filled on the current stream: the side stream waits on it first), ``dst`` the
        next round's send buffer, whose exchange is then posted with ``post_after_keep``."""
        self.api.wait_stream(self.stream, self._current())
        self.api.copy(dst, src, self.stream)
        self.api.record_stream(dst, self.stream)

    def post_after_keep(self, sends: Sequence[torch.Tensor], recvs: Sequence[torch.Tensor],
                        post: Callable[[], Any]) -> Any:
        """``posted`` and ``post()`` (the grouped send/recv) with the side stream current, so that
        NCCL waits on the side stream (after its ``keep`` copies, and the current stream's send
        copies) while the caller's stream never waits on it (a dead peer's receive holds only
        the side stream, see ``finish``)."""
        self.exchanged = True
        self.api.wait_stream(self.stream, self._current())
        with self.api.use_stream(self.stream):
            self.api.exchange_posted(self.device, sends, recvs, self.stream)
            return post()

    def received(self, wait: Callable[[], None], bufs: Sequence[torch.Tensor]) -> None:
        """A round's exchange (sends only too), posted: ``wait`` (``work.wait()``) runs with the side
        stream current, so NCCL's completion orders the side stream and never the caller's: a
        receive from a dead peer holds only the side stream, which a failed load leaves behind
        (``finish``). Received device buffers become readable on the side stream, and stay
        allocated until it is done."""
        with self.api.use_stream(self.stream):
            wait()
        self.api.exchange_waited(self.device, bufs, self.stream)
        for b in bufs:
            self.api.record_stream(b, self.stream)


Stage = HostStage | DeviceStage


def allocate(what: str, sizes: Sequence[int], device: torch.device,
             alloc: Callable[[int], torch.Tensor]) -> list[torch.Tensor]:
    """``alloc`` of each size; a failure (``torch.OutOfMemoryError`` or any other) becomes a
    ``StagingMemoryError`` naming the memory and the bytes asked for."""
    out = []
    for n in sizes:
        try:
            out.append(alloc(n))
        except Exception as e:  # noqa: BLE001 - OOM and driver errors alike
            first = str(e).splitlines()[0][:300] if str(e) else ""
            raise StagingMemoryError(
                f"could not allocate {n} bytes of {what}{_listed(sizes)} for {device} "
                f"({type(e).__name__}: {first}); lower memory_budget (the arenas hold at most about that) "
                f"or free memory on {device}"
            ) from e
    return out


@contextlib.contextmanager
def finishing(stage: Stage, hold: Sequence[torch.Tensor] = ()) -> Iterator[None]:
    """``stage.finish()`` on every exit; on a failing one its own error must not hide the first
    (``hold``: the load's targets, see ``DeviceStage.finish``)."""
    try:
        yield
    except BaseException:
        try:
            stage.finish(failed=True, hold=hold)
        except Exception as e:  # noqa: BLE001 - already failing
            log.warning("finishing the device stage after a failure: %s", e)
        raise
    stage.finish()


def _listed(sizes: Sequence[int]) -> str:
    return f" ({' + '.join(map(str, sizes))} bytes in all)" if len(sizes) > 1 else ""


# ------------------------------------------------------------------ pinned host memory for saves

# Process state: whether CUDA has refused to page-lock host memory here (the first refusal's
# reason), so that the fallback warns once and later pins do not ask again.
_PIN_REFUSED: dict[str, str] = {}
_PIN_LOCK = threading.Lock()
_FALLBACK = "_streamckpt_unpinned_fallback"  # set on a block that ``pin`` did not lock


def pin_host(api: CudaApi, nbytes: int, device: torch.device) -> torch.Tensor:
    """``api.pin``: exactly ``nbytes`` page-locked; where CUDA refuses to lock host memory
    (``PinRefused``: some VM runtimes, a low ``ulimit -l``), torch's pinned allocator instead
    (rounded up, cached), or pageable memory if that fails too (device-to-host copies into it
    are synchronous). One warning per process; after it every pin takes the fallback."""
    if not _PIN_REFUSED:
        try:
            return api.pin(nbytes, device)
        except PinRefused as e:
            with _PIN_LOCK:
                first = not _PIN_REFUSED
                _PIN_REFUSED.setdefault("why", str(e))
            if first:
                log.warning("%s: staging through torch's pinned allocator instead (its blocks are rounded up to a "
                            "power of two and cached), or pageable memory with synchronous copies", e)
    try:
        t = api.pinned(nbytes, device)
    except Exception as e:  # noqa: BLE001 - any failure: pageable memory still works
        log.debug("torch's pinned allocator failed too (%s): pageable staging of %d bytes", e, nbytes)
        t = torch.empty(nbytes, dtype=torch.uint8)
    setattr(t, _FALLBACK, True)
    return t


def unpin_host(api: CudaApi, t: torch.Tensor, device: torch.device) -> None:
    """Give back what ``pin_host`` locked, under ``device`` (a fallback block needs nothing)."""
    if not getattr(t, _FALLBACK, False):
        api.unpin(t, device)


# ------------------------------------------------------------------ saves: device bytes to the host


class DeviceToHost:
    """A GPU's bytes on the host through two reused pinned blocks gated by events.

    Copies run on a side stream that first waits on the caller's stream (pending writes
    to the tensor); span j goes into block ``j % 2``; the host reads a block only after
    waiting on the event recorded after its copy, and a block is refilled only once the
    host has asked for the span after it (so it is done with it). The blocks are pinned
    at exactly the largest span asked for (``CudaApi.pin``: no power-of-two rounding, no
    allocator cache) and unpinned by ``close``. ``host_spans`` drives it.
    """

    def __init__(self, api: CudaApi, device: torch.device, block_bytes: int = SAVE_BLOCK_BYTES) -> None:
        self.api = api
        self.device = device
        self.block_bytes = block_bytes  # the largest span a caller should ask for
        self.stream = api.new_stream(device)
        self.blocks: list[torch.Tensor | None] = [None, None]
        self.events = [api.new_event(device), api.new_event(device)]
        self._slot = 0

    def fit(self, nbytes: int) -> None:
        """Both blocks hold at least ``nbytes`` (the largest span about to be copied); call only
        while no copy into them is pending."""
        for slot, block in enumerate(self.blocks):
            if block is None or block.numel() < nbytes:
                if block is not None:
                    unpin_host(self.api, block, self.device)
                self.blocks[slot] = None  # the old block goes before the new one is pinned
                self.blocks[slot] = pin_host(self.api, nbytes, self.device)

    def flat(self, t: torch.Tensor) -> torch.Tensor:
        """``t``'s elements as flat uint8 on the device, ordered after the caller's stream."""
        self.api.wait_stream(self.stream, self.api.current_stream(self.device))
        t = t.detach()
        if t.dim() == 0:
            t = t.reshape(1)
        if t.is_contiguous():
            self.api.record_stream(t, self.stream)
            return t.reshape(-1).view(torch.uint8)
        nbytes = t.numel() * t.element_size()
        buf = self.api.empty(nbytes, self.device, self.stream)
        self.api.copy(buf.view(t.dtype).view(t.shape), t, self.stream)
        return buf

    def issue(self, data: torch.Tensor, lo: int, n: int) -> tuple[int, torch.Tensor]:
        """Enqueue the copy of ``data[lo:lo+n]`` into the next block: (its slot, the block's span)."""
        slot = self._slot
        self._slot ^= 1
        block = self.blocks[slot]
        if block is None or block.numel() < n:  # larger than ``fit`` said: this block only (the other may be busy)
            if block is not None:
                unpin_host(self.api, block, self.device)
            self.blocks[slot] = None
            block = self.blocks[slot] = pin_host(self.api, n, self.device)
        span = block[:n]
        self.api.copy(span, data[lo:lo + n], self.stream)
        self.api.record(self.events[slot], self.stream)
        return slot, span

    def ready(self, slot: int) -> None:
        """Block the host until the copy into block ``slot`` is done."""
        self.api.host_wait(self.events[slot])

    def spans(self, t: torch.Tensor, step: int) -> Iterator[torch.Tensor]:
        """Consecutive host spans of one tensor's bytes, ``step`` bytes each but the last; a span
        stays valid until the next one is requested."""
        piece = SavePiece(lambda: t, self.api.device_of(t), t.numel() * t.element_size(), step)
        for _, span, _ in host_spans([piece], lambda _dev: self):
            if span.numel():
                yield span

    def close(self) -> None:
        """Wait for the side stream and unpin the blocks."""
        self.api.stream_sync(self.stream)
        for slot, block in enumerate(self.blocks):
            if block is not None:
                unpin_host(self.api, block, self.device)
            self.blocks[slot] = None


@dataclass(frozen=True, slots=True)
class SavePiece:
    """One item's bytes to bring to the host: ``tensor()`` gives its tensor (called only when its
    bytes are due: a staged copy may not exist before), ``device`` is where they live."""

    tensor: Callable[[], torch.Tensor]
    device: torch.device
    nbytes: int
    step: int  # a CUDA piece's span size


@dataclass(frozen=True, slots=True)
class _Cut:
    item: int
    device: torch.device | None  # None: host memory, read in place
    lo: int
    n: int
    last: bool  # the item's last span


def _cuts(pieces: Sequence[SavePiece]) -> list[_Cut]:
    out: list[_Cut] = []
    for i, p in enumerate(pieces):
        if p.device.type != "cuda" or p.nbytes == 0:
            out.append(_Cut(i, None, 0, p.nbytes, True))
            continue
        step = max(1, p.step)
        out += [_Cut(i, p.device, lo, min(step, p.nbytes - lo), lo + step >= p.nbytes)
                for lo in range(0, p.nbytes, step)]
    return out


def host_spans(
    pieces: Sequence[SavePiece], d2h: Callable[[torch.device], DeviceToHost],
) -> Iterator[tuple[int, torch.Tensor, bool]]:
    """Every piece's bytes as host spans, in order: ``(piece index, span, last span of the piece)``.

    A host piece is one span, read in place (a CUDA piece of no bytes too, as an empty
    span); a CUDA piece is cut into spans of at most its ``step`` bytes and copied through
    ``d2h(device)``'s two pinned blocks. The copy of the next device span — of the same
    piece or of a later one — is enqueued before the host waits for this one: the GPU
    copies item k+1 while the host checksums and uploads item k. A span stays valid
    until the next one is requested.
    """
    cuts = _cuts(pieces)
    later: list[int | None] = [None] * len(cuts)  # index of the next device cut after each cut
    nxt: int | None = None
    for j in range(len(cuts) - 1, -1, -1):
        later[j] = nxt
        if cuts[j].device is not None:
            nxt = j
    sizes: dict[torch.device, int] = {}
    for c in cuts:
        if c.device is not None:
            sizes[c.device] = max(sizes.get(c.device, 0), c.n)
    for dev, n in sizes.items():
        d2h(dev).fit(n)
    flats: dict[int, torch.Tensor] = {}
    issued: dict[int, tuple[DeviceToHost, int, torch.Tensor]] = {}

    def issue(j: int) -> None:
        c = cuts[j]
        stage = d2h(c.device)  # type: ignore[arg-type]
        if c.item not in flats:
            flats[c.item] = stage.flat(pieces[c.item].tensor())
        slot, span = stage.issue(flats[c.item], c.lo, c.n)
        if c.last:
            del flats[c.item]  # the side stream holds it (record_stream, or allocated there)
        issued[j] = (stage, slot, span)

    if nxt is not None:
        issue(nxt)
    for j, c in enumerate(cuts):
        if c.device is None:
            yield c.item, _host_bytes(pieces[c.item].tensor()), c.last
            continue
        stage, slot, span = issued.pop(j)
        k = later[j]
        if k is not None:
            issue(k)  # before the host waits for this span: the overlap
        stage.ready(slot)
        yield c.item, span, c.last


def _host_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a host tensor's elements (a copy when not contiguous)."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dim() == 0:
        t = t.reshape(1)
    if t.device.type != "cpu":
        t = t.cpu()  # another accelerator (or a CUDA tensor without a GPU stand-in): a plain copy
    return t.reshape(-1).view(torch.uint8)
