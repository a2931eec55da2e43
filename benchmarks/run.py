"""Benchmark entry point: ``python -m benchmarks.run --scenario all --size 1GiB``.

Starts a local S3 server, prepares the data (once per size), then measures each
loader in fresh processes, loaders alternating within each repetition, and writes
BENCHMARKS.md (medians with min–max). See benchmarks/__init__.py for the layout and
BENCHMARKS.md for the definitions of the columns.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import data, dcpplug, savebench, stall
from .sections import replace_sections
from .server import BUCKET, BenchServer, free_port
from .worker import fill_outcome
from .capped import (CAPPED, CAPPED_LOADERS, CAPPED_QUICK, CAPPED_REPS_IN_ALL, CAPPED_TITLES, CAPPED_WORLD, base_of,
                     cap_lines, capped_note, capped_targets, run_capped)
from .throttle import parse_rate

REPO = Path(__file__).resolve().parent.parent
PEERS = ["naive", "dcp-fsspec", "s3torchconnector", "runai", "rangereader.s3fs", "rangereader.obstore"]
# Resident targets (written once before the clock, as live parameters are): compared with each other
RESIDENT = ["streamckpt.resident", "rangereader.obstore.resident"]
SCENARIOS = {
    "a": "full load of the HF safetensors model, one process",
    "b": f"a TP rank (rank {data.TP_RANK} of {data.TP_WORLD}) loading 1/4 of the rows of every tensor, one process",
    "c": f"reshard: saved by {data.SAVE_WORLD} ranks row-wise, loaded by {data.LOAD_COL_WORLD} ranks column-wise (gloo)",
    "d": "replicated load: 2 ranks (gloo) each need the whole model",
    "e": "the checkpoint zstd-compressed, full load, one process",
    "f": "the planner alone at 512/1024/4096 simulated ranks",
    "s": "save: one process saving the whole model, side by side; then 2- and 4-rank DDP saves (gloo)",
    "g": "under a bandwidth cap on the S3 server: a replicated load on 4 ranks (g1) and the reshard of (c) (g2)",
    "t": "training stall: a training loop stepping while sc.async_save / dcp.async_save (thread, process) upload",
    "p": "the DCP plug-ins: dcp.load / dcp.save through streamckpt.dcp vs s3torchconnector.dcp",
}
LOAD_SCENARIOS = "abcdeg"
WORLD = {"a": 1, "b": 1, "c": data.LOAD_COL_WORLD, "d": 2, "e": 1, "g1": CAPPED_WORLD, "g2": data.LOAD_COL_WORLD}
# What each loader reads in each scenario (for bytes-needed and notes).
DATASET = {
    "streamckpt": {"a": "hf", "b": "hf", "c": "sc_rows4", "d": "hf", "e": "sc_rows4_zstd"},
    "streamckpt.s3fs": {"a": "hf", "b": "hf", "c": "sc_rows4", "d": "hf", "e": "sc_rows4_zstd"},
    "streamckpt.obstore": {"a": "hf", "b": "hf", "c": "sc_rows4", "d": "hf", "e": "sc_rows4_zstd"},
    "streamckpt.http": {"a": "hf", "b": "hf", "c": "sc_rows4", "d": "hf", "e": "sc_rows4_zstd"},
    "streamckpt.load_full": {"a": "hf", "e": "sc_rows4_zstd"},
    "streamckpt.dcp": {"a": "dcp_full", "b": "dcp_full"},
    "naive": {"a": "hf", "b": "hf", "c": "naive_rows4", "d": "hf", "e": "naive_zst"},
    "dcp-fsspec": {"a": "dcp_full", "b": "dcp_full", "c": "dcp_rows4", "d": "dcp_full", "e": "dcp_rows4_zstd"},
    "s3torchconnector": {"a": "dcp_full", "b": "dcp_full", "c": "dcp_rows4", "d": "dcp_full", "e": "dcp_rows4_zstd"},
    "runai": {"a": "hf", "b": "hf", "d": "hf"},
    "streamckpt.no_read_once": {},  # (g) only: the same loader with read_once=False
    "streamckpt.resident": {"a": "hf", "b": "hf", "c": "sc_rows4"},
    "rangereader.s3fs": {"a": "hf", "b": "hf"},
    "rangereader.obstore": {"a": "hf", "b": "hf"},
    "rangereader.obstore.resident": {"a": "hf", "b": "hf"},
}
for _sets in DATASET.values():
    _sets.update({g: _sets[b] for g, b in CAPPED.items() if b in _sets})
DATASET["streamckpt.no_read_once"] = {g: DATASET["streamckpt"][b] for g, b in CAPPED.items()}


# How a session lent a GPU runs the prepared check (issue 26): the device tool's `run`, pasted as is.
GPU_CHECK = [
    "On a lent GPU (the device tool's `nvidia-h200`), after `make gpu-wheels` here, one `run` call does it all "
    "(install, `tests/test_gpu.py`, `benchmarks/gpu.py`; done within 300 s by its own deadline, so a lease leaves "
    "time to rerun it; it stops at the first failed set-up step):", "",
    "```", 'command:   bash benchmarks/gpu_check.sh', 'carry:     [".whl"]', "timeout_s: 360", "```", "",
    "It leaves `$OUT/gpu_check.log` (everything), `$OUT/gpu_summary.txt` (a PASS/FAIL line per check) and "
    "`$OUT/gpu.txt` (this section's text, for `--gpu-results`).", "",
]


def title(scenario: str) -> str:
    return CAPPED_TITLES.get(scenario) or SCENARIOS[scenario]
PEER_MODULE = {
    "dcp-fsspec": "torch", "s3torchconnector": "s3torchconnector", "runai": "runai_model_streamer",
    "naive": "safetensors", "ceiling.obstore": "obstore", "streamckpt.obstore": "obstore", "streamckpt.http": "obstore",
    "rangereader.obstore": "obstore", "rangereader.obstore.resident": "obstore",
}


@dataclass
class Sample:
    seconds: float | None = None
    bytes_read: int | None = None
    requests: int | None = None
    rss_peak: int | None = None
    rss_delta: int | None = None
    ok: str = ""
    na: str | None = None
    error: str | None = None
    sc_stats: dict[str, int] = field(default_factory=dict)
    backend: str | None = None  # streamckpt rows: the client that did the range reads
    touch_s: float | None = None  # resident rows: zero-filling the fresh targets before the clock


# ------------------------------------------------------------------ helpers


def human(n: float | None, unit: str = "B") -> str:
    if n is None:
        return "n/a"
    for u in ("", "Ki", "Mi", "Gi", "Ti"):
        if abs(n) < 1024 or u == "Ti":
            return f"{n:.0f} {u}{unit}" if u == "" else f"{n:.1f} {u}{unit}"
        n /= 1024
    return f"{n}"


def versions() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for pkg in ("torch", "s3fs", "aiohttp", "fsspec", "safetensors", "zstandard", "localbucket", "moto",
                "s3torchconnector", "runai-model-streamer", "obstore"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def git_rev() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "streamckpt"], cwd=REPO, capture_output=True, text=True).stdout.strip()
        return rev + (" (+ uncommitted changes in streamckpt/)" if dirty else "")
    except OSError:
        return "unknown"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def peer_installed(loader: str) -> bool:
    from importlib.util import find_spec

    mod = PEER_MODULE.get(loader)
    return mod is None or find_spec(mod) is not None


def safetensors_data_ranges(path: Path) -> tuple[int, dict[str, tuple[int, int]]]:
    """(data start, name -> absolute [start, stop)) from a local safetensors file's header."""
    with path.open("rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    base = 8 + n
    out = {}
    for k, v in header.items():
        if k != "__metadata__":
            s, e = v["data_offsets"]
            out[k] = (base + s, base + e)
    return base, out


# ------------------------------------------------------------------ the harness


class Harness:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.size = data.parse_size(args.size)
        self.model = data.model_for_size(self.size)
        self.root = Path(args.data_dir).resolve() / self.model.key()
        self.bucket_dir = self.root / BUCKET
        self.logs = self.root / "logs"
        self.server: BenchServer | None = None
        self.fingerprints_path = self.bucket_dir / "fingerprints.json"
        self.results: dict[str, dict[str, list[Sample]]] = {}
        self.curl: dict[str, list[tuple[float, int]]] = {}
        self.notes: list[str] = []
        self.timing: dict[str, float] = {}
        self.planner_rows: list[dict[str, Any]] | None = None
        self.planner_note = ""
        self.metadata_rows: list[dict[str, Any]] = []
        self.metadata_note = ""
        self.profiles: dict[str, str] = {}
        self.save_results: dict[tuple[str, int], list[savebench.SaveSample]] = {}
        self.load_start = os.getloadavg()[0]

    # -------------------------------------------------------------- data

    def prepare(self) -> None:
        t0 = time.perf_counter()
        self.bucket_dir.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        quick = self.args.quick and not self.args.loaders and "p" not in self.args.scenarios  # (p) reads DCP's
        data.generate_local(self.bucket_dir, self.model, dcp=not quick)
        missing = data.saved_by_ranks_missing(self.bucket_dir, self.model)
        if quick:  # --quick runs streamckpt, naive and the ceiling only
            missing = [d for d in missing if d.startswith("sc_")]
        if not set(self.args.scenarios) & set(LOAD_SCENARIOS + "p"):  # (s) and (f) need only the hf files
            missing = []
        if missing:
            spec = {"world": data.SAVE_WORLD, "bucket_dir": str(self.bucket_dir), "model": data.spec_to_json(self.model),
                    "datasets": missing}
            errs = self._spawn("saver", spec, data.SAVE_WORLD, "save", timeout=600)
            if errs:
                self.notes.append(f"saving the rank-saved datasets failed: {errs[0]}")
            data.mark_ready(self.bucket_dir, self.model, [d for d in missing if (self.bucket_dir / d).is_dir()
                                                          and any((self.bucket_dir / d).iterdir())])
        self.timing["prepare"] = time.perf_counter() - t0

    def have(self, dataset: str) -> bool:
        d = self.bucket_dir / dataset
        return (d / ".ready").is_file()

    # -------------------------------------------------------------- processes

    def _env(self, world: int) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        env.update(self.server.env() if self.server else {})
        env["MASTER_ADDR"] = "127.0.0.1"
        env["MASTER_PORT"] = str(free_port())
        env["WORLD_SIZE"] = str(world)
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // world))
        env.setdefault("RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING", "0")
        env.setdefault("RUNAI_STREAMER_S3_REQUEST_TIMEOUT_MS", "60000")
        return env

    def _spawn(self, module: str, spec: dict[str, Any], world: int, tag: str, timeout: float,
               wrap0: list[str] | None = None) -> list[str]:
        """Run ``world`` processes of ``benchmarks.<module>``; returns error strings."""
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False, dir=self.root) as f:
            spec = dict(spec, out=f.name[:-5])
            json.dump(spec, f)
            spec_path = f.name
        env = self._env(world)
        procs = []
        for r in range(world):
            log = open(self.logs / f"{tag}.{r}.log", "w")
            cmd = [sys.executable, "-m", f"benchmarks.{module}", spec_path, str(r)]
            if r == 0 and wrap0:
                cmd = wrap0 + cmd
            procs.append((subprocess.Popen(cmd,
                                           env=dict(env, RANK=str(r)), stdout=log, stderr=subprocess.STDOUT,
                                           cwd=REPO), log))
        errors = []
        deadline = time.monotonic() + timeout
        for p, log in procs:
            try:
                rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
                if rc != 0:
                    errors.append(f"{tag}: exit code {rc} (see {log.name})")
            except subprocess.TimeoutExpired:
                errors.append(f"{tag}: timed out after {timeout:.0f} s (see {log.name})")
                for q, _ in procs:
                    q.kill()
            log.close()
        for p, _ in procs:
            p.wait()
        self._last_spec = spec
        os.unlink(spec_path)
        return errors

    def _views(self, scenario: str) -> list[str]:
        if base_of(scenario) == "b":
            return [f"rows{data.TP_RANK}of{data.TP_WORLD}"]
        if base_of(scenario) == "c":
            return [f"cols{r}of{data.LOAD_COL_WORLD}" for r in range(data.LOAD_COL_WORLD)]
        return ["full"] * WORLD[scenario]

    def measure(self, scenario: str, loader: str, rep: int) -> Sample:
        world = 1 if loader.startswith("ceiling") else WORLD[scenario]
        spec: dict[str, Any] = {
            "loader": loader, "scenario": base_of(scenario), "world": world, "endpoint": self.server.endpoint,
            "model": data.spec_to_json(self.model), "fingerprints": str(self.fingerprints_path),
            "views": self._views(scenario),
        }
        if loader.startswith("ceiling"):
            spec["ranges"] = self.ceiling_ranges(scenario)
        wrap0 = None
        prof = self.root / f"pyspy-{scenario}.txt"
        if rep < 0:  # the extra, unmeasured run under py-spy
            import shutil

            spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
            if Path(spy).exists():
                wrap0 = [spy, "record", "-r", "250", "-f", "raw", "--threads", "-o", str(prof), "--"]
            else:
                self.notes.append("--profile: py-spy not installed; no profile")
        self.server.reset()
        if loader == "ceiling" and self.args.quick:
            return self._ceiling_here(spec)
        tag = f"{scenario}-{loader}-{'profile' if rep < 0 else rep}"
        timeout = 60 if self.args.quick else max(180.0, 60 + 3 * self.size / (50 << 20))
        if self.server.bandwidth_cap:  # every rank may read everything through the cap
            timeout += 3 * world * self.size / self.server.bandwidth_cap
        errors = self._spawn("worker", spec, world, tag, timeout, wrap0)
        if wrap0 and prof.is_file():
            self.profiles[scenario] = summarize_pyspy(prof)
        stats = self.server.stats()
        results = []
        for r in range(world):
            p = Path(f"{self._last_spec['out']}.{r}.json")
            if p.is_file():
                results.append(json.loads(p.read_text()))
                p.unlink()
        s = Sample()
        if not fill_outcome(s, results, errors, world):
            return s
        s.seconds = max(r["seconds"] for r in results)
        if stats is not None:
            s.bytes_read = int(stats["get_body_bytes"])
            s.requests = int(sum(stats["requests"].values()))
        if loader.startswith("streamckpt"):
            for key in ("bytes_read", "bytes_needed", "requests", "bytes_sent", "bytes_received"):
                vals = [r[key] for r in results if key in r]
                if vals:
                    s.sc_stats[key] = int(sum(vals))
            s.backend = next((r["backend"] for r in results if "backend" in r), None)
            if s.bytes_read is None and "bytes_read" in s.sc_stats:
                s.bytes_read = s.sc_stats["bytes_read"]
                s.requests = s.sc_stats.get("requests")
        touch = [r["touch_s"] for r in results if "touch_s" in r]
        s.touch_s = max(touch) if touch else None
        if loader.startswith("rangereader") and s.bytes_read is None:
            s.bytes_read = int(sum(r.get("bytes_read", 0) for r in results))
            s.requests = int(sum(r.get("requests", 0) for r in results))
        elif loader.startswith("ceiling") and s.bytes_read is None:
            s.bytes_read = int(results[0].get("bytes_read", 0))
            s.requests = int(results[0].get("requests", 0))
        return s

    def _ceiling_here(self, spec: dict[str, Any]) -> Sample:
        """--quick: the ceiling in this process (saves a process start; figures are not the point)."""
        from .worker import Clock, load_ceiling

        clock = Clock(1)
        _, st = load_ceiling(spec, self.model, 0, 1, clock)
        stats = self.server.stats()
        return Sample(seconds=clock.seconds, bytes_read=int(stats["get_body_bytes"]) if stats else st["bytes_read"],
                      requests=int(sum(stats["requests"].values())) if stats else st["requests"],
                      rss_peak=0, rss_delta=0, ok="—")

    # -------------------------------------------------------------- ceilings

    def _data_files(self, dataset: str) -> list[str]:
        files = data.dataset_files(self.bucket_dir, dataset)
        keep = [f for f in files if f.endswith((".safetensors", ".distcp", ".zst"))
                or "/data/" in f or f.rsplit("/", 1)[-1].startswith("0")]
        return [f for f in keep if not f.endswith((".json", ".metadata"))] or files

    def ceiling_dataset(self, scenario: str) -> str:
        scenario = base_of(scenario)
        if scenario in ("a", "b", "d"):
            return "hf"
        if scenario == "c":
            return "sc_rows4" if self.have("sc_rows4") else "dcp_rows4"
        return "sc_rows4_zstd" if self.have("sc_rows4_zstd") else "dcp_rows4_zstd"

    def ceiling_ranges(self, scenario: str) -> list[tuple[str, int, int]]:
        """The needed bytes as (object, start, stop): data sections, or TP row blocks for (b)."""
        scenario = base_of(scenario)
        ds = self.ceiling_dataset(scenario)
        out: list[tuple[str, int, int]] = []
        if ds == "hf":
            for fname in data.hf_file_names():
                path = self.bucket_dir / "hf" / fname
                base, ranges = safetensors_data_ranges(path)
                if scenario != "b":
                    out.append((f"hf/{fname}", base, path.stat().st_size))
                    continue
                shapes = {t.name: t for t in self.model.tensors()}
                for name, (s, e) in sorted(ranges.items(), key=lambda kv: kv[1]):
                    rows = shapes[name].shape[0]
                    row_bytes = (e - s) // rows
                    r0, r1 = data.row_slice(rows, data.TP_RANK, data.TP_WORLD)
                    out.append((f"hf/{fname}", s + r0 * row_bytes, s + r1 * row_bytes))
            return out
        for f in self._data_files(ds):
            out.append((f, 0, (self.bucket_dir / f).stat().st_size))
        return out

    def needed_bytes(self, scenario: str, loader: str) -> int:
        """Unique stored bytes the scenario needs (the denominator of GB/s and amplification)."""
        scenario = base_of(scenario)
        if scenario == "b":
            return self.model.nbytes // data.TP_WORLD
        if scenario == "e":
            ds = DATASET.get(loader, {}).get("e") or self.ceiling_dataset("e")
            return sum((self.bucket_dir / f).stat().st_size for f in self._data_files(ds)) if self.have(ds) else 0
        if loader.startswith("ceiling"):
            return sum(e - s for _, s, e in self.ceiling_ranges(scenario))
        return self.model.nbytes

    def curl_once(self, scenario: str) -> tuple[float, int] | None:
        objects = sorted({name for name, _, _ in self.ceiling_ranges(scenario)})
        if not objects or self.server.kind != "localbucket":
            return None
        urls = [f"{self.server.endpoint}/{BUCKET}/{o}" for o in objects]
        cmd = ["curl", "-s", "-f", "-Z", "--parallel-max", "8"]
        for u in urls:
            cmd += ["-o", "/dev/null", u]
        t0 = time.perf_counter()
        rc = subprocess.run(cmd, capture_output=True).returncode
        dt = time.perf_counter() - t0
        if rc != 0:
            return None
        return dt, sum((self.bucket_dir / o).stat().st_size for o in objects)

    # -------------------------------------------------------------- loop

    def loaders_for(self, scenario: str) -> list[str]:
        if self.args.loaders:
            base = [x for x in self.args.loaders.split(",") if x]
        elif scenario in CAPPED:
            base = CAPPED_QUICK if self.args.quick else CAPPED_LOADERS
        elif self.args.quick:
            base = ["streamckpt", "naive", "ceiling"]
        else:
            base = ["streamckpt", "streamckpt.obstore", "streamckpt.s3fs", "streamckpt.load_full", "streamckpt.dcp",
                    *PEERS, *RESIDENT, "ceiling", "ceiling.obstore"]
        return [b for b in base if b.startswith("ceiling") or scenario in DATASET.get(b, {}) or b == "runai"]

    def run_scenario(self, scenario: str) -> None:
        loaders = self.loaders_for(scenario)
        res: dict[str, list[Sample]] = {name: [] for name in loaders}
        self.results[scenario] = res
        if scenario in self.args.profile and "streamckpt" in loaders:
            # An extra run under py-spy, not counted: the sampler takes CPU from a 2-core machine.
            self.measure(scenario, "streamckpt", -1)
        for rep in range(self.args.reps):
            order = loaders[rep % len(loaders):] + loaders[:rep % len(loaders)]  # alternate who goes first
            for loader in order:
                if not peer_installed(loader):
                    res[loader].append(Sample(na="not installed in this venv (see benchmarks/requirements.txt)"))
                    continue
                ds = DATASET.get(loader, {}).get(scenario)
                if ds and not self.have(ds) and not loader.startswith("ceiling"):
                    why = "not prepared by --quick" if self.args.quick else "could not be written (see Notes)"
                    res[loader].append(Sample(na=f"dataset {ds} {why}"))
                    continue
                s = self.measure(scenario, loader, rep)
                res[loader].append(s)
                shown = s.na and "n/a" or s.error and "ERROR " + s.error or f"{s.seconds:.2f} s"
                print(f"  ({scenario}) rep {rep + 1}/{self.args.reps} {loader:22s} {shown}", flush=True)
                if s.na:  # the same answer every time: do not repeat
                    res[loader].extend([s] * (self.args.reps - 1 - rep))
                    loaders = [x for x in loaders if x != loader]
            c = self.curl_once(scenario)
            if c:
                self.curl.setdefault(scenario, []).append(c)

    def run_planner(self) -> None:
        """Each rank count in a fresh process; the lead's planner_scale.bench wins if it exists.
        Then the per-rank metadata path (planner_bench.metadata), also one process per count."""
        from importlib.util import find_spec

        mod = "benchmarks.planner_scale" if find_spec("benchmarks.planner_scale") else "benchmarks.planner_bench"
        runs = [(64, 8)] if self.args.quick else [(512, 80), (1024, 80), (4096, 80)]
        rows = []
        for ranks, layers in runs:
            args = f"{ranks}" if layers == 80 else f"{ranks}, layers={layers}"
            rows.append(self._planner_call(mod, f"bench({args})", ranks))
            print(f"  (f) {ranks} ranks: {rows[-1]}", flush=True)
            md = self._planner_call("benchmarks.planner_bench", f"metadata({args})", ranks)
            self.metadata_rows += md if isinstance(md, list) else [md]
            print(f"  (f) {ranks} ranks, metadata: {md}", flush=True)
        self.planner_rows = rows
        self.planner_note = (f"`{mod}`: a 70B-like model (80 layers × 9 tensors, bf16) + a ZeRO-1 fp32 `exp_avg` "
                             "(flat ranges), saved TP=8 × PP=8 (ZeRO over DP=8), planned onto TP=4 × PP=16 × "
                             "DP=ranks/64. `one rank's plan` is `build_plan(rank=r)`, what each rank computes in a "
                             "load (process CPU time, one core; the slower of rank 0 and a middle rank); the goal is "
                             "< 2 s at 4096 ranks. `all ranks' plan` is `rank=None`, every rank's reads at once (what "
                             "a simulation computes). See docs/PLANNER.md.")
        self.metadata_note = ("`benchmarks.planner_bench.metadata`: the whole per-rank metadata path of the same "
                              "load, the JSON all-gather it replaced and `streamckpt.plan.specwire` side by side: this "
                              "rank's encoding, the bytes each rank receives from the all-gathers (padded, as "
                              "`all_gather_bytes` moves them) and the CPU time of cutting them out of the receive "
                              "buffer (network time not simulated), decoding every rank's specs, then rank 0's plan "
                              "from them (process CPU time, one core). Goal at 4096 ranks: ≤ 4 MiB received and "
                              "metadata + plan < 1.5 s.")

    def _planner_call(self, mod: str, call: str, ranks: int) -> Any:
        """``mod.call`` in a fresh one-core process: its JSON result, or an error row."""
        code = f"import json, {mod} as p; print(json.dumps(p.{call}))"
        try:
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                                 env=self._env(1), timeout=60 if self.args.quick else 900)
        except subprocess.TimeoutExpired:
            return {"ranks": ranks, "error": "timed out"}
        if out.returncode != 0:
            return {"ranks": ranks, "error": (out.stderr.strip().splitlines() or ["failed"])[-1][:200]}
        return json.loads(out.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ report


def _table(rows: list[dict[str, Any]]) -> list[str]:
    """A markdown table whose columns are every key of ``rows`` in first-seen order."""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    return lines + ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]


