r"""Verify Megatron checkpoints: local (non-persistent) checkpoint files against a persistent
``torch_dist`` checkpoint of the same iteration, or either one alone.

    # local (all ranks' directories, primaries and replicas) against persistent, bitwise
    python tools/verify_checkpoint.py --local-dir /ssd/local_ckpt \
        --persistent-dir /lustre/ckpt/iter_0000010

    # persistent alone: chunk coverage, storage ranges (truncation), every chunk/object read,
    # NaN/Inf, integrity.json (per-block xxh3, written by every save; or upstream's SHA-256)
    python tools/verify_checkpoint.py --persistent-dir /lustre/ckpt [--iteration 10]

    # local alone: every local iteration; primaries against their replicas (tensors and identity),
    # the newest complete and consistent iteration, leftovers of interrupted saves
    python tools/verify_checkpoint.py --local-dir /ssd/local_ckpt [--iteration 12]

    # in parallel, one process per file (gloo, CPU only)
    torchrun --nproc-per-node 8 tools/verify_checkpoint.py --local-dir ... --persistent-dir ... \
        --json report.json

``--persistent-dir`` accepts the iteration directory or the ``--save`` root (the iteration is then
the local checkpoint's, or ``--iteration``, or the latest). Under torchrun (``WORLD_SIZE`` > 1) the
process group is initialised with gloo and the files are divided among the processes; rank 0
prints the report and writes ``--json``. Each process checks with one torch thread (``--threads``):
run as many processes as there are cores to use.

With local files, every tensor of every file (primaries and replicas) is compared bitwise with the
same region of the persistent checkpoint, its stored xxh3 checksum (replication fix) is checked and
it is scanned for NaN/Inf; ``--verify-manifest`` adds the integrity.json pass over the persistent
files.

``--local-dir`` alone checks every local iteration found (only ``--iteration`` when given): each
file's stored checksums and NaN/Inf, then every primary against each of its replicas, tensor by
tensor (key, offset, dtype, shape, checksum) and by identity record (run id, save token, iteration,
owner, run settings...). A disagreement is a problem naming the shard, both files and what differs,
e.g. ``rank 1's shard of iteration 12: primary 1/iter_0000012_1_local.pt and replica
0/iter_0000012_1_local.pt differ in 47 of 48 tensors; identity records differ in run_id,
save_token``.
The report gives the newest iteration that is complete and consistent (every rank's shard has a
copy that verifies, all copies agree, all shards from one save), e.g. ``newest complete and
consistent local iteration: 12 (iteration 14: rank 1's shard missing (interrupted save))``; a newer
incomplete iteration is then a warning, not a problem. Leftovers of interrupted saves and of the
local tier's fallback are named as warnings: ``*.dirty.pt`` files, files in ``<rank>/rejected/``
and bad-tier markers ``<rank>/LOCAL_TIER_BAD.json``.

Output: a summary (files, tensors compared / equal / mismatched, bytes, checksums, NaN/Inf), the
local iterations (complete and consistent, or why not) and the newest complete and consistent one, a
table of bad shards per key (numeric key segments normalised to ``*``; primary / replica /
persistent counts; owner and holder ranks), the problems and warnings. The JSON report is
documented in :mod:`megatron.verify.report`.

Both tiers at the same iteration from ``pretrain_gpt.py``: when both intervals hit, the loop saves
only the persistent checkpoint; but after the last iteration it saves a persistent one unless
``train_iters % save_interval == 0``. So ``--train-iters N --save-interval <M not dividing N>
--non-persistent-save-interval N`` writes the local checkpoint of N in the loop and the persistent
one of N at the end (with ``integrity.json`` unless ``--no-verify-integrity``).

Exit status: 0 no problem found, 1 problems found (mismatch, copies that differ, checksum failure,
NaN/Inf, ...; warnings do not count), 2 bad input (missing directory, no checkpoint files,
iteration mismatch, unsupported format, a ``--json`` path that cannot be written), found before
any file is checked where it can be.

Library: :func:`megatron.verify.verify_checkpoint` with
:class:`megatron.verify.VerifyOptions`; design notes: ``docs/verify.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--local-dir", metavar="DIR", help="local checkpoint root (--non-persistent-local-ckpt-dir)"
    )
    p.add_argument(
        "--persistent-dir",
        metavar="DIR",
        help="torch_dist checkpoint: iteration directory or --save root",
    )
    p.add_argument(
        "--iteration",
        type=int,
        help="iteration to verify (default: the persistent one; with --local-dir "
        "alone: every local iteration)",
    )
    p.add_argument("--json", metavar="PATH", help="write the JSON report here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-nonfinite-check", action="store_true", help="do not scan for NaN/Inf")
    m = p.add_mutually_exclusive_group()
    m.add_argument(
        "--verify-manifest",
        dest="manifest",
        action="store_const",
        const=True,
        help="also verify integrity.json (checksums of every persistent file) when comparing with "
        "local files (default: only for a persistent checkpoint alone)",
    )
    m.add_argument(
        "--skip-manifest",
        dest="manifest",
        action="store_const",
        const=False,
        help="never verify integrity.json",
    )
    p.add_argument("--no-objects", action="store_true", help="do not compare ShardedObjects")
    p.add_argument(
        "--batch-mb",
        type=int,
        default=64,
        help="MiB checked per step; persistent regions that must be "
        "assembled from several chunks take this much memory at most",
    )
    p.add_argument(
        "--no-mmap",
        action="store_true",
        help="read local files into memory instead of mapping them",
    )
    p.add_argument("--no-readahead", action="store_true", help="no background read-ahead thread")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads per process (default 1; "
        "for more parallelism run more processes under torchrun)",
    )
    p.add_argument(
        "--max-rows", type=int, default=50, help="rows of tables / problems printed (all in --json)"
    )
    p.add_argument("--quiet", action="store_true", help="print only the RESULT line")
    p.add_argument(
        "--unrestricted-unpickling",
        action="store_true",
        help="unpickle without the allowlist (megatron/integrity/unpickle.py): the files may run "
        "code; only for checkpoints you wrote with code the allowlist does not know",
    )
    return p


def _unwritable(path: str) -> str | None:
    """Why the report cannot be written to ``path`` (``None``: it can), without creating it."""
    path = os.path.abspath(path)
    if os.path.isdir(path):
        return "is a directory"
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        return f"directory {parent} does not exist"
    if os.path.exists(path):
        return None if os.access(path, os.W_OK) else "is not writable"
    return None if os.access(parent, os.W_OK | os.X_OK) else f"directory {parent} is not writable"


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if not args.local_dir and not args.persistent_dir:
        _parser().print_usage(sys.stderr)
        print("error: give --local-dir, --persistent-dir or both", file=sys.stderr)
        return 2

    if args.json and (problem := _unwritable(args.json)):
        print(
            f"error: --json {args.json}: {problem}; give a path in a writable directory",
            file=sys.stderr,
        )
        return 2

    import torch.distributed as dist

    from megatron.integrity import unpickle
    from megatron.verify import CheckpointInputError, VerifyOptions, verify_checkpoint

    unpickle.POLICY.unrestricted = args.unrestricted_unpickling

    world = int(os.environ.get("WORLD_SIZE", "1"))
    group = None
    if world > 1:
        dist.init_process_group("gloo")
        group = dist.group.WORLD
    rank = dist.get_rank() if group is not None else 0
    try:
        try:
            options = VerifyOptions(
                check_nonfinite=not args.no_nonfinite_check,
                verify_manifest=args.manifest,
                compare_objects=not args.no_objects,
                batch_bytes=args.batch_mb * 1024 * 1024,
                mmap=not args.no_mmap,
                readahead=not args.no_readahead,
                torch_threads=args.threads,
                progress=not args.no_progress and sys.stderr.isatty(),
            )
            report = verify_checkpoint(
                args.local_dir,
                args.persistent_dir,
                iteration=args.iteration,
                options=options,
                group=group,
            )
        except CheckpointInputError as e:
            if rank == 0:
                print(f"error: {e}", file=sys.stderr)
            return 2
        if rank == 0:
            if args.quiet:
                print(
                    "RESULT: "
                    + ("OK" if report.ok else f"FAILED ({len(report.problems)} problem(s))")
                )
            else:
                print(report.format_text(max_rows=args.max_rows))
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(report.to_dict(), f, indent=1)
        return report.exit_code
    finally:
        if group is not None:
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
