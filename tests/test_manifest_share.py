"""How a load's ranks get the manifest: rank 0 fetches ``manifest.json`` in one GET (no
HEAD first) and passes its bytes on; every rank parses them. Counted at the server's
door (a pass-through proxy), on real gloo ranks."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

import streamckpt as sc
from distributed import run_ranks


def _state() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(4096.0).reshape(64, 64), "b": torch.arange(64, dtype=torch.int32)}


def load_rows(rank: int, world: int, uri: str, opts: dict[str, Any]) -> dict[str, Any]:
    full = _state()
    rows = 64 // world
    local = torch.zeros(rows, 64)
    sd = {"w": sc.ShardedTensor(local, (64, 64), (rank * rows, 0)), "b": torch.zeros(64, dtype=torch.int32)}
    res = sc.load(sd, uri, storage_options=opts)
    return {"rows_exact": torch.equal(local, full["w"][rank * rows:(rank + 1) * rows]),
            "b_exact": torch.equal(sd["b"], full["b"]), "kind": res.kind}


def _manifest_requests(proxy: Any) -> Counter[str]:
    return Counter(m for m, path, _ in proxy.history if path.split("?")[0].endswith("/manifest.json"))


def test_two_ranks_share_one_get_of_the_manifest(s3_uri: str, proxy_factory: Any, local_s3: Any) -> None:
    sc.save(_state(), s3_uri, storage_options=local_s3.storage_options)
    proxy = proxy_factory(faults=["slowdown"], rate=0.0)
    ranks = run_ranks(2, load_rows, kwargs={"uri": s3_uri, "opts": proxy.storage_options}, timeout=180)
    for r in ranks:
        assert r.value == {"rows_exact": True, "b_exact": True, "kind": "streamckpt"}, r
    assert _manifest_requests(proxy) == Counter({"GET": 1})


def test_one_process_reads_the_manifest_in_one_get(s3_uri: str, proxy_factory: Any, local_s3: Any) -> None:
    sc.save(_state(), s3_uri, storage_options=local_s3.storage_options)
    proxy = proxy_factory(faults=["slowdown"], rate=0.0)
    out = {k: torch.zeros_like(v) for k, v in _state().items()}
    sc.load(out, s3_uri, storage_options=proxy.storage_options)
    assert all(torch.equal(out[k], v) for k, v in _state().items())
    assert _manifest_requests(proxy) == Counter({"GET": 1})


def test_two_ranks_of_a_safetensors_checkpoint_look_for_the_manifest_once(
    s3_uri: str, proxy_factory: Any, local_s3: Any
) -> None:
    """No manifest.json: rank 0 looks for it once (404), reads the safetensors headers and
    passes the manifest built from them on."""
    from safetensors.torch import save

    from streamckpt.storage import Storage

    Storage(s3_uri, local_s3.storage_options).write_bytes("model.safetensors", save(_state()))
    proxy = proxy_factory(faults=["slowdown"], rate=0.0)
    ranks = run_ranks(2, load_rows, kwargs={"uri": s3_uri, "opts": proxy.storage_options}, timeout=180)
    for r in ranks:
        assert r.value == {"rows_exact": True, "b_exact": True, "kind": "safetensors"}, r
    assert _manifest_requests(proxy) == Counter({"GET": 1})
