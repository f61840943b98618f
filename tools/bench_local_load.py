"""Benchmark: what the validated local tier adds to loading a local checkpoint, on gloo processes.

Usage::

    python tools/bench_local_load.py [--reps 11] [--world 2]

Each rank saves a replicated local checkpoint (``--replication``-style clique of all ranks, the
replication fix's strategy) with the validated manager, then loads it repeatedly, interleaved:

  upstream    NVRx 0.7.0 ``LocalCheckpointManager.find_latest()`` + ``load()`` (no identity, no
              cross-check; the replication fix's strategy verifies the checksums of what it reads)
  validated   ``ValidatedLocalCheckpointManager.find_latest()`` + ``load()``: identity, topology,
              save token, cross-check of primaries and replicas, checksums and finiteness of the
              own primary; ``identity+cross-check`` is the work of the checks themselves (headers
              of every copy, fingerprints, decision), ``all_gather`` the one agreement collective
              including the wait for the slowest rank (upstream waits in its own collectives)

Both variants call ``load()`` twice, as ``load_checkpoint`` does (arguments, then the state):
upstream reads the files twice, the validated manager serves the second call from memory.

Configurations: ``quickstart`` is the quick start's model as ``pretrain_gpt.py`` stores it (per
rank ~0.87 MB in 58 tensors); ``large`` 256 MiB per rank in 256 tensors. Times are the slowest
rank's, in milliseconds; median and minimum over ``--reps``.

Target: identity+cross-check under 5% of the load time of the quick start's model.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CONFIGS = {"quickstart": (58, 870_000), "large": (256, 256 * 1024 * 1024)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tasd(rank, world, count, nbytes):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict

    g = torch.Generator().manual_seed(rank)
    n = max(1, nbytes // 4 // count)
    sd = {
        f"layer{i:04d}.weight": ShardedTensor.from_rank_offsets(
            f"layer{i:04d}.weight",
            torch.randn(n, generator=g),
            (0, rank, world),
            prepend_axis_num=1,
        )
        for i in range(count)
    }
    return MCoreTensorAwareStateDict.from_state_dict(sd, algo="fully_parallel")[0]


def _worker(rank, world, port, args, root, out_q):
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world)
    )
    sys.path.insert(0, _REPO)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import (
        LocalCheckpointManager,
    )

    from megatron.fixes.replication import FIX as replication_fix
    from megatron.training_ext import local_tier as lt

    replication_fix.apply()
    from nvidia_resiliency_ext.checkpointing.local.replication import strategies

    strategy = strategies.CliqueReplicationStrategy.from_replication_params(1, world)
    lt.install(
        argparse.Namespace(
            non_persistent_ckpt_type="local",
            local_tier_validation=True,
            local_tier_nan_window=0,
            seed=1234,
            world_size=world,
        )
    )
    results = {}
    for name in args.configs:
        count, nbytes = CONFIGS[name]
        d = os.path.join(root, name)
        lt.ValidatedLocalCheckpointManager(d, repl_strategy=strategy).save(
            _tasd(rank, world, count, nbytes), 1
        )
        dist.barrier()
        times = {
            "upstream": [],
            "validated": [],
            "identity+cross-check": [],
            "all_gather (incl. wait)": [],
        }
        for _ in range(args.reps):
            for variant in ("upstream", "validated"):
                cls = (
                    LocalCheckpointManager
                    if variant == "upstream"
                    else lt.ValidatedLocalCheckpointManager
                )
                m = cls(d, repl_strategy=strategy)
                dist.barrier()
                t0 = time.perf_counter()
                assert m.find_latest() == 1
                sd, _ = m.load()
                # load_checkpoint reads twice (arguments, then state); validated: from memory
                m.load()
                dt = time.perf_counter() - t0
                slow = [0.0] * world
                tm = getattr(m, "timings", {})
                dist.all_gather_object(slow, (dt, tm.get("identity", 0.0), tm.get("agree", 0.0)))
                times[variant].append(max(s[0] for s in slow) * 1e3)
                if variant == "validated":
                    times["identity+cross-check"].append(max(s[1] for s in slow) * 1e3)
                    times["all_gather (incl. wait)"].append(max(s[2] for s in slow) * 1e3)
                del sd
        results[name] = times
    if rank == 0:
        out_q.put(results)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=11)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    args = p.parse_args(argv)
    root = tempfile.mkdtemp(prefix="bench_local_load_")
    try:
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        port = _free_port()
        procs = [
            ctx.Process(target=_worker, args=(r, args.world, port, args, root, q))
            for r in range(args.world)
        ]
        for pr in procs:
            pr.start()
        results = q.get(timeout=3600)
        for pr in procs:
            pr.join()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"| config | variant | median [ms] | min [ms] |  (world {args.world}, "
        f"{args.reps} interleaved reps)"
    )
    print("|---|---|---|---|")
    for name, times in results.items():
        for variant, ts in times.items():
            print(f"| {name} | {variant} | {statistics.median(ts):.1f} | {min(ts):.1f} |")
    print()
    for name, times in results.items():
        up, va, idc = (
            statistics.median(times[k]) for k in ("upstream", "validated", "identity+cross-check")
        )
        print(
            f"{name}: validated / upstream = {va / up:.2f}; identity+cross-check = "
            f"{100 * idc / va:.1f}% of the validated load, {100 * idc / up:.1f}% of upstream's"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