def _fn(frame: str) -> str:
    """'func (path/to/file.py:123)' -> 'func (file.py)'."""
    name, _, where = frame.partition(" (")
    path = where.rsplit(":", 1)[0].rstrip(")")
    return f"{name} ({'/'.join(path.split('/')[-2:])})"


def summarize_pyspy(path: Path, top: int = 22) -> str:
    """Self and inclusive CPU samples per function from py-spy's raw output.

    Only the load: stacks under imports (before the clock) and under ``verify``
    (after it) are dropped.
    """
    selfs: dict[str, int] = {}
    incl: dict[str, int] = {}
    threads: dict[str, int] = {}
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit() or "_find_and_load" in stack or "verify (" in stack:
            continue
        n = int(count)
        frames = stack.split(";")
        frames = [_fn(f) for f in frames[1:]]  # frames[0] is py-spy's thread label
        if not frames:
            continue
        total += n
        kind = "main" if any(f.startswith("load_streamckpt") for f in frames) else "other threads"
        threads[kind] = threads.get(kind, 0) + n
        selfs[frames[-1]] = selfs.get(frames[-1], 0) + n
        for f in set(frames):
            incl[f] = incl.get(f, 0) + n
    if not total:
        return "no samples"
    out = [f"{total} samples at 250 Hz ({total / 250:.1f} CPU-s); " +
           ", ".join(f"{k}: {v * 100 // total}%" for k, v in threads.items()), "", "self %  function"]
    for f, n in sorted(selfs.items(), key=lambda kv: -kv[1])[:top]:
        out.append(f"{n * 100 / total:5.1f}  {f}")
    out += ["", "incl % function (streamckpt, fsspec/s3fs/aiohttp/botocore)"]
    keep = ("streamckpt/", "s3fs/", "fsspec/", "aiohttp/", "aiobotocore/", "botocore/", "torch/")
    rows = [(f, n) for f, n in incl.items() if any(k in f for k in keep)]
    for f, n in sorted(rows, key=lambda kv: -kv[1])[:top]:
        out.append(f"{n * 100 / total:5.1f}  {f}")
    return "\n".join(out)


