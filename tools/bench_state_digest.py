"""Benchmark: what the resume proof's state digest costs against the save and load it guards, on
gloo processes (CPU; on CUDA the tensors live on the GPU when one is present and ``--cuda``).

Usage::

    python tools/bench_state_digest.py [--configs 256mb quickstart] [--reps 5] [--world 2]

Two configurations, each the issue's cost target (digest <= 10% of the save time on CPU):

``256mb``
    Every rank holds ``--mb`` MB of fp32 state in ``--tensors`` ShardedTensors, each a TP-like
    shard of a global tensor (split along its last dim, so the digest takes its strided path, the
    general one), saved with ``torch_dist`` as ``pretrain_gpt.py`` does it (this fork's persistent
    tier: checksums in ``integrity.json``) and loaded (verification included).
``quickstart``
    The quick start's model (2 layers, hidden 64, vocabulary 384 after padding; DP 2, so rank 0
    holds the main replica): its 28 model blocks and their ``fp32_param``, ``exp_avg`` and
    ``exp_avg_sq`` (64 digest keys, 112 blocks), saved as a local checkpoint (this fork's
    validated local tier, replicated to the other rank as the quick start does). Not included
    here: the model's ``sharded_state_dict`` (about 1.3 ms per digest of the real model) and the
    CPU backend's torch function mode (the resume proof reads tensors outside it).

Per repetition, interleaved: the digest (every rank digests its blocks; the resume proof's exchange
combines them: one ``all_reduce`` after the first digest; what ``pretrain_gpt.py`` adds at a save
and again at a load), the digest with the first digest's ``all_gather_object`` exchange, the save,
for ``256mb`` the digest with the kernel's scalar form (the form for AVX2 hosts, and the only one
before 2026-12-05) and the load. Times are the slowest rank's, seconds, median and minimum over
``--reps`` after one warm-up.
"""

from __future__ import annotations

import argparse
import importlib.util
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

OPS = ("digest", "digest, gathering exchange", "digest, scalar kernel", "save", "load")
CONFIGS = ("256mb", "quickstart")


#: The quick start's model as the resume proof sees it: (key, global shape) of each block of
#: layer-stacked tensors (prepended layer axis) and of the others.
_LAYER = {
    "input_layernorm.weight": (64,),
    "input_layernorm.bias": (64,),
    "self_attention.linear_qkv.weight": (192, 64),
    "self_attention.linear_qkv.bias": (192,),
    "self_attention.linear_proj.weight": (64, 64),
    "self_attention.linear_proj.bias": (64,),
    "pre_mlp_layernorm.weight": (64,),
    "pre_mlp_layernorm.bias": (64,),
    "mlp.linear_fc1.weight": (256, 64),
    "mlp.linear_fc1.bias": (256,),
    "mlp.linear_fc2.weight": (64, 256),
    "mlp.linear_fc2.bias": (64,),
}
_OTHER = {
    "embedding.word_embeddings.weight": (384, 64),
    "embedding.position_embeddings.weight": (128, 64),
    "decoder.final_layernorm.weight": (64,),
    "decoder.final_layernorm.bias": (64,),
}
_STATES = ("fp32_param", "exp_avg", "exp_avg_sq")


