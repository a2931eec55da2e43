"""Nodes made of Linux network namespaces, joined by veth links shaped with ``tc``.

The scale model (benchmarks/scale_model.py) predicts loads across nodes; this module
builds nodes to check it on one machine (issue #37 item 3). Each "node" is a network
namespace with two veth links, like a GPU node's two networks: ``fab`` to a fabric bridge
(the ranks' gloo traffic to other nodes; the NIC) and ``sto`` to a storage bridge (its
GETs; the node's path to the object store). The store is a namespace of its own on the
storage bridge. Both bridges live in a namespace of their own, so nothing is added to the
root namespace: no link, address or route; traffic goes only between addresses of the
namespaces made here (``10.231.1.0/24`` storage, ``10.231.2.0/24`` fabric). Ranks of one
node talk over that node's loopback (the intra-node path).

Each link is shaped with a token bucket (``tc qdisc ... tbf``) on both ends' egress, so a
node gets the set rate out and the set rate in. Link latency is not emulated: ``netem``
is not in every kernel (not in this machine's), so a store's time to first byte is the
server's own ``--latency`` (benchmarks/server.py), and the fabric has none beyond the
kernel's; the scale model has no per-message latency term either.

Namespaces are named ``sck-<pid>-<tag>``; ``Topology.close`` (also run at exit and on
errors during setup) deletes exactly the namespaces it created, and with them every veth,
bridge and qdisc inside. It refuses to start if one of its names already exists.
Needs root (``ip netns add``); ``available()`` says why not where it cannot run.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

PREFIX = "sck-"
STORE_NET = "10.231.1"
FABRIC_NET = "10.231.2"
STORE_ADDR = f"{STORE_NET}.2"
INSIDE = "STREAMCKPT_NETNS_CHILD"  # set in every process started in a namespace: it may not build one


class NetnsError(RuntimeError):
    """Setting up or tearing down the namespaces failed; the message has the command and its output."""


@dataclass(frozen=True)
class Link:
    """A shaped link: ``mbit`` each way (None: unshaped, the kernel's veth speed)."""

    mbit: float | None

    @property
    def bytes_per_s(self) -> float | None:
        return None if self.mbit is None else self.mbit * 1e6 / 8


def _run(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(list(cmd), capture_output=True, text=True)
    if check and p.returncode != 0:
        raise NetnsError(f"{' '.join(cmd)}: exit {p.returncode}: {p.stderr.strip() or p.stdout.strip()}")
    return p


def available() -> str | None:
    """None where namespaces can be made here, else why not (for a skip message)."""
    if os.environ.get(INSIDE):
        return f"this process runs inside a namespace of the harness ({INSIDE} set)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None and not os.path.exists(f"/usr/sbin/{tool}"):
            return f"`{tool}` (iproute2) is not installed"
    probe = f"{PREFIX}{os.getpid()}-probe"
    p = _run(["ip", "netns", "add", probe], check=False)
    if p.returncode != 0:
        return f"`ip netns add` is not permitted here ({p.stderr.strip()}); it needs root or CAP_SYS_ADMIN"
    try:
        q = _run(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root", "tbf",
                  "rate", "100mbit", "burst", "32kb", "latency", "20ms"], check=False)
        if q.returncode != 0:
            return f"`tc qdisc ... tbf` is not available here ({q.stderr.strip()})"
    finally:
        _run(["ip", "netns", "del", probe], check=False)
    return None


def ours() -> list[str]:
    """Namespaces with our prefix that exist now (any process's)."""
    out = _run(["ip", "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(PREFIX)]


def shape(ns: str, dev: str, link: Link) -> None:
    """A token bucket on ``dev``'s egress in ``ns``: ``link.mbit``, a queue of 20 ms at that rate."""
    if link.mbit is None:
        return
    rate = link.mbit * 1e6 / 8
    burst = max(32 << 10, int(rate / 250))  # >= rate / HZ for HZ >= 250, so the bucket can reach its rate
    _run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate",
          f"{link.mbit:g}mbit", "burst", str(burst), "latency", "20ms"])


@dataclass
class Topology:
    """``nodes`` namespaces on a fabric bridge and a storage bridge, plus a store namespace.

    ``fabric``: each node's NIC (gloo to other nodes); ``node_store``: each node's link to
    the store; ``store``: the store's own link (all nodes' GETs together).
    """

    nodes: int
    fabric: Link = Link(400)
    node_store: Link = Link(200)
    store: Link = Link(None)
    tag: str = field(default_factory=lambda: f"{PREFIX}{os.getpid()}")
    created: list[str] = field(default_factory=list)

    # ------------------------------------------------------------ names

    @property
    def bridge_ns(self) -> str:
        return f"{self.tag}-br"

    @property
    def store_ns(self) -> str:
        return f"{self.tag}-st"

    def node_ns(self, k: int) -> str:
        return f"{self.tag}-n{k}"

    @staticmethod
    def store_addr(k: int) -> str:
        """Node ``k``'s address on the storage network."""
        return f"{STORE_NET}.{10 + k}"

    @staticmethod
    def fabric_addr(k: int) -> str:
        """Node ``k``'s address on the fabric (its ranks' gloo address)."""
        return f"{FABRIC_NET}.{10 + k}"

    def all_ns(self) -> list[str]:
        return [self.bridge_ns, self.store_ns] + [self.node_ns(k) for k in range(self.nodes)]

    # ------------------------------------------------------------ lifecycle

    def __enter__(self) -> "Topology":
        return self.open()

    def __exit__(self, *_: object) -> None:
        self.close()

    def open(self) -> "Topology":
        if os.environ.get(INSIDE):
            raise NetnsError(f"a process started inside a namespace ({INSIDE} set) may not build namespaces")
        if not 1 <= self.nodes <= 200:
            raise NetnsError(f"nodes must be 1..200, got {self.nodes}")
        clash = set(self.all_ns()) & set(ours())
        if clash:
            raise NetnsError(f"namespaces {sorted(clash)} exist already; not ours to reuse (remove them by hand "
                             "with `ip netns del` if a killed run left them)")
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Delete the namespaces this topology created (their links, bridges and qdiscs go with them)."""
        while self.created:
            _run(["ip", "netns", "del", self.created.pop()], check=False)
        atexit.unregister(self.close)

    def _ns(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self.created.append(name)
        _run(["ip", "-n", name, "link", "set", "lo", "up"])

    def _build(self) -> None:
        br = self.bridge_ns
        for name in self.all_ns():
            self._ns(name)
        for bridge in ("brs", "brf"):
            _run(["ip", "-n", br, "link", "add", bridge, "type", "bridge"])
            _run(["ip", "-n", br, "link", "set", bridge, "up"])
        self._attach(self.store_ns, "sto", "st", "brs", f"{STORE_ADDR}/24", self.store)
        for k in range(self.nodes):
            n = self.node_ns(k)
            self._attach(n, "sto", f"s{k}", "brs", f"{self.store_addr(k)}/24", self.node_store)
            self._attach(n, "fab", f"f{k}", "brf", f"{self.fabric_addr(k)}/24", self.fabric)

    def _attach(self, ns: str, dev: str, port: str, bridge: str, addr: str, link: Link) -> None:
        """A veth from ``ns`` (``dev``, with ``addr``) to ``bridge`` (port ``port``), shaped both ways."""
        br = self.bridge_ns
        _run(["ip", "-n", br, "link", "add", port, "type", "veth", "peer", "name", dev, "netns", ns])
        _run(["ip", "-n", br, "link", "set", port, "master", bridge])
        _run(["ip", "-n", br, "link", "set", port, "up"])
        _run(["ip", "-n", ns, "addr", "add", addr, "dev", dev])
        _run(["ip", "-n", ns, "link", "set", dev, "up"])
        shape(ns, dev, link)  # out of the namespace
        shape(br, port, link)  # into it

    # ------------------------------------------------------------ processes

    def cmd(self, ns: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside namespace ``ns`` (one this topology made)."""
        if ns not in self.created:
            raise NetnsError(f"{ns} is not a namespace of this topology")
        return ["ip", "netns", "exec", ns, *argv]

    def popen(self, ns: str, argv: Sequence[str], **kw: object) -> subprocess.Popen:
        """Start ``argv`` in ``ns``; its environment is ``child_env()`` unless ``env`` is given."""
        kw.setdefault("env", child_env())
        return subprocess.Popen(self.cmd(ns, argv), **kw)  # type: ignore[call-overload]

    def run_ranks(self, launches: Sequence[tuple[str, Sequence[str], dict[str, str]]], timeout: float,
                  what: str) -> None:
        """Start one process per ``(namespace, argv, env)`` (a job's ranks), wait for all of them
        within ``timeout`` seconds; the first that exits non-zero raises (naming ``what``), and
        whatever still runs then is killed."""
        procs = []
        try:
            for ns, argv, env in launches:
                procs.append(self.popen(ns, argv, env=env))
            deadline = time.monotonic() + timeout
            for rank, p in enumerate(procs):
                rc = p.wait(timeout=max(1, deadline - time.monotonic()))
                if rc:
                    raise RuntimeError(f"{what}: rank {rank} exited {rc}")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()


# ------------------------------------------------------------------ a plain socket's rate


def child_env(**extra: str) -> dict[str, str]:
    """Environment for a process started in a namespace: this checkout on ``PYTHONPATH`` and
    nothing else of ours (a script's folder on it once made a child import a stray ``nt.py``
    there, which built topologies recursively), marked so that it cannot build one itself."""
    root = str(Path(__file__).resolve().parents[1])
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=root, PYTHONSAFEPATH="1", **{INSIDE: "1"}, **extra)
    return env


