"""``streamckpt`` command line: inspect, verify, merge, demo.

Storage is reached as in the library: any fsspec URL, ``--endpoint-url`` and
repeated ``--storage-option key=value`` (dotted keys nest, values are parsed as
JSON when they can be: ``--storage-option client_kwargs.verify=false``); the
standard AWS environment variables work through s3fs/botocore. Long operations
show a byte progress bar on stderr unless ``--quiet``. A ``CheckpointError``
prints its message on stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from typing import Any, Sequence

from .errors import CheckpointError
from .loading.verify import verify_checkpoint
from .results import human_bytes as human

log = logging.getLogger("streamckpt.cli")

EXIT_CHECKPOINT_ERROR = 2


# ------------------------------------------------------------------ options


def parse_storage_options(pairs: Sequence[str], endpoint_url: str | None = None) -> dict[str, Any]:
    """``["a=1", "client_kwargs.region_name=x"]`` -> ``{"a": 1, "client_kwargs": {"region_name": "x"}}``."""
    opts: dict[str, Any] = {}
    if endpoint_url:
        opts["endpoint_url"] = endpoint_url
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"--storage-option expects key=value, got {pair!r}")
        try:
            value: Any = json.loads(raw)
        except ValueError:
            value = raw
        node = opts
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise argparse.ArgumentTypeError(f"--storage-option {key!r}: {part!r} is already a value")
        node[parts[-1]] = value
    return opts


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from ``123``, ``500MB`` (10^6), ``5GiB`` (2^30), ``2G`` (2^30)."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 5GB, 512MiB, 1000000)")
    number, unit, binary = float(m.group(1)), m.group(2).upper(), m.group(3)
    power = "KMGT".index(unit) + 1 if unit else 0
    bare = unit and not binary and not text.strip().upper().endswith("B")
    base = 1024 if (binary or bare) else 1000
    value = int(number * base ** power)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
    return value


# ----------------------------------------------------------------- commands


def cmd_inspect(args: argparse.Namespace) -> int:
    from .api import inspect

    info = inspect(args.uri, storage_options=args.storage_options)
    if args.json:
        print(json.dumps(info.to_dict(), indent=2, default=str))
    else:
        print(info)
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from .progress import ByteProgress

    with ByteProgress("verify", enabled=not args.quiet) as bar:
        rep = verify_checkpoint(args.uri, storage_options=args.storage_options, progress=bar,
                                on_total=bar.set_total)
    rate = rep.bytes_read / rep.seconds / 1e6 if rep.seconds else 0.0
    print(f"OK {rep.uri} [{rep.kind}]: {rep.files} files, {rep.shards} shards, {human(rep.bytes_read)} read "
          f"in {rep.requests} requests, {rep.checksums} checksums verified"
          f"{f', {rep.frames_decoded} zstd frames decoded' if rep.frames_decoded else ''}"
          f"{'' if rep.checksums else ' (this format stores no checksums: every byte was read)'}; "
          f"{rep.seconds:.2f} s, {rate:.1f} MB/s")
    return 0


def cmd_merge(args: argparse.Namespace) -> int:
    from .api import inspect
    from .merging import merge
    from .progress import ByteProgress

    skip = tuple(args.skip or ())
    total = None
    if not args.quiet:
        info = inspect(args.uri, storage_options=args.storage_options)
        total = sum(t.bytes for k, t in info.tensors.items() if not (skip and k.endswith(skip)))
    out_opts = args.out_storage_options if args.out_storage_options is not None else args.storage_options
    with ByteProgress("merge", total, enabled=not args.quiet) as bar:
        res = merge(args.uri, args.out, max_shard_bytes=args.max_shard_bytes, skip=skip,
                    storage_options=args.storage_options, out_storage_options=out_opts,
                    memory_budget=args.memory_budget, progress=bar)
    rate = res.total_size / res.seconds / 1e6 if res.seconds else 0.0
    print(f"wrote {len(res.files)} files + model.safetensors.index.json to {args.out}: "
          f"{human(res.total_size)} of tensors, {human(res.bytes_read)} read in {res.requests} requests, "
          f"{res.seconds:.2f} s, {rate:.1f} MB/s")
    for f in res.files:
        print(f"  {f}")
    return 0


def cmd_load_bench(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from . import loadbench

    reps = loadbench.run(args.uri, args.storage_options, args.processes, args.layout, args.memory_budget,
                         read_once=not args.no_read_once, repeat=args.repeat)
    if args.json:
        print(json.dumps([[asdict(r) for r in runs] for runs in reps], indent=2))
    else:
        print(f"{args.uri}: layout {args.layout!r} on {args.processes} rank(s), memory_budget "
              f"{human(args.memory_budget)}, read_once={not args.no_read_once}")
        print(loadbench.format_runs(reps))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    return run_demo(size_mb=args.size_mb, quiet=args.quiet, serve=args.serve, multirank=not args.single_process)


# --------------------------------------------------------------------- demo

DEMO_BUCKET = "streamckpt-demo"


def demo_state(size_mb: float) -> dict[str, Any]:
    """A small transformer-like state_dict of about ``size_mb`` MiB (seeded)."""
    import torch

    h = 1024 if size_mb >= 48 else 512 if size_mb >= 16 else 128
    g = torch.Generator().manual_seed(1234)
    layer_bytes = (3 * h * h + h * h + 2 * h * h + 2 * h * h) * 4
    embed_bytes = 4096 * h * 2
    layers = max(1, round((size_mb * 2**20 - embed_bytes) / layer_bytes))
    sd: dict[str, Any] = {"embed.weight": torch.randn(4096, h, generator=g).to(torch.bfloat16)}
    for i in range(layers):
        p = f"layers.{i}."
        sd[p + "attn.wqkv.weight"] = torch.randn(3 * h, h, generator=g)
        sd[p + "attn.wo.weight"] = torch.randn(h, h, generator=g)
        sd[p + "mlp.w1.weight"] = torch.randn(2 * h, h, generator=g)
        sd[p + "mlp.w2.weight"] = torch.randn(h, 2 * h, generator=g)
        sd[p + "norm.weight"] = torch.rand(h, generator=g) + 0.5
    sd["step"] = 1000
    return sd


def demo_layouts(sd: dict[str, Any]) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(name, state_dict to load into, expected tensors) for layouts unlike the saved one."""
    import torch

    from .core.sharded import ShardedTensor

    tensors = {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}
    out = []

    def tp(rank: int, world: int, dim: int) -> tuple[dict[str, Any], dict[str, Any]]:
        targets, expected = {}, {}
        for k, v in tensors.items():
            if v.dim() < 2:
                targets[k], expected[k] = torch.empty_like(v), v
                continue
            n = v.shape[dim] // world
            exp = v.narrow(dim, rank * n, n)
            offset = [0] * v.dim()
            offset[dim] = rank * n
            targets[k] = ShardedTensor(torch.empty_like(exp), v.shape, offset)
            expected[k] = exp
        return targets, expected

    def zero(rank: int, world: int) -> tuple[dict[str, Any], dict[str, Any]]:
        targets, expected = {}, {}
        for k, v in tensors.items():
            n = v.numel()
            a, b = n * rank // world, n * (rank + 1) // world
            exp = v.reshape(-1)[a:b]
            targets[k] = ShardedTensor(torch.empty_like(exp), v.shape, [0] * v.dim(), local_shape=v.shape,
                                       flat_range=(a, b))
            expected[k] = exp
        return targets, expected

    out.append(("TP rank 1/4, rows (Shard(0))", *tp(1, 4, 0)))
    out.append(("TP rank 2/4, columns (Shard(1))", *tp(2, 4, 1)))
    out.append(("ZeRO rank 5/8, flat range", *zero(5, 8)))
    full = {k: torch.empty_like(v) for k, v in tensors.items()}
    full["step"] = 0
    out.append(("full replica", full, {**tensors, "step": sd["step"]}))
    return out


