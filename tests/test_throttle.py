"""The benchmark server's bandwidth cap (benchmarks/throttle.py): token accounting on an injected clock.

No wall clock: every time is passed in, and the waits the bucket asks for are checked exactly.
"""

from __future__ import annotations

import pytest

from benchmarks.throttle import TokenBucket, format_rate, parse_rate


def test_full_bucket_lets_a_burst_through_then_lends_at_the_rate() -> None:
    b = TokenBucket(rate=100.0, burst=10)
    assert b.reserve(10, now=0.0) == 0.0  # the bucket starts full
    assert b.reserve(10, now=0.0) == pytest.approx(0.1)  # 10 bytes owed at 100 B/s
    assert b.reserve(50, now=0.0) == pytest.approx(0.6)  # queued behind the first loan
    # one second later the 60-byte debt is paid and 40 more refilled, but the bucket holds only 10
    assert b.reserve(10, now=1.0) == 0.0
    assert b.reserve(1, now=1.0) == pytest.approx(0.01)


def test_many_takers_together_never_beat_the_rate() -> None:
    """8 'connections' each reserving 1000 chunks of 1 MiB at the same instants: the last may go at
    (total - burst) / rate, i.e. the total is paced to the rate however many connections share it."""
    rate, chunk = 200e6, 1 << 20
    b = TokenBucket(rate=rate, burst=chunk)
    last = 0.0
    for i in range(1000):
        now = i * 0.001
        for _ in range(8):
            last = max(last, now + b.reserve(chunk, now))
    total = 8 * 1000 * chunk
    assert last == pytest.approx((total - chunk) / rate)


def test_idle_time_refills_only_up_to_the_burst() -> None:
    b = TokenBucket(rate=1000.0, burst=100)
    b.reserve(100, now=0.0)
    assert b.reserve(300, now=100.0) == pytest.approx(0.2)  # 100 s idle bought only 100 bytes


def test_an_earlier_clock_reading_from_another_thread_adds_no_tokens() -> None:
    b = TokenBucket(rate=100.0, burst=10)
    b.reserve(10, now=5.0)
    assert b.reserve(10, now=4.0) == pytest.approx(0.1)  # not credited with a negative interval
    assert b.reserve(10, now=5.0) == pytest.approx(0.2)


def test_take_sleeps_for_what_reserve_says() -> None:
    slept: list[float] = []
    b = TokenBucket(rate=100.0, burst=10, clock=lambda: 2.0, sleep=slept.append)
    b.take(10)
    b.take(20)
    assert slept == [pytest.approx(0.2)]


def test_rates_parse_in_decimal_and_binary_units_and_off() -> None:
    assert parse_rate("200MB/s") == 200e6
    assert parse_rate("1.5 GB/s") == 1.5e9
    assert parse_rate("100MiB/s") == 100 * 2**20
    assert parse_rate("200000000") == 200e6
    assert parse_rate("off") is None and parse_rate("0") is None
    assert format_rate(200e6) == "200 MB/s" and format_rate(None) == "off"
    with pytest.raises(ValueError, match="expected e.g. 200MB/s"):
        parse_rate("fast")
