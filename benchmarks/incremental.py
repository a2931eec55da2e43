"""Issue 35, item 7: a fine-tuning state with ~90 % of its bytes frozen, saved twice.

``python -m benchmarks.incremental --size 1GiB --reps 3 --load-reps 5``

The state is the llama-like model of ``benchmarks.data`` (embeddings, attention and MLP
matrices in bf16/fp16, fp32 norms) at ``--size``; its trainable part is every layer's
``q_proj`` and ``v_proj`` and every norm (about 9 % of the bytes at 1 GiB), the rest frozen.
Step 1 is the generated state, step 2 the same with the trainable tensors changed. Both are
written once to local safetensors files, outside any clock.

Against the local S3 server (``benchmarks.server``: localbucket, which counts the bytes it
receives), each repetition saves step 1 (the base, not measured), then step 2 three ways,
in rotating order, a fresh process per save (as ``benchmarks/save.py`` runs them):

* ``sc-full``: ``sc.save`` of step 2, no base;
* ``sc-incr``: ``sc.save(..., base=<step 1>)``;
* ``dcp``: ``dcp.save`` with s3torchconnector's ``S3StorageWriter`` (the ``dcp-s3`` saver of
  ``benchmarks/save.py``: its default thread count).

Each child times the save call only (imports and reading the state from local disk are
outside the clock; client construction is inside, as in ``benchmarks/save.py``). Then the
full and the incremental checkpoint of the first repetition are loaded with ``sc.load`` into
a state of empty tensors, alternating, a fresh process each (``--load-reps`` each), after
one GET of every object of the first repetition (the server's page cache warm for both);
the first load of each is checked tensor by tensor (xxh3-128 of the loaded bytes against the
generated state's). Last, the digest's throughput on one core over the step-2 state.

Why a script of its own (not ``digest_cost.py``): this scenario needs fresh processes per
save and load, DCP + s3torchconnector, and the bench server's byte counters;
``digest_cost.py`` measures the digest's overhead on a save inside one process.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from . import data
from .server import BUCKET, KEY, SECRET, BenchServer

MODES = ("sc-full", "sc-incr", "dcp")
PREFIX = "incr"  # every checkpoint goes under s3://bench/incr/r<rep>/


def trainable(name: str) -> bool:
    """The tensors a fine-tuning job changes: q/v projections and norms."""
    return name.endswith(("q_proj.weight", "v_proj.weight", "norm.weight"))


def _opts(endpoint: str) -> dict[str, Any]:
    return {"endpoint_url": endpoint, "key": KEY, "secret": SECRET}


# ------------------------------------------------------------------ children


def _state(path: str) -> dict[str, Any]:
    import safetensors.torch

    # cloned: anonymous memory, as a training job holds its tensors (not pages of a mapped file)
    return {k: v.clone() for k, v in safetensors.torch.load_file(path).items()}


def _xxh(t: Any) -> str:
    import xxhash

    return xxhash.xxh3_128(data.tensor_bytes(t)).hexdigest()


def child(spec: dict[str, Any]) -> dict[str, Any]:
    from .save import _s3_writer, preimport

    preimport()
    import streamckpt as sc

    mode, endpoint, uri = spec["mode"], spec["endpoint"], f"s3://{BUCKET}/{spec['target']}"
    out: dict[str, Any] = {"mode": mode}
    if mode.startswith("load"):
        import torch

        shapes = json.loads(Path(spec["shapes"]).read_text())
        sd = {k: torch.empty(shape, dtype=getattr(torch, dt)) for k, (shape, dt) in shapes.items()}
        t0 = time.perf_counter()
        res = sc.load(sd, uri, storage_options=_opts(endpoint))
        out["seconds"] = time.perf_counter() - t0
        out.update({k: int(getattr(res, k)) for k in ("bytes_read", "requests") if hasattr(res, k)})
        if spec.get("verify"):
            want = json.loads(Path(spec["digests"]).read_text())
            out["wrong"] = sorted(k for k, t in sd.items() if _xxh(t) != want[k])
        return out
    sd = _state(spec["state"])
    t0 = time.perf_counter()
    if mode == "dcp":
        import torch.distributed.checkpoint as dcp

        dcp.save(sd, storage_writer=_s3_writer(spec["target"], 1))
    else:
        base = f"s3://{BUCKET}/{spec['base']}" if spec.get("base") else None
        r = sc.save(sd, uri, storage_options=_opts(endpoint), base=base)
        out["bytes_written"], out["bytes_reused"] = r.bytes_written, r.bytes_reused
    out["seconds"] = time.perf_counter() - t0
    return out


# ------------------------------------------------------------------ parent


def _spawn(spec: dict[str, Any], work: Path, server: BenchServer) -> dict[str, Any]:
    path = work / "spec.json"
    path.write_text(json.dumps(spec))
    env = {**os.environ, **server.env()}
    server.reset()
    proc = subprocess.run([sys.executable, "-m", "benchmarks.incremental", "--child", str(path)], env=env,
                          capture_output=True, text=True, timeout=600)
    stats = server.stats() or {}
    if proc.returncode != 0:
        raise RuntimeError(f"{spec['mode']} failed:\n{proc.stderr[-4000:]}")
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    got["put_body_bytes"] = stats.get("put_body_bytes")
    got["get_body_bytes"] = stats.get("get_body_bytes")
    got["server_requests"] = stats.get("requests")
    return got


def _make_states(model: data.ModelSpec, work: Path) -> tuple[int, int]:
    """Step 1 and step 2 as local safetensors files, the shapes and step 2's digests; returns
    (state bytes, changed bytes)."""
    import safetensors.torch
    import torch

    sd = {t.name: data.make_tensor(model, i, t) for i, t in enumerate(model.tensors())}
    safetensors.torch.save_file(sd, str(work / "state-1.safetensors"))
    changed = 0
    for k, t in sd.items():
        if trainable(k):
            t.add_(torch.full_like(t, 1e-2))  # an optimizer step: every element moves
            changed += t.numel() * t.element_size()
    safetensors.torch.save_file(sd, str(work / "state-2.safetensors"))
    (work / "shapes.json").write_text(json.dumps({k: [list(t.shape), str(t.dtype).removeprefix("torch.")]
                                                 for k, t in sd.items()}))
    (work / "digests.json").write_text(json.dumps({k: _xxh(t) for k, t in sd.items()}))
    return sum(t.numel() * t.element_size() for t in sd.values()), changed


def _digest_rate(work: Path) -> float:
    """xxh3-128 over the step-2 state on one thread (the saver's digest pass): GB/s, median of 5."""
    sd = _state(str(work / "state-2.safetensors"))
    views = [data.tensor_bytes(t) for t in sd.values()]
    import xxhash

    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for v in views:
            xxhash.xxh3_128(v).hexdigest()
        times.append(time.perf_counter() - t0)
    return sum(len(v) for v in views) / statistics.median(times) / 1e9


def _all(samples: list[dict[str, Any]]) -> str:
    return ", ".join(f"{s['seconds']:.2f}" for s in samples)


def _load_avg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="1GiB")
    ap.add_argument("--reps", type=int, default=3, help="repetitions of the three saves")
    ap.add_argument("--load-reps", type=int, default=5, help="loads of each checkpoint")
    ap.add_argument("--workdir", default=None, help="default: a fresh temporary directory (removed after)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(Path(args.child).read_text()))))
        return
    work = Path(args.workdir or tempfile.mkdtemp(prefix="incbench-"))
    (work / BUCKET).mkdir(parents=True, exist_ok=True)
    model = data.model_for_size(data.parse_size(args.size))
    total, changed = _make_states(model, work)
    print(f"state {total / 2**20:.1f} MiB ({len(model.tensors())} tensors), trainable {changed / 2**20:.1f} MiB "
          f"({100 * changed / total:.1f} %); load average {_load_avg()}", flush=True)
    saves: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    loads: dict[str, list[dict[str, Any]]] = {"load-full": [], "load-incr": []}
    with BenchServer(work) as server:
        print(f"server: {server.kind}", flush=True)
        base_spec = {"endpoint": server.endpoint, "state": str(work / "state-2.safetensors")}
        for rep in range(args.reps):
            root = f"{PREFIX}/r{rep}"
            _spawn({**base_spec, "mode": "sc-full", "target": f"{root}/step-1",
                    "state": str(work / "state-1.safetensors")}, work, server)
            order = MODES[rep % 3:] + MODES[:rep % 3]
            for mode in order:
                target = {"sc-full": f"{root}/full-2", "sc-incr": f"{root}/step-2", "dcp": f"{root}/dcp-2"}[mode]
                got = _spawn({**base_spec, "mode": mode, "target": target,
                              "base": f"{root}/step-1" if mode == "sc-incr" else None}, work, server)
                got["load"] = _load_avg()
                saves[mode].append(got)
                print(f"rep {rep} {mode}: {got['seconds']:.3f} s, {got['put_body_bytes']} bytes received "
                      f"(load {got['load']})", flush=True)
            if rep > 0:
                shutil.rmtree(work / BUCKET / root, ignore_errors=True)  # rep 0's are loaded below
        folder = work / BUCKET / PREFIX / "r0"  # both checkpoints' objects in the page cache, as for every loader
        server.warm([p.relative_to(work / BUCKET).as_posix() for p in sorted(folder.rglob("*")) if p.is_file()])
        for k in range(args.load_reps):
            for mode in (("load-full", "load-incr") if k % 2 == 0 else ("load-incr", "load-full")):
                target = f"{PREFIX}/r0/{'full-2' if mode == 'load-full' else 'step-2'}"
                got = _spawn({"endpoint": server.endpoint, "mode": mode, "target": target, "verify": k < 2,
                              "shapes": str(work / "shapes.json"), "digests": str(work / "digests.json")},
                             work, server)
                got["load"] = _load_avg()
                if got.get("wrong"):
                    raise RuntimeError(f"{mode}: wrong tensors {got['wrong'][:5]}")
                loads[mode].append(got)
                print(f"load {k} {mode}: {got['seconds']:.3f} s, {got.get('requests')} requests, "
                      f"{got['get_body_bytes']} bytes sent (load {got['load']})", flush=True)
    rate = _digest_rate(work)
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    med = {m: statistics.median(s["seconds"] for s in saves[m]) for m in MODES}
    inc_put = statistics.median(s["put_body_bytes"] for s in saves["sc-incr"])
    lmed = {m: statistics.median(s["seconds"] for s in loads[m]) for m in loads}
    print("\n| measurement | result |\n|---|---|")
    for m in MODES:
        print(f"| save of step 2, {m} (median of {args.reps}) | {med[m]:.3f} s "
              f"(all: {_all(saves[m])}), "
              f"{statistics.median(s['put_body_bytes'] for s in saves[m]) / 2**20:.1f} MiB received |")
    print(f"| incremental save: bytes received ÷ changed bytes | {inc_put / changed:.3f} "
          f"({inc_put / 2**20:.1f} MiB for {changed / 2**20:.1f} MiB changed) |")
    print(f"| incremental save time ÷ our full save | {med['sc-incr'] / med['sc-full']:.3f} |")
    print(f"| incremental save time ÷ DCP + S3StorageWriter full save | {med['sc-incr'] / med['dcp']:.3f} |")
    for m in loads:
        print(f"| sc.load of the {m.removeprefix('load-')} checkpoint (median of {args.load_reps}) | {lmed[m]:.3f} s "
              f"(all: {_all(loads[m])}), "
              f"{statistics.median(s.get('requests') or 0 for s in loads[m]):.0f} requests |")
    print(f"| incremental load ÷ full load | {lmed['load-incr'] / lmed['load-full']:.3f} |")
    print(f"| xxh3-128 on one core (median of 5 passes over step 2) | {rate:.1f} GB/s |")
    print(f"\nload average at the end: {_load_avg()}")


if __name__ == "__main__":
    main()
