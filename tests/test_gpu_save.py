"""Saves of CUDA tensors, checked on CPU against the recording CUDA stand-in (``fakecuda``).

The stand-in runs device work only when the host forces it, as late as the recorded
waits allow, so a missing wait shows as wrong bytes or a recorded violation. Checked:

* ``save``: the D2H copy of item k+1 is enqueued before the host waits for item k's
  copy (so it runs while the host checksums and uploads item k), and the bytes load back;
* pinned memory is asked for at exactly the sizes needed (the largest item for ``save``,
  the staging budget or the share for ``async_save``), never a power of two, and given
  back: at the end of a ``save``, by ``SaveHandle.release_staging()``, and when the
  training group goes away;
* ``async_save``'s copies go through ``CudaApi`` (the stand-in sees them) after the
  caller's pending kernels, and the call returns only once they are done: a kernel that
  overwrites the tensors right after it returns does not reach the checkpoint.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
import torch

from distributed import run_ranks
from fakecuda import FakeCuda, FakeEvent, FakeStream

import streamckpt as sc
from streamckpt.comm import SoloComm
from streamckpt.saving.asyncsave import start_save
from streamckpt.saving.saver import run_save
from streamckpt.saving.staging import StagingArea
from streamckpt.storage import Storage

DEV = torch.device("cuda", 3)


class LoggingCuda(FakeCuda):
    """The stand-in, also logging the host's calls in order: each device-to-pinned copy
    (which source, where it sits in its stream) and each host wait (up to where)."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.log: list[tuple[str, int, int, int]] = []  # (what, source ptr or 0, stream id, position)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: FakeStream) -> None:
        super().copy(dst, src, stream)
        if self.device_of(src).type == "cuda" and self.device_of(dst).type == "cpu":
            self.log.append(("copy", src.untyped_storage().data_ptr(), stream.sid, len(stream.ops)))

    def host_wait(self, event: FakeEvent) -> None:
        if event.stream is not None:
            self.log.append(("wait", 0, event.stream.sid, event.pos))
        super().host_wait(event)


