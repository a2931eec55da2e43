"""Whether a save's PUTs came faster than the store serves one key prefix.

Every saving rank uploads its data files, one PUT each, into the checkpoint's one
``data/`` prefix; S3 serves about 3,500 PUTs per second on a prefix it has not split
(``storage.ratelimit``). docs/SCALE.md ("Saves: PUTs at scale") predicts that a save of a
few hundred ranks with 8 MiB objects asks for more. Each rank knows its own PUTs and upload
seconds, so the job's are gathered after the commit (one small collective, the same on
every rank) and rank 0 says, in one warning, when the rate passed the limit and what to do.

What is counted: the objects each rank wrote (its data files, and rank 0's manifest), one
PUT each; a retried PUT counts once, and a throttled response is not seen (the upload
client retries it). The rate divides them by the longest rank's upload.
"""

from __future__ import annotations

from ..comm import GroupComm, SoloComm
from ..storage.ratelimit import DEFAULT_PUT_LIMIT, PUT_LIMIT_ENV, JobRequests, rate_limit
from .writer import UploadShape


def put_limit() -> float:
    """The per-prefix PUT rate a save warns above: ``STREAMCKPT_PUT_RATE_LIMIT`` (requests per
    second, 0 for never) or ``DEFAULT_PUT_LIMIT``."""
    return rate_limit(PUT_LIMIT_ENV, DEFAULT_PUT_LIMIT)


def gather_puts(comm: SoloComm | GroupComm, puts: int, seconds: float, prefix: str) -> JobRequests:
    """Every rank's PUTs summed and the longest upload, on every rank (a collective: every
    rank calls it once its save is committed)."""
    rows = comm.gather_ints([puts, round(seconds * 1e6)])
    return JobRequests(requests=sum(r[0] for r in rows), throttled=0,
                       seconds=max(r[1] for r in rows) / 1e6, prefix=prefix)


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
