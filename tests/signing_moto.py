"""A moto S3 server in its own process that checks request signatures, for credential tests."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from typing import Iterator

import pytest

from streamckpt.testing.s3server import free_port


@contextlib.contextmanager
def signing_moto(objects: dict[str, bytes] | None = None) -> Iterator[tuple[str, dict[str, str]]]:
    """(endpoint, storage options of a user allowed s3:*) for a moto server that checks
    signatures: its first 5 requests (``INITIAL_NO_AUTH_ACTION_COUNT``) are free, and make
    the bucket ``signed``, the ``objects`` in it (at most one) and the user's key."""
    boto3 = pytest.importorskip("boto3")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            env=dict(os.environ, INITIAL_NO_AUTH_ACTION_COUNT="5"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), 0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    pytest.fail("moto server with auth did not start")
                time.sleep(0.05)
        endpoint = f"http://127.0.0.1:{port}"
        kw = {"endpoint_url": endpoint, "aws_access_key_id": "setup", "aws_secret_access_key": "setup",
              "region_name": "us-east-1"}
        s3, iam = boto3.client("s3", **kw), boto3.client("iam", **kw)
        s3.create_bucket(Bucket="signed")
        for key, body in (objects or {}).items():
            s3.put_object(Bucket="signed", Key=key, Body=body)
        iam.create_user(UserName="u")
        iam.put_user_policy(UserName="u", PolicyName="all", PolicyDocument=json.dumps(
            {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
        key = iam.create_access_key(UserName="u")["AccessKey"]
        yield endpoint, {"endpoint_url": endpoint, "key": key["AccessKeyId"], "secret": key["SecretAccessKey"]}
    finally:
        proc.terminate()
        proc.wait(timeout=30)
