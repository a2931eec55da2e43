"""What a load's first metadata requests cost in a fresh process, on a new ``Storage``.

Why: every load starts with small requests on its critical path (GET manifest.json, a 404
for HF/DCP checkpoints; a LIST of the prefix; GET of an index JSON). On the default S3
path (``STREAMCKPT_S3_BACKEND=http``) they go over ``http.client``; before, they built
obstore's client first. Each rep is a fresh interpreter (imports done before the clock
starts) that times one operation's first call, then the same call again; medians are
printed per operation.

    python -m benchmarks.firstcall --endpoint http://127.0.0.1:9931 [--reps 5] [--tree DIR ...]

``--tree`` puts a checkout first on the children's ``PYTHONPATH``; several are run
interleaved (a before/after comparison). Operations: ``list`` (``Storage.list`` of ``hf``),
``get`` (the HF index, 6.7 KB), ``get404`` (``manifest.json`` under ``hf``: absent),
``manifest`` (``formats.read_manifest`` of ``hf``: the 404, the LIST, the index GET, the
HEADs and the safetensors headers' ranged GETs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Any

from .server import BUCKET, KEY, SECRET

CHILD = """
import json, sys, time
from streamckpt.errors import CheckpointNotFoundError
from streamckpt.formats import read_manifest
from streamckpt.storage import Storage

op, endpoint, prefix = sys.argv[1:4]
opts = {"endpoint_url": endpoint, "key": KEY, "secret": SECRET}


def call(st):
    if op == "list":
        return st.list("")
    if op == "get":
        return st.read_bytes("model.safetensors.index.json", max_bytes=1 << 24)
    if op == "get404":
        try:
            st.read_bytes("manifest.json", max_bytes=1 << 24)
        except CheckpointNotFoundError:
            return None
        raise SystemExit("manifest.json exists")
    return read_manifest(st)


t0 = time.perf_counter()
st = Storage(f"s3://{BUCKET}/{prefix}", opts)
t1 = time.perf_counter()
call(st)
t2 = time.perf_counter()
call(st)
t3 = time.perf_counter()
import streamckpt
print(json.dumps({"tree": streamckpt.__file__, "backend": st.read_backend, "storage": t1 - t0, "first": t2 - t1, "second": t3 - t2}))
"""

OPS = ("list", "get", "get404", "manifest")


def run_once(op: str, endpoint: str, prefix: str, tree: str | None) -> dict[str, Any]:
    env = dict(os.environ)
    if tree:
        env["PYTHONPATH"] = os.pathsep.join([tree, *filter(None, [env.get("PYTHONPATH")])])
    code = f"KEY, SECRET, BUCKET = {KEY!r}, {SECRET!r}, {BUCKET!r}\n" + CHILD
    # cwd: ``python -c`` puts it first on sys.path, ahead of PYTHONPATH
    out = subprocess.run([sys.executable, "-c", code, op, endpoint, prefix], env=env, cwd=tree or None,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--prefix", default="hf")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tree", action="append", default=[],
                    help="a checkout to put first on the children's PYTHONPATH (repeat: runs interleaved)")
    ap.add_argument("--ops", default=",".join(OPS))
    args = ap.parse_args()
    trees = args.tree or [None]
    for op in args.ops.split(","):
        runs: dict[str | None, list[dict[str, Any]]] = {t: [] for t in trees}
        for _ in range(args.reps):
            for t in trees:  # interleaved, so a noisy moment hits every tree alike
                runs[t].append(run_once(op, args.endpoint, args.prefix, t))
        for t, rs in runs.items():
            med = {k: statistics.median(r[k] for r in rs) * 1e3 for k in ("storage", "first", "second")}
            firsts = " ".join(f"{r['first'] * 1e3:.1f}" for r in rs)
            print(f"{op:8s} {rs[0]['tree'].rsplit('/streamckpt/', 1)[0]} backend={rs[0]['backend']} median ms: "
                  f"Storage() {med['storage']:.1f}, first call {med['first']:.1f}, second {med['second']:.1f}"
                  f"  (first calls: {firsts})")


if __name__ == "__main__":
    main()