def _local(v: Any) -> Any:
    return getattr(v, "local_tensor", v)


def run_demo(size_mb: float = 64.0, quiet: bool = False, serve: bool = False, multirank: bool = True) -> int:
    """Save to an embedded S3 server, load other layouts by range reads, check every element."""
    import torch

    from . import api
    from .progress import ByteProgress
    from .testing import LocalS3

    with LocalS3() as s3:
        s3.make_bucket(DEMO_BUCKET)
        opts = s3.storage_options
        uri = f"s3://{DEMO_BUCKET}/run-1/step-1000"
        sd = demo_state(size_mb)
        nbytes = sum(v.numel() * v.element_size() for v in sd.values() if isinstance(v, torch.Tensor))
        print(f"embedded S3 server (moto) at {s3.endpoint_url}")
        print(f"saving {len(sd) - 1} tensors ({human(nbytes)}) to {uri} ...")
        saved = api.save(sd, uri, storage_options=opts, metadata={"demo": True})
        print(f"saved {human(saved.bytes_written)} in {len(saved.files)} file(s), {saved.seconds:.2f} s")
        rows = []
        for name, targets, expected in demo_layouts(sd):
            with ByteProgress(f"{name} (read)", enabled=not quiet) as bar:
                res = api.load(targets, uri, storage_options=opts, progress=bar, strict=True)
            bad = [k for k, exp in expected.items()
                   if not (torch.equal(_local(targets[k]), exp) if isinstance(exp, torch.Tensor) else targets[k] == exp)]
            if bad:
                print(f"MISMATCH in layout {name!r}: {', '.join(bad[:5])}", file=sys.stderr)
                return 1
            rows.append((name, res))
        print()
        print(_demo_table(rows))
        print("\nevery element of every layout matched the saved tensors.")
        if multirank:
            from .demo import format_reports, multirank_demo

            mr_uri = f"s3://{DEMO_BUCKET}/run-2/step-1000"
            print(f"\nmulti-rank: 4 gloo processes save {mr_uri} row-wise; 2 processes load it column-wise,"
                  f"\n3 processes as uneven row blocks (weights, a replicated norm, ZeRO-flat moments) ...")
            reports = multirank_demo(mr_uri, opts)
            print(format_reports(reports))
            if not all(r.ok for r in reports):
                print("a rank failed or loaded wrong values", file=sys.stderr)
                return 1
            print("every rank's every element matched.")
        if serve:
            _serve(s3, uri)
    return 0


