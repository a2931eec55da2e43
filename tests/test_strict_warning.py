"""``strict=False`` is not silent: the keys it leaves alone are named in a WARNING, each
with the checkpoint's names spelled close to it, and a load that matched nothing at all
says so louder."""

from __future__ import annotations

import logging

import pytest
import torch

import streamckpt as sc


@pytest.fixture
def saved(tmp_uri: str) -> str:
    sc.save({"encoder.weight": torch.arange(12.0).reshape(3, 4), "encoder.bias": torch.arange(4.0),
             "step": 5}, tmp_uri)
    return tmp_uri


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_a_typo_is_named_with_a_did_you_mean(saved: str, caplog: pytest.LogCaptureFixture) -> None:
    target = {"encoder.wieght": torch.zeros(3, 4), "encoder.bias": torch.zeros(4)}
    with caplog.at_level(logging.WARNING, logger="streamckpt"):
        res = sc.load(target, saved, strict=False)
    assert res.missing_keys == ["encoder.wieght"]
    assert torch.equal(target["encoder.bias"], torch.arange(4.0))  # the rest was loaded
    assert torch.equal(target["encoder.wieght"], torch.zeros(3, 4))  # left as it was
    [msg] = _warnings(caplog)
    assert "(strict=False): 1 of the state_dict's 2 key(s) are not in the checkpoint" in msg
    assert "'encoder.wieght' (did you mean 'encoder.weight'?)" in msg
    assert "no key of the state_dict was found" not in msg


def test_nothing_matched_says_it_loaded_nothing(saved: str, caplog: pytest.LogCaptureFixture) -> None:
    target = {"model.encoder.weight": torch.zeros(3, 4), "model.decoder.bias": torch.zeros(4)}
    with caplog.at_level(logging.WARNING, logger="streamckpt"):
        res = sc.load(target, saved, strict=False)
    assert res.missing_keys == ["model.decoder.bias", "model.encoder.weight"]
    assert res.bytes_read == 0 and res.bytes_needed == 0
    assert torch.equal(target["model.encoder.weight"], torch.zeros(3, 4))
    [msg] = _warnings(caplog)
    assert "no key of the state_dict was found in the checkpoint" in msg and "loaded nothing" in msg
    assert "all 2 key(s) are missing" in msg
    assert "the checkpoint has 3 name(s), such as 'encoder.bias', 'encoder.weight', 'step'" in msg


def test_a_long_list_is_cut_with_a_count(saved: str, caplog: pytest.LogCaptureFixture) -> None:
    target = {f"extra.{i:02d}": torch.zeros(1) for i in range(14)} | {"encoder.bias": torch.zeros(4)}
    with caplog.at_level(logging.WARNING, logger="streamckpt"):
        res = sc.load(target, saved, strict=False)
    assert len(res.missing_keys) == 14
    [msg] = _warnings(caplog)
    assert "14 of the state_dict's 15 key(s)" in msg
    assert "'extra.09', ... and 4 more" in msg and "'extra.10'" not in msg


def test_a_wrapper_prefix_is_pointed_out(tmp_uri: str, caplog: pytest.LogCaptureFixture) -> None:
    sc.save({"module.a": torch.ones(2), "module.b": torch.ones(3)}, tmp_uri)
    target = {"a": torch.zeros(2), "b": torch.zeros(3)}
    with caplog.at_level(logging.WARNING, logger="streamckpt"):
        sc.load(target, tmp_uri, strict=False)
    [msg] = _warnings(caplog)
    assert "loaded nothing" in msg and "the checkpoint's names carry the prefix 'module.'" in msg


def test_a_full_match_warns_nothing_and_strict_still_raises(saved: str, caplog: pytest.LogCaptureFixture) -> None:
    target = {"encoder.weight": torch.zeros(3, 4), "encoder.bias": torch.zeros(4)}
    with caplog.at_level(logging.WARNING, logger="streamckpt"):
        assert sc.load(target, saved, strict=False).missing_keys == []
    assert _warnings(caplog) == []
    with pytest.raises(sc.MissingKeysError, match="did you mean 'encoder.weight'"):
        sc.load({"encoder.wieght": torch.zeros(3, 4)}, saved)
