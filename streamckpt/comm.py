"""The few torch.distributed calls streamckpt makes, behind one small class.

``Comm`` carries bytes (JSON documents, never pickles), agrees on failure so
that an error on one rank raises on every rank, and runs one grouped
send/recv per pipeline round. ``SoloComm`` is the single-process case.
Every call is bounded by the process group's timeout.

Which tensors each call carries follows the group's backends (``device``):
small collectives on the host when the group has a CPU backend (gloo, or
``"cpu:gloo,cuda:nccl"``), else on this rank's GPU; the rounds' data on this
rank's GPU when the group has NCCL for CUDA tensors — except, on a mixed
``"cpu:gloo,cuda:nccl"`` group, a load in which no rank has CUDA targets
(``choose_data_plane``): it stays on gloo. This rank's GPU is chosen once
(``device.choose_device``), never taken from the current device alone.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterator, Sequence

import torch

from . import errors as _errors
from .core.targets import TargetSpec
from .cuda import device as _device
from .cuda.runtime import CudaApi, TorchCuda
from .errors import CheckpointError, PeerError
from .plan import specwire

log = logging.getLogger(__name__)

PEER_WAIT_ENV = "STREAMCKPT_PEER_WAIT_WARN"  # seconds a rank waits for its peers to arrive before it warns
PEER_WAIT_DEFAULT = 60.0
AGREE_EVERY_ON_GPU = 8  # rounds between failure agreements when each one syncs a GPU with the host
# rounds between failure agreements on a CPU backend: each is a barrier of every rank, and one
# per round kept the readers of a CPU-bound reshard idle (BENCHMARKS.md, the tier resume)
AGREE_EVERY_ON_CPU = 4


@dataclass(slots=True)
class P2P:
    peer: int  # group rank
    tensor: torch.Tensor
    tag: int


def encode_error(exc: BaseException | None, rank: int) -> dict[str, Any] | None:
    if exc is None:
        return None
    cls = type(exc).__name__ if isinstance(exc, CheckpointError) else "CheckpointError"
    return {"rank": rank, "cls": cls, "msg": str(exc) or type(exc).__name__, "type": type(exc).__name__}


def raise_agreed(failures: Sequence[dict[str, Any]], own: BaseException | None) -> None:
    """Raise on this rank after an agreed failure: its own error, or a peer's as the same class."""
    if own is not None:
        raise own
    first = min(failures, key=lambda f: f["rank"])
    cls = getattr(_errors, first["cls"], None)
    if not (isinstance(cls, type) and issubclass(cls, CheckpointError)):
        cls = PeerError
    msg = f"rank {first['rank']} failed: {first['msg']}"
    if cls is _errors.MissingKeysError:
        raise _errors.MissingKeysError(msg)
    exc = cls(msg)
    raise exc


class SoloComm:
    """One process, no group: every collective is the identity."""

    rank = 0
    world_size = 1
    device = torch.device("cpu")
    data_device = torch.device("cpu")
    backend = "none"
    agree_every = 1

    def prefer_device(self, devices: set[torch.device]) -> None:
        return None

    def choose_data_plane(self, cuda_targets: bool) -> None:
        return None

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        return [data]

    def broadcast_bytes(self, data: bytes | None, src: int = 0) -> bytes:
        return data or b""

    def agree(self, exc: BaseException | None) -> None:
        if exc is not None:
            raise exc

    def max_ints(self, values: list[int]) -> list[int]:
        return list(values)

    def gather_ints(self, values: list[int]) -> list[list[int]]:
        return [list(values)]

    def open_exchange(self) -> None:
        return None

    def exchange(self, sends: Sequence[P2P], recvs: Sequence[P2P]) -> list[Any]:
        if sends or recvs:
            raise RuntimeError("internal: point-to-point traffic in a single-process load")
        return []

    def wait(self, works: Sequence[Any]) -> None:
        return None

    def barrier(self) -> None:
        return None


def _backend_failure(what: str, exc: BaseException) -> PeerError:
    return PeerError(
        f"{what} failed: a peer rank died, was killed or timed out ({type(exc).__name__}: "
        f"{str(exc).splitlines()[0][:300] if str(exc) else ''}); this rank stops too"
    )


