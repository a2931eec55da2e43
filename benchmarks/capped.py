"""Scenario (g): loads under a total bandwidth cap on the S3 server (issue 16, "read-once where it matters").

On loopback, storage bandwidth is free: a loader whose ranks each read the whole model
pays little for it. In the cloud the ranks of a node share one NIC and a bucket prefix
its throughput. (g) caps the server (one token bucket for all connections,
benchmarks/throttle.py) and runs two load scenarios under it: (g1), a replicated load on
``CAPPED_WORLD`` ranks, and (g2), the 4-rows -> 2-columns reshard of (c). Each is a copy of
a base scenario (what the worker loads, the views, the bytes needed) with its own world
size. The harness (benchmarks/run.py) measures and reports them like the others.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

from . import data
from .throttle import format_rate, parse_rate

CAPPED = {"g1": "d", "g2": "c"}  # sub-scenario -> the base scenario it copies
CAPPED_WORLD = 4  # ranks of (g1): the ranks of one node sharing its NIC
CAPPED_TITLES = {
    "g1": f"under the cap, replicated load: {CAPPED_WORLD} ranks (gloo) each need the whole model",
    "g2": f"under the cap, reshard: saved by {data.SAVE_WORLD} ranks row-wise, loaded by {data.LOAD_COL_WORLD} "
          "ranks column-wise (gloo)",
}
CAPPED_GOALS = {"g1": 3.0, "g2": 2.0}  # issue 16: streamckpt ÷ the best peer, under the cap
# Not by default: DCP through fsspec reads 5.5× the bytes in (a) and 11× in (d) (at a 200 MB/s cap one
# (g1) run would take ~30 s) and naive took 8-10 s against the best peer's ~6; neither is ever the best
# peer. --loaders adds them. --quick has no peers installed: naive stands in.
CAPPED_LOADERS = ["streamckpt", "streamckpt.no_read_once", "s3torchconnector", "runai"]
CAPPED_QUICK = ["streamckpt", "streamckpt.no_read_once", "naive"]
CAPPED_REPS_IN_ALL = 2  # (g) with 3 reps took 4.5 min here (256 MiB): `--scenario all` runs at most 2


def base_of(scenario: str) -> str:
    """The scenario whose loads, views and needed bytes ``scenario`` shares (g1 -> d, g2 -> c)."""
    return CAPPED.get(scenario, scenario)


def capped_reps(args: argparse.Namespace) -> int:
    """(g)'s repetitions: --capped-reps; else --reps, at most CAPPED_REPS_IN_ALL under --scenario all."""
    if args.capped_reps:
        return args.capped_reps
    return min(args.reps, CAPPED_REPS_IN_ALL) if args.scenario == "all" else args.reps


def run_capped(h: Any) -> None:
    """(g1) and (g2) with the server's total bandwidth capped, then the cap lifted."""
    cap = parse_rate(h.args.bandwidth_cap)
    if not h.server.set_cap(cap):
        h.notes.append(f"(g) ran WITHOUT the {format_rate(cap)} cap: the {h.server.kind} server "
                       "cannot pace (install localbucket)")
    reps = h.args.reps
    h.args.reps = capped_reps(h.args)
    try:
        for sc in CAPPED:
            print(f"scenario ({sc}): {CAPPED_TITLES[sc]}", flush=True)
            h.run_scenario(sc)
    finally:
        h.args.reps = reps
        h.server.set_cap(None)


def applied_cap(h: Any) -> float | None:
    """The cap (g) ran under: None where the server cannot pace (moto) or the cap was off."""
    return parse_rate(h.args.bandwidth_cap) if h.server is not None and h.server.counts else None


def cap_lines(h: Any, scenario: str) -> list[str]:
    """Above a (g) table: the cap in force and the least time it allows."""
    if scenario not in CAPPED:
        return []
    cap = applied_cap(h)
    if not cap:
        return [f"No cap was applied (the {h.server.kind if h.server else 'no'} server cannot pace): these are "
                "uncapped figures.", ""]
    need = h.model.nbytes
    return [f"Cap: {format_rate(cap)} for all the server's connections together. One copy of the needed bytes "
            f"({need / 2**20:.1f} MiB) takes ≥ {need / cap:.2f} s at the cap; a loader that reads it k times needs "
            f"≥ k × that (read ampl. column).", ""]


def capped_note(h: Any) -> str:
    """The Columns entry for (g)."""
    return (
        "- (g): the same server with one token bucket pacing the GET (and PUT) bodies of all its connections "
        f"together to `--bandwidth-cap` ({h.args.bandwidth_cap}), as the ranks of a node share one NIC and a "
        "bucket prefix its throughput; traffic between ranks (gloo) is not capped. On loopback, reading a byte "
        "four times costs next to nothing; under the cap it costs four times the time. `streamckpt.no_read_once` "
        "is streamckpt with `read_once=False` (every rank reads what it needs itself); the curl row is the cap "
        f"check: full GETs of the objects, all in parallel, should come to the cap. {capped_reps(h.args)} "
        "repetition(s). Unless `--loaders` names them, DCP through fsspec and naive are left out (they read 4× "
        "the bytes too and are slower than the peers shown; `--quick` has no peers, so naive stands in)."
    )


def capped_targets(h: Any, figures: dict[str, dict[str, float]],
                   best_peer: Callable[[str], tuple[str, float] | None]) -> list[str]:
    """The issue-16 goal lines: streamckpt's GB/s ÷ the best peer's, under the cap."""
    out = []
    cap = applied_cap(h)
    under = f"under the {format_rate(cap)} cap" if cap else "WITHOUT a cap (not the goal's condition)"
    for sc, goal in CAPPED_GOALS.items():
        g = figures.get(sc, {})
        bp = best_peer(sc)
        if "streamckpt" in g and bp:
            r = g["streamckpt"] / bp[1]
            out.append(f"- ({sc}) {under}, ≥ {goal}× the best peer ({bp[0]}): {r:.2f}× — "
                       f"{'met' if r >= goal else 'MISSED'}")
    return out
