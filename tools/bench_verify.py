"""Throughput of the checkpoint verifier (``tools/verify_checkpoint.py``) against ``cat`` as the
I/O ceiling.

Usage::

    python tools/bench_verify.py [--size-gb 2] [--dir /tmp] [--world 2] [--hidden 2048] [--keep]

1. Generates, in the real formats, a local checkpoint of iteration 10 of ``--world`` ranks with
   replication factor 2 (every rank's file stored by two ranks: ``--size-gb`` GB of local files in
   all, primaries + replicas) and the persistent ``torch_dist`` checkpoint of the same state
   (``--size-gb / 2`` GB, written with megatron-core's ``dist_checkpointing.save`` and its
   ``integrity.json``). The model state is a GPT-like stack of layers (bf16 ``linear_qkv``,
   ``linear_proj``, ``linear_fc1``, ``linear_fc2`` weights with biases and norms, layer-stacked
   ShardedTensors); layer ``l`` belongs to rank ``l % world``. Local files are
   ``MCoreTensorAwareStateDict`` s with the replication fix's checksum record, saved with
   ``torch.save`` as NVRx's ``LocalCheckpointManager`` does.
2. Measures, cold (page cache dropped: ``sync; echo 3 > /proc/sys/vm/drop_caches``, needs root) and
   warm, the time to:

   * ``cat`` every file of both checkpoints to ``/dev/null``: one ``cat`` (``cat x1``) and one per
     verifier process over half the files each (``cat x2``);
   * verify (local + persistent with the default checks: every tensor bitwise, stored checksums,
     NaN/Inf, objects, coverage) with 1 process (this one) and with 2 processes (a gloo group
     started once). The time is ``report.timing.wall_s`` of ``verify_checkpoint`` (rank 0 for 2
     processes: includes gathering the results), i.e. without interpreter / import start-up.

   Variants run interleaved, ``--reps`` times; the median is reported (the machines these run on
   are shared, single runs vary a lot).

   GB/s = (local + persistent file bytes) / time (10^9 bytes); "% of ceiling" = cold verifier
   throughput / cold ``cat`` throughput with the same number of streams (target: >= 70%).
3. Prints a table and deletes the generated files (unless ``--keep``).

If dropping the page cache is not permitted the cold rows are skipped and the table says so.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from argparse import Namespace
from pathlib import Path

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

ITERATION = 10


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------
# Generation
# ---------------------------------------------------------------------------------------------


def _layer_shapes(h: int):
    """(name, per-layer shape) of a GPT layer with hidden size h (ffn 4h)."""
    return [
        ("self_attention.linear_qkv.weight", (3 * h, h)),
        ("self_attention.linear_qkv.bias", (3 * h,)),
        ("self_attention.linear_qkv.layer_norm_weight", (h,)),
        ("self_attention.linear_proj.weight", (h, h)),
        ("self_attention.linear_proj.bias", (h,)),
        ("mlp.linear_fc1.weight", (4 * h, h)),
        ("mlp.linear_fc1.bias", (4 * h,)),
        ("mlp.linear_fc1.layer_norm_weight", (h,)),
        ("mlp.linear_fc2.weight", (h, 4 * h)),
        ("mlp.linear_fc2.bias", (h,)),
    ]


def generate(root: Path, size_gb: float, world: int, hidden: int, seed: int = 0) -> dict:
    """Write ``root/local`` and ``root/ckpt/iter_0000010``; returns sizes and counts."""
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict

    from megatron.integrity.checksum import tensor as ck

    factor = min(2, world)
    dtype = torch.bfloat16
    shapes = _layer_shapes(hidden)
    per_layer = sum(torch.Size(s).numel() for _, s in shapes) * 2
    layers = max(world, round(size_gb * 1e9 / factor / per_layer))
    gen = torch.Generator().manual_seed(seed)
    # owner -> {name: ShardedTensor}
    owned = {r: {} for r in range(world)}
    for layer in range(layers):
        r = layer % world
        for name, shape in shapes:
            data = torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)
            key = f"decoder.layers.{name}"
            owned[r][f"{key}.{layer}"] = ShardedTensor.from_rank_offsets(
                key, data, (0, layer, layers), prepend_axis_num=1
            )
    args = Namespace(
        world_size=world, replication=factor > 1, replication_factor=factor, replication_jump=1
    )
    local = root / "local"
    for r in range(world):
        sd = MCoreTensorAwareStateDict(
            common={"iteration": ITERATION, "args": args}, sharded_state_dict=owned[r]
        )
        entries = [
            ck.make_entry(i, sh.key, sh.data, global_offset=sh.global_offset)
            for i, sh in enumerate(sd._sharded_tensors)
        ]
        ck.attach_record(sd, ck.make_record(r, entries))
        for j in range(factor):
            holder = (r + j) % world
            d = local / str(holder)
            d.mkdir(parents=True, exist_ok=True)
            with open(d / f"iter_{ITERATION:07d}_{r}_local.pt", "wb") as f:
                torch.save(sd, f)
    # persistent: one gloo process saving every shard (chunks == the local shards, as in real runs)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1"
    )
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        ckpt = root / "ckpt" / f"iter_{ITERATION:07d}"
        ckpt.mkdir(parents=True)
        flat = {f"{r}.{k}": v for r in range(world) for k, v in owned[r].items()}
        flat["iteration"] = ITERATION
        # megatron-core's torch_dist writer uses torch.cuda; without a GPU run it on this fork's
        # CPU backend
        cpu = None
        if not torch.cuda.is_available():
            from megatron.cpu import runtime as cpu

            cpu.activate()
        try:
            dist_checkpointing.save(flat, str(ckpt), verify_integrity=True)
        finally:
            if cpu is not None:
                cpu.deactivate()
        (root / "ckpt" / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
    finally:
        dist.destroy_process_group()
    files = sorted(str(p) for p in root.rglob("*") if p.is_file())
    return {
        "layers": layers,
        "files": files,
        "bytes": sum(os.path.getsize(f) for f in files),
        "local_bytes": sum(os.path.getsize(p) for p in local.rglob("*") if p.is_file()),
    }


# ---------------------------------------------------------------------------------------------
# Measurements
# ---------------------------------------------------------------------------------------------


def drop_caches() -> bool:
    """``sync; echo 3 > /proc/sys/vm/drop_caches``; False if not permitted."""
    try:
        subprocess.run(["sync"], check=True)
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def time_cat(files, streams: int) -> float:
    """Wall time of ``streams`` concurrent ``cat`` s over ``files`` (split by size) to /dev/null."""
    buckets = [[] for _ in range(streams)]
    load = [0] * streams
    for f in sorted(files, key=lambda f: -os.path.getsize(f)):
        i = load.index(min(load))
        buckets[i].append(f)
        load[i] += os.path.getsize(f)
    t = time.perf_counter()
    procs = [subprocess.Popen(["cat", *b], stdout=subprocess.DEVNULL) for b in buckets if b]
    for p in procs:
        if p.wait() != 0:
            raise RuntimeError("cat failed")
    return time.perf_counter() - t


def _verify_worker(rank: int, world: int, port: int, root: str, conn) -> None:
    """A verifier process of the 2-process group: initialises gloo once, then verifies on
    request."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world)
    )
    import torch.distributed as dist

    from megatron.verify import verify_checkpoint

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        conn.send("ready")
        while conn.recv() is not None:
            rep = verify_checkpoint(f"{root}/local", f"{root}/ckpt", group=dist.group.WORLD)
            conn.send((rep.timing["wall_s"], rep.ok))
    finally:
        dist.destroy_process_group()


