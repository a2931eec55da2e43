"""The GPU path on a real GPU (skipped without CUDA): what tests/test_gpu_invariants.py
checks against a stand-in, here against CUDA itself.

Each test makes the caller's stream busy (``torch.cuda._sleep``) before its init
kernels, so those kernels are still pending when streamckpt enqueues its copies: a
load (or save) that did not wait on the caller's stream would be overwritten by (or
read before) them. Local files only: no S3 server needed on the GPU machine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import streamckpt as sc
from distributed import run_ranks
from streamckpt.cuda.device import DeviceToHost
from streamckpt.cuda.runtime import TorchCuda

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SPIN = 200_000_000  # GPU cycles the caller's stream stays busy (~0.1 s) before its init kernels


def full(name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(shape, generator=g).to(dtype)


def _save_cpu(root: str, compression: str | None = None) -> dict[str, torch.Tensor]:
    fulls = {"w": full("w", (512, 384)), "b": full("b", (4099,), torch.bfloat16), "i": full("i", (37, 5), torch.float16)}
    sc.save(fulls, root, compression=compression, overwrite=True)
    return fulls


def _pending_init(tensors: list[torch.Tensor]) -> None:
    """Init kernels still queued behind a busy caller's stream when the load starts."""
    torch.cuda._sleep(SPIN)
    for t in tensors:
        t.fill_(-1)


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_single_gpu_load_after_pending_init_kernels(tmp_path: Path, compression: Any) -> None:
    fulls = _save_cpu(str(tmp_path), compression)
    dev = torch.device("cuda", torch.cuda.current_device())
    w = torch.empty(256, 384, device=dev)  # a TP row slice
    b = torch.empty(4099, dtype=torch.float32, device=dev)  # a cast on the way in
    i = torch.empty(5, 37, dtype=torch.float16, device=dev)  # a transpose on the way in
    _pending_init([w, b, i])
    res = sc.load({"w": sc.ShardedTensor(w, (512, 384), (256, 0)), "b": b, "i": i}, str(tmp_path),
                  transforms=[{"cast": {"key": "b", "dtype": "float32"}}, {"transpose": {"key": "i", "dims": [1, 0]}}],
                  memory_budget=64 << 10)
    assert res.rounds > 2
    assert torch.equal(w.cpu(), fulls["w"][256:])
    assert torch.equal(b.cpu(), fulls["b"].float())
    assert torch.equal(i.cpu(), fulls["i"].t())


def gloo_cuda_worker(rank: int, world: int, root: str) -> dict[str, Any]:
    """Two gloo ranks with CUDA targets on the one GPU: pinned arenas, H2D on a side stream,
    receive-only rounds (read once), pending init kernels."""
    fulls = {"w": full("w", (512, 384)), "b": full("b", (4099,), torch.bfloat16), "i": full("i", (37, 5), torch.float16)}
    dev = torch.device("cuda", 0)
    w = torch.empty(512, 192, device=dev)
    rep = torch.empty(4099, dtype=torch.bfloat16, device=dev)  # replicated: each rank reads half, receives half
    _pending_init([w, rep])
    res = sc.load({"w": sc.ShardedTensor(w, (512, 384), (0, 192 * rank)), "b": rep}, root, strict=False,
                  memory_budget=64 << 10)
    return {"w": bool(torch.equal(w.cpu(), fulls["w"][:, 192 * rank: 192 * rank + 192])),
            "b": bool(torch.equal(rep.cpu(), fulls["b"])), "received": res.bytes_received, "rounds": res.rounds}


def test_two_gloo_ranks_with_cuda_targets_on_one_gpu(tmp_path: Path) -> None:
    _save_cpu(str(tmp_path))
    out = [r.unwrap() for r in run_ranks(2, gloo_cuda_worker, kwargs={"root": str(tmp_path)}, timeout=240)]
    assert all(r["w"] and r["b"] for r in out), out
    assert all(r["received"] > 0 for r in out), out


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_cuda_save_sees_pending_kernels(tmp_path: Path, compression: Any) -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    want = {"w": full("w", (1024, 1030)), "h": full("h", (777,), torch.bfloat16)}
    sd = {k: torch.zeros(v.shape, dtype=v.dtype, device=dev) for k, v in want.items()}
    src = {k: v.to(dev) for k, v in want.items()}
    torch.cuda.synchronize()
    torch.cuda._sleep(SPIN)
    for k in sd:
        sd[k].copy_(src[k])  # pending when the save starts
    sd["wt"] = sd["w"].t()  # non-contiguous
    sc.save(sd, str(tmp_path), compression=compression)
    got = sc.load_full(str(tmp_path))
    assert torch.equal(got["w"], want["w"]) and torch.equal(got["h"], want["h"])
    assert torch.equal(got["wt"], want["w"].t())


def test_device_to_host_blocks_on_a_gpu() -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    n = (3 << 20) + 12345
    src = torch.empty(n, dtype=torch.uint8, device=dev)
    torch.cuda._sleep(SPIN)
    src.copy_((torch.arange(n, device=dev) % 251).to(torch.uint8))
    d2h = DeviceToHost(TorchCuda(), dev, block_bytes=1 << 20)
    got = torch.cat([span.clone() for span in d2h.spans(src, 1 << 20)])
    d2h.close()
    assert torch.equal(got, (torch.arange(n) % 251).to(torch.uint8))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_targets_on_another_gpu_than_the_current_one(tmp_path: Path) -> None:
    fulls = _save_cpu(str(tmp_path))
    torch.cuda.set_device(0)
    w = torch.empty(512, 384, device="cuda:1")
    with torch.cuda.device(1):
        _pending_init([w])
    sc.load({"w": w}, str(tmp_path), strict=False, memory_budget=64 << 10)
    assert torch.equal(w.cpu(), fulls["w"])
