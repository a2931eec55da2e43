"""``streamckpt`` command line: inspect, latest, ls, prune, gc, verify, merge, copy, load-bench, demo.

Storage is reached as in the library: any fsspec URL, ``--endpoint-url`` and
repeated ``--storage-option key=value`` (dotted keys nest, values are parsed as
JSON when they can be: ``--storage-option client_kwargs.verify=false``); the
standard AWS environment variables work through s3fs/botocore. Long operations
show their progress on stderr unless ``--quiet``: a bar on a terminal, a plain
line every few seconds elsewhere. A ``CheckpointError`` prints its message on
stderr (its hint in this command line's words: ``--storage-option key=...``, not
``storage_options={...}``) and exits with status 2, as does a bad argument (with
the command's usage). Output into a pipe closed early (``| head``) ends quietly with status 141
(128 + SIGPIPE, what a shell reports for a command killed by a closed pipe).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any, Sequence

from ..errors import CLI, CheckpointError
from ..loading.verify import verify_checkpoint
from ..results import human_bytes as human
from ..results import plural
from .args import (key_value, parse_duration, parse_keep_best, parse_size, parse_storage_options, positive_float,
                   positive_int)

log = logging.getLogger("streamckpt.cli")

EXIT_NONE_FOUND = 1  # `latest` found no committed checkpoint (as `grep` finds no line)
EXIT_CHECKPOINT_ERROR = 2
EXIT_BROKEN_PIPE = 128 + 13  # SIGPIPE: what `set -o pipefail` sees from `cat big | head`


# ------------------------------------------------------------------ options


# ----------------------------------------------------------------- commands


def cmd_inspect(args: argparse.Namespace) -> int:
    from ..api import inspect

    info = inspect(args.uri, storage_options=args.storage_options)
    if args.json:
        print(json.dumps(info.to_dict(), indent=2, default=str))
    else:
        print(info)
    return 0


def cmd_latest(args: argparse.Namespace) -> int:
    """The newest committed checkpoint under ROOT on stdout (``ckpt=$(streamckpt latest ...)``);
    none: a line on stderr and status 1, so that a script can tell."""
    from ..api import latest

    found = latest(args.root, storage_options=args.storage_options)
    if found is None:  # sc.latest has warned when ROOT is itself a checkpoint
        print(f"no committed checkpoint under {args.root}", file=sys.stderr)
        return EXIT_NONE_FOUND
    print(found)
    return 0


def _none_under(args: argparse.Namespace, command: str) -> None:
    """'no committed checkpoint under ROOT' on stderr, and when ROOT is itself a checkpoint
    (a step's URI given for its run's), the run's prefix to give instead."""
    from ..core.manifest import MANIFEST_NAME
    from ..storage import Storage

    line = f"no committed checkpoint under {args.root}"
    try:
        storage = Storage(args.root, args.storage_options)
        try:
            itself = storage.modified(MANIFEST_NAME) is not None
        finally:
            storage.close()
    except CheckpointError:  # the listing already answered; this is only a hint
        itself = False
    parent = args.root.rstrip("/").rpartition("/")[0]
    if itself and parent and not parent.endswith(":/"):
        line += f": it is itself a checkpoint; its run is {parent} (streamckpt {command} {parent})"
    print(line, file=sys.stderr)


def _manager(args: argparse.Namespace, **policy: Any) -> Any:
    from ..api import CheckpointManager

    return CheckpointManager(args.root, storage_options=args.storage_options, **policy)


def _policy_args(args: argparse.Namespace) -> dict[str, Any]:
    return {"keep_last": args.keep_last, "keep_every": args.keep_every, "keep_best": args.keep_best,
            "keep_time_interval": args.keep_time_interval}


def _add_policy(s: argparse.ArgumentParser, what: str) -> None:
    """The retention rules, as CheckpointManager takes them (``what``: how the help words them)."""
    s.add_argument("--keep-last", type=positive_int, metavar="N", help=f"{what} the N newest steps")
    s.add_argument("--keep-every", type=positive_int, metavar="K", help=f"{what} the steps divisible by K")
    s.add_argument("--keep-best", type=parse_keep_best, metavar="METRIC:MODE:K",
                   help=f"{what} the K best steps by a metric saved with them (MODE: min or max), e.g. loss:min:3")
    s.add_argument("--keep-time-interval", type=parse_duration, metavar="AGE",
                   help=f"{what} one step per AGE of commit time (the oldest, then each AGE after the last kept)")


