"""Garbage a run's root collects (moto over HTTP, real processes SIGKILLed mid-way): the data
of a save that died before its commit, an incomplete multipart upload, a prune cut short."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import streamckpt as sc
from streamckpt.manage.lease import LEASE_NAME
from streamckpt.storage import Storage
from streamckpt.testing import FaultProxy, LocalS3

from distributed import kill_when_stalled

REPO = Path(__file__).resolve().parents[1]

# The child saves step 2 (20 MiB: three data files) or prunes, through a manager, with storage
# options given as JSON; a line is printed when the call returns.
CHILD = textwrap.dedent(
    """
    import json, sys
    import torch
    import streamckpt as sc

    root, opts, what = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    mgr = sc.CheckpointManager(root, storage_options=opts, keep_last=2)
    if what == "save":
        g = torch.Generator().manual_seed(2)
        mgr.save(2, {"w": torch.randn(5 * 1024 * 1024, generator=g)})
    else:
        print(mgr.prune())
    print("DONE", flush=True)
    """
)


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(256, 64, generator=g), "step": step}


def _killed_mid_way(root: str, what: str, local_s3: LocalS3, held: Callable[[str, str], bool],
                    methods: tuple[str, ...], unsupported: Callable[[str, str], bool] | None = None) -> None:
    """Run the child through a proxy that holds the first request ``held`` picks; SIGKILL it then."""
    with FaultProxy(local_s3.endpoint_url, faults=["stall"], rate=1.0, stall_seconds=120, methods=methods,
                    match=held, max_repeats=10**9, unsupported=unsupported) as proxy:
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        child = subprocess.Popen([sys.executable, "-c", CHILD, root, json.dumps(proxy.storage_options), what],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        kill_when_stalled(child, proxy, timeout=120)


def _names(uri: str, opts: dict[str, Any]) -> list[str]:
    """The checkpoint objects under ``uri`` (not the writer lease, a root's own object)."""
    return [n for n in Storage(uri, opts).list("", recursive=True) if n != LEASE_NAME]


def test_killed_save_is_garbage_once_older_than_the_grace(s3_uri: str, s3_opts: dict[str, Any],
                                                           local_s3: LocalS3) -> None:
    mgr = sc.CheckpointManager(s3_uri, storage_options=s3_opts, writer_lease=None)  # a child saves beside it
    mgr.save(1, _state(1))
    # killed while committing: every data file is up, the manifest never is
    _killed_mid_way(s3_uri, "save", local_s3, lambda m, p: p.split("?")[0].endswith("/step-2/manifest.json"), ("PUT",))
    dead = [n for n in _names(s3_uri, s3_opts) if n.startswith("step-2/")]
    assert dead and all(n.startswith("step-2/data/") for n in dead)
    assert mgr.steps() == [1] and sc.latest(s3_uri, storage_options=s3_opts) == f"{s3_uri}/step-1"
    found = mgr.collect_garbage(older_than=3600)  # a save that may still be running: untouched
    assert len(found) == 1 and found[0].startswith(f"{s3_uri}/{LEASE_NAME} (the writer lease of pid "), found
    # ... but the killed child's writer lease: its pid is gone from this host
    time.sleep(3.5)
    # a save in progress, younger than the grace: its first data object is up
    Storage(s3_uri, s3_opts).write_bytes("step-3/data/00000-0000.safetensors", b"\0" * 1000)
    sizes = Storage(s3_uri, s3_opts).list_info("")
    expected = [f"{s3_uri}/{n} ({sc.results.human_bytes(sizes[n].size)})" for n in sorted(dead)]
    assert mgr.collect_garbage(older_than=2.5, dry_run=True) == expected
    assert sorted(n for n in _names(s3_uri, s3_opts) if n.startswith("step-2/")) == sorted(dead)  # dry run
    assert mgr.collect_garbage(older_than=2.5) == expected
    left = _names(s3_uri, s3_opts)
    assert [n for n in left if n.startswith("step-2/")] == []
    assert "step-3/data/00000-0000.safetensors" in left  # younger than the grace: left alone
    back = {"w": torch.zeros(256, 64), "step": 0}
    assert mgr.restore(back).step == 1 and torch.equal(back["w"], _state(1)["w"])  # type: ignore[union-attr]
    assert mgr.collect_garbage(older_than=0) == [f"{s3_uri}/step-3/data/00000-0000.safetensors (1000 B)"]


def test_open_multipart_upload_is_aborted(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    """A multipart upload its writer never completed nor aborted (the writer died): no listing
    of objects shows it, S3 bills its parts, collect_garbage aborts it."""
    mgr = sc.CheckpointManager(s3_uri, storage_options=s3_opts)
    mgr.save(1, _state(1))
    st = Storage(s3_uri, s3_opts)
    bucket, _, key = st.root.partition("/")
    s3 = st.fs
    up = s3.call_s3("create_multipart_upload", Bucket=bucket, Key=f"{key}/step-2/data/00000-0000.safetensors")
    s3.call_s3("upload_part", Bucket=bucket, Key=f"{key}/step-2/data/00000-0000.safetensors",
               UploadId=up["UploadId"], PartNumber=1, Body=b"\1" * (5 << 20))
    assert [u.name for u in st.open_uploads("")] == ["step-2/data/00000-0000.safetensors"]
    assert _names(s3_uri, s3_opts) == ["step-1/data/00000-0000.safetensors", "step-1/manifest.json"]
    # moto reports one fixed Initiated time (2010) for every upload, so the grace is shown with the
    # save's other data object, just written: a save in progress is left alone whole
    st.write_bytes("step-2/data/00001-0000.safetensors", b"\2" * 100)
    assert mgr.collect_garbage(older_than=3600) == []
    found = mgr.collect_garbage(older_than=0, dry_run=True)
    assert found == [f"{s3_uri}/step-2/data/00000-0000.safetensors (incomplete upload)",
                     f"{s3_uri}/step-2/data/00001-0000.safetensors (100 B)"]
    assert len(st.open_uploads("")) == 1
    assert mgr.collect_garbage(older_than=0) == found
    assert st.open_uploads("") == []
    resp = s3.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=key)
    assert resp.get("Uploads", []) == []
    assert _names(s3_uri, s3_opts) == ["step-1/data/00000-0000.safetensors", "step-1/manifest.json"]
    assert mgr.steps() == [1]


def test_prune_killed_between_deletions_leaves_kept_checkpoints_whole(s3_uri: str, s3_opts: dict[str, Any],
                                                                       local_s3: LocalS3) -> None:
    with sc.CheckpointManager(s3_uri, storage_options=s3_opts) as mgr:
        for step in (1, 2, 3, 4):
            mgr.save(step, _state(step))
    # the child prunes to keep_last=2 (step-1, then step-2), one DELETE per object (the proxy
    # refuses bulk deletes, as some S3 servers do); it dies on its second DELETE: step-1's
    # manifest is gone, its data is not
    count = itertools.count()
    _killed_mid_way(s3_uri, "prune", local_s3, lambda m, p: next(count) == 1, ("DELETE",),
                    unsupported=lambda m, p: m == "POST" and p.endswith("?delete"))
    mgr = sc.CheckpointManager(s3_uri, storage_options=s3_opts)
    assert mgr.steps() == [2, 3, 4]
    for step in (2, 3, 4):  # every checkpoint still committed loads whole
        back = {"w": torch.zeros(256, 64), "step": 0}
        assert mgr.restore(back, step=step).skipped == []  # type: ignore[union-attr]
        assert torch.equal(back["w"], _state(step)["w"]) and back["step"] == step
    assert [n for n in _names(s3_uri, s3_opts) if n.startswith("step-1/")] == ["step-1/data/00000-0000.safetensors"]
    assert mgr.collect_garbage(older_than=0) == [f"{s3_uri}/step-1/data/00000-0000.safetensors (64.1 KiB)"]
    assert sc.CheckpointManager(s3_uri, storage_options=s3_opts, keep_last=2).prune() == [f"{s3_uri}/step-2"]
    assert sorted({n.split("/")[0] for n in _names(s3_uri, s3_opts)}) == ["step-3", "step-4"]


@pytest.fixture
def other_store(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    """A fresh prefix and its options on fake-gcs-server or Azurite (``request.param``)."""
    if request.param == "gcs":
        return request.getfixturevalue("gcs_uri"), request.getfixturevalue("gcs_opts")
    server = request.getfixturevalue("local_azure_server")
    server.make_container("streamckpt-manager")
    return f"az://streamckpt-manager/{uuid.uuid4().hex[:10]}", server.storage_options


@pytest.mark.parametrize("other_store", ["gcs", "azure"], indirect=True)
def test_gcs_and_azure_roots_list_prune_and_collect(other_store: tuple[str, dict[str, Any]]) -> None:
    """The same listing, deletion and collection on fake-gcs-server (gcsfs) and Azurite
    (obstore): sizes and times from one listing; no multipart uploads to see there."""
    uri, opts = other_store
    with sc.CheckpointManager(uri, storage_options=opts, keep_last=1) as mgr:
        for step in (1, 2):
            mgr.save(step, _state(step), metrics={"loss": 1.0 / step})
        assert mgr.steps() == [2] and mgr.metrics(2) == {"loss": 0.5}
        Storage(uri, opts).write_bytes("step-3/data/00000-0000.safetensors", b"\0" * 2048)
        assert mgr.collect_garbage(older_than=3600) == []
        assert mgr.collect_garbage(older_than=0) == [f"{uri}/step-3/data/00000-0000.safetensors (2.0 KiB)"]
        back = {"w": torch.zeros(256, 64), "step": 0}
        assert mgr.restore(back).step == 2 and torch.equal(back["w"], _state(2)["w"])  # type: ignore[union-attr]
    assert sorted(_names(uri, opts)) == ["step-2/data/00000-0000.safetensors", "step-2/manifest.json"]


def test_a_child_is_judged_by_its_newest_object(tmp_path: Path) -> None:
    """A save in progress has old and fresh objects: its newest object counts, so the whole child is
    left alone until every object in it is older than the grace (the multipart path had the only check)."""
    root = tmp_path / "run"
    with sc.CheckpointManager(str(root)) as mgr:
        mgr.save(1, _state(1))
        dead = root / "step-2" / "data"
        dead.mkdir(parents=True)
        (dead / "00000-0000.safetensors").write_bytes(b"x" * 100)
        (dead / "00001-0000.safetensors").write_bytes(b"y" * 200)
        hour_ago = time.time() - 7200
        os.utime(dead / "00000-0000.safetensors", (hour_ago, hour_ago))  # old; its sibling is fresh
        assert mgr.collect_garbage(older_than=3600) == []
        assert sorted(os.listdir(dead)) == ["00000-0000.safetensors", "00001-0000.safetensors"]
        os.utime(dead / "00001-0000.safetensors", (hour_ago, hour_ago))  # now all of it is old
        assert mgr.collect_garbage(older_than=3600) == [f"{root}/step-2/data/00000-0000.safetensors (100 B)",
                                                         f"{root}/step-2/data/00001-0000.safetensors (200 B)"]
        assert not (root / "step-2").exists() and mgr.steps() == [1]
    assert torch.equal(sc.load_full(str(root / "step-1"))["w"], _state(1)["w"])


def test_mark_takes_the_newest_object_or_upload_of_each_child() -> None:
    from streamckpt.manage.garbage import mark
    from streamckpt.storage import ObjectInfo
    from streamckpt.storage.store import OpenUpload

    objects = {"a/data/0": ObjectInfo(1, modified=0.0), "a/data/1": ObjectInfo(2, modified=95.0),
               "b/data/0": ObjectInfo(3, modified=0.0), "b/data/1": ObjectInfo(4, modified=10.0),
               "top.txt": ObjectInfo(5, modified=0.0)}
    assert [g.name for g in mark(objects, [], set(), set(), now=100.0, older_than=50.0)] == ["b/data/0", "b/data/1"]
    fresh_upload = OpenUpload("b/data/2", "u1", initiated=99.0)
    assert mark(objects, [fresh_upload], set(), set(), now=100.0, older_than=50.0) == []
    assert [g.name for g in mark(objects, [], {"b/data/0"}, {"a"}, now=100.0, older_than=5.0)] == ["b/data/1"]
