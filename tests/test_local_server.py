"""``python -m streamckpt.testing.s3server`` as the README starts it: more than one bucket."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import torch

import streamckpt as sc
from streamckpt.testing.s3server import options_for

ROOT = Path(__file__).resolve().parents[1]


def test_the_local_server_makes_every_bucket_given() -> None:
    """``--bucket a --bucket b`` makes both, each usable on its own (the README's server block
    makes ``bucket`` and ``models``); a bucket not named is not there."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "streamckpt.testing.s3server", "--port", "0",
                             "--bucket", "first", "--bucket", "second"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        m = re.fullmatch(r"endpoint_url=(http://127\.0\.0\.1:\d+) key=\S+ secret=\S+\n", line)
        assert m, line
        opts = options_for(m.group(1))
        for bucket, value in (("first", 1.0), ("second", 2.0)):
            sc.save({"w": torch.full((3,), value)}, f"s3://{bucket}/run/step-1", storage_options=opts)
        for bucket, value in (("first", 1.0), ("second", 2.0)):
            got = sc.load_state(f"s3://{bucket}/run/step-1", storage_options=opts)
            assert torch.equal(got["w"], torch.full((3,), value))
        try:
            sc.save({"w": torch.zeros(1)}, "s3://third/run/step-1", storage_options=opts)
        except sc.CheckpointNotFoundError as e:
            assert "s3://third/run/step-1" in str(e)
        else:
            raise AssertionError("a bucket that was not named exists")
    finally:
        proc.terminate()
        proc.communicate(timeout=60)


def test_the_servers_help_says_bucket_repeats() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-m", "streamckpt.testing.s3server", "--help"], capture_output=True,
                       text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "repeat it for more (--bucket a --bucket b)" in " ".join(p.stdout.split())