def cmd_ls(args: argparse.Namespace) -> int:
    """The committed checkpoints under ROOT, one line each (status 1: none)."""
    from ..manage.report import rows, table

    if args.local is not None:
        return _ls_local(args)
    policy = _policy_args(args)
    with _manager(args, **policy) as mgr:
        found = rows(mgr.checkpoints(), mgr.policy if any(v is not None for v in policy.values()) else None)
    if not found:
        _none_under(args, "ls")
        return EXIT_NONE_FOUND
    print(json.dumps(found, indent=2) if args.json else table(found))
    return 0


def _ls_local(args: argparse.Namespace) -> int:
    """``ls ROOT --local DIR``: the run's local steps in one node's folder (the bucket is not asked)."""
    from ..manage.tier.localdir import LocalDir
    from ..manage.tier.report import local_rows, local_table
    from ..storage.store import checked_uri

    found = local_rows(LocalDir(args.local, checked_uri(args.root).rstrip("/")))
    if not found:
        print(f"no local steps of {args.root} in {args.local}", file=sys.stderr)
        return EXIT_NONE_FOUND
    print(json.dumps(found, indent=2) if args.json else local_table(found))
    return 0


def cmd_prune(args: argparse.Namespace) -> int:
    """Delete (or with --dry-run, list) the checkpoints the policy does not keep (status 1: none)."""
    policy = _policy_args(args)
    if all(v is None for v in policy.values()):
        print("prune needs a rule to keep by: --keep-last N, --keep-every K, --keep-best METRIC:MODE:K and/or "
              "--keep-time-interval AGE "
              "(with none, every checkpoint is kept and nothing is deleted)", file=sys.stderr)
        return EXIT_CHECKPOINT_ERROR
    with _manager(args, **policy) as mgr:
        gone = mgr.prune(dry_run=args.dry_run)
    for uri in gone:
        print(f"would delete {uri}" if args.dry_run else f"deleted {uri}")
    if not gone:
        print(f"nothing to prune under {args.root}", file=sys.stderr)
    return 0 if gone else EXIT_NONE_FOUND


def cmd_gc(args: argparse.Namespace) -> int:
    """Remove (or with --dry-run, list) the garbage under ROOT (status 1: none)."""
    with _manager(args) as mgr:
        found = mgr.collect_garbage(older_than=args.older_than, dry_run=args.dry_run)
    for item in found:
        print(f"would remove {item}" if args.dry_run else f"removed {item}")
    if not found:
        print(f"no garbage older than {args.older_than:g} s under {args.root}", file=sys.stderr)
    return 0 if found else EXIT_NONE_FOUND


def cmd_verify(args: argparse.Namespace) -> int:
    from ..progress import ByteProgress

    with ByteProgress("verify", enabled=not args.quiet) as bar:
        rep = verify_checkpoint(args.uri, storage_options=args.storage_options, progress=bar,
                                on_total=bar.set_total)
    rate = rep.bytes_read / rep.seconds / 1e6 if rep.seconds else 0.0
    frames = f", {plural(rep.frames_decoded, 'zstd frame')} decoded" if rep.frames_decoded else ""
    print(f"OK {rep.uri} [{rep.kind}]: {plural(rep.files, 'file')}, {plural(rep.shards, 'shard')}, "
          f"{human(rep.bytes_read)} read in {plural(rep.requests, 'request')}, "
          f"{plural(rep.checksums, 'checksum')} verified{frames}"
          f"{'' if rep.checksums else ' (this format stores no checksums: every byte was read)'}; "
          f"{rep.seconds:.2f} s, {rate:.1f} MB/s")
    return 0


def cmd_merge(args: argparse.Namespace) -> int:
    from ..api import inspect
    from ..merging import merge
    from ..progress import ByteProgress

    skip = tuple(args.skip or ())
    total = None
    if not args.quiet:
        info = inspect(args.uri, storage_options=args.storage_options)
        total = sum(t.bytes for k, t in info.tensors.items() if not (skip and k.endswith(skip)))
    with ByteProgress("merge", total, enabled=not args.quiet) as bar:
        res = merge(args.uri, args.out, max_shard_bytes=args.max_shard_bytes, skip=skip,
                    storage_options=args.storage_options, out_storage_options=args.out_storage_options,
                    memory_budget=args.memory_budget, progress=bar)
    rate = res.total_size / res.seconds / 1e6 if res.seconds else 0.0
    print(f"wrote {plural(len(res.files), 'file')} + model.safetensors.index.json to {args.out}: "
          f"{human(res.total_size)} of tensors, {human(res.bytes_read)} read in {plural(res.requests, 'request')}, "
          f"{res.seconds:.2f} s, {rate:.1f} MB/s")
    for f in res.files:
        print(f"  {f}")
    return 0