def med_range(vals: list[float], fmt: str = "{:.2f}") -> str:
    if not vals:
        return "n/a"
    m = statistics.median(vals)
    if len(vals) == 1:
        return fmt.format(m)
    return f"{fmt.format(m)} ({fmt.format(min(vals))}–{fmt.format(max(vals))})"


def summarize(h: Harness, scenario: str) -> tuple[list[str], dict[str, float]]:
    res = h.results[scenario]
    gbps: dict[str, float] = {}
    med_s: dict[str, float] = {}
    for loader, samples in res.items():
        good = [s for s in samples if s.seconds]
        if good:
            med_s[loader] = statistics.median(s.seconds for s in good)
            gbps[loader] = h.needed_bytes(scenario, loader) / med_s[loader] / 1e9
    curl = h.curl.get(scenario, [])
    curl_gbps = statistics.median(b / t / 1e9 for t, b in curl) if curl else None
    lines = cap_lines(h, scenario) + [
        "| loader | wall s, median (min–max) | GB/s | × ceiling | × curl | read ampl. | requests | peak RSS / rank | Δ RSS / rank | correct |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for loader, samples in res.items():
        first = samples[0] if samples else Sample(na="not run")
        if first.na:
            lines.append(f"| {loader} | n/a ({first.na}) | | | | | | | | |")
            continue
        good = [s for s in samples if s.seconds]
        bad = [s for s in samples if s.error]
        if not good:
            err = bad[0].error if bad else "no result"
            lines.append(f"| {loader} | error: {err.replace('|', '/')} | | | | | | | | |")
            continue
        need = h.needed_bytes(scenario, loader)
        ampl = [s.bytes_read / need for s in good if s.bytes_read is not None and need]
        reqs = [s.requests for s in good if s.requests is not None]
        xc = f"{gbps[loader] / gbps['ceiling']:.2f}" if "ceiling" in gbps and loader != "ceiling" else "—"
        xcurl = f"{gbps[loader] / curl_gbps:.2f}" if curl_gbps else "n/a"
        lines.append(
            f"| {loader} | {med_range([s.seconds for s in good])} | {gbps[loader]:.2f} | {xc} | {xcurl} | "
            f"{med_range(ampl, '{:.3f}') if ampl else 'n/a'} | {int(statistics.median(reqs)) if reqs else 'n/a'} | "
            f"{human(statistics.median(s.rss_peak for s in good))} | {human(statistics.median(s.rss_delta for s in good))} | "
            f"{good[0].ok}{' (' + str(len(bad)) + ' failed reps)' if bad else ''} |"
        )
    if curl_gbps:
        lines.append(f"| curl full GET of the same objects (8 parallel) | {med_range([t for t, _ in curl])} | "
                     f"{curl_gbps:.2f} | | | | | | | |")
    if "streamckpt" in med_s:
        vs = [f"{med_s[p] / med_s['streamckpt']:.2f}× {p}" for p in PEERS if p in med_s]
        if "streamckpt.no_read_once" in med_s:
            vs.append(f"{med_s['streamckpt.no_read_once'] / med_s['streamckpt']:.2f}× itself with read_once=False")
        if vs:
            lines.append("")
            lines.append("streamckpt speed-up (peer wall ÷ streamckpt wall): " + ", ".join(vs))
    lines += _resident_lines(res, med_s)
    sc_samples = [s for s in res.get("streamckpt", []) if s.seconds]
    if sc_samples and sc_samples[0].sc_stats:
        st = sc_samples[0].sc_stats
        lines.append("")
        lines.append("streamckpt LoadResult (sum over ranks, first rep): " +
                     ", ".join(f"{k}={human(v) if k.startswith('bytes') else v}" for k, v in st.items()))
    return lines, {**gbps, **({"curl": curl_gbps} if curl_gbps else {})}


def _resident_lines(res: dict[str, list[Sample]], med_s: dict[str, float]) -> list[str]:
    """Resident vs fresh targets: the page-fault floor, and how far a fresh load is above
    resident + floor (the goal: within 1.2×)."""
    touch = [s.touch_s for s in res.get("streamckpt.resident", []) if s.touch_s is not None]
    if not touch or "streamckpt.resident" not in med_s:
        return []
    floor = statistics.median(touch)
    out = ["", f"page-fault floor (CPU seconds zero-filling fresh targets of this size, before the resident rows' "
               f"clock): {floor:.3f} s"]
    if "streamckpt" in med_s:
        r = med_s["streamckpt"] / (med_s["streamckpt.resident"] + floor)
        out.append(f"fresh-target streamckpt ÷ (resident + floor): {r:.2f}")
    if "rangereader.obstore.resident" in med_s:
        r = med_s["rangereader.obstore.resident"] / med_s["streamckpt.resident"]
        out.append(f"resident targets, streamckpt speed-up over rangereader.obstore: {r:.2f}×")
    return out


def _best_peer(figures: dict[str, dict[str, float]], sc: str) -> tuple[str, float] | None:
    """The peer with the highest GB/s in scenario ``sc`` (any format it reads)."""
    g = figures.get(sc, {})
    peers = [(p, g[p]) for p in PEERS if p in g]
    return max(peers, key=lambda x: x[1]) if peers else None


def targets_check(h: Harness, figures: dict[str, dict[str, float]]) -> list[str]:
    out = []

    g = figures.get("a", {})
    # the ceiling of the same client stack: ceiling.obstore (raw range reads) when streamckpt read through
    # obstore or its http.client range reads, s3fs's cat_ranges when through s3fs
    backend = next((s.backend for s in h.results.get("a", {}).get("streamckpt", []) if s.backend), None)
    ceiling = "ceiling.obstore" if backend in ("obstore", "http") else "ceiling"
    if "streamckpt" in g and ceiling in g:
        r = g["streamckpt"] / g[ceiling]
        out.append(f"- (a) ≥ 0.85× the range-read ceiling of the same client ({ceiling}; streamckpt read through "
                   f"{backend or 'its default'}): {r:.2f}× — {'met' if r >= 0.85 else 'MISSED'}")
    for sc, goal in (("a", 1.8), ("b", 3.0), ("c", 3.0)):
        g = figures.get(sc, {})
        bp = _best_peer(figures, sc)
        if "streamckpt" in g and bp:
            r = g["streamckpt"] / bp[1]
            out.append(f"- ({sc}) ≥ {goal}× the best peer ({bp[0]}): {r:.2f}× — {'met' if r >= goal else 'MISSED'}")
    for sc, res in h.results.items():
        for s in res.get("streamckpt", [])[:1]:
            if s.seconds and s.bytes_read is not None:
                a = s.bytes_read / max(1, h.needed_bytes(sc, "streamckpt"))
                out.append(f"- ({sc}) read amplification ≤ 1.02: {a:.3f} — {'met' if a <= 1.02 else 'MISSED'}")
    budget = 256 << 20
    for sc, res in h.results.items():
        good = [s for s in res.get("streamckpt", []) if s.seconds]
        if good:
            world = WORLD.get(sc, 1)
            need_rank = h.needed_bytes(sc, "streamckpt") / (world if base_of(sc) == "c" else 1)
            if sc == "e":
                need_rank = h.model.nbytes
            delta = statistics.median(s.rss_delta for s in good)
            limit = need_rank + budget + (64 << 20)
            out.append(f"- ({sc}) Δ RSS ≤ targets + memory_budget + 64 MiB ({human(limit)}): {human(delta)} — "
                       f"{'met' if delta <= limit else 'MISSED'}")
    return out


def targets_16(h: Harness, figures: dict[str, dict[str, float]]) -> list[str]:
    """Issue 16's goals from this run: speed-ups over the best peer of the scenario (any
    peer, whatever format it reads), the full-GET fraction, and the metadata path at scale."""
    out = []
    for sc, loader, what, goal in (("a", "streamckpt", "full HF load", 2.0), ("a", "streamckpt.dcp", "full DCP load", 2.0),
                                   ("b", "streamckpt", "HF TP slice", 3.0), ("b", "streamckpt.dcp", "DCP TP slice", 3.0)):
        g = figures.get(sc, {})
        bp = _best_peer(figures, sc)
        if loader in g and bp:
            name, best = bp
            r = g[loader] / best
            out.append(f"- ({sc}) {what} (`{loader}`) ≥ {goal}× the best peer ({name}): {r:.2f}× — "
                       f"{'met' if r >= goal else 'MISSED'}")
    out += capped_targets(h, figures, lambda sc: _best_peer(figures, sc))
    g = figures.get("a", {})
    if "streamckpt" in g and "curl" in g:
        r = g["streamckpt"] / g["curl"]
        out.append(f"- (a) full HF load ≥ 0.35 of curl's full GETs: {r:.2f} — {'met' if r >= 0.35 else 'MISSED'}")
    if "streamckpt.resident" in g and "curl" in g:
        r = g["streamckpt.resident"] / g["curl"]
        out.append(f"- (a) resident-target full HF load ≥ 0.5 of curl's full GETs (issue 28): {r:.2f} — "
                   f"{'met' if r >= 0.5 else 'MISSED'}")
    res_a = h.results.get("a", {})
    touch = [s.touch_s for s in res_a.get("streamckpt.resident", []) if s.touch_s is not None]
    walls = {k: [s.seconds for s in res_a.get(k, []) if s.seconds] for k in ("streamckpt", "streamckpt.resident")}
    if touch and all(walls.values()):
        bound = statistics.median(walls["streamckpt.resident"]) + statistics.median(touch)
        r = statistics.median(walls["streamckpt"]) / bound
        out.append(f"- (a) fresh-target load within 1.2× of resident + page-fault floor (issue 28): {r:.2f}× — "
                   f"{'met' if r <= 1.2 else 'MISSED'}")
    for row in h.metadata_rows:
        if row.get("ranks") == 4096 and row.get("path") == "specwire":
            mib, total = row.get("received MiB/rank"), row.get("metadata + plan s")
            if mib is not None and total is not None:
                ok = mib <= 4 and total < 1.5
                out.append(f"- (f) 4096 ranks: received ≤ 4 MiB and metadata + plan < 1.5 s per rank: {mib} MiB, "
                           f"{total} s — {'met' if ok else 'MISSED'}")
    return out


def render(h: Harness, argv: list[str], wall: float) -> str:
    v = versions()
    m = h.model
    lines = [
        "# Benchmarks",
        "",
        "Generated by `benchmarks/run.py` — do not edit by hand; rerun the command below.",
        "",
        "```",
        "python -m benchmarks.run " + " ".join(shlex.quote(a) for a in argv),
        "```",
        "",
        "## Machine",
        "",
        f"- {os.cpu_count()} cores ({cpu_model()}), {human(os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES'))} RAM, "
        f"{platform.system()} {platform.release()}, Python {platform.python_version()}",
        f"- streamckpt at git {git_rev()}",
        "- " + ", ".join(f"{k} {val}" for k, val in v.items()),
        f"- S3 server: {h.server.kind if h.server else 'none'} on 127.0.0.1 (same machine: server and loaders share the cores)",
        f"- run took {wall:.0f} s; data preparation {h.timing.get('prepare', 0):.0f} s (cached across runs)",
        f"- load average (1 min) at start {h.load_start:.1f}, at end {os.getloadavg()[0]:.1f} — other work on this "
        "machine during the run skews the figures; the alternating order spreads it over all loaders",
        "",
        "## Data",
        "",
        f"- llama-like model: hidden {m.hidden}, intermediate {m.inter}, vocab {m.vocab}, {m.layers} layers, "
        f"{len(m.tensors())} tensors, {human(m.nbytes)} (bf16 matrices, fp16 embeddings/lm_head, fp32 norms; random)",
        "- `hf`: 2 safetensors shards + index; `naive_rows4`: 4 safetensors files of row blocks; "
        "`dcp_full`: torch DCP from one process; `dcp_rows4`, `sc_rows4`: saved by 4 gloo ranks as DTensor Shard(0); "
        "`*_zstd`, `naive_zst`: compressed copies",
    ]
    sizes = []
    for ds in ("hf", "sc_rows4", "sc_rows4_zstd", "dcp_rows4", "dcp_rows4_zstd", "naive_zst"):
        if h.have(ds):
            sizes.append(f"{ds} {human(data.dataset_bytes(h.bucket_dir, ds))}")
    lines.append("- stored sizes: " + ", ".join(sizes))
    ratios = []
    for comp, plain in (("sc_rows4_zstd", "sc_rows4"), ("dcp_rows4_zstd", "dcp_rows4"), ("naive_zst", "hf")):
        if h.have(comp) and h.have(plain):
            ratios.append(f"{comp} {data.dataset_bytes(h.bucket_dir, comp) / data.dataset_bytes(h.bucket_dir, plain):.3f}")
    if ratios:
        lines.append("- compressed size ÷ uncompressed size (scenario e): " + ", ".join(ratios))
    lines += [
        "",
        "## Columns",
        "",
        "- wall: seconds from a barrier before the load call to a barrier after it (clients, metadata reads and the "
        "load itself; not interpreter start or imports), max over ranks; every run is a fresh process per rank; "
        f"{h.args.reps} repetition(s), loaders alternating in order.",
        "- GB/s: unique stored bytes the scenario needs ÷ wall (10⁹ B/s). For (d) that is one copy of the model, "
        "for (b) a quarter, for (e) the compressed bytes the loader's own format stores.",
        "- × ceiling: GB/s ÷ the GB/s of `ceiling` (s3fs `cat_ranges` of the same needed bytes in 8 MiB ranges, "
        "in a fresh process: the client stack's raw range-read speed); `ceiling.obstore` reads the same ranges "
        "through obstore (Rust) to show whether the Python client is the limit. × curl: ÷ curl full GETs of the objects holding "
        "those bytes (8 in parallel).",
        "- `streamckpt` reads through its default client (`http.client` range reads into the targets, and HEAD, LIST "
        "and small whole objects over `http.client` too, when obstore is installed and the options map onto it); `streamckpt.http`, `streamckpt.obstore` "
        "and `streamckpt.s3fs` are the same loader with `STREAMCKPT_S3_BACKEND` set to `http`, `obstore` (range "
        "reads through obstore too) or `s3fs` (the fallback); "
        "`streamckpt.dcp` is `sc.load` reading the DCP checkpoint `dcp_full` in place (the peers' own input).",
        "- `rangereader.s3fs` / `rangereader.obstore` (`benchmarks/rangereader.py`): a hand-rolled loader as a user "
        "who tunes their own would write it, for (a) and (b): each safetensors header, then the needed tensor (or "
        "row) ranges coalesced into requests of at most 8 MiB (s3fs: all at once through `cat_ranges`, then "
        "copied; obstore: one `get_range_async` each, 32 in flight, each body copied as it comes), into "
        "preallocated targets; no checksums. `*.resident` rows load into targets "
        "written once before the clock (a resume into live parameters: no page faults left); the page-fault floor "
        "is the CPU time that writing took.",
        "- read ampl.: body bytes the server sent (its own counter) ÷ the unique bytes needed; requests: every request "
        "the server answered (HEAD, LIST, GET) during the load.",
        "- peak RSS: the OS's high-water mark of each rank's resident set (`VmHWM`; max over ranks); Δ RSS: peak minus the RSS just before the load "
        "(after imports and allocating the target tensors).",
        "- correct: every loaded tensor's crc32c equals the crc32c of the expected slice of the generated data.",
        "",
    ]
    if "g" in h.args.scenarios:
        lines[-1:-1] = [capped_note(h)]
    figures: dict[str, dict[str, float]] = {}
    for sc in h.results:
        if sc == next(iter(CAPPED)):
            lines += [f"## (g) {SCENARIOS['g']}", ""]
        lines.append(f"{'###' if sc in CAPPED else '##'} ({sc}) {title(sc)}")
        lines.append("")
        table, figs = summarize(h, sc)
        figures[sc] = figs
        lines += table
        lines.append("")
    lines += savebench.render_save(h, SCENARIOS["s"])
    lines += getattr(h, "notes_t", [])  # (t), when run
    lines += dcpplug.render_plug(h, SCENARIOS["p"])
    if "f" in h.args.scenarios:
        lines.append(f"## (f) {SCENARIOS['f']}")
        lines.append("")
        if h.planner_rows:
            lines += [h.planner_note, ""] + _table(h.planner_rows)
        else:
            lines.append(h.planner_note)
        if h.metadata_rows:
            lines += ["", h.metadata_note, ""] + _table(h.metadata_rows)
        lines.append("")
    checks = targets_check(h, figures)
    if checks:
        lines += ["## Targets (issue 6)", ""] + checks + [""]
    checks = targets_16(h, figures)
    if checks:
        lines += ["## Targets (issue 16)", ""] + checks + [""]
    for sc, text in h.profiles.items():
        lines += [f"## Profile of streamckpt in ({sc}) (py-spy, rank 0, an extra run not counted in the table, all threads, CPU samples)",
                  "", "```", text.rstrip(), "```", ""]
    lines += ["## GPU", ""]
    gpu = Path(h.args.gpu_results) if h.args.gpu_results else None
    if gpu and gpu.is_file():
        lines += ["From `benchmarks/gpu.py` on a lent GPU:", "", "```", gpu.read_text().strip(), "```", ""]
    else:
        lines += ["Not measured in this run (no GPU on this machine): `benchmarks/gpu.py` is ready for one; "
                  "pass its output with `--gpu-results FILE`.", ""] + GPU_CHECK
    notes = (h.server.notes if h.server else []) + h.notes
    if notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__)
    ap.add_argument("--scenario", default="all", help="a,b,c,d,e,f,g,s,p,t or all (= all but t; comma-separated list allowed)")
    ap.add_argument("--size", default="1GiB", help="model size, e.g. 16MiB, 256MiB, 1GiB")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="tiny data, 1 rep, streamckpt + naive + ceiling only "
                    "(s: streamckpt, its async, dcp-s3, naive, ceiling.obstore; DDP on 2 ranks)")
    ap.add_argument("--out", default="BENCHMARKS.md")
    ap.add_argument("--data-dir", default=str(REPO / "bench-data"))
    ap.add_argument("--loaders", default="", help="comma-separated subset of loaders (and of savers for s)")
    ap.add_argument("--server", default="auto", choices=["auto", "localbucket", "moto"])
    ap.add_argument("--profile", default="", help="scenarios (e.g. ab) where an extra streamckpt run is profiled by py-spy")
    ap.add_argument("--gpu-results", default="", help="text output of benchmarks/gpu.py to include")
    ap.add_argument("--bandwidth-cap", default="200MB/s",
                    help="(g): the server's total body bandwidth, e.g. 200MB/s, 100MiB/s (default 200MB/s)")
    ap.add_argument("--capped-reps", type=int, default=0,
                    help=f"(g): repetitions (default: --reps; at most {CAPPED_REPS_IN_ALL} under --scenario all)")
    ap.add_argument("--update", action="store_true",
                    help="replace only the rerun scenarios' sections of an existing --out (others kept as they are)")
    args = ap.parse_args(argv)
    try:
        parse_rate(args.bandwidth_cap)
    except ValueError as e:
        ap.error(str(e))
    sc = "abcdefgsp" if args.scenario == "all" else args.scenario.replace(",", "")
    bad = set(sc) - set(SCENARIOS)
    if bad:
        ap.error(f"unknown scenario(s) {sorted(bad)}")
    args.scenarios = sc
    if args.quick:
        args.reps = 1
        args.capped_reps = 1
        if args.size == "1GiB":
            args.size = "4MiB"
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    t0 = time.perf_counter()
    h = Harness(args)
    print(f"data: {h.model} ({human(h.model.nbytes)}) under {h.root}", flush=True)
    h.prepare()
    print(f"data ready in {h.timing['prepare']:.1f} s", flush=True)
    load_scenarios = [s for s in args.scenarios if s in LOAD_SCENARIOS]
    if load_scenarios or set("spt") & set(args.scenarios):
        h.server = BenchServer(h.root, kind=args.server).start()
        try:
            print(f"server: {h.server.kind} at {h.server.endpoint}", flush=True)
            if load_scenarios:
                h.server.warm([f for ds in sorted(os.listdir(h.bucket_dir)) if (h.bucket_dir / ds).is_dir()
                               for f in data.dataset_files(h.bucket_dir, ds)])
            for sc in load_scenarios:
                if sc == "g":
                    run_capped(h)
                    continue
                print(f"scenario ({sc}): {SCENARIOS[sc]}", flush=True)
                h.run_scenario(sc)
            if "s" in args.scenarios:
                print(f"scenario (s): {SCENARIOS['s']}", flush=True)
                savebench.run_save_scenario(h)
            if "t" in args.scenarios:  # benchmarks/stall.py, against this server
                print(f"scenario (t): {SCENARIOS['t']}", flush=True)
                reports = stall.measure(h.model.nbytes, "cpu", "s3", stall.SAVERS, stall.LOOPS, h.root / "stall",
                                        h.server, reps=args.reps)
                h.notes_t = stall.render(reports, ["--size", args.size, "--reps", str(args.reps)])
            if "p" in args.scenarios:
                print(f"scenario (p): {SCENARIOS['p']}", flush=True)
                dcpplug.run_plug_scenario(h)
        finally:
            h.server.stop()
    if "f" in args.scenarios:
        print(f"scenario (f): {SCENARIOS['f']}", flush=True)
        h.run_planner()
    text = render(h, argv, time.perf_counter() - t0)
    if args.update and Path(args.out).is_file():
        command = "python -m benchmarks.run " + " ".join(shlex.quote(a) for a in argv)
        text = replace_sections(Path(args.out).read_text(), text, args.scenarios, command)
    Path(args.out).write_text(text + "\n")
    print(f"wrote {args.out} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
