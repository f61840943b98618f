"""Benchmark: what the resume proof's state digest costs against the save and load it guards, on
gloo processes (CPU; on CUDA the tensors live on the GPU when one is present and ``--cuda``).

Usage::

    python tools/bench_state_digest.py [--mb 256] [--tensors 32] [--reps 3] [--world 2]

Every rank holds ``--mb`` MB of fp32 state in ``--tensors`` ShardedTensors, each a TP-like shard
of a global tensor (split along its last dim, so the digest takes its strided path, the general
one). Per repetition, interleaved: the digest (every rank digests its shards, one all-gather
combines them: what ``pretrain_gpt.py`` adds at a save and again at a load), a ``torch_dist``
save of the same state as ``pretrain_gpt.py`` does it (this fork's persistent tier: checksums in
``integrity.json``), and its load (verification included). Times are the slowest rank's, seconds,
median and minimum over ``--reps`` after one warm-up.

Targets (``docs/resume-proof.md``): digest <= 10% of the save time on CPU; on CUDA >= 50% of the
device's copy bandwidth.
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

OPS = ("digest", "save", "load")


def _worker(rank: int, world: int, port: int, args, out) -> None:
    sys.path.insert(0, _REPO)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    import argparse as ap
    import logging

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from megatron.cpu import runtime
    from megatron.integrity import state_digest as sd
    from megatron.training_ext import persistent_tier

    runtime.activate()
    logging.disable(logging.INFO)
    device = "cuda" if args.cuda else "cpu"
    rows = 1024
    cols = int(args.mb * 1e6) // 4 // args.tensors // rows
    g = torch.Generator().manual_seed(rank)
    state = {
        f"t{i}": ShardedTensor.from_rank_offsets(
            f"decoder.layers.{i}.weight",
            torch.randn(rows, cols, generator=g).to(device),
            (1, rank, world),
        )
        for i in range(args.tensors)
    }
    persistent_tier.install(ap.Namespace())

    def digest():
        sums = {}
        for sh in state.values():
            sums[sh.key] = sd.block_sum(sh.data, sh.global_offset, sh.global_shape)
        gathered = [None] * world
        dist.all_gather_object(gathered, sums)
        return {k: sd.finish([g[k] for g in gathered], rows * cols * world) for k in sums}

    times = {op: [] for op in OPS}
    for rep in range(-1, args.reps):
        d = os.path.join(args.dir, f"iter_{rep + 1:07d}")
        if rank == 0:
            shutil.rmtree(d, ignore_errors=True)
            os.makedirs(d)
        dist.barrier()
        t0 = time.perf_counter()
        digest()
        t_digest = slowest(time.perf_counter() - t0)
        t0 = time.perf_counter()
        dist_checkpointing.save(state, d)
        t_save = slowest(time.perf_counter() - t0)
        target = {k: t.without_data() for k, t in state.items()}
        for k, t in target.items():
            t.data = torch.empty_like(state[k].data)
        dist.barrier()
        t0 = time.perf_counter()
        dist_checkpointing.load(target, d)
        t_load = slowest(time.perf_counter() - t0)
        if rep >= 0:
            times["digest"].append(t_digest)
            times["save"].append(t_save)
            times["load"].append(t_load)
        dist.barrier()
        if rank == 0:
            shutil.rmtree(d, ignore_errors=True)
    persistent_tier.uninstall()
    if rank == 0:
        out.put(times)
    dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=256, help="MB of fp32 state per rank")
    p.add_argument("--tensors", type=int, default=32, help="tensors per rank")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--cuda", action="store_true", help="state on the GPU (needs CUDA)")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = p.parse_args(argv)
    tmp = None
    if args.dir is None:
        tmp = args.dir = tempfile.mkdtemp(prefix="bench_state_digest_")
    times = run_workers(_worker, args.world, args)
    if tmp:
        shutil.rmtree(tmp, ignore_errors=True)
    if times is None:
        return 1
    med = {op: statistics.median(v) for op, v in times.items()}
    print(
        f"{args.mb:g} MB fp32 state per rank, {args.world} gloo ranks, {args.tensors} tensors "
        f"per rank, {args.reps} interleaved reps; slowest rank, seconds"
    )
    print("| step | median | min |")
    print("|---|---:|---:|")
    for op in OPS:
        print(f"| {op} | {med[op]:.3f} | {min(times[op]):.3f} |")
    print()
    print(
        f"digest / save: {med['digest'] / med['save']:.1%} (target <= 10%); "
        f"digest / load: {med['digest'] / med['load']:.1%}; "
        f"digest rate {args.mb / med['digest']:.0f} MB/s per rank"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
