"""The namespace harness of benchmarks/netns.py (issue #37 item 3): it builds nodes, shapes
their links to the set rate (checked with a plain socket, not our loader), carries a real
2-node load bit for bit, and leaves nothing behind. Skips where namespaces cannot be made."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import netns
from benchmarks import scale_check as sc_check
from benchmarks.netns import Link, Topology

MBIT = 100  # low: the set rate, not this shared 2-core machine, must be the limit


@pytest.fixture(scope="module")
def topo():
    why = netns.available()
    if why:
        pytest.skip(f"network namespaces are not available: {why}")
    t = Topology(2, fabric=Link(MBIT), node_store=Link(MBIT))
    with t:
        yield t
    assert not set(t.all_ns()) & set(netns.ours()), "namespaces left after close"


def test_refuses_inside_a_namespace(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process the harness started may not build topologies itself (no recursion)."""
    monkeypatch.setenv(netns.INSIDE, "1")
    assert "inside a namespace" in (netns.available() or "")
    with pytest.raises(netns.NetnsError, match="inside a namespace"):
        Topology(2).open()


def test_links_carry_the_set_rate(topo: Topology) -> None:
    """One TCP stream over a tbf-shaped link: the set rate less headers (~94 % is payload)."""
    want = MBIT * 1e6 / 8
    fabric = netns.measure_rate(topo, topo.node_ns(0), topo.node_ns(1), topo.fabric_addr(1), 1.5)
    store_in = netns.measure_rate(topo, topo.store_ns, topo.node_ns(1), topo.store_addr(1), 1.5)
    for got in (fabric, store_in):
        assert 0.80 * want <= got <= 1.02 * want, (got, want)


@pytest.mark.slow
def test_two_node_load_is_exact(topo: Topology, tmp_path: Path) -> None:
    """moto in the store namespace; one rank per node loads the whole model (read once,
    exchanged over the fabric); each checks every element bit for bit."""
    port = sc_check.PORT
    opts = {"endpoint_url": f"http://{netns.STORE_ADDR}:{port}", "key": "streamckpt-test-key",
            "secret": "streamckpt-test-secret"}
    server = topo.popen(topo.store_ns, [sys.executable, "-m", "streamckpt.testing.s3server", "--host",
                                        netns.STORE_ADDR, "--port", str(port), "--bucket", "bench"],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        sc_check.wait_store(topo)
        spec = {"mode": "save", "uri": "s3://bench/whole", "storage_options": opts,
                "tensors": sc_check.tensors(2), "seed": sc_check.SEED}
        (tmp_path / "save.json").write_text(json.dumps(spec))
        subprocess.run(topo.cmd(topo.node_ns(0), [sys.executable, "-m", "benchmarks.netns_worker",
                                                  str(tmp_path / "save.json")]),
                       env=netns.child_env(), check=True, timeout=120)
        case = sc_check.CheckCase("t", "2 ranks on 2 nodes", "whole", 2, 2, "full")
        reports = sc_check.run_case(topo, case, 2, 1, tmp_path, opts=opts, timeout=180)
    finally:
        server.terminate()
        server.wait(timeout=10)
    size = 2 * sc_check.ROWS * sc_check.COLS
    assert [r["elements_checked"] for r in reports] == [size, size]
    reps = [r["reps"][0] for r in reports]
    assert sum(x["bytes_read"] for x in reps) == 4 * size  # read once: 2 × 8 MiB of fp32 in all
    assert sum(x["bytes_sent"] for x in reps) == 4 * size  # and each half sent to the other node
