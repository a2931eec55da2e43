"""Check that the planner makes exactly the plans a reference revision makes.

``python -m benchmarks.plan_equiv --against main --ranks 512 --examples 400``
extracts ``streamckpt`` at the git revision ``--against`` into a temporary
package (``streamckpt_ref``), then plans the same inputs with both and compares
every field of every plan: reads (file, range, reader, chunk runs, staging,
every copy), rounds, tags, targets and their holders, missing and unexpected
keys, round claims; one-rank plans before and after ``settle_all``.

Inputs: the planner benchmark's 70B-like job (``--ranks``: the all-ranks plan and
one-rank plans of a spread of ranks, edges placed with the claims of those
ranks), and random cases drawn from the generators of ``tests/test_plan.py``
(replicated, ZeRO, and mixed layouts) and ``tests/gpu_cases.py`` (zstd frames,
transforms, read_once off), every rank's plan each. With ``--wire`` the new
planner plans from the specs as a load receives them (``specwire``'s gathered
pieces), the reference from the plain lists. A tool for refactoring the
planner, not a benchmark: it prints what differs and exits non-zero.
"""

from __future__ import annotations

import argparse
import importlib
import io
import random
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent


def load_reference(rev: str, into: Path) -> Any:
    """``streamckpt`` at ``rev`` as the package ``streamckpt_ref`` (its imports are relative)."""
    raw = subprocess.run(["git", "-C", str(REPO), "archive", rev, "streamckpt"], check=True,
                         capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        tar.extractall(into, filter="data")
    (into / "streamckpt").rename(into / "streamckpt_ref")
    sys.path.insert(0, str(into))
    return importlib.import_module("streamckpt_ref.plan.planner")


def _run(r: Any) -> tuple:
    s = r.shard
    return (s.file, s.byte_offset, s.offset, s.shape, s.flat_range, s.codec, s.chunk_size, r.raw_total, r.lo, r.hi,
            r.file_start, r.out_start)


def _copy(c: Any) -> tuple:
    return (c.target, c.offset, c.length, c.src_dtype, c.src_shape, c.src_strides, tuple(c.dst_box), c.dst_base,
            c.dst_frame, c.perm)


def _read(r: Any, tag: bool = True) -> tuple:
    return (r.file, r.start, r.stop, r.reader, tuple(map(_run, r.runs)), r.zstd, r.staging,
            tuple(map(_copy, r.copies)), r.private, r.round, r.tag if tag else None)


def signature(plan: Any, shared_tags: bool = True) -> tuple:
    """Everything a plan says, as plain values; without ``shared_tags`` the tags of shared
    reads are left out (they are numbered per component since the planner plans each
    component of shared tensors apart; before, they were indices among all shared reads)."""
    ids = {id(r): i for i, r in enumerate(plan.reads)}
    edges = {id(r) for r in plan.edge_reads}
    return (
        plan.world_size, plan.num_rounds, plan.rank, plan.base_rounds, plan.edge_degree, plan.settled,
        tuple(_read(r, shared_tags or r.private or id(r) in edges) for r in plan.reads),
        tuple(ids.get(id(r), -1) for r in plan.edge_reads),
        tuple((tuple(t.spec), tuple(t.needers)) for t in plan.targets),
        tuple(map(tuple, plan.rank_targets)), tuple(map(tuple, plan.missing)), tuple(plan.unexpected),
        tuple(getattr(plan.options, f) for f in ("memory_budget", "max_gap_bytes", "max_request_bytes", "read_once",
                                                  "max_round_bytes")),
    )


def _diff(what: str, a: tuple, b: tuple) -> str:
    names = ["world", "num_rounds", "rank", "base_rounds", "edge_degree", "settled", "reads", "edge_reads",
             "targets", "rank_targets", "missing", "unexpected", "options"]
    for name, x, y in zip(names, a, b):
        if x != y:
            if name == "reads" and len(x) == len(y):
                i = next(i for i, (p, q) in enumerate(zip(x, y)) if p != q)
                return f"{what}: read {i} differs:\n  new {x[i]}\n  ref {y[i]}"
            return f"{what}: {name} differs ({len(x) if hasattr(x, '__len__') else x} vs "\
                   f"{len(y) if hasattr(y, '__len__') else y})"
    return f"{what}: differs"


class Checker:
    """Plans each input with both planners and counts what differs."""

    def __init__(self, new: Any, ref: Any, wire: bool = False, shared_tags: bool = True) -> None:
        self.new, self.ref = new, ref
        self.shared_tags = shared_tags
        self.wire = wire  # the new planner plans from specs sent through this tree's specwire
        self.wired = 0
        self.plans = 0
        self.raised = 0  # inputs both planners rejected with the same error
        self.failures: list[str] = []
        self.seconds = {"new": 0.0, "ref": 0.0}

    def _both(self, fn: Callable[[Any], Any]) -> tuple[Any, Any]:
        t0 = time.perf_counter()
        a = fn(self.new)
        t1 = time.perf_counter()
        b = fn(self.ref)
        self.seconds["new"] += t1 - t0
        self.seconds["ref"] += time.perf_counter() - t1
        return a, b

    def same(self, what: str, a: Any, b: Any) -> bool:
        self.plans += 1
        sa, sb = signature(a, self.shared_tags), signature(b, self.shared_tags)
        if sa != sb:
            self.failures.append(_diff(what, sa, sb))
            print(self.failures[-1], flush=True)
            return False
        return True

    def case(self, what: str, manifest: Any, targets: list, opts: dict, view: Callable[[Any], Any] | None = None,
             ranks: list[int] | None = None) -> None:
        """The all-ranks plan, then one-rank plans of ``ranks`` (all by default), before and after settling."""
        sent = _through_wire(targets) if self.wire else None
        self.wired += sent is not None

        def plan(mod: Any, rank: int | None) -> Any:
            v = view(mod) if view is not None else None
            given = sent if sent is not None and mod is self.new else targets
            return mod.build_plan(manifest, given, mod.PlanOptions(**opts), v, rank=rank)

        errors = []
        for mod in (self.new, self.ref):
            try:
                plan(mod, None)
                errors.append(None)
            except Exception as e:  # both must raise the same error
                errors.append((type(e).__name__, str(e)))
        if errors[0] != errors[1]:
            self.plans += 1
            self.failures.append(f"{what}: errors differ: {errors}")
            print(self.failures[-1], flush=True)
            return
        if errors[0] is not None:
            self.raised += 1
            return
        self.same(f"{what} all ranks", *self._both(lambda m: plan(m, None)))
        pairs = [self._both(lambda m: plan(m, r)) for r in (ranks if ranks is not None else range(len(targets)))]
        for r, (a, b) in zip(ranks or range(len(targets)), pairs):
            self.same(f"{what} rank {r}", a, b)
        self.new.settle_all([a for a, _ in pairs])
        self.ref.settle_all([b for _, b in pairs])
        for r, (a, b) in zip(ranks or range(len(targets)), pairs):
            self.same(f"{what} rank {r} settled", a, b)


def _through_wire(targets: list) -> Any:
    """Every rank's specs as a load receives them (``specwire``: encode, route, decode);
    None when a rank's specs cannot be encoded (a load raises that on every rank)."""
    from streamckpt.plan import specwire
    from streamckpt.errors import CheckpointError

    try:
        encs = [specwire.encode(t) for t in targets]
    except CheckpointError:
        return None
    routing = specwire.route([specwire.parse_header(e.header(), r) for r, e in enumerate(encs)])
    payloads = [specwire.payload(routing, r, e) for r, e in enumerate(encs)]
    return specwire.decode_all(routing, specwire.assemble(routing, payloads))


def bench_job(check: Checker, ranks: int, layers: int) -> None:
    from benchmarks.planner_bench import build_manifest, build_targets

    manifest, targets = build_manifest(layers=layers), build_targets(ranks, layers=layers)
    picks = sorted({0, 1, 3, 4, 63, 64, ranks // 2 + 1, ranks - 1} & set(range(ranks)))
    for read_once in (True, False):
        check.case(f"bench {ranks} ranks, {layers} layers, read_once={read_once}", manifest, targets,
                   {"read_once": read_once}, ranks=picks)


def random_cases(check: Checker, examples: int, seed: int) -> None:
    sys.path.insert(0, str(REPO / "tests"))
    import test_plan as tp

    rng0 = random.Random(seed)
    for i in range(examples):
        s = rng0.randrange(2**32)
        rng = random.Random(s)
        kind = ["replicated", "zero", "mixed"][i % 3]
        ndim = rng.randint(1, 3)
        world = rng.randint(1, 5) if kind == "replicated" else rng.randint(2, 5)
        shape = tuple(rng.randint(1 if kind == "replicated" else 2, 10) for _ in range(ndim))
        import torch

        if kind == "mixed":
            manifest, _, _ = tp._make_checkpoint(rng, shape, torch.float32, keys=("w", "m"))
            targets = [a + b for a, b in zip(tp._make_targets(rng, shape, world, "F32", key="w"),
                                             tp._zero_targets(rng, shape, world, "F32", key="m"))]
        else:
            dtype = rng.choice([torch.float32, torch.int16])
            manifest, _, _ = tp._make_checkpoint(rng, shape, dtype)
            code = manifest.tensors["w"].dtype
            make = tp._make_targets if kind == "replicated" else tp._zero_targets
            targets = make(rng, shape, world, code)
        _spoil(rng, targets, shape)
        opts = {"memory_budget": rng.choice([256, 512, 1024, 2048, 1 << 20]),
                "max_gap_bytes": rng.choice([0, 16, 1 << 20]), "read_once": kind != "replicated" or rng.random() < 0.7}
        check.case(f"{kind} seed {s}", manifest, targets, opts)


def _spoil(rng: random.Random, targets: list, shape: tuple[int, ...]) -> None:
    """Now and then: keys the checkpoint lacks, and a dtype or shape it does not have."""
    from streamckpt.core.targets import TargetSpec

    spec = TargetSpec("w", "F32", shape, (0,) * len(shape), shape)
    for bad in (spec._replace(key="absent"), spec._replace(key="gone", flat_range=(0, 1)),
                spec._replace(dtype="F64"), spec._replace(global_shape=shape + (1,))):
        if rng.random() < (0.2 if bad.key != "w" else 0.05):
            for r in rng.sample(range(len(targets)), rng.randint(1, len(targets))):
                targets[r].insert(rng.randint(0, len(targets[r])), bad)


def gpu_cases(check: Checker, examples: int, seed: int) -> None:
    """Cases of the GPU invariant tests: the real writer (zstd frames, chunk sizes), transforms."""
    sys.path.insert(0, str(REPO / "tests"))
    import gpu_cases as gc_

    from streamckpt.formats import read_manifest
    from streamckpt.storage import Storage

    rng0 = random.Random(seed)
    for _ in range(examples):
        case = gc_.Case(seed=rng0.randrange(2**31), world=rng0.randint(1, 8), budget=rng0.choice([1024, 4096, 1 << 20]),
                        read_once=rng0.random() < 0.7, zstd=rng0.random() < 0.5, chunk=rng0.choice([64, 256, 4096]),
                        data_on_device=False, agree_every=1, current_device=0, transform=rng0.random() < 0.5,
                        cpu_targets=False)
        with tempfile.TemporaryDirectory() as d:
            gc_.write_checkpoint(case, d)
            storage = Storage(d)
            try:
                manifest = read_manifest(storage)
            finally:
                storage.close()
        view = None
        if case.transform:
            v = gc_.view_of(case, manifest)
            view = lambda _mod: v  # noqa: E731 - the same transforms view for both planners
        check.case(f"gpu case {case}", manifest, gc_.layout(case),
                   {"memory_budget": case.budget, "read_once": case.read_once}, view)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", default="main", help="git revision of the reference planner")
    ap.add_argument("--ranks", type=int, nargs="*", default=[512], help="benchmark job sizes (multiples of 64)")
    ap.add_argument("--layers", type=int, default=80)
    ap.add_argument("--examples", type=int, default=300, help="random cases from tests/test_plan.py's generators")
    ap.add_argument("--gpu-cases", type=int, default=100, help="random cases from tests/gpu_cases.py")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--wire", action="store_true",
                    help="the new planner plans from the specs as specwire delivers them (gathered pieces)")
    ap.add_argument("--no-shared-tags", action="store_true",
                    help="leave shared reads' tags out (a reference that numbers them among all shared reads)")
    args = ap.parse_args()
    import streamckpt.plan.planner as new

    with tempfile.TemporaryDirectory() as tmp:
        check = Checker(new, load_reference(args.against, Path(tmp)), args.wire, not args.no_shared_tags)
        for n in args.ranks:
            bench_job(check, n, args.layers)
        random_cases(check, args.examples, args.seed)
        gpu_cases(check, args.gpu_cases, args.seed)
    print(f"{check.plans} plans compared, {len(check.failures)} differ, {check.raised} inputs rejected alike, "
          f"{check.wired} inputs sent through specwire; "
          f"planning s: new "
          f"{check.seconds['new']:.1f}, ref {check.seconds['ref']:.1f}")
    return 1 if check.failures else 0


if __name__ == "__main__":
    sys.exit(main())
