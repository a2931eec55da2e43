"""Time to a verdict under a permanently failing path, per S3 read client and fault kind.

One 1000-byte range with a CRC32C check (for ``rot``: the whole 1 MiB object in
16 KiB checks, so that the read covers the rotten byte) is read with the default ``RetryPolicy``
through ``FaultProxy(rate=1.0)`` in front of moto's S3 server; the table gives the
error raised, the seconds until it, and the requests the proxy saw. docs/RELIABILITY.md
quotes this output.

    python -m benchmarks.faults [--kinds slowdown,reset,short,flip,rot,stall] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import random
import time

from streamckpt.core.checksum import crc32c
from streamckpt.storage import RangeRead, Storage
from streamckpt.storage.obstore_backend import BACKEND_ENV
from streamckpt.testing import FaultProxy, LocalS3

KINDS = ("slowdown", "reset", "short", "flip", "rot", "stall")


def measure(s3: LocalS3, client: str, kind: str, data: bytes, uri: str) -> tuple[str, float, int]:
    os.environ[BACKEND_ENV] = client
    with FaultProxy(s3.endpoint_url, faults=[kind], rate=1.0, max_repeats=10**9, stall_seconds=120) as proxy:
        st = Storage(uri, proxy.storage_options)
        # rot flips one fixed byte of the object: read all of it (16 KiB checks) so the read covers it
        a, b, step = (0, len(data), 16 << 10) if kind == "rot" else (1000, 2000, 1000)
        r = RangeRead("data/00000.bin", a, b, tuple((o, step, crc32c(data[a + o:a + o + step]))
                                                   for o in range(0, b - a, step)))
        t0 = time.monotonic()
        try:
            st.read_into([r], [memoryview(bytearray(r.length))]).result()
            verdict = "no error"
        except Exception as e:  # noqa: BLE001 - the verdict is what we measure
            verdict = type(e).__name__
        elapsed = time.monotonic() - t0
        requests = proxy.requests
        st.close()
    return verdict, elapsed, requests


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--clients", default="http,obstore,s3fs")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    data = random.Random(0).randbytes(1 << 20)
    rows = ["| fault (every request) | client | verdict | seconds | requests |", "|---|---|---|---|---|"]
    with LocalS3() as s3:
        uri = s3.make_bucket("faults") + "/bench"
        os.environ[BACKEND_ENV] = "s3fs"
        Storage(uri, s3.storage_options).write_bytes("data/00000.bin", data)
        for kind in args.kinds.split(","):
            for client in args.clients.split(","):
                verdict, secs, n = measure(s3, client, kind, data, uri)
                rows.append(f"| {kind} | {client} | {verdict} | {secs:.1f} | {n} |")
                print(rows[-1], flush=True)
    text = "\n".join(rows) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
