"""Device choice and backend detection (streamckpt.cuda.device), every combination, no GPU needed.

The expected values are the rules as a table: the group's bound device, else the
targets' device, else LOCAL_RANK (when it names a visible GPU), else the current
device; small collectives on the host when the group has a CPU backend; the rounds'
data on the GPU when CUDA tensors go over NCCL.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import streamckpt as sc
from distributed import run_ranks
from streamckpt.comm import AGREE_EVERY_ON_CPU
from fakecuda import FakeCuda
from streamckpt.cuda.device import (
    Transport,
    bound_device,
    choose_device,
    group_backends,
    parse_backends,
    place,
    transport,
)
from streamckpt.errors import CheckpointError, IncompatibleStateDictError

CPU = torch.device("cpu")


def cuda(i: int) -> torch.device:
    return torch.device("cuda", i)


@pytest.mark.parametrize("text,expected", [
    ("nccl", {"cuda": "nccl"}),
    ("gloo", {"cpu": "gloo", "cuda": "gloo"}),
    ("cpu:gloo,cuda:nccl", {"cpu": "gloo", "cuda": "nccl"}),
    (" CPU:Gloo , CUDA:NCCL ", {"cpu": "gloo", "cuda": "nccl"}),
    ("cuda:nccl", {"cuda": "nccl"}),
    ("cpu:gloo", {"cpu": "gloo"}),
    ("mpi", {"cpu": "mpi", "cuda": "mpi"}),
    ("undefined", {}),
    ("", {}),
])
def test_parse_backends(text: str, expected: dict[str, str]) -> None:
    assert parse_backends(text) == expected


@pytest.mark.parametrize("text", ["cpu:", "cpu:gloo,nccl", ":gloo"])
def test_parse_backends_rejects_malformed(text: str) -> None:
    with pytest.raises(CheckpointError, match="expected device:backend"):
        parse_backends(text)


def _dist(backend: str, config: str | None) -> Any:
    """torch.distributed's two backend queries, as a given torch version answers them."""
    ns = SimpleNamespace(get_backend=lambda g: backend, group=SimpleNamespace(WORLD=None))
    if config is not None:
        ns.get_backend_config = lambda g: config
    return ns


@pytest.mark.parametrize("backend,config,expected", [
    ("undefined", "cpu:gloo,cuda:nccl", {"cpu": "gloo", "cuda": "nccl"}),  # init_process_group() on a GPU build
    ("undefined", "cpu:gloo", {"cpu": "gloo"}),  # init_process_group() on a CPU build
    ("nccl", "cuda:nccl", {"cuda": "nccl"}),
    ("gloo", "cpu:gloo,cuda:gloo", {"cpu": "gloo", "cuda": "gloo"}),
    ("nccl", None, {"cuda": "nccl"}),  # a torch without get_backend_config
    ("cpu:gloo,cuda:nccl", None, {"cpu": "gloo", "cuda": "nccl"}),
])
def test_group_backends(backend: str, config: str | None, expected: dict[str, str]) -> None:
    assert group_backends(_dist(backend, config), object()) == expected


def test_group_backends_unknown_raises() -> None:
    with pytest.raises(CheckpointError, match="cannot tell which backend"):
        group_backends(_dist("undefined", None), object())


def test_bound_device_from_group_or_world() -> None:
    world = SimpleNamespace(bound_device_id=cuda(3))
    dist = SimpleNamespace(group=SimpleNamespace(WORLD=world))
    assert bound_device(dist, SimpleNamespace(bound_device_id=cuda(1))) == cuda(1)
    assert bound_device(dist, SimpleNamespace(bound_device_id=None)) == cuda(3)  # sub-groups inherit
    assert bound_device(SimpleNamespace(group=SimpleNamespace(WORLD=None)), object()) is None


BOUND = [None, cuda(2)]
TARGETS = [set(), {CPU}, {cuda(3)}, {CPU, cuda(3)}, {cuda(3), cuda(5)}]
LOCAL_RANK = [None, "1", "7", "x"]
COUNT, CURRENT = 4, 0


def expected_device(bound: torch.device | None, targets: set[torch.device], local_rank: str | None) -> Any:
    """The rule, written out: a class for the one error case."""
    if bound is not None:
        return bound
    gpus = {d for d in targets if d.type == "cuda"}
    if len(gpus) > 1:
        return IncompatibleStateDictError
    if gpus:
        return gpus.pop()
    if local_rank is not None and local_rank.isdigit() and int(local_rank) < COUNT:
        return cuda(int(local_rank))
    return cuda(CURRENT)


