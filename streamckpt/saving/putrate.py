"""Whether a save's PUTs came faster than the store serves one key prefix.

Every saving rank uploads its data files, one PUT each, into the checkpoint's one
``data/`` prefix; S3 serves about 3,500 PUTs per second on a prefix it has not split
(``storage.ratelimit``). docs/SCALE.md ("Saves: PUTs at scale") predicts that a save of a
few hundred ranks with 8 MiB objects asks for more. Each rank knows its own PUTs and upload
seconds, so the job's travel with the shard records every rank gathers before the commit
(no collective of their own) and rank 0 says, in one warning, when the rate passed the limit and what to do.

What is counted: the objects each rank wrote (its data files, and rank 0's manifest), one
PUT each; a retried PUT counts once, and a throttled response is not seen (the upload
client retries it). The rate divides them by the longest rank's upload.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from ..storage.ratelimit import DEFAULT_PUT_LIMIT, PUT_LIMIT_ENV, JobRequests, rate_limit
from .writer import UploadShape


def put_limit() -> float:
    """The per-prefix PUT rate a save warns above: ``STREAMCKPT_PUT_RATE_LIMIT`` (requests per
    second, 0 for never) or ``DEFAULT_PUT_LIMIT``."""
    return rate_limit(PUT_LIMIT_ENV, DEFAULT_PUT_LIMIT)


def job_puts(per_rank: Sequence[Mapping[str, Any]], prefix: str) -> JobRequests:
    """The job's PUTs from every rank's shard-record document (``saver.write_and_commit``
    gathers them for the manifest anyway, so counting costs no collective): each rank's data
    files, its upload's microseconds, and rank 0's manifest."""
    return JobRequests(requests=sum(d["puts"] for d in per_rank) + 1, throttled=0,
                       seconds=max(d["upload_us"] for d in per_rank) / 1e6, prefix=prefix)


def over_put_limit(job: JobRequests, limit: float, shape: UploadShape) -> str | None:
    """The warning for a save whose PUT rate on its prefix passed ``limit`` (None when not,
    or when ``limit`` is 0); ``shape``: how the save cut its data files."""
    if limit <= 0 or job.per_second <= limit:
        return None
    return (
        f"the save made {job.requests} PUTs in {job.seconds:.2f} s: {job.per_second:,.0f} per second on the key "
        f"prefix {job.prefix}, above the {limit:,.0f}/s a prefix is served before the store answers 503 SlowDown "
        f"(S3's documented 3,500/s; {PUT_LIMIT_ENV} sets the limit). Write fewer, larger data files: "
        f"STREAMCKPT_UPLOAD_OBJECT_BYTES (now {shape.object_bytes / 2**20:g} MiB) sets their size; each rank's "
        f"upload memory is STREAMCKPT_UPLOAD_BUFFERS (now {shape.buffers}) of them"
    )