def _quickstart_blocks(rank: int):
    """(key, data, global offset, global shape, replica id) of every model block, as rank
    ``rank`` of 2 DP ranks holds it (both hold everything; rank 0 the main replica)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for name, shape in _LAYER.items():
        for layer in range(2):
            data = torch.randn(*shape, generator=g)
            offset = (layer,) + (0,) * len(shape)
            out.append((f"decoder.layers.{name}", data, offset, (2,) + shape, rank))
    for name, shape in _OTHER.items():
        out.append((name, torch.randn(*shape, generator=g), (0,) * len(shape), shape, rank))
    return out


def _digest_fn(blocks, states, world):
    """The resume proof's digest of ``blocks`` (model) and ``states`` (per block: the optimizer
    state tensors by name): block sums on the main replica, then its exchange."""
    from megatron.integrity.digest import state as sd
    from megatron.training_ext import resume_proof as rp

    exchange = rp.DigestExchange()

    def digest(combine=exchange.exchange, kernel="auto"):
        acc = rp.PartialDigest()
        with rp.no_torch_function():  # as the resume proof reads them
            for i, (key, data, goff, gshape, replica) in enumerate(blocks):
                if replica != 0:
                    continue
                acc.add(key, sd.block_sum(data, goff, gshape, kernel), gshape, data.dtype, "model")
                lshape = (1,) * (len(gshape) - data.dim()) + tuple(data.shape)
                for name, value in states[i].items():
                    v = sd.range_sum(
                        data, 0, data.numel(), lshape, goff, gshape, values=value, kernel=kernel
                    )
                    acc.add(f"optimizer.state.{name}.{key}", v, gshape, value.dtype, "optimizer")
        mine = (acc.sums, acc.meta, acc.skipped, {"torch": "0" * 16}, {"optimizer_step": []}, None)
        sums, meta, *_ = combine(mine)
        out = {}
        for key, parts in sums.items():
            numel = 1
            for d in meta[key][0]:
                numel *= d
            out[key] = sd.finish(parts, numel)
        return out

    def gathering():  # the first digest of a process: all_gather_object
        return digest(exchange.gather_all)

    return digest, gathering


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
    from megatron.integrity.digest import state as sd
    from megatron.training_ext import persistent_tier

    runtime.activate()
    logging.disable(logging.INFO)
    sd.warm_up()
    has_numba = importlib.util.find_spec("numba") is not None  # its scalar form can be timed
    device = "cuda" if args.cuda else "cpu"
    results = {}
    for config in args.configs:
        times = {op: [] for op in OPS}
        if config == "256mb":
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
            blocks = [
                (sh.key, sh.data, sh.global_offset, sh.global_shape, 0) for sh in state.values()
            ]
            digest, gathering = _digest_fn(blocks, [{} for _ in blocks], world)
            persistent_tier.install(ap.Namespace())

            def save(d, state=state):
                dist_checkpointing.save(state, d)

            def load(d, state=state):
                target = {k: t.without_data() for k, t in state.items()}
                for k, t in target.items():
                    t.data = torch.empty_like(state[k].data)
                dist.barrier()
                t0 = time.perf_counter()
                dist_checkpointing.load(target, d)
                return time.perf_counter() - t0

        else:
            blocks = _quickstart_blocks(rank)
            g = torch.Generator().manual_seed(1)
            states = [{n: torch.randn(b[1].numel(), generator=g) for n in _STATES} for b in blocks]
            digest, gathering = _digest_fn(blocks, states, world)
            save = _local_save(rank, world, blocks, states, os.path.join(args.dir, "local"))
            load = None
        for rep in range(-1, args.reps):
            d = os.path.join(args.dir, config, f"iter_{rep + 1:07d}")
            if rank == 0:
                shutil.rmtree(d, ignore_errors=True)
                os.makedirs(d)
            dist.barrier()
            t0 = time.perf_counter()
            gathering()
            t_gather = slowest(time.perf_counter() - t0)
            t0 = time.perf_counter()
            digest()
            t_digest = slowest(time.perf_counter() - t0)
            if config == "256mb" and has_numba:  # the kernel's form for AVX2 hosts
                t0 = time.perf_counter()
                digest(kernel="scalar")
                t_scalar = slowest(time.perf_counter() - t0)
            dist.barrier()
            t0 = time.perf_counter()
            save(d if config == "256mb" else rep + 2)
            t_save = slowest(time.perf_counter() - t0)
            t_load = slowest(load(d)) if load else None
            if rep >= 0:
                times["digest"].append(t_digest)
                times["digest, gathering exchange"].append(t_gather)
                if config == "256mb" and has_numba:
                    times["digest, scalar kernel"].append(t_scalar)
                times["save"].append(t_save)
                if t_load is not None:
                    times["load"].append(t_load)
            dist.barrier()
            if rank == 0:
                shutil.rmtree(d, ignore_errors=True)
        if config == "256mb":
            persistent_tier.uninstall()
        results[config] = times
    if rank == 0:
        out.put(results)
    dist.destroy_process_group()


def _local_save(rank, world, blocks, states, root):
    """A save of the model blocks and their optimizer state as a local checkpoint (the validated
    local tier, replicated to the other ranks), as ``--non-persistent-ckpt-type local`` saves."""
    import argparse as ap

    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict
    from nvidia_resiliency_ext.checkpointing.local.replication import strategies

    from megatron.fixes.replication import FIX as replication_fix
    from megatron.training_ext import local_tier as lt

    replication_fix.apply()
    strategy = strategies.CliqueReplicationStrategy.from_replication_params(1, world)
    lt.install(
        ap.Namespace(
            non_persistent_ckpt_type="local",
            local_tier_validation=True,
            local_tier_nan_window=0,
            seed=1234,
            world_size=world,
        )
    )

    def save(iteration):
        state = {}
        for i, (key, data, goff, gshape, _replica) in enumerate(blocks):
            layer = f".{goff[0]}" if len(gshape) > data.dim() else ""
            tensors = {"": data, **{f"optimizer.{n}.": v for n, v in states[i].items()}}
            for prefix, t in tensors.items():
                name = f"{prefix}{key}{layer}"
                state[name] = ShardedTensor.from_rank_offsets(name, t.reshape(-1), (0, rank, world))
        tasd = MCoreTensorAwareStateDict.from_state_dict(state, algo="fully_parallel")[0]
        lt.ValidatedLocalCheckpointManager(root, repl_strategy=strategy).save(tasd, iteration)

    return save


def _fmt(v) -> str:
    return f"{statistics.median(v):.4f} (min {min(v):.4f})" if v else ""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    p.add_argument("--mb", type=float, default=256, help="256mb: MB of fp32 state per rank")
    p.add_argument("--tensors", type=int, default=32, help="256mb: tensors per rank")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--cuda", action="store_true", help="256mb: state on the GPU (needs CUDA)")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = p.parse_args(argv)
    if "quickstart" in args.configs and args.world != 2:
        p.error("the quickstart configuration is the quick start's 2 ranks: --world 2")
    tmp = None
    if args.dir is None:
        tmp = args.dir = tempfile.mkdtemp(prefix="bench_state_digest_")
    results = run_workers(_worker, args.world, args)
    if tmp:
        shutil.rmtree(tmp, ignore_errors=True)
    if results is None:
        return 1
    print(
        f"{args.world} gloo ranks, {args.reps} interleaved reps; slowest rank, seconds, median "
        f"(min); target: digest <= 10% of the save"
    )
    print(
        "| state per rank | digest | digest, gathering exchange | digest, scalar kernel | save "
        "| load | digest / save |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    names = {
        "256mb": f"{args.mb:g} MB fp32, {args.tensors} TP-sharded tensors, torch_dist save",
        "quickstart": "the quick start's model (64 keys, 112 blocks), local save",
    }
    for config, times in results.items():
        ratio = statistics.median(times["digest"]) / statistics.median(times["save"])
        best = min(times["digest"]) / min(times["save"])
        print(
            f"| {names[config]} | {_fmt(times['digest'])} | "
            f"{_fmt(times['digest, gathering exchange'])} | "
            f"{_fmt(times['digest, scalar kernel'])} | {_fmt(times['save'])} | "
            f"{_fmt(times['load'])} | {ratio:.1%} (mins: {best:.1%}) |"
        )
    if "256mb" in results:
        med = statistics.median(results["256mb"]["digest"])
        print(f"\ndigest rate (256mb): {args.mb / med:.0f} MB/s per rank")
    return 0


if __name__ == "__main__":
    sys.exit(main())
