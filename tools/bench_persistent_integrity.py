"""Benchmark: what default integrity costs a persistent ``torch_dist`` checkpoint, save and load,
on gloo processes (CPU).

Usage::

    python tools/bench_persistent_integrity.py [--gib 1.0] [--tensors 64] [--reps 5] [--world 2]

Every rank holds ``--gib / --world`` GiB of fp32 in ``--tensors`` ShardedTensors; the variants
run interleaved (one save and one load of each per repetition, the order rotating):

  upstream              megatron-core 0.19.2 ``dist_checkpointing.save`` / ``load`` as
                        ``pretrain_gpt.py`` calls them without ``--verify-integrity``: no checksums
  upstream --verify-integrity
                        the same with ``verify_integrity=True``: rank 0 SHA-256es every file after
                        the save and before the load (``validation.save_integrity_manifest``)
  fork default          this fork's default (``megatron.training_ext.persistent_tier``): each rank
                        hashes the files it wrote (xxh3-64 per 4 MiB block) right after the save,
                        and the ranks verify a share each before the load

Times are the slowest rank's wall time of one ``save`` (including its finalisation) or ``load``,
in seconds; median and minimum over ``--reps`` (after one warm-up repetition of every variant).
Written to ``--dir`` (default: a temporary directory), so the data is in the page cache when
hashed and loaded, as right after a save.

Target: the fork's integrity under 10% of the save time.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)
from tools._gloo_bench import run_workers, slowest  # noqa: E402

VARIANTS = ("upstream", "upstream --verify-integrity", "fork default")


def _state(rank: int, world: int, tensors: int, per_rank_bytes: int):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    n = per_rank_bytes // 4 // tensors
    g = torch.Generator().manual_seed(rank)
    return {
        f"t{i}": ShardedTensor.from_rank_offsets(
            f"decoder.layers.{i}.weight", torch.randn(1, n, generator=g), (0, rank, world)
        )
        for i in range(tensors)
    }


def _worker(rank: int, world: int, port: int, args, out) -> None:
    sys.path.insert(0, _REPO)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    from megatron.core import dist_checkpointing

    from megatron.cpu import runtime
    from megatron.training_ext import persistent_tier

    runtime.activate()  # the torch_dist writer calls torch.cuda.synchronize()
    from megatron.integrity import manifest as mf

    spent = {"save": 0.0, "load": 0.0}  # this rank's seconds inside the fork's integrity work

    def timed(fn, op):
        def run(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[op] += time.perf_counter() - t0

        return run

    mf.save_manifest = timed(mf.save_manifest, "save")
    mf.verify_checkpoint_dir = timed(mf.verify_checkpoint_dir, "load")
    per_rank = int(args.gib * (1 << 30)) // world
    state = _state(rank, world, args.tensors, per_rank)
    import logging

    logging.disable(logging.INFO)
    times = {
        (v, op): [] for v in VARIANTS for op in ("save", "load", "save_integrity", "load_integrity")
    }
    for rep in range(
        -1, args.reps
    ):  # rep -1 warms up (writer processes, page cache) and is dropped
        order = VARIANTS[rep % 3 :] + VARIANTS[: rep % 3] if rep >= 0 else VARIANTS
        for v in order:
            d = os.path.join(args.dir, f"iter_{rep + 1:07d}_{VARIANTS.index(v)}")
            if rank == 0:
                shutil.rmtree(d, ignore_errors=True)
                os.makedirs(d)
            dist.barrier()
            if v == "fork default":
                persistent_tier.install(argparse.Namespace())
            spent.update(save=0.0, load=0.0)
            try:
                up_verify = v == "upstream --verify-integrity"
                t0 = time.perf_counter()
                dist_checkpointing.save(state, d, verify_integrity=up_verify)
                t_save = slowest(time.perf_counter() - t0)
                target = {k: t.without_data() for k, t in state.items()}
                for k, t in target.items():
                    t.data = torch.empty_like(state[k].data)
                dist.barrier()
                t0 = time.perf_counter()
                loaded = dist_checkpointing.load(target, d, verify_integrity=up_verify)
                t_load = slowest(time.perf_counter() - t0)
                if rep >= 0:
                    times[(v, "save")].append(t_save)
                    times[(v, "load")].append(t_load)
                    times[(v, "save_integrity")].append(slowest(spent["save"]))
                    times[(v, "load_integrity")].append(slowest(spent["load"]))
                assert all(torch.equal(loaded[k], state[k].data) for k in state)
            finally:
                persistent_tier.uninstall()
            dist.barrier()
            if rank == 0:
                shutil.rmtree(d, ignore_errors=True)
    if rank == 0:
        out.put(times)
    dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=1.0, help="checkpoint size in GiB (all ranks)")
    p.add_argument("--tensors", type=int, default=64, help="tensors per rank")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = p.parse_args(argv)
    tmp = None
    if args.dir is None:
        tmp = args.dir = tempfile.mkdtemp(prefix="bench_persistent_integrity_")
    times = run_workers(_worker, args.world, args)
    if tmp:
        shutil.rmtree(tmp, ignore_errors=True)
    if times is None:
        return 1
    med = {k: statistics.median(x) for k, x in times.items()}
    print(
        f"{args.gib:g} GiB torch_dist checkpoint, {args.world} gloo ranks, "
        f"{args.tensors} tensors per rank, "
        f"{args.reps} interleaved reps; slowest rank, seconds"
    )
    print("| variant | save median | save min | load median | load min |")
    print("|---|---|---|---|---|")
    for v in VARIANTS:
        s, lo = times[(v, "save")], times[(v, "load")]
        print(
            f"| {v} | {med[(v, 'save')]:.3f} | {min(s):.3f} | "
            f"{med[(v, 'load')]:.3f} | {min(lo):.3f} |"
        )
    print()
    base_save, base_load = med[("upstream", "save")], med[("upstream", "load")]
    v = "upstream --verify-integrity"
    print(
        f"{v}: save {med[(v, 'save')] / base_save:.2f}x, "
        f"load {med[(v, 'load')] / base_load:.2f}x upstream"
    )
    v = "fork default"
    si, li = med[(v, "save_integrity")], med[(v, "load_integrity")]
    print(
        f"{v}: save {med[(v, 'save')] / base_save:.2f}x, "
        f"load {med[(v, 'load')] / base_load:.2f}x upstream; "
        f"time inside the checksums (measured, slowest rank): save {si * 1e3:.0f} ms = "
        f"{100 * si / base_save:.1f}% of the upstream save, load {li * 1e3:.0f} ms = "
        f"{100 * li / base_save:.1f}% of the upstream save"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
