"""Random checkpoints and layouts for the GPU invariant tests, run against ``fakecuda``.

A ``Case`` (drawn by hypothesis in the parent) fixes a seed, a world size and the
load's options. The parent writes the checkpoint with the real saver; every rank then
derives the same target layout from the seed, plans its own part with the real
planner, and runs the real ``Executor`` with a ``FakeCuda`` (``run_rank``): targets on
this rank's fake GPU (a few on the CPU), each with a pending init kernel on the
caller's stream. The report says what the fake saw and whether every target holds the
checkpoint's values.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
from hypothesis import strategies as st

from fakecuda import FakeCuda
from streamckpt.comm import GroupComm, SoloComm
from streamckpt.core import manifest as mf
from streamckpt.core.regions import Box
from streamckpt.core.targets import TargetSpec
from streamckpt.cuda.device import place
from streamckpt.formats import read_manifest
from streamckpt.loading.pipeline import Destinations, Executor
from streamckpt.plan.planner import IdentityView, PlanOptions, build_plan, settle_rounds
from streamckpt.saving.writer import ShardToWrite, write_data_file
from streamckpt.storage import Storage
from streamckpt.transforms import as_transforms

CODES = {torch.float32: "F32", torch.int16: "I16", torch.float64: "F64", torch.bfloat16: "BF16"}


@dataclass(frozen=True)
class Case:
    seed: int
    world: int
    budget: int
    read_once: bool
    zstd: bool
    chunk: int
    data_on_device: bool  # the NCCL data plane (device buffers), bytes carried by gloo
    agree_every: int
    current_device: int
    transform: bool  # transpose + cast "b" on the way in (permute and cast on the GPU)
    cpu_targets: bool  # some targets stay on the CPU
    max_peers: int = 8  # PlanOptions.max_peers: small to relay pieces many ranks hold
    direct_message_bytes: int = 16  # PlanOptions': small, so messages split into parts (split_message)

    def doc(self) -> dict[str, Any]:
        return asdict(self)


def cases(min_world: int = 1, max_world: int = 8) -> st.SearchStrategy[Case]:
    return st.builds(
        Case,
        seed=st.integers(0, 2**31 - 1),
        world=st.integers(min_world, max_world),
        budget=st.sampled_from([1024, 4096, 1 << 20]),
        read_once=st.booleans(),
        zstd=st.booleans(),
        chunk=st.sampled_from([64, 256, 4096]),
        data_on_device=st.booleans(),
        agree_every=st.sampled_from([1, 1, 3]),
        current_device=st.integers(0, 7),
        transform=st.booleans(),
        cpu_targets=st.booleans(),
        direct_message_bytes=st.sampled_from([16, 256 << 10]),
    )


def _shapes(rng: random.Random) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    a = tuple(rng.randint(1, 12) for _ in range(rng.randint(1, 3)))
    odd = (rng.choice([1, 3, 5, 7]),)  # an odd int16 count: the shards after it are misaligned on disk
    b = (rng.randint(2, 9), rng.randint(2, 9))
    return {"a": (a, rng.choice([torch.float32, torch.bfloat16])), "odd": (odd, torch.int16), "b": (b, torch.float32)}


def originals(case: Case) -> dict[str, torch.Tensor]:
    rng = random.Random(case.seed)
    out = {}
    for j, (key, (shape, dt)) in enumerate(_shapes(rng).items()):
        vals = torch.arange(math.prod(shape), dtype=torch.float64) * 1.25 - 7 + 1000 * j
        out[key] = vals.to(dt).reshape(shape)
    return out


def _grid(shape: tuple[int, ...], rng: random.Random) -> list[Box]:
    boxes = [Box((), ())]
    for s in shape:
        pts = sorted(rng.sample(range(1, s), min(s - 1, rng.randint(0, 2)))) if s > 1 else []
        cuts = [0] + pts + [s]
        boxes = [Box(b.offset + (lo,), b.shape + (hi - lo,)) for b in boxes for lo, hi in zip(cuts, cuts[1:])]
    return boxes


def write_checkpoint(case: Case, path: str) -> None:
    """The checkpoint: a random grid of shards per tensor, spread over three data files by
    the real writer (``write_data_file``), committed with a manifest like the saver's."""
    rng = random.Random(case.seed + 1)
    files: dict[str, list[ShardToWrite]] = {}
    fulls = originals(case)
    for key, full in fulls.items():
        for box in _grid(tuple(full.shape), rng):
            spec = TargetSpec(key, CODES[full.dtype], tuple(full.shape), box.offset, box.shape)
            name = f"data/{rng.randint(0, 2):05d}.{'zst' if case.zstd else 'safetensors'}"
            files.setdefault(name, []).append(ShardToWrite(spec, full[box.slices()].clone()))
    storage = Storage(path)
    try:
        shards: dict[str, list[mf.Shard]] = {k: [] for k in fulls}
        sizes = {}
        for name, items in sorted(files.items()):
            rng.shuffle(items)
            records, sizes[name] = write_data_file(storage, name, items, compression="zstd" if case.zstd else None,
                                                   chunk_size=case.chunk)
            for key, shard in records:
                shards[key].append(shard)
        tensors = {k: mf.TensorMeta(CODES[f.dtype], tuple(f.shape), tuple(shards[k])) for k, f in fulls.items()}
        manifest = mf.Manifest(tensors=tensors, files=sizes)
        mf.validate(manifest)
        storage.write_bytes(mf.MANIFEST_NAME, mf.to_json(manifest))
    finally:
        storage.close()


