"""The real ``streamckpt`` console script (``.venv/bin/streamckpt`` via subprocess)
against the moto S3 server: inspect, verify (clean and corrupted), merge, demo,
and errors (exit status 2 with the message on stderr)."""

from __future__ import annotations

import io
import json
import os
import re
import shlex
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
from streamckpt.cli import EXIT_BROKEN_PIPE, parse_size, parse_storage_options
from streamckpt.merging import INDEX_NAME
from streamckpt.progress import ByteProgress, is_terminal
from streamckpt.results import DtypeName, TensorInfo, abbreviate, human_bytes as human, plural

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


def test_latest_prints_the_newest_and_says_when_there_is_none(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    for step in (9, 10):
        sc.save({"w": torch.full((4,), float(step))}, f"{s3_uri}/step-{step}", storage_options=s3_opts)
    r = cli("latest", s3_uri, *s3_flags(s3_opts))
    assert (r.returncode, r.stdout, r.stderr) == (0, f"{s3_uri}/step-10\n", "")
    r = cli("latest", f"{s3_uri}/step-10", *s3_flags(s3_opts))  # a checkpoint holds no checkpoints
    assert (r.returncode, r.stdout) == (1, "")
    assert r.stderr.endswith(f"latest: {s3_uri}/step-10 is itself a committed checkpoint, not a run's root: latest "
                             f"looks at the checkpoints directly under a root (this one's is {s3_uri}); taking "
                             f"this None for 'start fresh' would pass over it\n"
                             f"no committed checkpoint under {s3_uri}/step-10\n"), r.stderr


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
    total = 256 * 512 * 4 + 512 * 2  # the tensors kept, known before the merge starts (stderr is a pipe here)
    assert _final("merge", total, total).fullmatch(r.stderr.splitlines()[-1]), r.stderr


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
    assert " on 1 rank, memory_budget 256.0 MiB," in r.stdout and " over 1 repetition: " in r.stdout, r.stdout


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
    saves = [x for x in r.stdout.splitlines() if x.startswith("save/4 ")]
    written = [float(re.findall(r"([\d.]+)Mi", x)[0]) for x in saves]  # a save's row: its bytes written, not 0
    assert len(saves) == 4 and all(w > 0 for w in written) and 32.0 <= sum(written) < 32.5, saves
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
                assert r.stdout.startswith("wrote 1 file + model.safetensors.index.json")  # 4 MiB < 8MiB
    finally:
        p.send_signal(signal.SIGINT)
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


# ------------------------------------------------- what a new user meets (#24)


def test_plural_and_abbreviate() -> None:
    assert [plural(n, "file") for n in (0, 1, 2)] == ["0 files", "1 file", "2 files"]
    assert plural(1, "index", "indices") == "1 index" and plural(3, "index", "indices") == "3 indices"
    assert abbreviate("x" * 60) == "x" * 60
    assert abbreviate("x" * 61) == "x" * 57 + "..."


def test_checkpoint_info_str_counts_and_values() -> None:
    """One tensor / one file in the singular; every value beside its name, long ones cut."""
    info = sc.CheckpointInfo(
        uri="s3://b/c", kind="streamckpt", tensors={"w": TensorInfo((2, 3), DtypeName("F32"), 1, 24)},
        total_bytes=24, metadata={}, values={"step": 7, "optim.param_groups": [{"lr": 0.5, "params": list(range(30))}],
                                             "name": "run-1"},
        files={"data/00000.safetensors": 120})
    assert str(info).splitlines() == [
        "s3://b/c  [streamckpt]",
        "1 tensor, 24 B of tensor data, 1 file (120 B stored)",
        "name  dtype    shape                  shards       bytes",
        "w     F32      2x3                         1        24 B",
        "3 values:",
        "  step               = 7",
        "  optim.param_groups = [{'lr': 0.5, 'params': [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,...",
        "  name               = 'run-1'",
    ]
    two = sc.CheckpointInfo(uri="u", kind="dcp", tensors={}, total_bytes=0, metadata={}, files={"a": 1, "b": 2})
    assert str(two).splitlines()[1] == "0 tensors, 0 B of tensor data, 2 files (3 B stored)"


@pytest.fixture(scope="module")
def with_values(local_s3: Any) -> str:
    """A checkpoint with a long non-tensor value (optimizer param groups) and a short one."""
    uri = "s3://streamckpt-test/cli-values"
    sd = {"w": torch.zeros(4), "step": 12,
          "optim": {"param_groups": [{"lr": 0.01, "betas": [0.9, 0.99], "params": list(range(100))}]}}
    sc.save(sd, uri, storage_options=local_s3.storage_options, overwrite=True)
    return uri


def test_inspect_shows_values_and_json_keeps_them_whole(with_values: str, s3_opts: dict[str, Any]) -> None:
    r = cli("inspect", with_values, *s3_flags(s3_opts))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[1].startswith("1 tensor, 16 B of tensor data, 1 file ("), lines
    assert lines[lines.index("2 values:") + 1:] == [  # in the state_dict's order
        "  step               = 12",
        "  optim.param_groups = [{'lr': 0.01, 'betas': [0.9, 0.99], 'params': [0, 1, 2, 3...",
    ]
    r = cli("inspect", with_values, "--json", *s3_flags(s3_opts))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["values"] == {
        "optim.param_groups": [{"lr": 0.01, "betas": [0.9, 0.99], "params": list(range(100))}], "step": 12}


@pytest.fixture(scope="module")
def many_tensors(local_s3: Any) -> str:
    """3000 tiny tensors: ``inspect`` prints ~200 KB, far more than a pipe holds (64 KiB)."""
    uri = "s3://streamckpt-test/cli-many"
    sc.save({f"layers.{i}.norm.weight": torch.full((2,), float(i)) for i in range(3000)}, uri,
            storage_options=local_s3.storage_options, overwrite=True)
    return uri


@pytest.mark.parametrize("extra", [[], ["--json"]], ids=["text", "json"])
def test_output_into_a_pipe_closed_early_is_quiet(many_tensors: str, s3_opts: dict[str, Any],
                                                  extra: list[str]) -> None:
    """``streamckpt inspect URI | head -1``: the first line, no traceback, status 141."""
    cmd = shlex.join([_script(), "inspect", many_tensors, *extra, *s3_flags(s3_opts)])
    r = subprocess.run(["bash", "-c", f'{cmd} | head -1; echo "status=${{PIPESTATUS[0]}}"'], capture_output=True,
                       text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    first = "{" if extra else f"{many_tensors}  [streamckpt]"
    assert r.stdout.splitlines() == [first, f"status={EXIT_BROKEN_PIPE}"], (r.stdout[-500:], r.stderr)
    assert r.stderr == ""


def test_bad_storage_option_shows_the_commands_usage(tmp_path: Path) -> None:
    r = cli("inspect", str(tmp_path), "--storage-option", "foo")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("usage: streamckpt inspect "), r.stderr
    assert r.stderr.splitlines()[-1] == ("streamckpt inspect: error: argument --storage-option: "
                                         "expects key=value, got 'foo'")
    r = cli("merge", str(tmp_path), str(tmp_path / "out"), "--storage-option", "a=1", "--storage-option", "a.b=2")
    assert r.returncode == 2 and r.stderr.startswith("usage: streamckpt merge "), r.stderr
    assert r.stderr.splitlines()[-1] == "streamckpt merge: error: --storage-option 'a.b': 'a' is already a value"


@pytest.mark.parametrize("args, message", [
    (["merge", "u", "o", "--out-storage-option", "x"], "argument --out-storage-option: expects key=value, got 'x'"),
    (["load-bench", "u", "-n", "0"], "argument --processes/-n: must be at least 1: '0'"),
    (["load-bench", "u", "--repeat", "two"], "argument --repeat: not an integer: 'two'"),
    (["demo", "--size-mb", "-4"], "argument --size-mb: must be a positive number: '-4'"),
    (["demo", "--endpoint-url", "http://h:1"], "unrecognized arguments: --endpoint-url http://h:1"),
])
def test_value_errors_name_their_command(args: list[str], message: str) -> None:
    """Each is refused before anything runs, with that command's usage and status 2."""
    r = cli(*args)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith(f"usage: streamckpt {args[0]} "), r.stderr
    assert r.stderr.splitlines()[-1] == f"streamckpt {args[0]}: error: {message}"


# plain progress lines: "<desc>: <done> of <total> (<pct>%), <rate> MB/s" every few seconds, then
# "<desc>: <done> of <total> (<pct>%) in <s> s, <rate> MB/s" when done
def _final(desc: str, done: int, total: int) -> re.Pattern[str]:
    pct = round(100 * done / total)
    return re.compile(rf"{re.escape(desc)}: {re.escape(human(done))} of {re.escape(human(total))} \({pct}%\) "
                      rf"in \d+\.\d\d s, \d+\.\d MB/s")


def test_verify_progress_when_stderr_is_not_a_terminal(native: tuple[str, dict[str, torch.Tensor]],
                                                       s3_opts: dict[str, Any]) -> None:
    uri, tensors = native
    total = sum(t.numel() * t.element_size() for t in tensors.values())  # uncompressed: stored == tensor bytes
    r = cli("verify", uri, *s3_flags(s3_opts))
    assert r.returncode == 0, r.stderr
    assert "\r" not in r.stderr and "Traceback" not in r.stderr
    lines = r.stderr.splitlines()
    assert _final("verify", total, total).fullmatch(lines[-1]), lines
    assert all(f" of {human(total)} (" in line for line in lines), lines  # earlier lines, if slow, too
    assert re.fullmatch(rf"OK {re.escape(uri)} \[streamckpt\]: 1 file, 3 shards, {re.escape(human(total))} read in "
                        r"\d+ requests?, \d+ checksums verified; \d+\.\d\d s, \d+\.\d MB/s\n", r.stdout), r.stdout


def test_verify_progress_on_a_terminal_is_a_bar(native: tuple[str, dict[str, torch.Tensor]],
                                                s3_opts: dict[str, Any]) -> None:
    """stderr on a pty (80 columns): a tqdm bar, redrawn with '\\r', showing the total."""
    import fcntl
    import pty
    import select
    import struct
    import termios

    from tqdm import tqdm

    uri, tensors = native
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    p = subprocess.Popen([_script(), "verify", uri, *s3_flags(s3_opts)], stdout=subprocess.PIPE, stderr=slave,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    os.close(slave)
    chunks = []
    try:
        while select.select([master], [], [], 120)[0]:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child closed its end
                break
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(master)
        out, _ = p.communicate(timeout=60)
    err = b"".join(chunks).decode()
    assert p.returncode == 0, err
    assert "\r" in err and f"/{tqdm.format_sizeof(total, divisor=1024)}" in err, repr(err)
    assert "Traceback" not in err and b"OK " in out


def test_demo_load_progress_knows_its_totals() -> None:
    """Each layout's read bar gets its total from the load's plan: every final line reads
    done == total, and done is the table's "read" figure."""
    r = cli("demo", "--size-mb", "4", "--single-process")
    assert r.returncode == 0, r.stderr
    assert "\r" not in r.stderr
    finals = [line for line in r.stderr.splitlines() if " in " in line and line.endswith("MB/s")]
    layouts = ("TP rank 1/4, rows (Shard(0))", "TP rank 2/4, columns (Shard(1))", "ZeRO rank 5/8, flat range",
               "full replica")
    assert [f.split(" (read): ")[0] for f in finals] == list(layouts), r.stderr
    for name, line in zip(layouts, finals):
        m = re.fullmatch(rf"{re.escape(name)} \(read\): (.+) of (.+) \(100%\) in \d+\.\d\d s, \d+\.\d MB/s", line)
        assert m and m.group(1) == m.group(2), line
        row = next(x for x in r.stdout.splitlines() if x.startswith(name))
        assert re.findall(r"[\d.]+ (?:[KMG]i)?B", row)[1] == m.group(1), (row, line)


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_byte_progress_lines_every_interval() -> None:
    """Not a terminal: at most one line per interval while bytes arrive, and a final one."""
    clock, out = _Clock(), io.StringIO()
    with ByteProgress("merge", 4_000_000, stream=out, interval=5.0, clock=clock) as bar:
        for _ in range(4):
            clock.now += 2.0
            bar(1_000_000)
    assert out.getvalue().splitlines() == [
        "merge: 2.9 MiB of 3.8 MiB (75%), 0.5 MB/s",  # at 6 s (3 MB), not at 2 or 4 s
        "merge: 3.8 MiB of 3.8 MiB (100%) in 8.00 s, 0.5 MB/s",
    ]


def test_byte_progress_totals_and_failure() -> None:
    clock, out = _Clock(), io.StringIO()
    bar = ByteProgress("load", stream=out, clock=clock)
    bar.add_total(600)
    bar.add_total(400)  # a retried plan adds its own bytes
    clock.now += 1.0
    bar(500)
    bar.close(failed=True)
    bar.close()  # once only
    assert out.getvalue() == "load: stopped at 500 B of 1000 B (50%) in 1.00 s, 0.0 MB/s\n"
    out = io.StringIO()
    with ByteProgress("x", stream=out, clock=clock) as bar:
        bar(2048)
    assert out.getvalue() == "x: 2.0 KiB in 0.00 s, 0.0 MB/s\n"  # no total known: none invented
    out = io.StringIO()
    with ByteProgress("q", 10, enabled=False, stream=out) as bar:
        bar(10)
    assert out.getvalue() == "" and bar.done == 10


def test_byte_progress_chooses_the_bar_only_on_a_terminal() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty = Tty()
    with ByteProgress("verify", 2048, stream=tty) as bar:
        bar(1024)
    assert "\r" in tty.getvalue() and "/2.00k" in tty.getvalue()
    assert not is_terminal(io.StringIO()) and not is_terminal(object()) and is_terminal(Tty())