class VerifyGroup:
    """``nproc`` verifier processes (gloo), started once; :meth:`run` verifies once and returns
    (rank 0's ``report.timing.wall_s``, ``report.ok``)."""

    def __init__(self, root: Path, nproc: int):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        port = _free_port()
        self.conns, self.procs = [], []
        for r in range(nproc):
            a, b = ctx.Pipe()
            p = ctx.Process(target=_verify_worker, args=(r, nproc, port, str(root), b), daemon=True)
            p.start()
            self.conns.append(a)
            self.procs.append(p)
        for c in self.conns:
            if c.recv() != "ready":
                raise RuntimeError("verifier process failed to start")

    def run(self) -> tuple:
        for c in self.conns:
            c.send("go")
        out = [c.recv() for c in self.conns]
        return out[0]

    def close(self) -> None:
        for c in self.conns:
            c.send(None)
        for p in self.procs:
            p.join(60)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--size-gb",
        type=float,
        default=2.0,
        help="local checkpoint size (primaries + replicas), GB",
    )
    p.add_argument("--dir", default="/tmp", help="where to generate (needs ~1.5x --size-gb free)")
    p.add_argument("--world", type=int, default=2, help="ranks of the simulated run (files)")
    p.add_argument("--hidden", type=int, default=2048, help="hidden size of the simulated layers")
    p.add_argument("--reps", type=int, default=3, help="repetitions (median reported)")
    p.add_argument("--keep", action="store_true", help="keep the generated checkpoint")
    a = p.parse_args(argv)

    from megatron.verify.report import format_table

    need = a.size_gb * 1.5e9 * 1.1
    free = shutil.disk_usage(a.dir).free
    if free < need:
        print(
            f"error: {a.dir} has {free / 1e9:.1f} GB free, the benchmark needs {need / 1e9:.1f} GB",
            file=sys.stderr,
        )
        return 2
    root = Path(tempfile.mkdtemp(prefix="bench_verify_", dir=a.dir))
    group = None
    try:
        t = time.perf_counter()
        info = generate(root, a.size_gb, a.world, a.hidden)
        total = info["bytes"]
        print(
            f"generated {len(info['files'])} files, {total / 1e9:.2f} GB "
            f"({info['local_bytes'] / 1e9:.2f} GB local, "
            f"{(total - info['local_bytes']) / 1e9:.2f} GB persistent, {info['layers']} layers, "
            f"world {a.world}) "
            f"in {time.perf_counter() - t:.0f} s",
            flush=True,
        )
        from megatron.verify import verify_checkpoint

        group = VerifyGroup(root, 2)
        can_drop = drop_caches()
        variants = {
            "cat x1": lambda: (time_cat(info["files"], 1), None),
            "cat x2": lambda: (time_cat(info["files"], 2), None),
            "verify 1 proc": lambda: (lambda r: (r.timing["wall_s"], r.ok))(
                verify_checkpoint(root / "local", root / "ckpt")
            ),
            "verify 2 procs": group.run,
        }
        times: dict = {}
        oks: dict = {}
        caches = ("cold", "warm") if can_drop else ("warm",)
        for rep in range(
            a.reps
        ):  # interleaved repetitions: slow phases of a shared machine hit all variants
            for cache in caches:
                for name, fn in variants.items():
                    if cache == "cold":
                        drop_caches()
                    else:
                        time_cat(info["files"], 1)  # everything in the page cache
                    secs, ok = fn()
                    times.setdefault((cache, name), []).append(secs)
                    if ok is not None:
                        oks.setdefault((cache, name), []).append(ok)
                    print(f"  rep {rep + 1}/{a.reps} {cache} {name:15s} {secs:6.2f} s", flush=True)
        rows = []
        for cache in caches:
            for name in variants:
                ts = times[(cache, name)]
                med = statistics.median(ts)
                ok = oks.get((cache, name))
                pct = "-"
                if cache == "cold" and name.startswith("verify"):
                    ref = statistics.median(
                        times[("cold", "cat x1" if "1 proc" in name else "cat x2")]
                    )
                    pct = f"{100 * ref / med:.0f}%"
                rows.append(
                    [
                        name,
                        cache,
                        f"{med:.2f}",
                        f"{min(ts):.2f}",
                        f"{max(ts):.2f}",
                        f"{total / med / 1e9:.3f}",
                        "-" if ok is None else ("OK" if all(ok) else "FAILED"),
                        pct,
                    ]
                )
        print()
        print(
            f"Verifier throughput: {total / 1e9:.2f} GB (local + persistent files), "
            f"{os.cpu_count()} CPUs, "
            f"median of {a.reps} interleaved runs; GB/s = bytes / median time"
            + (
                ""
                if can_drop
                else "; page cache could NOT be dropped (not permitted): warm figures only"
            )
        )
        print(
            format_table(
                (
                    "variant",
                    "cache",
                    "median s",
                    "min s",
                    "max s",
                    "GB/s",
                    "report",
                    "% of cat, same streams (cold)",
                ),
                rows,
            )
        )
        return 0
    finally:
        if group is not None:
            group.close()
        if a.keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
