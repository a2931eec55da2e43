"""Check the scale model against loads measured across namespace "nodes" (issue #37 item 3).

``sudo python -m benchmarks.scale_check`` (root: it makes network namespaces; bench venv:
the store is localbucket). It builds a topology (benchmarks/netns.py: each node a
namespace with a tc-shaped fabric link and a tc-shaped link to the store), runs the S3
server (benchmarks/server.py) in the store's namespace, **measures** this machine's
parameters through those links (plain sockets for the links' rates, plain HTTP GETs for
one connection's throughput and a GET's first byte) and writes them as a parameter file
(``configs/scale/local_netns.yaml``); then, per case, predicts the load with
``scale_model.predict_load`` from the plan ``sc.load`` makes and runs it: ranks are
processes in the node namespaces (``ip netns exec``), gloo over the fabric links, rank
``i`` on node ``i // ranks_per_node``. Every load is checked bit for bit. One table:
predicted, measured, measured ÷ predicted, within ±25 %, and the machine's CPU use while
loading (the model assumes links, not CPUs, are the limit).
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import netns
from . import scale_model as sm
from .netns import Link, Topology, child_env

ROOT = Path(__file__).resolve().parents[1]
PORT = 9000
MASTER_PORT = 29611
BUCKET = "bench"  # benchmarks/server.py's bucket
OPTS = {"endpoint_url": f"http://{netns.STORE_ADDR}:{PORT}", "key": "bench-key", "secret": "bench-secret"}
SEED = 7
ROWS, COLS = 1024, 2048  # one fp32 tensor: 8 MiB


@dataclass(frozen=True)
class CheckCase:
    key: str
    title: str
    dataset: str  # "whole" (saved by one process) or "rows4" (saved by 4 ranks, row blocks)
    ranks: int
    nodes: int
    layout: str  # "full" (every rank the whole model) or "cols" (column blocks)
    read_once: bool = True


CASES = {
    "a": CheckCase("a", "replicated: 4 ranks on 2 nodes each load the whole model", "whole", 4, 2, "full"),
    "a-own": CheckCase("a-own", "replicated, read_once=False (every rank reads all it needs)", "whole", 4, 2, "full",
                       read_once=False),
    "b": CheckCase("b", "reshard: saved by 4 ranks row-wise, loaded column-wise by 4 ranks on 2 nodes", "rows4", 4, 2,
                   "cols"),
    "c": CheckCase("c", "reshard: saved by 4 ranks row-wise, loaded column-wise by 8 ranks on 4 nodes", "rows4", 8, 4,
                   "cols"),
}


def tensors(n: int) -> list[list[Any]]:
    return [[f"layers.{i}.weight", ROWS, COLS] for i in range(n)]


# ------------------------------------------------------------------ data


def _save_rows(rank: int, world: int, path: str, n: int) -> None:
    import streamckpt as sc
    from benchmarks.netns_worker import rows_of, tensor

    sd = {}
    for i, (name, rows, cols) in enumerate(tensors(n)):
        r0, r1 = rows_of(rows, rank, world)
        sd[name] = sc.ShardedTensor(tensor(SEED, i, rows, cols)[r0:r1].clone(), (rows, cols), (r0, 0))
    sc.save(sd, path, overwrite=True)


def make_data(root: Path, n: int) -> None:
    """``root/bench/whole`` and ``root/bench/rows4`` (local files the server serves), kept while their stamp matches."""
    import streamckpt as sc
    from benchmarks.netns_worker import tensor
    from streamckpt.spawn import run_ranks

    stamp = f"{n}x{ROWS}x{COLS}-seed{SEED}"
    for name in ("whole", "rows4"):
        d = root / BUCKET / name
        if (d / ".stamp").is_file() and (d / ".stamp").read_text() == stamp:
            continue
        if name == "whole":
            sd = {t[0]: tensor(SEED, i, ROWS, COLS) for i, t in enumerate(tensors(n))}
            sc.save(sd, str(d), overwrite=True)
            del sd
        else:
            bad = [o for o in run_ranks(_save_rows, 4, (str(d), n)) if not o.ok]
            if bad:
                raise RuntimeError(bad[0].error)
        (d / ".stamp").write_text(stamp)


def manifest_of(root: Path, dataset: str) -> Any:
    from streamckpt.core.manifest import MANIFEST_NAME, from_json

    return from_json((root / BUCKET / dataset / MANIFEST_NAME).read_bytes())


def targets_of(case: CheckCase, n: int) -> list[list[Any]]:
    from benchmarks.netns_worker import cols_of
    from streamckpt.core.targets import TargetSpec

    out = []
    for r in range(case.ranks):
        specs = []
        for name, rows, cols in tensors(n):
            c0, c1 = (0, cols) if case.layout == "full" else cols_of(cols, r, case.ranks)
            specs.append(TargetSpec(name, "F32", (rows, cols), (0, c0), (rows, c1 - c0)))
        out.append(specs)
    return out


# ------------------------------------------------------------------ measuring the machine

PROBE = r"""
import http.client, json, statistics, sys, threading, time
host, port, key, size = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
piece, conc, each = 4 << 20, 8, 2