def measure_rate(topo: Topology, src_ns: str, dst_ns: str, dst_addr: str, seconds: float = 2.0,
                 python: str | None = None, port: int = 5301) -> float:
    """Bytes/s one TCP connection carries from ``src_ns`` to ``dst_addr`` in ``dst_ns``,
    counted at the receiver after its first 0.3 s (past the bucket's initial burst).
    Plain sockets, not our loader: this checks the shaping itself."""
    import json
    import sys

    python = python or sys.executable
    env = child_env()
    sink = topo.popen(dst_ns, [python, "-m", "benchmarks.netns", "sink", dst_addr, str(port), str(seconds)],
                      stdout=subprocess.PIPE, text=True, env=env)
    try:
        src = topo.popen(src_ns, [python, "-m", "benchmarks.netns", "source", dst_addr, str(port), str(seconds + 1)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        out, _ = sink.communicate(timeout=seconds + 30)
        src.wait(timeout=30)
    finally:
        for p in (sink, src):
            if p.poll() is None:
                p.kill()
                p.wait()
    return float(json.loads(out.strip().splitlines()[-1])["bytes_per_s"])


def _sink(addr: str, port: int, seconds: float) -> None:
    import json
    import socket
    import time

    with socket.create_server((addr, port)) as srv:
        srv.settimeout(20)
        conn, _ = srv.accept()
        with conn:
            conn.settimeout(10)
            buf = bytearray(1 << 20)
            t0 = time.perf_counter()
            start, n = None, 0
            while True:
                k = conn.recv_into(buf)
                if not k:
                    break
                now = time.perf_counter()
                if start is None and now - t0 >= 0.3:
                    start = now
                elif start is not None:
                    n += k
                    if now - start >= seconds:
                        break
            rate = n / (time.perf_counter() - start) if start else 0.0
    print(json.dumps({"bytes_per_s": rate}), flush=True)


def _source(addr: str, port: int, seconds: float) -> None:
    import socket
    import time

    deadline = time.monotonic() + 10
    while True:
        try:
            s = socket.create_connection((addr, port), timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    data = bytes(1 << 20)
    end = time.monotonic() + seconds
    s.settimeout(10)
    with s:
        try:
            while time.monotonic() < end:
                s.sendall(data)
        except OSError:
            pass  # the sink stops reading when it has counted enough


def main(argv: Sequence[str] | None = None) -> None:
    import sys

    a = list(argv if argv is not None else sys.argv[1:])
    if a[:1] == ["sink"]:
        _sink(a[1], int(a[2]), float(a[3]))
    elif a[:1] == ["source"]:
        _source(a[1], int(a[2]), float(a[3]))
    else:
        print(available() or "network namespaces can be made here")


if __name__ == "__main__":
    main()