def _gpu_state(fake: FakeCuda, sizes: list[int], seed: int = 0,
               ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """GPU tensors (float32, ``sizes`` elements each) filled by pending caller kernels."""
    g = torch.Generator().manual_seed(seed)
    want = {f"t{i:02d}": torch.randn(n, generator=g) for i, n in enumerate(sizes)}
    sd = {}
    for k, v in want.items():
        t = fake.place(torch.zeros_like(v), DEV)
        fake.launch(DEV, lambda t=t, v=v: t.copy_(v), writes=[t], label=f"caller writes {k}")
        sd[k] = t
    return sd, want


def _loads_back(root: Path, want: dict[str, torch.Tensor]) -> None:
    got = sc.load_full(str(root))
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k


def _overlap_report(fake: LoggingCuda, sd: dict[str, torch.Tensor]) -> list[tuple[int, int]]:
    """Per item in save order: (log index of its copy, log index of the host wait covering it)."""
    ptrs = {t.untyped_storage().data_ptr(): k for k, t in sd.items()}
    copies = [(i, sid, pos, ptrs[ptr]) for i, (what, ptr, sid, pos) in enumerate(fake.log) if what == "copy"]
    waits = [(i, sid, pos) for i, (what, _, sid, pos) in enumerate(fake.log) if what == "wait"]
    assert [c[3] for c in copies] == sorted(sd), "one copy per item, in key order"
    out = []
    for i, sid, pos, _ in copies:
        covering = [w for w, wsid, wpos in waits if wsid == sid and wpos >= pos]
        assert covering, f"copy at log {i} was never waited for"
        out.append((i, covering[0]))
    return out


def test_save_copies_item_k_plus_1_while_the_host_encodes_item_k(tmp_path: Path) -> None:
    """Several items: each next item's copy is enqueued before the host waits for this one's."""
    fake = LoggingCuda(current_device=0)
    fake.expect_device(DEV)
    sizes = [10_000, 7_000, 12_345, 3, 9_999, 11_000]  # float32 elements: one item and one span each
    sd, want = _gpu_state(fake, sizes)
    storage = Storage(str(tmp_path))
    try:
        run_save(SoloComm(), storage, sd, compression=None, metadata=None, overwrite=False, cuda=fake)
    finally:
        storage.close()
    order = _overlap_report(fake, sd)
    assert len(order) == len(sizes)
    for k in range(len(order) - 1):
        copy_next, wait_this = order[k + 1][0], order[k][1]
        assert copy_next < wait_this, (f"item {k + 1}'s copy (log {copy_next}) was issued after the host "
                                       f"waited for item {k} (log {wait_this}): no overlap")
    assert fake.violations + fake.check_record_stream() == []
    assert fake.devices_used == {DEV}
    # two pinned blocks of exactly the largest item's bytes, unpinned when the save returns
    assert fake.pins.asked == [4 * max(sizes)] * 2
    assert fake.pins.live == {} and sorted(fake.pins.unpinned) == [4 * max(sizes)] * 2
    _loads_back(tmp_path, want)


def test_save_spans_a_large_item_and_mixes_host_tensors(tmp_path: Path) -> None:
    """An item larger than a span is cut into spans (zstd frames intact); a CPU tensor between
    GPU ones is read in place while the next GPU copy runs."""
    fake = LoggingCuda(current_device=0)
    fake.expect_device(DEV)
    sd, want = _gpu_state(fake, [300_000, 5_000])  # 1.2 MB: one item, spans of 64 chunks of 16 KiB
    sd["cpu"] = want["cpu"] = torch.arange(1000, dtype=torch.int64)
    storage = Storage(str(tmp_path))
    try:
        run_save(SoloComm(), storage, sd, compression="zstd", metadata=None, overwrite=False,
                 chunk_size=16 << 10, cuda=fake)
    finally:
        storage.close()
    assert fake.violations + fake.check_record_stream() == []
    assert fake.pins.live == {}
    _loads_back(tmp_path, want)


@pytest.mark.parametrize("budget", [None, 300_000, 1_000_003])
def test_async_save_pins_exactly_the_budget_and_releases_it(tmp_path: Path, budget: int | None) -> None:
    """Pinned staging is the budget (or, without one, the share) to the byte, kept for the next
    save, and unpinned by release_staging(); the copies go through the stand-in."""
    fake = FakeCuda(current_device=0)
    fake.expect_device(DEV)
    sizes = [40_000, 25_000, 60_001, 1]
    sd, want = _gpu_state(fake, sizes, seed=1)
    first = start_save(sd, str(tmp_path / "a"), staging_budget=budget, cuda=fake)
    first.result(timeout=60)
    share = StagingArea.needed(4 * n for n in sizes)  # what an unbudgeted save stages
    size = budget if budget is not None else share
    assert size & (size - 1) != 0, "the test needs a size that is not a power of two"
    assert fake.pins.asked == [size]
    assert fake.pins.live_bytes == size  # kept for the next save
    assert fake.counts.get("copy", 0) == len(sizes)  # every item's D2H went through CudaApi
    second = start_save(sd, str(tmp_path / "b"), staging_budget=budget, cuda=fake)
    second.result(timeout=60)
    assert fake.pins.asked == [size], "the second save reuses the pinned block"
    second.release_staging()
    assert fake.pins.live == {} and fake.pins.unpinned == [size]
    assert fake.violations == []
    _loads_back(tmp_path / "a", want)
    _loads_back(tmp_path / "b", want)


def test_async_save_copies_after_the_callers_kernels_and_before_returning(tmp_path: Path) -> None:
    """The caller's pending kernels land in the checkpoint; its kernel right after the call does not."""
    fake = FakeCuda(current_device=1)
    fake.expect_device(DEV)
    sd, want = _gpu_state(fake, [5_000, 8_000, 2_500], seed=2)
    handle = start_save(sd, str(tmp_path), cuda=fake)
    for t in sd.values():  # training goes on at once: the next step overwrites the tensors
        fake.launch(DEV, lambda t=t: t.fill_(-1.0), writes=[t], label="next step")
    fake.synchronize()
    handle.result(timeout=60)
    handle.release_staging()
    assert fake.violations == []
    assert fake.counts.get("copy", 0) == 3
    _loads_back(tmp_path, want)


def test_a_background_local_save_copies_after_the_callers_kernels_and_before_returning(tmp_path: Path) -> None:
    """The memory/peer tier's background save (``async_save=True``) stages CUDA tensors as
    ``async_save`` does: after the caller's pending kernels, before it returns; its staging
    is pinned at the share's size; the local step restores what was passed."""
    from streamckpt.manage.tier.localdir import LocalDir
    from streamckpt.manage.tier.localsave import Background, save_local
    from streamckpt.manage.tier.partners import topology

    fake = FakeCuda(current_device=1)
    fake.expect_device(DEV)
    sd, want = _gpu_state(fake, [5_000, 8_000, 2_500], seed=4)
    root, node = str(tmp_path / "bucket"), str(tmp_path / "node")
    folder = LocalDir(node, root)
    handle = save_local(SoloComm(), folder, sd, step=3, metadata={}, compression=None, topology=topology(1, 0),
                        replicas=0, keep=2, background=Background(None, cuda=fake))
    assert isinstance(handle, sc.SaveHandle)
    for t in sd.values():  # training goes on at once: the next step overwrites the tensors
        fake.launch(DEV, lambda t=t: t.fill_(-1.0), writes=[t], label="next step")
    fake.synchronize()
    handle.result(timeout=60)
    assert fake.violations == [] and fake.counts.get("copy", 0) == 3
    assert list(fake.pins.live.values()) == [StagingArea.needed(v.nbytes for v in want.values())]
    handle.release_staging()
    assert fake.pins.live == {}
    assert sorted(folder.committed()) == [3]
    target = {k: torch.zeros_like(v) for k, v in want.items()}
    with sc.CheckpointManager(root, local_dir=node) as mgr:
        got = mgr.restore(target)
    assert got is not None and (got.source, got.step) == ("local", 3)
    assert all(torch.equal(target[k], v) for k, v in want.items())


def test_async_save_budget_below_the_share_stages_behind_the_upload(tmp_path: Path) -> None:
    """A budget of a fifth of the share: copies one after the other as the upload frees room."""
    fake = FakeCuda(current_device=0)
    fake.expect_device(DEV)
    sizes = [50_000] * 5 + [123]
    sd, want = _gpu_state(fake, sizes, seed=3)
    budget = 4 * 50_000 + 4096
    handle = start_save(sd, str(tmp_path), staging_budget=budget, cuda=fake)
    handle.result(timeout=60)
    assert fake.pins.asked == [budget]  # items fit a quarter of it: cut, no memory of their own
    handle.release_staging()
    assert fake.pins.live == {}
    assert fake.violations == []
    _loads_back(tmp_path, want)


# ----------------------------------------------------------------------------- the group goes away


def group_gone_worker(rank: int, world: int, root: str) -> dict[str, Any]:
    import torch.distributed as dist

    fake = FakeCuda(current_device=rank)
    dev = torch.device("cuda", rank)
    want = torch.arange(20_000, dtype=torch.float32) + rank
    t = fake.place(torch.zeros_like(want), dev)
    fake.launch(dev, lambda: t.copy_(want), writes=[t])
    sd = {"w": sc.ShardedTensor(t, (40_000,), (rank * 20_000,))}
    group = dist.new_group([0, 1])
    budget = 100_001  # above the one item (80 kB): no memory of its own
    start_save(sd, root, process_group=group, staging_budget=budget, cuda=fake).result(timeout=60)
    kept = fake.pins.live_bytes
    dist.destroy_process_group(group)
    del group
    gc.collect()
    return {"asked": fake.pins.asked, "kept": kept, "after": fake.pins.live_bytes,
            "violations": fake.violations}


def test_staging_is_unpinned_when_the_group_goes_away(tmp_path: Path) -> None:
    ranks = run_ranks(2, group_gone_worker, kwargs={"root": str(tmp_path)}, timeout=120)
    for r in ranks:
        v = r.unwrap()
        assert v == {"asked": [100_001], "kept": 100_001, "after": 0, "violations": []}, (r.rank, v)
    got = sc.load_full(str(tmp_path))
    assert torch.equal(got["w"], torch.cat([torch.arange(20_000, dtype=torch.float32) + r for r in range(2)]))


# ----------------------------------------------------------------------------- on a real GPU (skipped without CUDA)

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _pin_refusal() -> str:
    """Why this GPU refuses ``cudaHostRegister`` (the lent VM may), or "" where it pins."""
    from streamckpt.cuda.runtime import PinRefused, TorchCuda

    api, dev = TorchCuda(), torch.device("cuda", torch.cuda.current_device())
    try:
        api.unpin(api.pin(4096, dev), dev)
    except PinRefused as e:
        return str(e)
    return ""


def _needs_pinning() -> None:
    why = _pin_refusal()
    if why:
        pytest.skip(f"pinning is refused here, so exact pinned staging cannot be checked ({why}); "
                    f"test_saving_cuda_tensors_when_pinning_is_refused_on_a_gpu covers the fallback")


def _host_allocator_bytes() -> int:
    """Bytes torch's pinned host allocator holds (cached included); 0 where torch cannot tell."""
    stats = getattr(torch.cuda, "host_memory_stats", lambda: {})()
    return int(stats.get("allocated_bytes.current", stats.get("allocated_bytes.all.current", 0)))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("nbytes", [1, 4096, 1_000_003])
def test_pin_is_exact_and_registered_on_a_gpu(nbytes: int) -> None:
    from streamckpt.cuda.runtime import TorchCuda

    _needs_pinning()
    api = TorchCuda()
    dev = torch.device("cuda", torch.cuda.current_device())
    before = _host_allocator_bytes()
    t = api.pin(nbytes, dev)
    assert t.numel() == nbytes and t.is_pinned()
    assert _host_allocator_bytes() == before  # not torch's (rounding, caching) allocator
    src = (torch.arange(nbytes, device=dev) % 251).to(torch.uint8)
    t.copy_(src, non_blocking=True)
    torch.cuda.synchronize(dev)
    assert torch.equal(t, src.cpu())
    api.unpin(t, dev)
    assert not t.is_pinned()


@pytest.mark.gpu
@needs_gpu
def test_async_save_and_save_of_cuda_tensors_on_a_gpu(tmp_path: Path) -> None:
    _needs_pinning()
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator().manual_seed(7)
    want = {f"t{i}": torch.randn(n, generator=g) for i, n in enumerate([3 << 20, 1 << 20, 12345, 1])}
    sd = {k: v.to(dev) for k, v in want.items()}
    before = _host_allocator_bytes()
    handle = sc.async_save(sd, str(tmp_path / "async"), staging_budget=9_000_001)
    for t in sd.values():
        t.fill_(-1.0)  # the next step, right after the call
    handle.result(timeout=120)
    handle.release_staging()
    for k, v in want.items():
        sd[k].copy_(v.to(dev))
    sc.save(sd, str(tmp_path / "sync"))
    assert _host_allocator_bytes() == before  # neither save pinned through torch's allocator
    _loads_back(tmp_path / "async", want)
    _loads_back(tmp_path / "sync", want)



@pytest.mark.gpu
@needs_gpu
def test_a_background_local_save_of_cuda_tensors_on_a_gpu(tmp_path: Path) -> None:
    """The tier's background save (``async_save=True``) of CUDA tensors overwritten right after
    ``save`` returns: the local step restores (onto the GPU) what was passed."""
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator().manual_seed(9)
    want = {f"t{i}": torch.randn(n, generator=g) for i, n in enumerate([3 << 20, 12345])}
    sd = {k: v.to(dev) for k, v in want.items()}
    kw = dict(local_dir=str(tmp_path / "node"), local_every=1, save_every=100)
    with sc.CheckpointManager(str(tmp_path / "bucket"), async_save=True, **kw) as mgr:  # type: ignore[arg-type]
        handle = mgr.save(1, sd)
        for t in sd.values():
            t.fill_(-1.0)  # the next step, right after the call
        assert isinstance(handle, sc.SaveHandle)
    target = {k: torch.zeros_like(v, device=dev) for k, v in want.items()}
    with sc.CheckpointManager(str(tmp_path / "bucket"), **kw) as mgr:  # type: ignore[arg-type]
        got = mgr.restore(target)
    assert got is not None and (got.source, got.step) == ("local", 1)
    assert all(torch.equal(target[k].cpu(), v) for k, v in want.items())


@pytest.mark.gpu
@needs_gpu
def test_saving_cuda_tensors_when_pinning_is_refused_on_a_gpu(tmp_path: Path) -> None:
    """Where cudaHostRegister is refused (the lent VM may), saves of CUDA tensors still come back
    exact through the fallback (tests/test_gpu_hazards.py shows the same on CPU); where it pins,
    the same saves (the pinned path) must be exact too."""
    dev = torch.device("cuda", torch.cuda.current_device())
    refused = _pin_refusal()
    g = torch.Generator().manual_seed(9)
    want = {f"t{i}": torch.randn(n, generator=g) for i, n in enumerate([1 << 20, 4099, 1])}
    sd = {k: v.to(dev) for k, v in want.items()}
    sc.save(sd, str(tmp_path / "sync"))
    handle = sc.async_save(sd, str(tmp_path / "async"), staging_budget=1 << 20)
    handle.result(timeout=120)
    handle.release_staging()
    _loads_back(tmp_path / "sync", want)
    _loads_back(tmp_path / "async", want)
    print(f"pinning refused: {refused or 'no'}")