def cmd_copy(args: argparse.Namespace) -> int:
    from ..manage.copying import copy_checkpoint

    res = copy_checkpoint(args.uri, args.out, storage_options=args.storage_options,
                          out_storage_options=args.out_storage_options)
    what = "" if res.checkpoints == [""] else f" ({plural(len(res.checkpoints), 'checkpoint')} of the run)"
    print(f"copied {args.uri} to {args.out}{what}: {plural(len(res.files), 'file')}, {human(res.bytes_written)} "
          f"({'references kept shared' if what else 'self-contained'}), {res.seconds:.2f} s")
    for name, why in res.skipped:
        print(f"  left out {name}: its manifest cannot be read ({why})")
    return 0


def cmd_load_bench(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from .. import loadbench

    reps = loadbench.run(args.uri, args.storage_options, args.processes, args.layout, args.memory_budget,
                         read_once=not args.no_read_once, repeat=args.repeat)
    if args.json:
        print(json.dumps([[asdict(r) for r in runs] for runs in reps], indent=2))
    else:
        print(f"{args.uri}: layout {args.layout!r} on {plural(args.processes, 'rank')}, memory_budget "
              f"{human(args.memory_budget)}, read_once={not args.no_read_once}")
        print(loadbench.format_runs(reps))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from ..demo import run_demo

    return run_demo(size_mb=args.size_mb, quiet=args.quiet, serve=args.serve, multirank=not args.single_process)


# -------------------------------------------------------------------- main


URI_HELP = ("the checkpoint: s3://bucket/prefix, gs://..., az://..., file:///dir or a local path "
            "(also one *.safetensors file or a *.safetensors.index.json)")

EPILOG = """examples:
  streamckpt demo              # an embedded S3 server: save, then load 4 other layouts
  streamckpt inspect s3://bucket/run/step-1000 --endpoint-url http://127.0.0.1:9000
  streamckpt latest s3://bucket/run  # the newest committed checkpoint under a prefix
  streamckpt ls s3://bucket/run --keep-last 3       # a run's steps, and what keeping 3 would keep
  streamckpt prune s3://bucket/run --keep-last 3 --keep-every 1000 --dry-run
  streamckpt gc s3://bucket/run --older-than 2h     # dead saves' objects, open multipart uploads
  streamckpt verify s3://bucket/run/step-1000
  streamckpt merge s3://bucket/run/step-1000 s3://bucket/hf --max-shard-bytes 2GiB --skip .exp_avg

'streamckpt COMMAND --help' lists the options of a command. Exit status: 0 done,
1 demo mismatch, no checkpoint for latest or ls, nothing to prune or gc, 2 checkpoint error or bad arguments, 130 interrupted, 141 output
pipe closed early."""


def _parents() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """(storage flags, output flags): every command has the second; ``demo`` brings its
    own server, so it has no storage flags to ignore."""
    storage = argparse.ArgumentParser(add_help=False)
    storage.add_argument("--endpoint-url", metavar="URL", help="S3-compatible endpoint (e.g. http://127.0.0.1:9000)")
    storage.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE", type=key_value,
                         help="fsspec storage option (repeatable; dotted keys nest; JSON values parsed, "
                              "e.g. client_kwargs.verify=false)")
    output = argparse.ArgumentParser(add_help=False)
    output.add_argument("-q", "--quiet", action="store_true", help="no progress output on stderr")
    output.add_argument("-v", "--verbose", action="count", default=0, help="log more (-v info, -vv debug)")
    return storage, output


