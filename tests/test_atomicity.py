"""Save atomicity: the manifest is the commit. A save killed mid-way (a real process,
SIGKILL) leaves no manifest, ``latest`` keeps returning the previous checkpoint, and
that checkpoint still loads bit-exact; committed checkpoints are never replaced
without ``overwrite=True``; failed uploads are aborted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import streamckpt as sc
from streamckpt.errors import CheckpointExistsError, CheckpointNotFoundError
from streamckpt.storage import RetryPolicy, Storage
from streamckpt.testing import FaultProxy, LocalS3

from distributed import kill_when_stalled

REPO = Path(__file__).resolve().parents[1]

# The child saves 20 MiB (three data files of at most 8 MiB, one PUT each, uploaded
# several at once) and prints a line once the save returns.
CHILD = textwrap.dedent(
    """
    import json, sys
    import torch
    import streamckpt as sc

    uri, opts = sys.argv[1], json.loads(sys.argv[2])
    g = torch.Generator().manual_seed(2)
    sd = {"w": torch.randn(5 * 1024 * 1024, generator=g), "step": 2}
    sc.save(sd, uri, storage_options=opts)
    print("SAVED", flush=True)
    """
)


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(1000, 64, generator=g), "step": 1}


def _spawn(uri: str, opts: dict[str, Any]) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, uri, json.dumps(opts)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )


def _pending_uploads(s3_opts: dict[str, Any], uri: str) -> list[str]:
    st = Storage(uri, s3_opts)
    bucket, _, key = st.root.partition("/")
    resp = st.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=key)
    return [u["Key"] for u in resp.get("Uploads", [])]


@pytest.mark.parametrize(
    "moment,stalled",
    [
        ("mid-data", lambda m, p: m == "PUT" and "/data/00000-0001." in p),  # the second data file is held
        ("before-manifest", lambda m, p: m == "PUT" and p.split("?")[0].endswith("/manifest.json")),
    ],
    ids=["mid-data", "before-manifest"],
)
def test_save_killed_mid_way_leaves_previous_checkpoint_latest(
    moment: str, stalled: Any, s3_uri: str, s3_opts: dict[str, Any], local_s3: LocalS3
) -> None:
    root = s3_uri
    first = _state(1)
    sc.save(first, f"{root}/step-1", storage_options=s3_opts)
    assert sc.latest(root, storage_options=s3_opts) == f"{root}/step-1"

    with FaultProxy(local_s3.endpoint_url, faults=["stall"], rate=1.0, stall_seconds=120,
                    methods=("PUT", "POST"), match=stalled, max_repeats=10**9) as proxy:
        child = _spawn(f"{root}/step-2", proxy.storage_options)
        kill_when_stalled(child, proxy)

    st = Storage(f"{root}/step-2", s3_opts)
    assert not st.exists("manifest.json")
    if moment == "before-manifest":
        assert st.list("data", recursive=True), "the data file was complete when the process died"
    else:  # data files may be up, but the held one is not: nothing is committed
        assert "data/00000-0001.safetensors" not in st.list("", recursive=True)
    assert sc.latest(root, storage_options=s3_opts) == f"{root}/step-1"
    with pytest.raises(CheckpointNotFoundError):
        sc.load({"w": torch.zeros(5 * 1024 * 1024)}, f"{root}/step-2", storage_options=s3_opts)
    back = {"w": torch.zeros(1000, 64), "step": 0}
    sc.load(back, f"{root}/step-1", storage_options=s3_opts)
    assert torch.equal(back["w"], first["w"]) and back["step"] == 1


@pytest.mark.slow
def test_save_that_completes_in_a_child_becomes_latest(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    """The control for the kill test: the same child, left alone, commits."""
    sc.save(_state(1), f"{s3_uri}/step-1", storage_options=s3_opts)
    child = _spawn(f"{s3_uri}/step-2", s3_opts)
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0, err[-2000:]
    assert "SAVED" in out
    assert sc.latest(s3_uri, storage_options=s3_opts) == f"{s3_uri}/step-2"
    assert _pending_uploads(s3_opts, s3_uri) == []


@pytest.mark.parametrize("where", ["s3", "local"])
def test_committed_checkpoint_needs_overwrite(where: str, s3_uri: str, s3_opts: dict[str, Any], tmp_uri: str) -> None:
    uri, opts = (s3_uri, s3_opts) if where == "s3" else (tmp_uri, None)
    first, second = _state(1), _state(2)
    sc.save(first, uri, storage_options=opts)
    with pytest.raises(CheckpointExistsError) as ei:
        sc.save(second, uri, storage_options=opts)
    assert "overwrite=True" in str(ei.value)
    back = {"w": torch.zeros(1000, 64), "step": 0}
    sc.load(back, uri, storage_options=opts)
    assert torch.equal(back["w"], first["w"])  # the refused save changed nothing
    sc.save(second, uri, storage_options=opts, overwrite=True)
    sc.load(back, uri, storage_options=opts)
    assert torch.equal(back["w"], second["w"])


def test_failed_upload_is_aborted_and_leaves_nothing(s3_uri: str, s3_opts: dict[str, Any], local_s3: LocalS3) -> None:
    """A data file whose second part cannot be uploaded: StorageError, multipart aborted."""
    policy = RetryPolicy(max_attempts=2, client_attempts=1, base_delay=0.01, total_timeout=5)
    with FaultProxy(local_s3.endpoint_url, faults=["slowdown"], rate=1.0, methods=("PUT",),
                    match=lambda m, p: "partNumber=2" in p, max_repeats=10**9) as proxy:
        st = Storage(s3_uri, proxy.storage_options, policy=policy)
        up = st.open_write("data/00000.safetensors", block_size=5 << 20)
        with pytest.raises(sc.StorageError) as ei:  # raised by write or, with parts in flight, by commit
            up.write(b"\x01" * (11 << 20))
            up.commit()
        assert "data/00000.safetensors" in str(ei.value)
        # s3fs numbers its own parts; obstore's writer (also behind the http read path) numbers and retries them in Rust
        assert "part 2" in str(ei.value) or (st.read_backend in ("obstore", "http") and "503" in str(ei.value))
        up.abort()  # idempotent after the automatic abort
    assert _pending_uploads(s3_opts, s3_uri) == []
    assert Storage(s3_uri, s3_opts).list("", recursive=True) == []


# ------------------------------------------------------------- a rank killed mid-way

# Longer than run_ranks' deadline: a survivor that learned of the death only from a
# collective's timeout would be killed by the harness (NoResult) and fail the test. The
# bound is structural: the survivor raises PeerError at the first collective it enters
# after the peer died, because the peer's closed connection fails it.
PG_TIMEOUT = 600.0


def _die_when_held(opts: dict[str, Any], methods: tuple[str, ...], match: Any = None) -> dict[str, Any]:
    """Route this rank's requests through a proxy that holds the first eligible one, and
    SIGKILL this process the moment it is held. Returns the storage options to use."""
    import threading

    proxy = FaultProxy(opts["endpoint_url"], faults=["stall"], rate=1.0, stall_seconds=120,
                       methods=methods, match=match, max_repeats=10**9).start()

    def killer() -> None:
        while proxy.stalled_now == 0:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=killer, daemon=True).start()
    return proxy.storage_options


def save_with_rank_killed(rank: int, world: int, uri: str, opts: dict[str, Any]) -> str:
    """Two ranks save rows of one tensor; rank 1 dies while its data file is uploading."""
    g = torch.Generator().manual_seed(rank)
    sd = {"w": sc.ShardedTensor(torch.randn(256, 1024, generator=g), (512, 1024), (256 * rank, 0))}
    if rank == 1:
        opts = _die_when_held(opts, ("PUT", "POST"))
    sc.save(sd, uri, storage_options=opts)
    return "saved"


def load_with_rank_killed(rank: int, world: int, uri: str, opts: dict[str, Any]) -> str:
    """Two ranks load row halves (each reads its own); rank 1 dies while its data read is in flight."""
    w = torch.zeros(256, 1024)
    if rank == 1:
        opts = _die_when_held(opts, ("GET",), match=lambda m, p: "/data/" in p)
    sc.load({"w": sc.ShardedTensor(w, (512, 1024), (256 * rank, 0))}, uri, storage_options=opts)
    return "loaded"


def test_rank_killed_during_save_fails_the_others_and_commits_nothing(
    s3_uri: str, s3_opts: dict[str, Any]
) -> None:
    from distributed import run_ranks

    sc.save(_state(1), f"{s3_uri}/step-1", storage_options=s3_opts)
    ranks = run_ranks(2, save_with_rank_killed, kwargs={"uri": f"{s3_uri}/step-2", "opts": s3_opts},
                      timeout=150, pg_timeout=PG_TIMEOUT)
    assert ranks[1].error is not None and ranks[1].error.cls == "NoResult"  # it really died
    assert ranks[0].error is not None, "the surviving rank must raise, not report success"
    assert not Storage(f"{s3_uri}/step-2", s3_opts).exists("manifest.json")
    assert sc.latest(s3_uri, storage_options=s3_opts) == f"{s3_uri}/step-1"
    # its data file uploaded, the survivor's next collective is the gather of shard records
    _expect_peer_error(ranks[0].error, "gathering metadata from all ranks")


def test_rank_killed_during_load_fails_the_others_in_bounded_time(
    s3_uri: str, s3_opts: dict[str, Any]
) -> None:
    from distributed import run_ranks

    g = torch.Generator().manual_seed(5)
    sc.save({"w": torch.randn(512, 1024, generator=g)}, s3_uri, storage_options=s3_opts)
    ranks = run_ranks(2, load_with_rank_killed, kwargs={"uri": s3_uri, "opts": s3_opts},
                      timeout=150, pg_timeout=PG_TIMEOUT)
    assert ranks[1].error is not None and ranks[1].error.cls == "NoResult"
    assert ranks[0].error is not None, "the surviving rank must raise, not hang or succeed"
    # its own round-0 reads done, the survivor's next collective is the round's agreement
    _expect_peer_error(ranks[0].error, "agreeing on success with all ranks")


def _expect_peer_error(err: Any, collective: str) -> None:
    """The survivor raised PeerError (not the backend's raw error, nor another class) in
    ``collective``, the first one after the death, failed by the peer's closed
    connection: one collective after the death, no timeout waited out."""
    assert err.cls == "PeerError", f"{err.cls}: {err.msg[:300]}"
    assert err.msg.startswith(f"{collective} failed: a peer rank died"), err.msg[:300]
    assert "closed by peer" in err.msg or "reset by peer" in err.msg, err.msg[:300]


def test_upload_aborted_by_caller_leaves_no_multipart_upload(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    """A data file abandoned mid-way by the caller (another rank failed, Ctrl-C): no multipart
    upload is left open on the server, whichever client writes (obstore cannot abort one
    itself: the store aborts it through s3fs), and nothing is visible."""
    st = Storage(s3_uri, s3_opts)
    up = st.open_write("data/00000.safetensors", block_size=5 << 20)
    up.write(b"\x01" * (11 << 20))  # two whole parts handed over: the multipart upload has begun
    up.abort()
    assert _pending_uploads(s3_opts, s3_uri) == []
    assert Storage(s3_uri, s3_opts).list("", recursive=True) == []
