"""The retention rules alone (pure: ``manage.retention.Policy`` on hand-made entries): every
rule's edges — ties, nan, a missing metric, keep_every over gaps, the newest always kept."""

from __future__ import annotations

import math
from typing import Any

import pytest

from streamckpt.errors import CheckpointError
from streamckpt.manage.index import Entry
from streamckpt.manage.retention import Policy


def _entries(metrics: dict[int, dict[str, Any]]) -> list[Entry]:
    return [Entry(f"step-{s}", s, s * 10**9, dict(m)) for s, m in metrics.items()]


def _kept(policy: Policy, entries: list[Entry]) -> list[int]:
    pruned = {e.step for e in policy.to_prune(entries)}
    return sorted(e.step for e in entries if e.step not in pruned)  # type: ignore[misc]


def test_keep_best_ties_keep_the_newer_step() -> None:
    entries = _entries({1: {"loss": 0.5}, 2: {"loss": 0.5}, 3: {"loss": 0.9}})
    policy = Policy(keep_best=("loss", "min", 1))
    assert _kept(policy, entries) == [2, 3]  # 2 ties 1 and is newer; 3 is the newest
    assert policy.reasons(entries) == {1: [], 2: ["best"], 3: ["newest"]}
    maxed = _entries({1: {"acc": 0.7}, 2: {"acc": 0.7}, 3: {"acc": 0.7}, 4: {"acc": 0.1}})
    assert _kept(Policy(keep_best=("acc", "max", 2)), maxed) == [2, 3, 4]


def test_keep_best_skips_nan_missing_and_non_numbers() -> None:
    entries = _entries({1: {"loss": 0.1}, 2: {"loss": math.nan}, 3: {}, 4: {"loss": "0.01"},
                        5: {"loss": True}, 6: {"loss": 0.3}, 7: {"loss": 0.2}, 8: {"val": 0.0}})
    policy = Policy(keep_best=("loss", "min", 2))
    assert policy.reasons(entries) == {1: ["best"], 2: [], 3: [], 4: [], 5: [], 6: [], 7: ["best"], 8: ["newest"]}
    assert _kept(Policy(keep_best=("loss", "max", 1)), entries) == [6, 8]
    assert _kept(Policy(keep_best=("loss", "min", 1)), _entries({1: {}, 2: {}})) == [2]  # no candidate: newest


def test_keep_last_keep_every_with_gaps_and_their_union() -> None:
    entries = _entries({s: {} for s in (3, 5, 10, 11, 20, 25, 27)})
    assert _kept(Policy(keep_last=2), entries) == [25, 27]
    assert _kept(Policy(keep_every=10), entries) == [10, 20, 27]  # 27: the newest, kept by no rule
    assert _kept(Policy(keep_every=5), entries) == [5, 10, 20, 25, 27]
    assert _kept(Policy(keep_last=1, keep_every=10), entries) == [10, 20, 27]
    assert Policy(keep_last=1, keep_every=10).reasons(entries)[20] == ["every"]
    assert _kept(Policy(keep_last=100), entries) == [3, 5, 10, 11, 20, 25, 27]
    assert _kept(Policy(), entries) == [3, 5, 10, 11, 20, 25, 27]  # no rule: everything
    assert Policy().reasons(entries)[3] == ["all"]
    assert Policy(keep_last=1).to_prune([]) == [] and Policy(keep_last=1).reasons([]) == {}


def test_union_of_all_three_and_prune_order() -> None:
    entries = _entries({1: {"loss": 0.2}, 2: {"loss": 0.1}, 3: {"loss": 0.4}, 4: {"loss": 0.3}, 5: {"loss": 0.5},
                        6: {"loss": 0.6}})
    policy = Policy(keep_last=1, keep_every=3, keep_best=("loss", "min", 1))
    assert policy.reasons(entries) == {1: [], 2: ["best"], 3: ["every"], 4: [], 5: [], 6: ["last", "every"]}
    assert [e.step for e in policy.to_prune(list(reversed(entries)))] == [1, 4, 5]  # oldest first


def test_unmanaged_and_unreadable_entries_are_never_pruned() -> None:
    entries = _entries({1: {}, 2: {}}) + [Entry("other", None, 0), Entry("broken", None, 0, error="bad json")]
    assert [e.name for e in Policy(keep_last=1).to_prune(entries)] == ["step-1"]


@pytest.mark.parametrize("kwargs", [{"keep_last": 0}, {"keep_every": -1}, {"keep_last": True}, {"keep_last": 1.5},
                                    {"keep_best": ("loss", "lowest", 1)}, {"keep_best": ("loss", "min", 0)},
                                    {"keep_best": ("loss", "min")}, {"keep_best": (1, "min", 1)}])
def test_bad_rules_are_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(CheckpointError, match=next(iter(kwargs))):
        Policy(**kwargs)
