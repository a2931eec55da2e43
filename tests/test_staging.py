"""The staging ring: copies carved out of one block in FIFO order, never more than the
budget live, waiting for releases, stopped by fail()."""

from __future__ import annotations

import threading
import time

import torch

from streamckpt.saving.staging import StagingArea, copy_all


def _offset(area: StagingArea, t: torch.Tensor) -> int:
    assert area.block is not None
    return t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size() - area.block.data_ptr()


def _copy_soon(area: StagingArea, t: torch.Tensor, seconds: float = 5.0) -> torch.Tensor:
    """``area.copy(t)``, failing (not hanging) when it does not return in time."""
    out: list[torch.Tensor | None] = []
    worker = threading.Thread(target=lambda: out.append(area.copy(t)), daemon=True)
    worker.start()
    worker.join(seconds)
    if not out:
        area.fail()
        raise AssertionError("copy still waiting for room that should be free")
    assert out[0] is not None
    return out[0]


def test_copies_are_exact_views_of_one_block_and_wrap_around() -> None:
    area = StagingArea(1024)
    src = [torch.arange(64, dtype=torch.int32), torch.full((50,), 2.5, dtype=torch.float64),
           torch.tensor(7, dtype=torch.int16)]
    got = [area.copy(t) for t in src]
    assert [_offset(area, g) for g in got] == [0, 256, 704]  # 64-byte aligned, in order
    for s, g in zip(src, got):
        assert torch.equal(s, g) and g.dtype == s.dtype and g.shape == s.shape
    src[0].zero_()
    assert got[0].sum().item() == sum(range(64))  # a copy: the caller may change its tensor
    area.release()  # the oldest copies (offsets 0 and 256) are written
    area.release()
    d = _copy_soon(area, torch.ones(75, dtype=torch.int32))  # 300 bytes: no room after 768, wraps to 0
    assert _offset(area, d) == 0 and torch.equal(got[2], src[2]) and area.peak <= 1024


def test_a_copy_waits_for_room_and_fail_stops_it() -> None:
    area = StagingArea(512)
    area.copy(torch.zeros(100, dtype=torch.int32))  # 400 bytes
    seen: list[object] = []

    def stage() -> None:
        seen.append(area.copy(torch.ones(50, dtype=torch.int32)))  # 200 bytes: waits for the release

    t = threading.Thread(target=stage)
    t.start()
    time.sleep(0.1)
    assert not seen  # still waiting: 400 + 200 > 512
    area.release()
    t.join(5)
    assert len(seen) == 1 and torch.equal(seen[0], torch.ones(50, dtype=torch.int32))
    area.copy(torch.zeros(64, dtype=torch.int32))  # 256 bytes behind it
    t = threading.Thread(target=stage)
    t.start()
    time.sleep(0.1)
    area.fail()
    t.join(5)
    assert seen[-1] is None  # stopped, not hung


def test_an_item_larger_than_the_block_gets_memory_of_its_own_when_alone() -> None:
    area = StagingArea(256)
    big = torch.arange(1000, dtype=torch.int64)
    got = area.copy(big)
    assert torch.equal(got, big) and got.untyped_storage().data_ptr() != area.block.data_ptr()
    area.release()
    small = area.copy(torch.ones(8))
    assert _offset(area, small) == 0


def test_without_a_budget_every_copy_is_its_own() -> None:
    area = StagingArea(None)
    got = area.copy(torch.arange(10))
    assert torch.equal(got, torch.arange(10))
    area.release()


def test_without_a_budget_the_share_sized_block_is_reused() -> None:
    sizes = [4000, 64, 1]
    share = StagingArea.needed(sizes)
    assert share == 4032 + 64 + 64  # each copy 64-byte aligned
    area = StagingArea(None, size=share)
    assert area.block is not None and area.block.numel() == share
    first = [area.copy(torch.full((n,), i + 1, dtype=torch.uint8)) for i, n in enumerate(sizes)]
    assert [_offset(area, t) for t in first] == [0, 4032, 4096]  # all live at once, in one block
    assert all(torch.equal(t, torch.full((n,), i + 1, dtype=torch.uint8)) for i, (t, n) in enumerate(zip(first, sizes)))
    for _ in sizes:
        area.release()
    assert area.fits(None, None, share) and area.fits(None, None, share - 100)
    assert not area.fits(None, None, share + 1) and not area.fits(share, None, share)
    area.reset()
    again = area.copy(torch.full((100,), 9, dtype=torch.uint8))
    assert _offset(area, again) == 0 and torch.equal(again, torch.full((100,), 9, dtype=torch.uint8))


def test_copy_all_spreads_pieces_over_threads_and_copies_every_byte() -> None:
    """Reserved room filled by ``copy_all``: tensors larger than a piece are cut, odd
    sizes, bools, 0-d and non-contiguous sources all arrive exact; the copies own their
    bytes (the sources change afterwards, the copies do not)."""
    src = [torch.arange((5 << 20) // 4 + 3, dtype=torch.int32),  # > 1 piece, ragged tail
           torch.rand(33, 7, dtype=torch.float64).to(torch.bfloat16),
           torch.tensor([True, False, True]), torch.tensor(3.5),
           torch.arange(64, dtype=torch.int64).reshape(8, 8).t(),  # not contiguous
           torch.empty(0, 4)]
    area = StagingArea(None, size=StagingArea.needed(t.numel() * t.element_size() for t in src))
    outs = [area.reserve(t) for t in src]
    assert all(o is not None for o in outs)
    copy_all([(o, t) for o, t in zip(outs, src)], workers=3)
    expected = [t.clone() for t in src]
    for t in src:
        if t.numel():
            t.zero_() if t.dtype != torch.bool else t.fill_(False)
    for o, e in zip(outs, expected):
        assert o.dtype == e.dtype and o.shape == e.shape and torch.equal(o, e)
    assert area.peak == StagingArea.needed(t.numel() * t.element_size() for t in src)


def test_copy_all_raises_a_workers_error_on_the_caller() -> None:
    dst = torch.empty(3 << 20, dtype=torch.uint8)
    src = torch.ones(3 << 20, dtype=torch.uint8)
    bad = (torch.empty(5), torch.ones(6))  # shapes differ: copy_ raises
    try:
        copy_all([(dst, src), bad], workers=2)
    except RuntimeError as e:
        assert "size" in str(e) or "match" in str(e)
    else:
        raise AssertionError("copy_all swallowed a failing copy")


def _vma_flags(address: int) -> list[str] | None:
    """The ``VmFlags`` of the mapping that holds ``address`` (Linux ``/proc/self/smaps``)."""
    inside = False
    try:
        lines = open("/proc/self/smaps").read().splitlines()
    except OSError:
        return None
    for line in lines:
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    return None


def test_a_cpu_block_is_left_to_the_kernels_default_pages() -> None:
    """No ``MADV_HUGEPAGE`` on the staging block: on VMs that hand 2 MiB blocks back to the
    host, first-touching huge pages cost ~6x the CPU of default pages per staged byte
    (the 1 GiB ``async_save`` blocking cliff of issue 35). ``hg`` in ``VmFlags`` is the advice."""
    area = StagingArea(None, size=8 << 20)
    assert area.block is not None
    flags = _vma_flags(area.block.data_ptr())
    if flags is None:
        import pytest

        pytest.skip("no /proc/self/smaps here (not Linux)")
    assert "hg" not in flags
    area.block.fill_(7)  # ordinary memory: written and read back
    assert int(area.block[-1]) == 7 and int(area.block.sum()) == 7 * (8 << 20)
    area.close()
