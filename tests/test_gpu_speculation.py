"""A DCP load into (stand-in) GPU tensors: the predicted heads' checks ride the GPU path too.

``speculation``'s check targets are allocated through the load's ``CudaApi`` on the
targets' GPU and read back with its ``download``, so ``fakecuda`` sees every step (and
its rules hold); before, they were ``torch.empty(device=...)`` and ``.cpu()``, invisible
to the stand-in. Real ``dcp.save`` output on local files.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fakecuda import FakeCuda
from test_dcp_fast import _dcp_save, _model, _relayout_last_item

from streamckpt.comm import SoloComm
from streamckpt.formats import read_manifest, speculation
from streamckpt.loading.loader import LoadRequest, run_load
from streamckpt.plan.planner import PlanOptions
from streamckpt.storage import Storage


@pytest.mark.parametrize("relaid", [False, True])
def test_dcp_checks_on_the_targets_gpu(tmp_path: Path, relaid: bool) -> None:
    model = _model()
    _dcp_save(model, tmp_path / "ck")
    if relaid:  # a prediction misses: the checks say so, and the exact fallback loads again
        _relayout_last_item(tmp_path / "ck", "l1.wq")
    fake = FakeCuda(current_device=0)
    dev = torch.device("cuda", 5)
    fake.expect_device(dev)
    sd = {}
    for k, v in model.items():
        sd[k] = fake.place(torch.zeros_like(v), dev)
        fake.launch(dev, lambda t=sd[k]: t.fill_(3), writes=[sd[k]], label=f"init {k}")
    storage = Storage(str(tmp_path / "ck"))
    try:
        req = LoadRequest(state_dict=sd, strict=True, options=PlanOptions(memory_budget=64 << 10),
                          transforms=None, cuda=fake)
        res = run_load(SoloComm(), storage, req)
    finally:
        storage.close()
    fake.synchronize()
    assert fake.violations + fake.check_record_stream() == []
    assert fake.devices_used == {dev}
    assert res.missing_keys == [] == res.unexpected_keys
    for k, v in model.items():
        assert torch.equal(sd[k], v), k
    # every check of the (full) load landed on the GPU and was read back from there: one download
    # each, on the first attempt (the exact fallback predicts nothing, so it checks nothing)
    storage = Storage(str(tmp_path / "ck"))
    try:
        checks = speculation.all_checks(read_manifest(storage, speculative=True))
    finally:
        storage.close()
    assert len(checks) > 0
    assert fake.counts.get("download", 0) == len(checks)