def get(c, lo, hi):
    c.request("GET", key, headers={"Range": f"bytes={lo}-{hi - 1}"})
    r = c.getresponse(); n = 0
    while True:
        b = r.read(1 << 20)
        if not b: return n
        n += len(b)

c = http.client.HTTPConnection(host, port, timeout=60)
fb = []
for i in range(21):
    t0 = time.perf_counter()
    c.request("GET", key, headers={"Range": "bytes=0-0"})
    r = c.getresponse(); r.read(1); t1 = time.perf_counter(); r.read()
    if i: fb.append(t1 - t0)
t0 = time.perf_counter(); n = get(c, 0, size); one = n / (time.perf_counter() - t0)
got = []
def worker(i):
    w = http.client.HTTPConnection(host, port, timeout=60)
    for j in range(each):
        lo = ((i * each + j) * piece) % max(piece, size - piece)
        got.append(get(w, lo, lo + piece))
ts = [threading.Thread(target=worker, args=(i,)) for i in range(conc)]
t0 = time.perf_counter(); [t.start() for t in ts]; [t.join() for t in ts]
agg = sum(got) / (time.perf_counter() - t0)
print(json.dumps({"first_byte_s": statistics.median(fb), "conn_Bps": one, "node_gets_Bps": agg,
                  "gets": [conc, each, piece]}))