def view_of(case: Case, manifest: Any) -> Any:
    if not case.transform:
        return IdentityView(manifest)
    rules = [{"transpose": {"key": "b", "dims": [1, 0]}}, {"cast": {"key": "b", "dtype": "float64"}}]
    source = {k: (t.shape, t.dtype) for k, t in manifest.tensors.items()}
    return as_transforms(rules).apply(source)


def expected_full(case: Case) -> dict[str, torch.Tensor]:
    out = originals(case)
    if case.transform:
        out["b"] = out["b"].t().to(torch.float64)
    return out


def layout(case: Case) -> list[list[TargetSpec]]:
    """Every rank's targets: grid boxes of each (viewed) tensor held by random ranks, some flat ranges."""
    rng = random.Random(case.seed + 2)
    specs: list[list[TargetSpec]] = [[] for _ in range(case.world)]
    for key, full in expected_full(case).items():
        shape = tuple(full.shape)
        for box in _grid(shape, rng):
            flat = None
            if rng.random() < 0.3 and box.numel > 1:
                a = rng.randint(0, box.numel - 1)
                flat = (a, rng.randint(a + 1, box.numel))
            for r in rng.sample(range(case.world), rng.randint(1, case.world)):
                specs[r].append(TargetSpec(key, CODES[full.dtype], shape, box.offset, box.shape, flat))
    return specs


def _expected(full: torch.Tensor, spec: TargetSpec) -> torch.Tensor:
    block = full[spec.box.slices()]
    return block if spec.flat_range is None else block.reshape(-1)[spec.flat_range[0]:spec.flat_range[1]]


def run_rank(case: Case, rank: int, comm: SoloComm | GroupComm, path: str,
             fail_alloc: Callable[[str, int], bool] | None = None, keep: dict[str, Any] | None = None,
             ) -> dict[str, Any]:
    """One rank's load through the real planner and executor, on a fake GPU (whose
    allocations ``fail_alloc`` may make fail); ``keep`` gets the fake, the device and the
    targets (to look at after a load that raised)."""
    rng = random.Random(case.seed * 31 + rank)
    storage = Storage(path)
    try:
        manifest = read_manifest(storage)
        specs = layout(case)
        opts = PlanOptions(memory_budget=case.budget, read_once=case.read_once, max_peers=case.max_peers,
                           direct_message_bytes=case.direct_message_bytes)
        plan = build_plan(manifest, specs, opts, view_of(case, manifest), rank=rank)
        settle_rounds(plan, comm.max_ints)
        fake = FakeCuda(current_device=case.current_device, fail_alloc=fail_alloc)
        dev = torch.device("cuda", (case.seed + 3 * rank) % 8)
        fake.expect_device(dev)
        fulls = expected_full(case)
        tensors: dict[int, torch.Tensor] = {}
        expected: dict[int, torch.Tensor] = {}
        for uid, spec in zip(plan.rank_targets[rank], specs[rank]):
            want = _expected(fulls[spec.key], spec)
            t = torch.full(tuple(want.shape), 99, dtype=want.dtype)
            if not (case.cpu_targets and rng.random() < 0.3):
                fake.place(t, dev)
                fake.launch(dev, lambda t=t: t.fill_(-3), writes=[t], label=f"init kernel of {spec.key}")
            tensors[uid], expected[uid] = t, want
        mark = fake.mark(dev)
        if keep is not None:
            keep.update(fake=fake, device=dev, targets=tensors)
        placement = place(fake, list(tensors.values()), dev if case.data_on_device else torch.device("cpu"))
        ex = Executor(plan, comm, storage, Destinations(tensors), placement=placement, agree_every=case.agree_every)
        stats = ex.run()
        fake.synchronize()
        wrong = [uid for uid, t in tensors.items() if not torch.equal(t, expected[uid])]
        return {
            "violations": fake.violations + fake.check_ordering(dev, mark) + fake.check_record_stream(),
            "wrong": wrong,
            "targets": len(tensors),
            "on_gpu": sum(placement.is_device(t) for t in tensors.values()),
            "devices": sorted(map(str, fake.devices_used)),
            "device": str(dev),
            "placement": {"device": str(placement.device), "data_on_device": placement.data_on_device},
            "rounds": stats.rounds,
            "recv_only_rounds": sum(1 for r in ex.schedule if r.recvs and not r.reads),
            "send_only_rounds": sum(1 for r in ex.schedule if r.sends and not r.recvs),
            "received_bytes": stats.bytes_received,
            "relay_sends": sum(1 for r in ex.schedule for m in r.sends if m.relayed),
            "split_sends": sum(1 for r in ex.schedule for m in r.sends if m.part),
            "copies": fake.counts.get("copy", 0),
            "target_writes": len(fake.target_writes()),
        }
    finally:
        storage.close()
