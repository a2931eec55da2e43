"""Peak memory of a load, measured by the OS in a fresh process."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import torch

import streamckpt as sc

CHILD = textwrap.dedent(
    """
    import json, sys, torch, streamckpt as sc

    def rss(field):
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        raise RuntimeError(field)

    uri, opts, budget = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    target = torch.empty(4096, 4096)
    target.fill_(0)  # touch every page: the target itself counts in the baseline
    probe = {"w": torch.empty(1)}
    try:
        sc.load(probe, uri, storage_options=opts, strict=False)  # warm imports, clients, pools
    except sc.IncompatibleStateDictError:
        pass
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak-RSS high-water mark (VmHWM) to the current RSS
    base = rss("VmRSS")
    r = sc.load({"w": target}, uri, storage_options=opts, memory_budget=budget)
    peak = rss("VmHWM")
    # after the peak is read: every element (float32 holds these integers exactly)
    ok = bool(torch.equal(target, torch.arange(4096 * 4096, dtype=torch.float32).reshape(4096, 4096)))
    print(json.dumps({"base": base, "peak": peak, "ok": ok, "rounds": r.rounds, "staging": r.staging_bytes,
                      "read": r.bytes_read, "needed": r.bytes_needed}))
    """
)


def test_64mib_tensor_with_8mib_budget_keeps_peak_rss_low(s3_uri, s3_opts):
    t = torch.arange(4096 * 4096, dtype=torch.float32).reshape(4096, 4096)  # 64 MiB
    sc.save({"w": t}, s3_uri, storage_options=s3_opts)
    del t
    budget = 8 << 20
    out = subprocess.run(
        [sys.executable, "-c", CHILD, s3_uri, json.dumps(s3_opts), str(budget)],
        capture_output=True, text=True, timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["ok"]
    assert res["read"] == res["needed"] == 64 << 20
    assert res["staging"] <= budget
    assert res["rounds"] >= 8
    growth = res["peak"] - res["base"]
    # well under the tensor's 64 MiB beyond the target itself: staging (8 MiB) + client buffers
    assert growth < 32 << 20, f"peak RSS grew by {growth / 2**20:.1f} MiB"
