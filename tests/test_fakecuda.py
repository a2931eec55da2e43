"""The CUDA stand-in fails where a GPU would: each check, shown on the smallest program.

``tests/fakecuda.py`` is what the GPU invariant tests trust, so each of its checks is
shown here both ways: the right program passes with the right bytes, the one missing
a wait, a ``record_stream`` or pinned memory gets wrong bytes and/or a violation. (The
same checks going red on the library's own code, with a guarded line removed, are
listed in docs/RELIABILITY.md.)
"""

from __future__ import annotations

import pytest
import torch

from fakecuda import POISON, FakeCuda

DEV = torch.device("cuda", 2)


def _fake() -> FakeCuda:
    fake = FakeCuda(current_device=0)
    fake.expect_device(DEV)
    return fake


@pytest.mark.parametrize("ordered", [True, False])
def test_nccl_receive_lands_only_when_its_op_runs(ordered: bool) -> None:
    """A read of a receive buffer ordered after NCCL (via the current stream) sees the bytes;
    one that is not sees POISON and is a race."""
    fake = _fake()
    cur, side = fake.current_stream(DEV), fake.new_stream(DEV)
    recv = fake.empty(16, DEV, cur)
    fake.exchange_posted(DEV, [], [recv])
    data = torch.arange(16, dtype=torch.uint8)
    recv.copy_(data)  # what gloo delivers during work.wait()
    fake.exchange_waited(DEV, [recv], cur)
    assert torch.equal(recv, torch.full((16,), POISON, dtype=torch.uint8))  # NCCL's op has not run
    target = fake.place(torch.zeros(16, dtype=torch.uint8), DEV)
    if ordered:
        fake.wait_stream(side, cur)
    fake.copy(target, recv, side)
    fake.synchronize()
    if ordered:
        assert torch.equal(target, data)
        assert fake.violations == []
    else:
        assert torch.equal(target, torch.full((16,), POISON, dtype=torch.uint8))
        assert [v.split(" on ")[0] for v in fake.violations] == ["race: copy (16,)->(16,)"]


@pytest.mark.parametrize("waited", [True, False])
def test_a_send_copy_run_early_for_nccl_is_checked_again_when_forced(waited: bool) -> None:
    """Gloo needs the send bytes at post time, so the send copy runs then; the host writing its
    pinned source before waiting for it is still a violation (a GPU may run it later)."""
    fake = _fake()
    cur = fake.current_stream(DEV)
    host = fake.pinned(8, DEV)
    host.fill_(1)
    send = fake.empty(8, DEV, cur)
    fake.copy(send, host, cur)
    fake.exchange_posted(DEV, [send], [])
    assert torch.equal(send, torch.ones(8, dtype=torch.uint8))  # what gloo sent
    ev = fake.new_event(DEV)
    fake.record(ev, cur)
    if waited:
        fake.host_wait(ev)
    host.fill_(2)  # the next round's fetch into the arena
    fake.synchronize()
    if waited:
        assert fake.violations == []
    else:
        assert len(fake.violations) == 1 and fake.violations[0].startswith("host-write: ")
        assert "ran early for NCCL" in fake.violations[0]


def test_a_host_wait_covers_what_the_event_stream_waited_for() -> None:
    """An event recorded right after ``wait_stream`` (no op after it) still waits for the waitee."""
    fake = _fake()
    cur, side = fake.current_stream(DEV), fake.new_stream(DEV)
    t = fake.place(torch.zeros(4), DEV)
    fake.launch(DEV, lambda: t.fill_(7), writes=[t])
    fake.wait_stream(side, cur)
    ev = fake.new_event(DEV)
    fake.record(ev, side)
    fake.host_wait(ev)
    assert torch.equal(t, torch.full((4,), 7.0))


@pytest.mark.parametrize("pinned", [True, False])
def test_a_non_blocking_copy_from_pageable_memory_is_a_violation(pinned: bool) -> None:
    fake = _fake()
    side = fake.new_stream(DEV)
    src = fake.pinned(32, DEV) if pinned else torch.empty(32, dtype=torch.uint8)
    src.copy_(torch.arange(32, dtype=torch.uint8))
    dst = fake.empty(32, DEV, side)
    fake.copy(dst, src, side)
    fake.stream_sync(side)
    assert torch.equal(dst, torch.arange(32, dtype=torch.uint8))
    if pinned:
        assert fake.violations == []
    else:
        assert len(fake.violations) == 1 and fake.violations[0].startswith("pageable: ")
        assert "pageable host source" in fake.violations[0]


@pytest.mark.parametrize("recorded", [True, False])
def test_a_freed_block_is_reused_under_a_pending_reader_without_record_stream(recorded: bool) -> None:
    """The caching allocator hands a freed block back to its stream at once unless it was
    ``record_stream``-ed on the stream still reading it: then the reader gets the new bytes."""
    fake = _fake()
    cur, side = fake.current_stream(DEV), fake.new_stream(DEV)
    buf = fake.empty(64, DEV, cur)
    first_ptr = buf.data_ptr()
    buf.fill_(7)  # its bytes (a kernel's closure would keep it allocated)
    target = fake.place(torch.zeros(64, dtype=torch.uint8), DEV)
    fake.wait_stream(side, cur)
    fake.copy(target, buf, side)  # pending: nothing forced the side stream yet
    if recorded:
        fake.record_stream(buf, side)
    del buf  # the caller drops it; the side stream's copy has not run
    again = fake.empty(64, DEV, cur)
    assert (again.data_ptr() == first_ptr) is (not recorded)
    fake.launch(DEV, lambda: again.fill_(9), writes=[again])
    fake.stream_sync(cur)  # the caller's stream first: its new kernel runs before the side copy
    fake.synchronize()
    if recorded:
        assert torch.equal(target, torch.full((64,), 7, dtype=torch.uint8))
        assert fake.violations + fake.check_record_stream() == []
    else:
        assert torch.equal(target, torch.full((64,), 9, dtype=torch.uint8))
        assert any(v.startswith("race: ") for v in fake.violations), fake.violations
        assert any(v.startswith("no-record-stream: ") for v in fake.check_record_stream())


def test_an_injected_allocation_failure_is_torch_oom() -> None:
    fake = FakeCuda(fail_alloc=lambda kind, n: kind == "empty" and n > 100)
    cur = fake.current_stream(DEV)
    assert fake.empty(100, DEV, cur).numel() == 100
    with pytest.raises(torch.OutOfMemoryError, match=r"Tried to allocate 101 bytes \(empty, fake\)"):
        fake.empty(101, DEV, cur)
    assert fake.pinned(1000, DEV).numel() == 1000
    assert fake.counts["failed empty"] == 1


def test_the_stand_ins_cudart_has_exactly_torchs_methods() -> None:
    """torch/csrc/cuda/shared/cudart.cpp binds these eight and no cudaGetLastError (issue 42): a
    call to another one must fail on CPU as it fails on the GPU."""
    from fakecuda import TORCH_CUDART, FakeCudart

    assert TORCH_CUDART == ("cudaGetErrorString", "cudaProfilerStart", "cudaProfilerStop", "cudaHostRegister",
                            "cudaHostUnregister", "cudaStreamCreate", "cudaStreamDestroy", "cudaMemGetInfo")
    assert {m for m in dir(FakeCudart) if m.startswith("cuda")} == set(TORCH_CUDART)
    with pytest.raises(AttributeError):
        FakeCudart().cudaGetLastError()  # type: ignore[attr-defined]