@pytest.mark.parametrize("bound,targets,local_rank", list(itertools.product(BOUND, TARGETS, LOCAL_RANK)))
def test_choose_device_every_combination(bound: Any, targets: set[torch.device], local_rank: Any) -> None:
    want = expected_device(bound, targets, local_rank)
    kwargs = dict(bound=bound, targets=targets, local_rank=local_rank, current=CURRENT, count=COUNT)
    if want is IncompatibleStateDictError:
        with pytest.raises(IncompatibleStateDictError, match="2 GPUs"):
            choose_device(**kwargs)
    else:
        assert choose_device(**kwargs) == want


# backend string -> (control on the GPU, data on the GPU)
PLANES = {
    "nccl": (True, True),
    "gloo": (False, False),
    "cpu:gloo,cuda:nccl": (False, True),
    "cpu:gloo": (False, False),
    "cuda:nccl": (True, True),
}


@pytest.mark.parametrize("text,bound,targets,local_rank",
                         list(itertools.product(PLANES, BOUND, TARGETS[:4], LOCAL_RANK)))
def test_transport_every_combination(text: str, bound: Any, targets: set[torch.device], local_rank: Any) -> None:
    asked = []

    def gpu() -> torch.device:
        asked.append(1)
        return choose_device(bound=bound, targets=targets, local_rank=local_rank, current=CURRENT, count=COUNT)

    control_gpu, data_gpu = PLANES[text]
    dev = expected_device(bound, targets, local_rank)
    assert transport(parse_backends(text), gpu) == Transport(dev if control_gpu else CPU, dev if data_gpu else CPU)
    assert bool(asked) == (control_gpu or data_gpu), "the GPU is chosen only when one is used"


def test_undefined_backend_resolves_through_the_config() -> None:
    """init_process_group() without a backend on a GPU build: get_backend says "undefined"."""
    backends = group_backends(_dist("undefined", "cpu:gloo,cuda:nccl"), object())
    assert transport(backends, lambda: cuda(1)) == Transport(CPU, cuda(1))


def test_place() -> None:
    fake = FakeCuda(current_device=0)
    a = fake.place(torch.zeros(3), cuda(2))
    b = fake.place(torch.zeros(3), cuda(5))
    c = torch.zeros(3)
    assert place(fake, [c], CPU).device is None
    p = place(fake, [a, c], CPU)
    assert (p.device, p.data_on_device, p.is_device(a), p.is_device(c)) == (cuda(2), False, True, False)
    p = place(fake, [c], cuda(4))  # NCCL data plane, CPU targets only: stage through the group's GPU
    assert (p.device, p.data_on_device) == (cuda(4), True)
    assert place(fake, [a], cuda(2)).data_on_device
    with pytest.raises(IncompatibleStateDictError, match="2 GPUs"):
        place(fake, [a, b], CPU)
    with pytest.raises(CheckpointError, match="on cuda:2 but its process group exchanges data on cuda:4"):
        place(fake, [a], cuda(4))


# ----------------------------------------------------------------------------- a real group without a backend


def no_backend_worker(rank: int, world: int, root: str) -> dict[str, Any]:
    import torch.distributed as dist

    from streamckpt.comm import make_comm

    comm = make_comm(None)
    full = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    lo, hi = 3 * rank, 3 * rank + 3
    sc.save({"w": sc.ShardedTensor(full[lo:hi].clone(), (6, 10), (lo, 0))}, root)
    t = torch.zeros(6, 5)
    res = sc.load({"w": sc.ShardedTensor(t, (6, 10), (0, 5 * rank))}, root)
    return {
        "get_backend": str(dist.get_backend()), "backends": comm.backends, "device": str(comm.device),
        "data_device": str(comm.data_device), "agree_every": comm.agree_every,
        "ok": bool(torch.equal(t, full[:, 5 * rank: 5 * rank + 5])), "received": res.bytes_received,
    }


def test_init_process_group_without_backend(tmp_path: Any) -> None:
    out = [r.unwrap() for r in run_ranks(2, no_backend_worker, kwargs={"root": str(tmp_path)}, backend=None)]
    for r in out:
        assert r["get_backend"] == "undefined"
        assert r["backends"] == {"cpu": "gloo"}
        assert (r["device"], r["data_device"], r["agree_every"]) == ("cpu", "cpu", AGREE_EVERY_ON_CPU)
        assert r["ok"]
    assert sum(r["received"] for r in out) > 0
