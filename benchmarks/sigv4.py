"""What signing one ranged GET costs: streamckpt's SigV4 (``storage/httpget.py``) vs botocore's.

Why the http read path signs its own requests: botocore's signer costs more per request
and its import (botocore.auth, botocore.credentials) would land inside ``sc.load``'s wall
time in a fresh process. Prints microseconds per signature and the import time.

    python -m benchmarks.sigv4 [--n 5000]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

IMPORT = "import time; t = time.perf_counter(); {}; print(time.perf_counter() - t)"


def import_seconds(stmt: str) -> float:
    out = subprocess.run([sys.executable, "-c", IMPORT.format(stmt)], capture_output=True, text=True, check=True)
    return float(out.stdout.strip())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=5000)
    args = ap.parse_args()
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    from streamckpt.storage.httpget import SigV4, http_target

    cfg = {"access_key_id": "AKID", "secret_access_key": "secret", "endpoint": "http://127.0.0.1:9000",
           "region": "us-east-1"}
    target = http_target(cfg)
    path = target.path("bench", "hf/model-00001-of-00002.safetensors")
    ours = SigV4(target)
    t = time.perf_counter()
    for _ in range(args.n):
        ours.headers(path)
    mine = (time.perf_counter() - t) / args.n
    auth = S3SigV4Auth(Credentials("AKID", "secret"), "s3", "us-east-1")
    t = time.perf_counter()
    for i in range(args.n):
        req = AWSRequest(method="GET", url=f"http://127.0.0.1:9000{path}", headers={"Range": f"bytes={i}-{i + 9}"})
        auth.add_auth(req)
    boto = (time.perf_counter() - t) / args.n
    print(f"streamckpt SigV4: {mine * 1e6:.1f} µs per request")
    print(f"botocore S3SigV4Auth (AWSRequest + add_auth): {boto * 1e6:.1f} µs per request")
    print(f"import botocore.auth + botocore.credentials (fresh interpreter): "
          f"{import_seconds('import botocore.auth, botocore.credentials'):.3f} s")
    print(f"import http.client, ssl, hmac, hashlib (what the http path adds; fresh interpreter): "
          f"{import_seconds('import http.client, ssl, hmac, hashlib'):.3f} s")


if __name__ == "__main__":
    main()
