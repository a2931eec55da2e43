"""The real ``streamckpt`` console script (``.venv/bin/streamckpt`` via subprocess)
against the moto S3 server: inspect, verify (clean and corrupted), merge, demo,
and errors (exit status 2 with the message on stderr)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
from safetensors.torch import load

import streamckpt as sc
from streamckpt.cli import parse_size, parse_storage_options
from streamckpt.merging import INDEX_NAME

ROOT = Path(__file__).resolve().parents[1]


def _script() -> str:
    exe = Path(sys.executable).parent / "streamckpt"
    found = str(exe) if exe.exists() else shutil.which("streamckpt")
    if not found:
        pytest.skip("the streamckpt console script is not installed (pip install -e .)")
    return found


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([_script(), *args], capture_output=True, text=True, timeout=timeout, env=env)


def s3_flags(opts: dict[str, Any]) -> list[str]:
    return ["--endpoint-url", opts["endpoint_url"], "--storage-option", f"key={opts['key']}",
            "--storage-option", f"secret={opts['secret']}"]


# ------------------------------------------------------------ pure helpers


def test_parse_storage_options() -> None:
    assert parse_storage_options(["anon=true", "client_kwargs.region_name=eu-west-1", "max_concurrency=8",
                                  "profile=dev"], "http://h:1") == {
        "endpoint_url": "http://h:1", "anon": True, "client_kwargs": {"region_name": "eu-west-1"},
        "max_concurrency": 8, "profile": "dev"}


def test_parse_size() -> None:
    assert parse_size("123") == 123
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("5GiB") == 5 * 2**30
    assert parse_size("2G") == 2 * 2**30
    assert parse_size("1.5MiB") == 3 * 2**19
    assert parse_size("10KB") == 10_000


# ----------------------------------------------------------- real commands


@pytest.fixture(scope="module")
def native(local_s3: Any) -> tuple[str, dict[str, torch.Tensor]]:
    """A streamckpt checkpoint on S3 (checksummed chunks of 256 KiB)."""
    opts = local_s3.storage_options
    g = torch.Generator().manual_seed(5)
    sd = {"w": torch.randn(256, 512, generator=g), "w.exp_avg": torch.randn(256, 512, generator=g),
          "b": torch.randn(512, generator=g).to(torch.bfloat16), "step": 3}
    uri = "s3://streamckpt-test/cli-native"
    sc.save(sd, uri, storage_options=opts, overwrite=True)
    return uri, {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}


def test_inspect_json(native: tuple[str, dict[str, torch.Tensor]], s3_opts: dict[str, Any]) -> None:
    uri, tensors = native
    r = cli("inspect", uri, "--json", *s3_flags(s3_opts))
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["kind"] == "streamckpt"
    assert doc["total_bytes"] == sum(t.numel() * t.element_size() for t in tensors.values())
    assert doc["tensors"]["w"] == {"shape": [256, 512], "dtype": "F32", "shards": 1, "bytes": 256 * 512 * 4}
    assert doc["values"] == {"step": 3}


@pytest.mark.slow
def test_inspect_text(native: tuple[str, dict[str, torch.Tensor]], s3_opts: dict[str, Any]) -> None:
    r = cli("inspect", native[0], *s3_flags(s3_opts))
    assert r.returncode == 0, r.stderr
    assert "[streamckpt]" in r.stdout and "w.exp_avg" in r.stdout and "256x512" in r.stdout


def test_verify_clean_then_corrupted(local_s3: Any, s3_uri: str, s3_opts: dict[str, Any]) -> None:
    sc.save({"w": torch.randn(300, 700), "z": torch.zeros(1000)}, s3_uri, storage_options=s3_opts, compression="zstd")
    r = cli("verify", s3_uri, "--quiet", *s3_flags(s3_opts))
    assert r.returncode == 0, r.stderr
    info = sc.inspect(s3_uri, storage_options=s3_opts)
    m = re.search(r"(\d+) checksums verified, (\d+) zstd frames decoded", r.stdout)
    assert m and int(m.group(1)) == int(m.group(2)) >= 4
    # Flip one byte in the middle of the data file, in place on S3.
    fs = fsspec.filesystem("s3", **s3_opts)
    (name,) = [n for n in info.files]
    data = bytearray(fs.cat_file(f"{s3_uri}/{name}"))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(f"{s3_uri}/{name}", bytes(data))
    r = cli("verify", s3_uri, "--quiet", *s3_flags(s3_opts))
    assert r.returncode == 2
    assert "checksum mismatch" in r.stderr and name in r.stderr, r.stderr


@pytest.mark.slow
def test_verify_truncated(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    sc.save({"w": torch.randn(300, 700)}, s3_uri, storage_options=s3_opts)
    fs = fsspec.filesystem("s3", **s3_opts)
    (name,) = sc.inspect(s3_uri, storage_options=s3_opts).files
    fs.pipe_file(f"{s3_uri}/{name}", fs.cat_file(f"{s3_uri}/{name}")[:-10])
    r = cli("verify", s3_uri, "--quiet", *s3_flags(s3_opts))
    assert r.returncode == 2 and "truncated" in r.stderr and name in r.stderr, r.stderr


def test_merge_command(native: tuple[str, dict[str, torch.Tensor]], s3_uri: str, s3_opts: dict[str, Any]) -> None:
    uri, tensors = native
    r = cli("merge", uri, s3_uri, "--max-shard-bytes", "300KB", "--skip", ".exp_avg", *s3_flags(s3_opts))
    assert r.returncode == 0, r.stderr
    fs = fsspec.filesystem("s3", **s3_opts)
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(s3_uri, detail=False))
    assert names == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", INDEX_NAME]
    index = json.loads(fs.cat_file(f"{s3_uri}/{INDEX_NAME}"))
    assert index["metadata"]["total_size"] == 256 * 512 * 4 + 512 * 2
    got: dict[str, torch.Tensor] = {}
    for f in names[:2]:
        got.update(load(fs.cat_file(f"{s3_uri}/{f}")))
    assert set(got) == {"w", "b"} and all(torch.equal(got[k], tensors[k]) for k in got)
    assert "wrote 2 files" in r.stdout


def test_load_bench_zero_layout_on_2_ranks(native: tuple[str, dict[str, torch.Tensor]],
                                           s3_opts: dict[str, Any]) -> None:
    """Two spawned gloo ranks load flat ZeRO ranges of every tensor: together they need
    and read each stored byte once (the seam chunk is read once and sent)."""
    uri, tensors = native
    r = cli("load-bench", uri, "-n", "2", "--layout", "zero", "--repeat", "2", "--json", *s3_flags(s3_opts),
            timeout=240)
    assert r.returncode == 0, r.stderr
    reps = json.loads(r.stdout)
    assert len(reps) == 2 and all(len(runs) == 2 for runs in reps)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    for runs in reps:
        assert [x["rank"] for x in runs] == [0, 1]
        assert sum(x["bytes_needed"] for x in runs) == total
        assert sum(x["bytes_read"] for x in runs) == total  # every stored byte once over both ranks
        assert sum(x["bytes_sent"] for x in runs) == sum(x["bytes_received"] for x in runs) > 0
        assert all(x["seconds"] > 0 and x["requests"] > 0 for x in runs)


def test_load_bench_text_single_process(native: tuple[str, dict[str, torch.Tensor]],
                                        s3_opts: dict[str, Any]) -> None:
    uri, tensors = native
    r = cli("load-bench", uri, "--layout", "cols", "--repeat", "1", *s3_flags(s3_opts))
    assert r.returncode == 0, r.stderr
    mib = sum(t.numel() * t.element_size() for t in tensors.values()) / 2**20
    assert f"read {mib:.2f} MiB for {mib:.2f} MiB needed (1.000×)" in r.stdout, r.stdout


def test_missing_checkpoint_exit_2(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    r = cli("inspect", s3_uri, *s3_flags(s3_opts))
    assert r.returncode == 2 and "no checkpoint at" in r.stderr and s3_uri in r.stderr


@pytest.mark.slow
def test_more_errors_exit_2(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes((2**60).to_bytes(8, "little") + b"{}")
    r = cli("verify", str(tmp_path))
    assert r.returncode == 2 and "exceeds" in r.stderr and "model.safetensors" in r.stderr
    r = cli("inspect", str(tmp_path), "--storage-option", "novalue")
    assert r.returncode == 2 and "key=value" in r.stderr


@pytest.mark.slow
def test_inspect_and_verify_hf_and_dcp(tmp_path: Path) -> None:
    """Foreign kinds through the CLI (local paths: fast, no server needed)."""
    from safetensors.torch import save_file
    import warnings

    import torch.distributed.checkpoint as dcp

    (tmp_path / "hf").mkdir()
    save_file({"a": torch.ones(4, 4), "b": torch.arange(3)}, str(tmp_path / "hf" / "model.safetensors"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"x": torch.ones(8), "step": 2}, checkpoint_id=str(tmp_path / "dcp"))
    r = cli("inspect", str(tmp_path / "hf"), "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["kind"] == "safetensors"
    r = cli("verify", str(tmp_path / "dcp"), "-q")
    assert r.returncode == 0 and "[dcp]" in r.stdout and "stores no checksums" in r.stdout


def test_demo() -> None:
    """The README's main job: save to the embedded S3, load four other layouts by
    range reads, check every element, print the table."""
    r = cli("demo", "--size-mb", "4", "--quiet")
    assert r.returncode == 0, r.stderr
    assert "every element of every layout matched" in r.stdout
    rows = {line.split("  ")[0]: line for line in r.stdout.splitlines()}
    full = next(v for k, v in rows.items() if k.startswith("full replica"))
    needed, read = re.findall(r"([\d.]+ [KMG]iB)", full)[:2]
    assert needed == read  # a full load reads each byte once
    # the multi-rank part: 4 gloo ranks save, 2 and 3 ranks load other layouts, read once in total
    assert "every rank's every element matched." in r.stdout
    for phase in ("cols", "rows"):
        line = next(x for x in r.stdout.splitlines() if x.startswith(f"{phase}: all ranks read"))
        read_mib, needed_mib = map(float, re.findall(r"([\d.]+) MiB", line)[:2])
        assert read_mib <= needed_mib  # each stored byte fetched by exactly one rank


@pytest.mark.slow
def test_demo_serve_then_commands_against_it(tmp_path: Path) -> None:
    """``demo --serve`` checks every element, prints the table, then keeps its S3
    server up; inspect/verify/merge run against that embedded server."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.Popen([_script(), "demo", "--size-mb", "4", "--quiet", "--serve", "--single-process"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines: list[str] = []
        assert p.stdout is not None
        for line in p.stdout:
            lines.append(line)
            if "streamckpt merge" in line:
                break
        out = "".join(lines)
        assert "every element of every layout matched" in out, out + (p.stderr.read() if p.poll() is not None else "")
        for layout in ("TP rank 1/4, rows", "TP rank 2/4, columns", "ZeRO rank 5/8", "full replica"):
            assert layout in out
        cmds = [line.split() for line in lines if line.strip().startswith("streamckpt ")]
        assert [c[1] for c in cmds] == ["inspect", "verify", "merge"]
        for c in cmds:
            r = cli(*c[1:], "--quiet")
            assert r.returncode == 0, (c, r.stderr)
            if c[1] == "inspect":
                assert "metadata: {'demo': True}" in r.stdout
            if c[1] == "verify":
                assert "checksums verified" in r.stdout
            if c[1] == "merge":
                assert re.search(r"wrote \d+ files", r.stdout)
    finally:
        p.send_signal(signal.SIGINT)
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