"""


def probe_store(topo: Topology, key: str, big: int) -> dict[str, float]:
    """From node 0: a GET's first byte (median of 20 one-byte ranges on one connection, the
    server's --latency included), one connection's throughput over ``big`` bytes (a whole
    data file), and the node's throughput with 8 connections each GETting 4 MiB ranges
    twice (what a rank's round asks: streamckpt's reads go out as 4 MiB pieces, see
    ``Reader.piece_for``; a GET's first byte and TCP's ramp after it included)."""
    p = subprocess.run(topo.cmd(topo.node_ns(0), [sys.executable, "-c", PROBE, netns.STORE_ADDR, str(PORT), key,
                                                  str(big)]), capture_output=True, text=True, env=child_env(),
                       timeout=300)
    if p.returncode:
        raise RuntimeError(f"store probe failed: {p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def wait_store(topo: Topology, deadline_s: float = 30) -> None:
    code = (f"import socket,time\nfor _ in range({int(deadline_s * 10)}):\n"
            f"    try: socket.create_connection(('{netns.STORE_ADDR}', {PORT}), timeout=1).close(); break\n"
            f"    except OSError: time.sleep(0.1)\nelse: raise SystemExit('store not up')")
    subprocess.run(topo.cmd(topo.node_ns(0), [sys.executable, "-c", code]), check=True, env=child_env())


def measure_machine(topo: Topology, per_node: int, key: str, big: int) -> tuple[dict[str, Any], dict[str, float]]:
    """The parameter file's tree, every figure measured here through the shaped links."""
    fab = netns.measure_rate(topo, topo.node_ns(0), topo.node_ns(1), topo.fabric_addr(1), 3.0)
    link = netns.measure_rate(topo, topo.store_ns, topo.node_ns(0), topo.store_addr(0), 3.0)
    loop = netns.measure_rate(topo, topo.node_ns(0), topo.node_ns(0), topo.fabric_addr(0), 2.0)
    probes = [probe_store(topo, key, big) for _ in range(3)]  # medians of 3: the machine is shared
    st = {k: statistics.median(p[k] for p in probes) for k in ("first_byte_s", "conn_Bps", "node_gets_Bps")}
    sto = st["node_gets_Bps"]
    raw = {"fabric_Bps": fab, "store_link_Bps": link, "loopback_Bps": loop, **st}
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    how = f"measured by benchmarks/scale_check.py on {when}"
    p5 = sm.flatten(_yaml(ROOT / "configs" / "scale" / "aws_p5.yaml"))
    doc = {
        "store": {
            "connection_MBps": {"value": round(st["conn_Bps"] / 1e6, 2), "source": (
                f"{how}: median of 3 runs of one HTTP connection from node 0 GETting a {big / 2**20:.0f} MiB data file from the store "
                "(benchmarks/server.py in its namespace) through the node's shaped store link")},
            "first_byte_ms": {"value": round(st["first_byte_s"] * 1e3, 2), "source": (
                f"{how}: median of 3 runs of the median of 20 one-byte ranged GETs on one kept-alive connection from node 0 (the "
                "server's --latency, its handling and the link's round trip)")},
            "prefix_get_per_s": {"value": 1e9, "source": "the local server has no per-prefix request limit"},
        },
        "node": {
            "gpus": {"value": per_node, "source": "ranks per node namespace in the checked cases"},
            "fabric_Gbps": {"value": round(fab * 8 / 1e9, 4), "source": (
                f"{how}: one TCP connection node 0 -> node 1 over the fabric links (tc tbf at "
                f"{topo.fabric.mbit:g} Mbit/s each), payload bytes per second")},
            "store_Gbps": {"value": round(sto * 8 / 1e9, 4), "source": (
                f"{how}: median of 3 runs of node 0's GETs with 8 in flight, 4 MiB each (streamckpt's pieces), through its store "
                f"link (tc tbf at {topo.node_store.mbit:g} Mbit/s; one plain TCP stream over it: "
                f"{link * 8 / 1e6:.0f} Mbit/s of payload), body bytes per second")},
            "nvlink_GBps_each_way": {"value": round(loop / 1e9, 3), "source": (
                f"{how}: one TCP connection within node 0's namespace (loopback: how its ranks reach each other)")},
        },
        "peer": {k: p5[f"peer.{k}"] for k in ("nccl_MiB", "gloo_MiB")},
        "clients": {s: {k: p5[f"clients.{s}.{k}"] for k in ("concurrency", "request_MiB")} for s in sm.STRATEGIES},
    }
    return doc, raw


def _yaml(path: Path) -> dict[str, Any]:
    import yaml

    return yaml.safe_load(path.read_text())


def write_params(path: Path, doc: dict[str, Any], command: str) -> None:
    import yaml

    head = ("# This machine, as benchmarks/scale_check.py measured it through its namespace nodes\n"
            "# (benchmarks/netns.py), for benchmarks/scale_model.py. Every leaf is {value, source}.\n"
            f"# Written by: {command}\n\n")
    path.write_text(head + yaml.safe_dump(doc, sort_keys=False, width=120, allow_unicode=True))


# ------------------------------------------------------------------ CPU while loading