class GroupComm:
    """A torch.distributed process group (gloo on CPU, NCCL on GPU).

    Backend errors (a peer's socket closed, a collective timing out) become
    ``PeerError`` so that every surviving rank raises a ``CheckpointError``.
    """

    def __init__(self, group: Any | None, *, cuda: CudaApi | None = None) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.backends = _device.group_backends(dist, self.group)
        self.backend = ",".join(f"{d}:{b}" for d, b in sorted(self.backends.items()))
        self._cuda = cuda if cuda is not None else TorchCuda()
        self._targets: set[torch.device] = set()
        self._gpu: torch.device | None = None
        self._transport: _device.Transport | None = None
        self._host_data = False  # this load's data rides the CPU backend (choose_data_plane)
        # an agreement is a barrier (and on a GPU-only group a host sync): every few rounds
        self.agree_every = AGREE_EVERY_ON_CPU if "cpu" in self.backends else AGREE_EVERY_ON_GPU

    def prefer_device(self, devices: set[torch.device]) -> None:
        """This rank's tensors' devices: the GPU to use when the group is not bound to one
        (tensors on several GPUs are refused later, when the ranks agree on the plan)."""
        if self._gpu is None and len(devices) == 1:
            self._targets = set(devices)

    def gpu(self) -> torch.device:
        """This rank's GPU for collectives, chosen once (see ``device.choose_device``)."""
        if self._gpu is None:
            self._gpu = _device.choose_device(
                bound=_device.bound_device(self.dist, self.group),
                targets=self._targets,
                local_rank=os.environ.get("LOCAL_RANK"),
                current=self._cuda.current_device(),
                count=self._cuda.device_count(),
            )
        return self._gpu

    def _tensors(self) -> _device.Transport:
        if self._transport is None:
            self._transport = _device.transport(self.backends, self.gpu)
        return self._transport

    @property
    def device(self) -> torch.device:
        """Where the small collectives' tensors live."""
        return self._tensors().control

    @property
    def mixed(self) -> bool:
        """A CPU backend and NCCL for CUDA tensors (``"cpu:gloo,cuda:nccl"``, ``init_process_group()``
        on a GPU build): the rounds' data may take either."""
        return "cpu" in self.backends and self.backends.get("cuda") == "nccl"

    def choose_data_plane(self, cuda_targets: bool) -> None:
        """Before placing a load (a collective on a mixed group: call it on every rank): its data
        goes over NCCL only when some rank loads into CUDA tensors; a load into CPU tensors only
        keeps it on the CPU backend (gloo), with no device buffers and no blocking
        device-to-host copy per message."""
        if not self.mixed:
            return
        self._host_data = self.max_ints([1 if cuda_targets else 0])[0] == 0

    @property
    def data_device(self) -> torch.device:
        """Where the rounds' send/recv buffers live."""
        return _device.CPU if self._host_data else self._tensors().data

    def _global(self, group_rank: int) -> int:
        if self.group is self.dist.group.WORLD:
            return group_rank
        return self.dist.get_global_rank(self.group, group_rank)

    def _int_tensor(self, values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(values), dtype=torch.int64, device=self.device)

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        try:
            return self._all_gather_bytes(data)
        except RuntimeError as e:
            raise _backend_failure("gathering metadata from all ranks", e) from None

    def _all_gather_bytes(self, data: bytes) -> list[bytes]:
        sizes = [self._int_tensor([0]) for _ in range(self.world_size)]
        self.dist.all_gather(sizes, self._int_tensor([len(data)]), group=self.group)
        lens = [int(s.item()) for s in sizes]
        width = max(max(lens), 1)
        buf = torch.zeros(width, dtype=torch.uint8)
        if data:
            buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        buf = buf.to(self.device)
        out = [torch.empty(width, dtype=torch.uint8, device=self.device) for _ in range(self.world_size)]
        self.dist.all_gather(out, buf, group=self.group)
        return [bytes(o[:n].cpu().numpy().tobytes()) for o, n in zip(out, lens)]

    def broadcast_bytes(self, data: bytes | None, src: int = 0) -> bytes:
        try:
            return self._broadcast_bytes(data, src)
        except RuntimeError as e:
            raise _backend_failure(f"receiving metadata from rank {src}", e) from None

    def _broadcast_bytes(self, data: bytes | None, src: int = 0) -> bytes:
        n = self._int_tensor([len(data) if data is not None and self.rank == src else 0])
        self.dist.broadcast(n, self._global(src), group=self.group)
        size = int(n.item())
        buf = torch.empty(size, dtype=torch.uint8)
        if self.rank == src and size:
            buf.copy_(torch.frombuffer(bytearray(data or b""), dtype=torch.uint8))
        buf = buf.to(self.device)
        if size:
            self.dist.broadcast(buf, self._global(src), group=self.group)
        return bytes(buf.cpu().numpy().tobytes())

    def max_ints(self, values: list[int]) -> list[int]:
        """Element-wise maximum of every rank's ``values``."""
        t = self._int_tensor(values)
        try:
            self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX, group=self.group)
        except RuntimeError as e:
            raise _backend_failure("agreeing on the plan's rounds with all ranks", e) from None
        return [int(x) for x in t.tolist()]

    def gather_ints(self, values: list[int]) -> list[list[int]]:
        """Every rank's ``values`` (the same length everywhere), in rank order, on every rank:
        one all-gather."""
        out = [self._int_tensor([0] * len(values)) for _ in range(self.world_size)]
        try:
            self.dist.all_gather(out, self._int_tensor(values), group=self.group)
        except RuntimeError as e:
            raise _backend_failure("gathering request counts from all ranks", e) from None
        return [[int(x) for x in t.tolist()] for t in out]

    def agree(self, exc: BaseException | None) -> None:
        """All ranks learn whether any failed; if so every rank raises."""
        flag = self._int_tensor([1 if exc is not None else 0])
        try:
            self.dist.all_reduce(flag, op=self.dist.ReduceOp.MAX, group=self.group)
        except RuntimeError as e:
            if exc is not None:
                raise exc from None
            raise _backend_failure("agreeing on success with all ranks", e) from None
        if int(flag.item()) == 0:
            return
        blob = json.dumps(encode_error(exc, self.rank)).encode()
        failures = [json.loads(b) for b in self.all_gather_bytes(blob)]
        raise_agreed([f for f in failures if f], exc)

    def _on_data_device(self) -> Any:
        """NCCL's grouped send/recv wants this rank's GPU current; nothing on a host data plane."""
        dev = self.data_device
        return torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()

    def open_exchange(self) -> None:
        """Before a load's first grouped send/recv, which NCCL requires every rank to join when
        it is the group's first call on the GPU: one tiny all-reduce that every rank makes."""
        if self.data_device.type != "cuda":
            return
        try:
            with self._on_data_device():
                self.dist.all_reduce(torch.zeros(1, device=self.data_device), group=self.group)
        except RuntimeError as e:
            raise _backend_failure("opening the data exchange with all ranks", e) from None

    def exchange(self, sends: Sequence[P2P], recvs: Sequence[P2P]) -> list[Any]:
        ops = [self.dist.P2POp(self.dist.isend, s.tensor, self._global(s.peer), self.group, s.tag) for s in sends]
        ops += [self.dist.P2POp(self.dist.irecv, r.tensor, self._global(r.peer), self.group, r.tag) for r in recvs]
        if not ops:
            return []
        try:
            with self._on_data_device():
                return self.dist.batch_isend_irecv(ops)
        except RuntimeError as e:
            raise _backend_failure("exchanging data with peer ranks", e) from None

    def wait(self, works: Sequence[Any]) -> None:
        try:
            for w in works:
                w.wait()
        except RuntimeError as e:
            raise _backend_failure("exchanging data with peer ranks", e) from None

    def barrier(self) -> None:
        try:
            if self.device.type == "cuda":  # NCCL's barrier would otherwise guess the GPU
                self.dist.barrier(group=self.group, device_ids=[self.device.index])
            else:
                self.dist.barrier(group=self.group)
        except RuntimeError as e:
            raise _backend_failure("waiting for all ranks", e) from None