def _demo_table(rows: list[tuple[str, Any]]) -> str:
    head = ("layout loaded", "needed", "read", "read/needed", "requests", "seconds", "MB/s")
    lines = [head]
    for name, r in rows:
        rate = r.bytes_needed / r.seconds / 1e6 if r.seconds else 0.0
        amp = r.bytes_read / r.bytes_needed if r.bytes_needed else 0.0
        lines.append((name, human(r.bytes_needed), human(r.bytes_read), f"{amp:.2f}", str(r.requests),
                      f"{r.seconds:.3f}", f"{rate:.1f}"))
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    fmt = [f"{{:<{widths[0]}}}"] + [f"{{:>{w}}}" for w in widths[1:]]
    out = ["  ".join(f.format(c) for f, c in zip(fmt, row)) for row in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


def _serve(s3: Any, uri: str) -> None:
    import threading

    from .testing.s3server import TEST_KEY, TEST_SECRET

    flags = f"--endpoint-url {s3.endpoint_url} --storage-option key={TEST_KEY} --storage-option secret={TEST_SECRET}"
    print(f"\nthe embedded S3 server keeps running (Ctrl-C stops it); try:\n"
          f"  streamckpt inspect {uri} {flags}\n"
          f"  streamckpt verify {uri} {flags}\n"
          f"  streamckpt merge {uri} s3://{DEMO_BUCKET}/hf --max-shard-bytes 8MiB {flags}", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass


# -------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--endpoint-url", help="S3-compatible endpoint (e.g. http://127.0.0.1:9000)")
    common.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE",
                        help="fsspec storage option (repeatable; dotted keys nest; JSON values parsed)")
    common.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    common.add_argument("-v", "--verbose", action="count", default=0, help="log more (-v info, -vv debug)")

    p = argparse.ArgumentParser(prog="streamckpt", description="Stream sharded PyTorch checkpoints from object storage.")
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("inspect", parents=[common], help="describe a checkpoint (any kind) from its metadata")
    s.add_argument("uri")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(func=cmd_inspect)

    s = sub.add_parser("verify", parents=[common], help="read every byte and check every checksum")
    s.add_argument("uri")
    s.set_defaults(func=cmd_verify)

    s = sub.add_parser("merge", parents=[common], help="write a checkpoint as Hugging Face safetensors shards")
    s.add_argument("uri")
    s.add_argument("out")
    s.add_argument("--max-shard-bytes", type=parse_size, default=5 * 2**30,
                   help="tensor bytes per output file (default 5GiB; accepts 500MB, 2GiB, ...)")
    s.add_argument("--skip", action="append", metavar="SUFFIX", help="drop tensors whose name ends with SUFFIX")
    s.add_argument("--memory-budget", type=parse_size, default=256 * 2**20, help="staging bytes (default 256MiB)")
    s.add_argument("--out-storage-option", action="append", default=None, metavar="KEY=VALUE",
                   help="storage options for OUT (default: the same as for URI)")
    s.set_defaults(func=cmd_merge)

    s = sub.add_parser("load-bench", parents=[common],
                       help="time loads into a synthetic layout (rows, cols, zero, full) on N local gloo ranks")
    s.add_argument("uri")
    s.add_argument("--processes", "-n", type=int, default=1, help="local ranks, spawned with gloo (default 1)")
    s.add_argument("--layout", choices=("full", "rows", "cols", "zero"), default="full",
                   help="each rank's targets: whole tensors, row blocks, column blocks or flat ZeRO ranges")
    s.add_argument("--memory-budget", type=parse_size, default=256 * 2**20, help="staging bytes (default 256MiB)")
    s.add_argument("--repeat", type=int, default=3, help="timed loads (default 3; the median is reported)")
    s.add_argument("--no-read-once", action="store_true", help="every rank reads its own bytes (no exchange)")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(func=cmd_load_bench)

    s = sub.add_parser("demo", parents=[common],
                       help="save a checkpoint to an embedded S3 server and stream back other layouts")
    s.add_argument("--size-mb", type=float, default=64.0, help="approximate checkpoint size in MiB (default 64)")
    s.add_argument("--serve", action="store_true",
                   help="keep the embedded S3 server running afterwards (Ctrl-C stops it)")
    s.add_argument("--single-process", action="store_true",
                   help="skip the multi-rank part (4 gloo processes save, 2 and 3 load other layouts)")
    s.set_defaults(func=cmd_demo)
    return p


def _version() -> str:
    from . import __version__

    return __version__


def _setup_logging(verbose: int) -> None:
    level = logging.WARNING if verbose <= 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if verbose < 2:
        for noisy in ("botocore", "aiobotocore", "s3fs", "fsspec", "urllib3", "werkzeug"):
            logging.getLogger(noisy).setLevel(logging.WARNING)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``streamckpt`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    _setup_logging(args.verbose)
    try:
        args.storage_options = parse_storage_options(args.storage_option, args.endpoint_url) or None
        outs = getattr(args, "out_storage_option", None)
        args.out_storage_options = parse_storage_options(outs) if outs is not None else None
    except argparse.ArgumentTypeError as e:
        parser.error(str(e))
    try:
        return int(args.func(args) or 0)
    except CheckpointError as e:
        print(f"streamckpt {args.command}: error: {e}", file=sys.stderr)
        return EXIT_CHECKPOINT_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def console() -> None:  # pragma: no cover - thin wrapper for setuptools
    sys.exit(main())


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
