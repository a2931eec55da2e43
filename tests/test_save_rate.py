"""benchmarks/save_rate.py: a save's PUTs per second on one key prefix, counted by hand."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from benchmarks.save_rate import MiB, predict_save
from benchmarks.scale_model import CASES, build_manifest, coarsening, load_machine

pytest.importorskip("yaml")


def test_405b_save_is_bound_by_the_prefix_put_rate() -> None:
    m = load_machine("configs/scale/aws_p5.yaml")
    case = CASES["405b-scale"]
    p = predict_save("405b-scale", case, m, 3500.0, 8 * MiB, 4)
    stored = sum(build_manifest(case).files.values()) * coarsening(case)
    per_rank = math.ceil(stored / 2048)
    files = -(-per_rank // (8 * MiB))
    assert p.ranks == 2048 and p.puts == 2048 * files + 1
    assert p.seconds == pytest.approx(math.ceil(files / 4) * m.first_byte_s + per_rank / (4 * m.conn_Bps))
    assert p.prefix_seconds == pytest.approx(p.puts / 3500)
    assert p.puts_per_s > 3500 and p.bound == "S3 prefix PUT rate"
    bigger = predict_save("405b-scale", case, m, 3500.0, 64 * MiB, 4)
    assert bigger.puts == 2048 * -(-per_rank // (64 * MiB)) + 1 < p.puts / 7


def test_few_writers_are_not_prefix_bound() -> None:
    m = load_machine("configs/scale/aws_p5.yaml")
    case = replace(CASES["70b-serve"])
    p = predict_save("70b-serve", case, m, 3500.0, 8 * MiB, 4)
    assert p.ranks == 8 and p.puts_per_s < 3500 and p.bound == "upload bandwidth/latency"