class CpuSampler:
    """The whole machine's busy share from /proc/stat, sampled every 0.2 s in a thread."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, int, int]] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            with open("/proc/stat") as f:
                v = [int(x) for x in f.readline().split()[1:]]
            idle = v[3] + v[4]
            self.samples.append((time.time(), sum(v) - idle, sum(v)))
            self._stop.wait(0.2)

    def __enter__(self) -> "CpuSampler":
        self._t.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        self._t.join()

    def busy(self, start: float, end: float) -> float:
        inside = [s for s in self.samples if start - 0.2 <= s[0] <= end + 0.2]
        if len(inside) < 2:
            return float("nan")
        a, b = inside[0], inside[-1]
        return (b[1] - a[1]) / max(1, b[2] - a[2])


# ------------------------------------------------------------------ running a case


def run_case(topo: Topology, case: CheckCase, n: int, reps: int, out_dir: Path, uri_root: str = f"s3://{BUCKET}",
             opts: dict[str, Any] | None = None, timeout: float = 600) -> list[dict[str, Any]]:
    """Start the case's ranks in their node namespaces; returns each rank's report."""
    per_node = case.ranks // case.nodes
    spec = {"mode": "load", "uri": f"{uri_root}/{case.dataset}", "storage_options": opts or OPTS,
            "tensors": tensors(n), "seed": SEED, "layout": case.layout, "read_once": case.read_once,
            "reps": reps, "out": str(out_dir / case.key)}
    spec_path = out_dir / f"{case.key}.json"
    spec_path.write_text(json.dumps(spec))
    launches = []
    for r in range(case.ranks):
        env = child_env(RANK=str(r), WORLD_SIZE=str(case.ranks), MASTER_ADDR=topo.fabric_addr(0),
                        MASTER_PORT=str(MASTER_PORT), GLOO_SOCKET_IFNAME="fab", OMP_NUM_THREADS="1")
        launches.append((topo.node_ns(r // per_node), [sys.executable, "-m", "benchmarks.netns_worker",
                                                        str(spec_path)], env))
    topo.run_ranks(launches, timeout, f"case {case.key}")
    return [json.loads((out_dir / f"{case.key}.{r}.json").read_text()) for r in range(case.ranks)]


def summarize(case: CheckCase, pred: sm.Prediction, reports: list[dict[str, Any]], cpu: CpuSampler,
              ncpu: int) -> dict[str, Any]:
    reps = len(reports[0]["reps"])
    walls, busy, own_cpu = [], [], []
    for i in range(reps):
        rs = [r["reps"][i] for r in reports]
        start, end = min(x["start"] for x in rs), max(x["end"] for x in rs)
        walls.append(max(x["seconds"] for x in rs))
        busy.append(cpu.busy(start, end))
        own_cpu.append(sum(x["cpu_seconds"] for x in rs) / ((end - start) * ncpu))
    med = statistics.median(walls)
    # when the slowest rank's progress callback first fired (after its first bytes were placed;
    # reads that land straight in their targets report only at the end) and what followed its last
    first_progress = [max(r["reps"][i]["first_progress_s"] or 0.0 for r in reports) for i in range(reps)]
    tail = [max(x["seconds"] for x in rs) - max(x["last_progress_s"] or 0.0 for x in rs)
            for rs in ([r["reps"][i] for r in reports] for i in range(reps))]
    last = [r["reps"][-1] for r in reports]
    return {
        "case": case.key, "title": case.title, "ranks": case.ranks, "nodes": case.nodes, "read_once": case.read_once,
        "predicted_s": pred.seconds, "bottleneck": pred.bottleneck, "terms": pred.terms, "rounds": pred.rounds,
        "predicted_fetched_MB": pred.fetched_GB * 1e3, "measured_s": walls, "median_s": med,
        "ratio": med / pred.seconds if pred.seconds else float("nan"),
        "measured_read_MB": sum(x["bytes_read"] for x in last) / 1e6,
        "requests": sum(x["requests"] for x in last), "predicted_requests": pred.requests,
        "first_progress_s": first_progress, "tail_s": tail, "machine_busy": busy, "ranks_cpu_share": own_cpu,
        "elements_checked": sum(r["elements_checked"] for r in reports),
    }


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| case | ranks / nodes | read_once | predicted s | bottleneck (s charged) | measured s (median; all) "
            "| measured ÷ predicted | within ±25 % | read MB (measured / predicted) | GETs (measured / predicted) "
            "| CPU busy, whole machine (ranks' own) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        terms = ", ".join(f"{k} {v:.2f}" for k, v in sorted(r["terms"].items(), key=lambda kv: -kv[1]))
        ok = "yes" if abs(r["ratio"] - 1) <= 0.25 else "**no**"
        lines.append(
            f"| {r['case']} | {r['ranks']} / {r['nodes']} | {r['read_once']} | {r['predicted_s']:.2f} | "
            f"{r['bottleneck']} ({terms}) | {r['median_s']:.2f}; {', '.join(f'{w:.2f}' for w in r['measured_s'])} | "
            f"{r['ratio']:.2f} | {ok} | {r['measured_read_MB']:.0f} / {r['predicted_fetched_MB']:.0f} | "
            f"{r['requests']} / {r['predicted_requests']} | "
            f"{max(r['machine_busy']):.0%} ({max(r['ranks_cpu_share']):.0%}) |")
    return "\n".join(lines)


# ------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> None:
    import os

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cases", nargs="*", default=list(CASES), help=f"of {', '.join(CASES)}")
    ap.add_argument("--tensors", type=int, default=32, help="8 MiB fp32 tensors in the model (default 32: 256 MiB)")
    ap.add_argument("--fabric-mbit", type=float, default=400, help="each node's fabric link, each way")
    ap.add_argument("--store-mbit", type=float, default=200, help="each node's link to the store, each way")
    ap.add_argument("--latency", type=float, default=0.02, help="the server's time to first byte, seconds")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--root", type=Path, default=Path(tempfile.gettempdir()) / "streamckpt-scale-check")
    ap.add_argument("--params", type=Path, default=ROOT / "configs" / "scale" / "local_netns.yaml",
                    help="where to write the measured parameter file")
    ap.add_argument("--json", type=Path, help="write every figure here too")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: the namespaces are removed on the way out
    why = netns.available()
    if why:
        raise SystemExit(f"scale_check needs network namespaces: {why}")
    cases = [CASES[k] for k in args.cases]
    nodes = max(c.nodes for c in cases)
    per_node = {c.ranks // c.nodes for c in cases}
    if len(per_node) != 1:
        raise SystemExit("every case must have the same ranks per node (the parameter file has one gpus figure)")
    make_data(args.root, args.tensors)
    command = "python -m benchmarks.scale_check " + " ".join(argv if argv is not None else sys.argv[1:])
    ncpu = os.cpu_count() or 1
    rows = []
    with Topology(max(2, nodes), fabric=Link(args.fabric_mbit), node_store=Link(args.store_mbit)) as topo:
        server = topo.popen(topo.store_ns, [sys.executable, "-m", "benchmarks.server", "--root", str(args.root),
                                            "--port", str(PORT), "--host", netns.STORE_ADDR, "--latency",
                                            str(args.latency)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_store(topo)
            data_file = sorted(f for f in manifest_of(args.root, "whole").files)[0]
            doc, raw = measure_machine(topo, per_node.pop(), f"/{BUCKET}/whole/{data_file}",
                                        manifest_of(args.root, "whole").files[data_file])
            write_params(args.params, doc, command)
            print(f"# measured: {json.dumps(raw)} -> {args.params}", flush=True)
            m = sm.machine_from_dict(doc)
            with CpuSampler() as cpu, tempfile.TemporaryDirectory() as tmp:
                for case in cases:
                    pred = sm.predict_load(manifest_of(args.root, case.dataset), targets_of(case, args.tensors), m,
                                           read_once=case.read_once)
                    reports = run_case(topo, case, args.tensors, args.reps, Path(tmp))
                    rows.append(summarize(case, pred, reports, cpu, ncpu))
                    print(json.dumps(rows[-1]), flush=True)
        finally:
            server.terminate()
            server.wait(timeout=10)
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps({"measured": raw, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