def _command(sub: Any, name: str, func: Any, help: str, description: str,
             parents: list[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """One subcommand; its parser rides along in the namespace so that value errors found
    after parsing (``command_parser.error``) print this command's usage, not the top one."""
    s = sub.add_parser(name, parents=parents, help=help, description=description)
    s.set_defaults(func=func, command_parser=s)
    return s


def build_parser() -> argparse.ArgumentParser:
    storage, output = _parents()
    both = [storage, output]
    p = argparse.ArgumentParser(prog="streamckpt",
                                description="Stream sharded PyTorch checkpoints from object storage.",
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = _command(sub, "inspect", cmd_inspect, "describe a checkpoint (any kind) from its metadata",
                 "Describe a checkpoint from its metadata alone (no tensor data is read): its kind, each "
                 "tensor's dtype, shape, shards and bytes, its files, non-tensor values and user metadata.", both)
    s.add_argument("uri", metavar="URI", help=URI_HELP)
    s.add_argument("--json", action="store_true", help="machine-readable output (values in full)")

    s = _command(sub, "latest", cmd_latest, "print the newest committed checkpoint under a prefix",
                 "Print the URI of the newest committed streamckpt checkpoint directly under ROOT (by the commit "
                 "time its manifest records; a prefix without manifest.json is uncommitted and never chosen), "
                 "or exit with status 1 when there is none.", both)
    s.add_argument("root", metavar="ROOT", help="the prefix holding the checkpoints (e.g. s3://bucket/run)")

    s = _command(sub, "ls", cmd_ls, "list a run's committed checkpoints: step, time, size, metrics",
                 "List the committed checkpoints under ROOT (read from their manifests): step, commit time, size, "
                 "files and metrics; with --keep-* also whether that policy keeps each. Status 1 when there are "
                 "none.", both)
    s.add_argument("root", metavar="ROOT", help="the run's prefix (e.g. s3://bucket/run)")
    s.add_argument("--json", action="store_true", help="machine-readable output (sizes in bytes)")
    s.add_argument("--local", metavar="DIR", help="the run's local steps in this node's local_dir instead (the "
                   "memory/peer tier: committed or not, files held here)")
    _add_policy(s, "show what a policy keeps:")

    s = _command(sub, "prune", cmd_prune, "delete the checkpoints a retention policy does not keep",
                 "Delete the committed checkpoints under ROOT that no rule keeps (the union of the --keep-* "
                 "rules, as CheckpointManager applies them; the newest step always is kept; at least one rule), "
                 "each manifest first, then its data. Status 1 when there is nothing to delete.", both)
    s.add_argument("root", metavar="ROOT", help="the run's prefix (e.g. s3://bucket/run)")
    _add_policy(s, "keep")
    s.add_argument("--dry-run", action="store_true", help="only print what would be deleted")

    s = _command(sub, "gc", cmd_gc, "remove what no committed checkpoint references (dead saves, open uploads)",
                 "Remove the objects under ROOT that no committed manifest references and the incomplete "
                 "multipart uploads (S3), when older than --older-than; a save younger than that is never touched. "
                 "Status 1 when there is nothing to remove.", both)
    s.add_argument("root", metavar="ROOT", help="the run's prefix (e.g. s3://bucket/run)")
    s.add_argument("--older-than", type=parse_duration, default=3600.0, metavar="AGE",
                   help="grace period: 3600, 30m, 1h, 2d (default 1h); longer than any save takes (garbage "
                        "changed in the last 10 minutes is named in a warning: a save in progress elsewhere?)")
    s.add_argument("--dry-run", action="store_true", help="only print what would be removed, with sizes")

    s = _command(sub, "verify", cmd_verify, "read every byte and check every checksum",
                 "Read every stored byte of every tensor, check every checksum and that every zstd frame "
                 "decodes; the first bad object is named and the exit status is 2.", both)
    s.add_argument("uri", metavar="URI", help=URI_HELP)

    s = _command(sub, "merge", cmd_merge, "write a checkpoint as Hugging Face safetensors shards",
                 "Write the checkpoint at URI to OUT as Hugging Face safetensors shards "
                 "(model-0000k-of-0000n.safetensors) and model.safetensors.index.json, streamed.", both)
    s.add_argument("uri", metavar="URI", help=URI_HELP)
    s.add_argument("out", metavar="OUT", help="the output directory (any URI, like URI)")
    s.add_argument("--max-shard-bytes", type=parse_size, default=5 * 2**30, metavar="SIZE",
                   help="tensor bytes per output file (default 5GiB; accepts 500MB, 2GiB, ...)")
    s.add_argument("--skip", action="append", metavar="SUFFIX",
                   help="drop tensors whose name ends with SUFFIX (repeatable)")
    s.add_argument("--memory-budget", type=parse_size, default=256 * 2**20, metavar="SIZE",
                   help="staging bytes (default 256MiB)")
    s.add_argument("--out-storage-option", action="append", default=None, metavar="KEY=VALUE", type=key_value,
                   help="storage option for OUT (repeatable; default: the same options as for URI)")

    s = _command(sub, "copy", cmd_copy, "copy a checkpoint (self-contained) or a run (every committed checkpoint)",
                 "Copy the streamckpt checkpoint at URI to OUT (another prefix, bucket or store) as a "
                 "self-contained checkpoint: the files an incremental checkpoint shares with its siblings "
                 "are copied too, every checksum is verified on the way, the manifest is written last. "
                 "Given a run's root (a CheckpointManager's), copy every committed checkpoint under it, "
                 "references kept shared, manifests last.", both)
    s.add_argument("uri", metavar="URI", help=URI_HELP + "; or a run's root")
    s.add_argument("out", metavar="OUT", help="the copy's prefix (any URI, like URI); no committed checkpoint there")
    s.add_argument("--out-storage-option", action="append", default=None, metavar="KEY=VALUE", type=key_value,
                   help="storage option for OUT (repeatable; default: the same options as for URI)")

    s = _command(sub, "load-bench", cmd_load_bench,
                 "time loads into a synthetic layout (rows, cols, zero, full) on N local gloo ranks",
                 "Time loads of the checkpoint at URI into a synthetic layout (built from its metadata) on N "
                 "local gloo ranks; prints each rank's bytes needed, read and sent, and the median GB/s.", both)
    s.add_argument("uri", metavar="URI", help=URI_HELP)
    s.add_argument("--processes", "-n", type=positive_int, default=1, metavar="N",
                   help="local ranks, spawned with gloo (default 1)")
    s.add_argument("--layout", choices=("full", "rows", "cols", "zero"), default="full",
                   help="each rank's targets: whole tensors, row blocks, column blocks or flat ZeRO ranges")
    s.add_argument("--memory-budget", type=parse_size, default=256 * 2**20, metavar="SIZE",
                   help="staging bytes (default 256MiB)")
    s.add_argument("--repeat", type=positive_int, default=3, metavar="N",
                   help="timed loads (default 3; the median is reported)")
    s.add_argument("--no-read-once", action="store_true", help="every rank reads its own bytes (no exchange)")
    s.add_argument("--json", action="store_true", help="machine-readable output")

    s = _command(sub, "demo", cmd_demo, "save a checkpoint to an embedded S3 server and stream back other layouts",
                 "Start an embedded S3 server (moto, 127.0.0.1), save a transformer-like checkpoint to it, load "
                 "other layouts by range reads and check every element; then the same with several processes.",
                 [output])
    s.add_argument("--size-mb", type=positive_float, default=64.0, metavar="MIB",
                   help="approximate checkpoint size in MiB (default 64)")
    s.add_argument("--serve", action="store_true",
                   help="keep the embedded S3 server running afterwards (Ctrl-C stops it)")
    s.add_argument("--single-process", action="store_true",
                   help="skip the multi-rank part (4 gloo processes save, 2 and 3 load other layouts)")
    return p


def _version() -> str:
    from .. import __version__

    return __version__


def _setup_logging(verbose: int) -> None:
    level = logging.WARNING if verbose <= 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if verbose < 2:
        for noisy in ("botocore", "aiobotocore", "s3fs", "fsspec", "urllib3", "werkzeug"):
            logging.getLogger(noisy).setLevel(logging.WARNING)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``streamckpt`` console script; returns the exit status.

    A reader that closes the output pipe early (``| head``) is no error: no traceback,
    status ``EXIT_BROKEN_PIPE``."""
    try:
        try:
            return _run(argv)
        finally:
            sys.stdout.flush()  # here, inside the try, rather than in the interpreter's final flush
    except BrokenPipeError:
        _discard_stdout()
        return EXIT_BROKEN_PIPE


def _run(argv: Sequence[str] | None) -> int:
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:  # argparse would report these with the top-level usage
        args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    _setup_logging(args.verbose)
    _storage_options(args)
    try:
        return int(args.func(args) or 0)
    except CheckpointError as e:
        print(f"streamckpt {args.command}: error: {e.render(CLI)}", file=sys.stderr)
        return EXIT_CHECKPOINT_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _storage_options(args: argparse.Namespace) -> None:
    """``args.storage_options`` / ``args.out_storage_options`` from the repeated flags; a
    bad combination exits through the command's own parser (its usage, status 2)."""
    try:
        pairs = getattr(args, "storage_option", [])
        args.storage_options = parse_storage_options(pairs, getattr(args, "endpoint_url", None)) or None
        outs = getattr(args, "out_storage_option", None)
        args.out_storage_options = (parse_storage_options(outs, flag="--out-storage-option")
                                    if outs is not None else None)
    except argparse.ArgumentTypeError as e:
        args.command_parser.error(str(e))


def _discard_stdout() -> None:
    """Point file descriptor 1 at /dev/null, so that flushing what is still buffered
    (the interpreter does at exit) cannot raise BrokenPipeError a second time."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stdout.fileno())
        finally:
            os.close(devnull)
    except (OSError, ValueError):  # no real stdout (replaced by a test harness): nothing to flush
        pass


def console() -> None:  # pragma: no cover - thin wrapper for setuptools
    sys.exit(main())
