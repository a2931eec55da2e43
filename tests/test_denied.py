"""Wrong credentials fail at once on every path (issue 44 item 7): a 403 is never retried, and
the message is S3's parsed error code with the credential hint, never the raw XML body.

`sc.latest` failed in one request while the manager's listing (obstore's list request, whose
error wraps the response) retried 8 times (2.8-7.8 s) and printed the XML. A proxy in front
of a signature-checking moto server counts the requests each call makes.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any, Callable, Iterator

import pytest
import torch

import streamckpt as sc
from streamckpt.testing.faultproxy import FaultProxy

from signing_moto import signing_moto

ROOT = "s3://signed/run"


@pytest.fixture(scope="module")
def denied() -> Iterator[tuple[FaultProxy, dict[str, Any]]]:
    with signing_moto({"x/manifest.json": b"{}"}) as (endpoint, opts):
        proxy = FaultProxy(endpoint, faults=["slowdown"], rate=0.0).start()  # counts, injects nothing
        try:
            yield proxy, dict(opts, endpoint_url=proxy.endpoint_url, secret="wrong-secret")
        finally:
            proxy.stop()


def _calls(bad: dict[str, Any]) -> dict[str, Callable[[], Any]]:
    def manager() -> Any:
        return sc.CheckpointManager(ROOT, storage_options=bad, keep_last=1)

    return {
        "latest": lambda: sc.latest(ROOT, storage_options=bad),
        "manager.steps": lambda: manager().steps(),
        "manager.restore": lambda: manager().restore(),
        "manager.save": lambda: manager().save(1, {"w": torch.ones(2)}),
        "manager.prune": lambda: manager().prune(),
        "manager.collect_garbage": lambda: manager().collect_garbage(),
        "save": lambda: sc.save({"w": torch.ones(2)}, f"{ROOT}/step-1", storage_options=bad),
        "load_state": lambda: sc.load_state("s3://signed/x", storage_options=bad),
        "copy": lambda: sc.copy("s3://signed/x", "s3://signed/y", storage_options=bad),
    }


@pytest.mark.parametrize("call", list(_calls({})))
def test_a_403_is_not_retried_and_names_the_code(call: str, denied: tuple[FaultProxy, dict[str, Any]]) -> None:
    proxy, bad = denied
    before = proxy.requests
    with pytest.raises(sc.StorageError) as e:
        _calls(bad)[call]()
    msg = str(e.value)
    code = "HTTP 403 Forbidden" if call == "save" else "HTTP 403 SignatureDoesNotMatch"  # a HEAD's 403 has no body
    assert "after 1 attempt(s)" in msg and code in msg, msg
    assert "check the keys" in msg and "<?xml" not in msg and "wrong-secret" not in msg, msg
    assert proxy.requests - before <= 2, proxy.history[before:]  # one request, or one per client


def test_the_cli_ls_fails_at_once_with_the_code(denied: tuple[FaultProxy, dict[str, Any]]) -> None:
    proxy, bad = denied
    before = proxy.requests
    p = subprocess.run([sys.executable, "-m", "streamckpt", "ls", ROOT, "--endpoint-url", bad["endpoint_url"],
                        "--storage-option", f"key={bad['key']}", "--storage-option", "secret=wrong-secret"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "HTTP 403 SignatureDoesNotMatch" in p.stderr, p.stderr
    assert "<?xml" not in p.stderr and "--storage-option key=" in p.stderr, p.stderr
    assert proxy.requests - before == 1, proxy.history[before:]