def make_comm(process_group: Any | None) -> SoloComm | GroupComm:
    """A group communicator when torch.distributed is initialized, else the solo one."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover
        return SoloComm()
    if process_group is None and not (dist.is_available() and dist.is_initialized()):
        return SoloComm()
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise CheckpointError(f"process_group must be a torch.distributed ProcessGroup (or None: the default "
                              f"group, when initialized), got {type(process_group).__name__}")
    if not dist.is_initialized():
        raise CheckpointError("a process_group was given, but torch.distributed is not initialized in this "
                              "process: call torch.distributed.init_process_group() first, or pass "
                              "process_group=None to work alone")
    comm = GroupComm(process_group)
    if comm.world_size == 1:
        return SoloComm()
    return comm


def group_timeout(dist: Any, group: Any) -> "timedelta | None":
    """The collective timeout ``group`` was made with (``init_process_group(timeout=...)``), read
    from its backend's options; None when no backend says (torch's default then applies).

    Why: a group streamckpt makes for its own use (the async save's) must give up when the
    training group would, not after torch's default of 30 minutes."""
    for device in getattr(group, "_device_types", ()) or ():
        try:
            timeout = group._get_backend(device).options._timeout
        except (AttributeError, RuntimeError):
            continue
        if isinstance(timeout, timedelta) and timeout.total_seconds() > 0:
            return timeout
    return None


def alone_in_launched_job(comm: SoloComm | GroupComm) -> str:
    """A hint when this process runs alone although a launcher (torchrun) started several:
    ``WORLD_SIZE`` > 1 in its environment but no group (``init_process_group`` never called),
    so each process saves or loads as a world of its own. Else ``""``."""
    raw = os.environ.get("WORLD_SIZE", "")
    if not isinstance(comm, SoloComm) or not raw.isdigit() or int(raw) <= 1:
        return ""
    return (f"; this process ran alone, as rank 0 of 1: torch.distributed is not initialized, yet "
            f"WORLD_SIZE={raw} (torchrun?): call torch.distributed.init_process_group() first, so that "
            f"the ranks save and load together")


def peer_wait_seconds() -> float:
    """``$STREAMCKPT_PEER_WAIT_WARN`` (seconds, default 60; 0 turns the warning off). A value
    that is not a number is reported and the default used: raising here, before the first
    collective, on a rank whose environment differs would leave the others waiting."""
    raw = os.environ.get(PEER_WAIT_ENV, "").strip()
    try:
        value = float(raw) if raw else PEER_WAIT_DEFAULT
    except ValueError:
        value = -1.0
    if value < 0 or value != value:
        log.warning("%s=%r is not a number of seconds >= 0; using %g", PEER_WAIT_ENV, raw, PEER_WAIT_DEFAULT)
        return PEER_WAIT_DEFAULT
    return value


@contextlib.contextmanager
def warn_if_peers_late(comm: SoloComm | GroupComm, call: str) -> Iterator[None]:
    """Warn once if this rank waits long for the others to enter ``call``.

    Why: ``sc.save`` and ``sc.load`` are collective under torch.distributed. A save wrapped
    in ``if rank == 0:`` (the ``torch.save`` habit) blocks in its first collective until the
    group's timeout (30 min by default) and says nothing; this names the likely cause while
    it waits. A rank that is only slow to arrive makes it a harmless line.
    """
    seconds = 0.0 if isinstance(comm, SoloComm) else peer_wait_seconds()
    if seconds <= 0:
        yield
        return
    timer = threading.Timer(seconds, log.warning, args=(
        "rank %d of %d has waited %g s for the other ranks of its group to enter %s: under torch.distributed "
        "it is collective, and every rank of the group must call it (one wrapped in 'if rank == 0:', as "
        "torch.save often is, waits here until the group's timeout); pass process_group= to use a subgroup "
        "(%s=0 turns this warning off)", comm.rank, comm.world_size, seconds, call, PEER_WAIT_ENV))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def gather_targets(comm: SoloComm | GroupComm, specs: list[TargetSpec], own: BaseException | None,
                   call: str = "this call") -> Sequence[Sequence[TargetSpec]]:
    """Every rank's target specs, or an agreed failure.

    Two all-gathers (``specwire``): fixed-size headers (an error, or each
    section's digest and length), then every distinct section once, in parts
    spread over the ranks holding it. Each rank receives and decodes about the
    distinct layouts' bytes, not ranks × specs.
    """
    if isinstance(comm, SoloComm):
        if own is not None:
            raise own
        return [specs]
    enc: specwire.Encoded | None = None
    if own is None:
        try:
            enc = specwire.encode(specs)
        except CheckpointError as e:
            own = e
    head = enc.header() if enc is not None else b"E" + json.dumps(encode_error(own, comm.rank)).encode()
    with warn_if_peers_late(comm, call):  # the call's first collective: where a rank-0-only call waits
        heads = comm.all_gather_bytes(head)
    failures = [json.loads(h[1:]) for h in heads if h[:1] == b"E"]
    if failures or enc is None:
        raise_agreed(failures, own)
    return specwire.exchange(enc, heads, comm.rank, comm.all_gather_bytes)
