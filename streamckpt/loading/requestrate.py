"""Whether a load's GETs came faster than the store serves one key prefix.

S3 serves at least 5,500 GET/HEAD requests per second per partitioned key prefix and
answers 503 SlowDown above that while it repartitions (its performance guidelines; other
stores have like limits). A fresh checkpoint's objects share one prefix, so until the
store has split it, the whole job's GETs count against one limit: a load that reads
once on a thousand ranks makes its requests from a thousand clients at once. Each rank
knows only its own requests and seconds, so the job's are gathered (one small collective
after the load, the same on every rank) and rank 0 says, in one warning, when the rate
passed the limit and what to do.

What is measured: every range request of the load's data phase (each rank's
``LoadResult.requests``, retries included; not the few metadata requests of rank 0),
divided by the longest rank's data phase. That is an average: bursts within it run
faster, so a rate near the limit may already meet SlowDown. The prefix is the longest
one that all of the checkpoint's data files share, at a ``/``: the partition that
takes every request until the store splits it (when it has split it already, the
warning is pessimistic; the throttled count says what the store thought).
"""

from __future__ import annotations

import logging

from ..comm import GroupComm, SoloComm
from ..results import plural
from ..storage.ratelimit import DEFAULT_GET_LIMIT, GET_LIMIT_ENV, JobRequests, key_prefix, rate_limit

log = logging.getLogger(__name__)

LIMIT_ENV = GET_LIMIT_ENV  # requests per second; 0 turns the warning off

__all__ = ["DEFAULT_GET_LIMIT", "JOB_REQUESTS_IN_FLIGHT", "JobRequests", "LIMIT_ENV", "gather_job", "get_limit",
           "job_spread", "key_prefix", "over_limit"]


def get_limit() -> float:
    """The per-prefix GET rate a load warns above: ``STREAMCKPT_GET_RATE_LIMIT`` (requests per
    second, 0 for never) or ``DEFAULT_GET_LIMIT``."""
    return rate_limit(LIMIT_ENV, DEFAULT_GET_LIMIT)


JOB_REQUESTS_IN_FLIGHT = 1024  # pieces a whole job's batches are cut into at once (see job_spread)


def job_spread(world: int, max_concurrency: int) -> int:
    """How many requests one rank cuts a batch of reads into (``Storage.read_into``'s ``spread``).

    A rank alone spreads a round over half of its ``max_concurrency`` (pieces of 4-16 MiB),
    to fill a link with connections that are each slower than it. In a large job the other
    ranks' requests are the concurrency, and every extra piece is a GET against the one
    prefix's limit: at S3's 5,500 GET/s and a ~0.2 s request (150 ms first byte + 4 MiB at
    88 MB/s, configs/scale/aws_p5.yaml) about 1,100 requests in flight already reach it. So
    the job's ranks together keep about ``JOB_REQUESTS_IN_FLIGHT`` pieces: jobs of up to 64
    ranks are cut as before; at 1,024 ranks and more a read goes as the plan made it
    (up to 16 MiB), 4x fewer GETs than 4 MiB pieces.
    """
    return max(1, min(max(1, max_concurrency // 2), JOB_REQUESTS_IN_FLIGHT // max(1, world)))


def gather_job(comm: SoloComm | GroupComm, requests: int, throttled: int, seconds: float,
               prefix: str) -> JobRequests:
    """Every rank's counts summed and the longest data phase, on every rank (a collective:
    every rank calls it after its data phase)."""
    rows = comm.gather_ints([requests, throttled, round(seconds * 1e6)])
    return JobRequests(
        requests=sum(r[0] for r in rows),
        throttled=sum(r[1] for r in rows),
        seconds=max(r[2] for r in rows) / 1e6,
        prefix=prefix,
    )


def over_limit(job: JobRequests, limit: float) -> str | None:
    """The warning for a job whose GET rate on its prefix passed ``limit`` (None when not,
    or when ``limit`` is 0)."""
    if limit <= 0 or job.per_second <= limit:
        return None
    throttled = (f"; the store answered {plural(job.throttled, 'request')} with SlowDown/throttling, retried"
                 if job.throttled else "")
    return (
        f"the load made {job.requests} range GETs in {job.seconds:.2f} s: {job.per_second:,.0f} per second on "
        f"the key prefix {job.prefix}, above the {limit:,.0f}/s a prefix is served before the store answers "
        f"503 SlowDown (S3's documented 5,500/s; {LIMIT_ENV} sets the limit){throttled}. Make fewer, larger "
        f"requests (a memory_budget of at least 64 MiB keeps reads up to 16 MiB; below "
        f"{JOB_REQUESTS_IN_FLIGHT} ranks a smaller max_concurrency cuts each batch into fewer pieces, from "
        f"{JOB_REQUESTS_IN_FLIGHT} ranks reads already go whole), or spread the data files over several "
        f"prefixes so the store can partition them"
    )
