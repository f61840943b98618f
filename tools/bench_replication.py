"""Benchmark of the local-checkpoint replication fix against upstream NVRx, on gloo processes.

Usage::

    python tools/bench_replication.py [--size-mb 64] [--reps 5] [--world 2] [--device cpu|cuda]
    python tools/bench_replication.py --hash-only [--device cuda]    # hash throughput table only

Each rank holds ``--size-mb`` MiB of float32 tensors in a real ``MCoreTensorAwareStateDict``.
All variants run in one process group, interleaved (every repetition runs every variant once, in
turn) and the median over repetitions is reported; a variant's time is the slowest rank's.

Variants:
  upstream/64        NVRx 0.7.0 ``CliqueReplicationStrategy.replicate`` (unpatched), 64 tensors
  fixed/64           ``FixedCliqueReplicationStrategy.replicate``, same tensors
  fixed-nocsum/64    fixed, with the checksum function replaced by a constant (its wall-clock cost)
  fixed/1024         fixed, the same bytes in 1024 tensors
  fixed-nocsum/1024  fixed, 1024 tensors, checksums replaced by a constant (what bounds 1024/64
                     without them)
  pack/1024          the owner's packing copy alone: ``memmove`` of the 1024 tensors into 4 MiB
                     staging buckets as ``replicate`` packs them, both ranks at once (the memory
                     bandwidth the 1024-tensor path needs beyond the 64-tensor one)
  upstream/1024      upstream, 1024 tensors (per-tensor overhead reference)
  bcast/64           plain per-tensor ``dist.broadcast`` of the same bytes from every rank
                     (transport reference: no state dicts, no metadata)
  upstream/8         upstream, the same bytes in 8 tensors (each sent in several messages)
  fixed/8            fixed, 8 tensors: checksums computed chunk by chunk as the messages go out
                     and land
  fixed/quantized    fixed, 64 quantized tensors (the Transformer-Engine-like float8 test double
                     of tests/unit_tests/fixes/replication_doubles.py, nominal dtype bfloat16,
                     --size-mb / 4 nominal bytes): bytes sent vs primary bytes; its time is
                     dominated by the double's CPU dequantize, not by the transport

``--device cuda``: ranks on separate GPUs over NCCL (``--world`` capped at the GPU count; with one
GPU a one-rank NCCL group: the device-side hashing and host-copy path of ``replicate`` within one
process); the quantized variant (its test double dequantizes on the CPU) and pack/1024 (a host
copy) are left out.

Before the replicate table, a hash throughput table (median of interleaved repetitions): every
checksum candidate on chunks of several sizes (cache-sized and larger than the last-level cache)
against a copy of the same bytes (``memmove`` on CPU, a device-to-device copy on CUDA). CPU:
xxh3_64 (xxhash), crc32c and blake3 (when installed), sha256 (hashlib), pmix64 in torch ops; CUDA:
pmix64's Triton kernel and torch ops.

Targets: CPU fixed/1024 <= 1.15 x fixed/64; fixed/64 <= 1.05 x upstream/64; fixed/1024 <= 0.6 x
upstream/1024; CUDA checksum throughput >= 50% of the device-to-device copy's.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _median_time(fn, reps, sync=lambda: None):
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def hash_table(device: str, sizes_mib, reps: int) -> list:
    """Rows ``(algorithm, size MiB, GB/s, GB/s of a copy of the same bytes)``, interleaved."""
    sys.path.insert(0, _REPO)
    from megatron.integrity.checksum import device as dh

    cands = {}
    if device == "cpu":
        import xxhash

        cands["xxh3_64 (xxhash)"] = lambda t, mv: xxhash.xxh3_64_intdigest(mv)
        try:
            import crc32c

            cands["crc32c (crc32c)"] = lambda t, mv: crc32c.crc32c(mv)
        except ImportError:
            pass
        try:
            import blake3

            cands["blake3 (blake3, 1 thread)"] = lambda t, mv: blake3.blake3(mv).digest()
        except ImportError:
            pass
        cands["sha256 (hashlib)"] = lambda t, mv: hashlib.sha256(mv).digest()
        cands["pmix64 (torch ops)"] = lambda t, mv: dh.pmix64_tensor(t, "torch")
        sync = lambda: None
    else:
        cands["pmix64 (Triton)"] = lambda t, mv: dh.pmix64_tensor(t, "triton")
        cands["pmix64 (torch ops)"] = lambda t, mv: dh.pmix64_tensor(t, "torch")
        sync = torch.cuda.synchronize
    rows = []
    for mib in sizes_mib:
        n = int(mib * 2**20)
        src = torch.randint(0, 256, (n,), dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        mv = memoryview(src.numpy()) if device == "cpu" else None
        if device == "cpu":
            copy = lambda: ctypes.memmove(dst.data_ptr(), src.data_ptr(), n)  # noqa: B023 (called in this iteration)
        else:
            copy = lambda: dst.copy_(src)  # noqa: B023 (called in this iteration)
        # repeat small chunks so each timing covers >= 64 MiB (cache-resident chunk, hot loop)
        inner = max(1, int(64 // mib))
        timings = {name: [] for name in ["copy", *cands]}
        for _ in range(reps + 1):
            for name, f in [("copy", lambda t, m: copy()), *cands.items()]:  # noqa: B023 (called in this iteration)
                timings[name].append(
                    _median_time(lambda: [f(src, mv) for _ in range(inner)], 1, sync) / inner  # noqa: B023 (called in this iteration)
                )
        med = {k: statistics.median(v[1:]) for k, v in timings.items()}
        for name in cands:
            rows.append((name, mib, n / med[name] / 1e9, n / med["copy"] / 1e9))
    return rows


def print_hash_table(device: str, rows) -> None:
    print(
        f"\nchecksum throughput on {device} (one thread on CPU), median, vs a copy of the same "
        f"bytes ({'memmove' if device == 'cpu' else 'device-to-device copy'})\n"
    )
    print(f"{'algorithm':<28}{'chunk [MiB]':>12}{'GB/s':>9}{'copy GB/s':>11}{'hash/copy':>11}")
    for name, mib, gbps, copy in rows:
        print(f"{name:<28}{mib:>12g}{gbps:>9.2f}{copy:>11.2f}{gbps / copy:>11.2f}")


def _tasd(rank, world, tensors):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict

    sd = {
        k: ShardedTensor.from_rank_offsets(k, t, (0, rank, world), prepend_axis_num=1)
        for k, t in tensors.items()
    }
    return MCoreTensorAwareStateDict.from_state_dict(sd, algo="atomic")[0]


def _tensors(rank, total_bytes, count, quantized=False, device="cpu"):
    g = torch.Generator().manual_seed(rank * 1000 + count)
    n = total_bytes // 4 // count
    if not quantized:
        return {
            f"layer{i:04d}.weight": torch.randn(n, generator=g).to(device) for i in range(count)
        }
    sys.path.insert(0, os.path.join(_REPO, "tests", "unit_tests", "fixes"))
    import replication_doubles as D

    n = total_bytes // 2 // count  # nominal bfloat16
    return {
        f"layer{i:04d}.weight": D.quantize(torch.randn(n, generator=g).to(torch.bfloat16))
        for i in range(count)
    }


def _worker(rank, world, port, args, out_q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    sys.path.insert(0, _REPO)
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    from megatron.fixes import replication as R
    from megatron.integrity.checksum import tensor as ck

    total = args.size_mb * 1024 * 1024
    group = dist.new_group(list(range(world)))
    upstream = R.UpstreamClique(group, target_device="cpu")
    fixed = R.FixedCliqueReplicationStrategy(group, target_device="cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    data = {
        64: _tensors(rank, total, 64, device=args.device),
        1024: _tensors(rank, total, 1024, device=args.device),
        8: _tensors(rank, total, 8, device=args.device),
    }
    if not cuda:
        data["q"] = _tensors(rank, max(total // 4, 1 << 20), 64, quantized=True)
    csum_time = [0.0]
    cpu = [0.0, 0.0]  # process and main-thread CPU time at the start of a variant
    sent = [0]
    real_csum, real_bcast = R.transport._cpu_checksum, R.transport._broadcast

    def timed_csum(ptr, nbytes):
        t0 = time.perf_counter()
        try:
            return real_csum(ptr, nbytes)
        finally:
            csum_time[0] += time.perf_counter() - t0

    def counting_bcast(buf, src, grp):
        if src == rank:
            sent[0] += buf.numel()
        return real_bcast(buf, src, grp)

    def run_replicate(strategy_fn, key):
        tasd = _tasd(rank, world, data[key])
        sync()
        dist.barrier(group)
        cpu[0], cpu[1] = time.process_time(), time.thread_time()
        t0 = time.perf_counter()
        replicas, _ = strategy_fn(tasd)
        sync()
        return time.perf_counter() - t0, replicas

    def v_upstream(key):
        return run_replicate(lambda sd: R.UPSTREAM_REPLICATE(upstream, sd, "id"), key)

    def v_fixed(key):
        return run_replicate(lambda sd: R.fixed_replicate(fixed, sd, "id"), key)

    real_device_csum = ck.tensor_checksum_on_device

    def v_fixed_nocsum(key):
        R.transport._cpu_checksum = lambda ptr, nbytes: 0
        ck.tensor_checksum_on_device = lambda t: torch.zeros((), dtype=torch.int64, device=t.device)
        try:
            return v_fixed(key)
        finally:
            R.transport._cpu_checksum = timed_csum
            ck.tensor_checksum_on_device = real_device_csum

    def v_pack(key):
        tensors = list(data[key].values())
        bucket = R.plan.DEFAULT_BUCKET_BYTES["cpu"]
        slots = [torch.empty(bucket, dtype=torch.uint8) for _ in range(2)]
        dist.barrier(group)
        cpu[0], cpu[1] = time.process_time(), time.thread_time()
        t0 = time.perf_counter()
        slot, pos = 0, 0
        for t in tensors:
            n = t.numel() * t.element_size()
            if pos + n > bucket:
                slot, pos = 1 - slot, 0
            ctypes.memmove(slots[slot].data_ptr() + pos, t.data_ptr(), n)
            pos += n
        return time.perf_counter() - t0, None

    def v_bcast(key):
        tensors = list(data[key].values())
        recv = [torch.empty_like(t) for t in tensors]
        sync()
        dist.barrier(group)
        cpu[0], cpu[1] = time.process_time(), time.thread_time()
        t0 = time.perf_counter()
        for src in range(world):
            for t, r in zip(tensors, recv):
                dist.broadcast(t if src == rank else r, src=src, group=group)
        sync()
        return time.perf_counter() - t0, None

    variants = [
        ("upstream/64", v_upstream, 64),
        ("fixed/64", v_fixed, 64),
        ("fixed-nocsum/64", v_fixed_nocsum, 64),
        ("fixed/1024", v_fixed, 1024),
        ("fixed-nocsum/1024", v_fixed_nocsum, 1024),
        ("upstream/1024", v_upstream, 1024),
        ("bcast/64", v_bcast, 64),
        ("upstream/8", v_upstream, 8),
        ("fixed/8", v_fixed, 8),
    ]
    if not cuda:
        variants.append(("pack/1024", v_pack, 1024))
        variants.append(("fixed/quantized", v_fixed, "q"))
    R.transport._cpu_checksum, R.transport._broadcast = timed_csum, counting_bcast
    times = {name: [] for name, _, _ in variants}
    cpus = {name: [] for name, _, _ in variants}
    main_cpus = {name: [] for name, _, _ in variants}
    shares = []
    q_sent = q_primary = q_payload = 0
    for rep in range(args.warmup + args.reps):
        for name, fn, key in variants:
            csum_time[0], sent[0] = 0.0, 0
            elapsed, replicas = fn(key)
            measured = torch.tensor(
                [
                    time.process_time() - cpu[0],
                    elapsed,
                    csum_time[0] / elapsed if elapsed else 0.0,
                    time.thread_time() - cpu[1],
                ],
                dtype=torch.float64,
                device=args.device,
            )
            dist.all_reduce(measured, op=dist.ReduceOp.MAX, group=group)
            cpu_used, slowest, share, main_used = measured.cpu()
            if rep >= args.warmup:
                times[name].append(slowest.item())
                cpus[name].append(cpu_used.item())
                main_cpus[name].append(main_used.item())
                if name == "fixed/64":
                    shares.append(share.item())
                if name == "fixed/quantized":
                    q_sent = sent[0]
                    own = replicas[rank]
                    q_primary = sum(t.nbytes for t in own.tensors)
                    q_payload = sum(
                        t._data.nbytes + t._scale_inv.nbytes for t in data["q"].values()
                    )
            del replicas
    if rank == 0:
        out_q.put(
            {
                "times": {k: statistics.median(v) for k, v in times.items()},
                "mins": {k: min(v) for k, v in times.items()},
                "cpu": {k: statistics.median(v) for k, v in cpus.items()},
                "main_cpu": {k: statistics.median(v) for k, v in main_cpus.items()},
                "all": times,
                "share": statistics.median(shares),
                "q_sent": q_sent,
                "q_primary": q_primary,
                "q_payload": q_payload,
            }
        )
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size-mb", type=int, default=64, help="MiB of tensors per rank (default 64)")
    p.add_argument("--reps", type=int, default=5, help="measured repetitions (median)")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured repetitions first")
    p.add_argument("--world", type=int, default=2, help="processes (one clique)")
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: gloo ranks; cuda: NCCL ranks on separate GPUs (default cpu)",
    )
    p.add_argument(
        "--hash-sizes",
        default="0.0625,1,4,256",
        help="chunk sizes of the hash table, MiB, comma-separated",
    )
    p.add_argument("--hash-only", action="store_true", help="print the hash throughput table only")
    args = p.parse_args(argv)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("--device cuda: no CUDA device", file=sys.stderr)
            return 2
        args.world = max(1, min(args.world, torch.cuda.device_count()))
    print_hash_table(
        args.device,
        hash_table(args.device, [float(x) for x in args.hash_sizes.split(",")], args.reps),
    )
    if args.hash_only:
        return 0

    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, args.world, port, args, q)) for r in range(args.world)
    ]
    for pr in procs:
        pr.start()
    for pr in procs:
        pr.join()
    if any(pr.exitcode != 0 for pr in procs) or q.empty():
        print("benchmark failed", [pr.exitcode for pr in procs], file=sys.stderr)
        return 1
    res = q.get()
    t = res["times"]
    mb = args.size_mb
    backend = "NCCL" if args.device == "cuda" else "gloo"
    print(
        f"\nreplicate(): {args.world} {backend} ranks, {mb} MiB per rank, median of {args.reps} "
        f"(interleaved, slowest rank), torch {torch.__version__}, {os.cpu_count()} CPUs\n"
    )
    print(
        f"{'variant':<18}{'median [s]':>11}{'min [s]':>9}{'CPU [s]':>9}{'main [s]':>9}"
        f"{'GB/s recv/rank':>16}"
        f"{'vs upstream/64':>16}"
    )
    for name, sec in t.items():
        gbps = mb * 2**20 * max(args.world - 1, 1) / sec / 1e9 if sec else float("nan")
        print(
            f"{name:<18}{sec:>11.3f}{res['mins'][name]:>9.3f}{res['cpu'][name]:>9.3f}"
            f"{res['main_cpu'][name]:>9.3f}{gbps:>16.2f}"
            f"{sec / t['upstream/64']:>16.3f}"
        )
    print(
        "(CPU: process CPU time, all threads incl. gloo's; main: CPU time of the thread that calls "
        "replicate; busiest rank, median)"
    )
    print()
    rows = [
        ("fixed/64 / upstream/64", t["fixed/64"] / t["upstream/64"], "<= 1.05"),
        ("  same, min times", res["mins"]["fixed/64"] / res["mins"]["upstream/64"], "(reference)"),
        ("fixed/1024 / fixed/64", t["fixed/1024"] / t["fixed/64"], "<= 1.15"),
        ("  same, CPU time", res["cpu"]["fixed/1024"] / res["cpu"]["fixed/64"], "(reference)"),
        ("  same, min times", res["mins"]["fixed/1024"] / res["mins"]["fixed/64"], "(reference)"),
        (
            "  same, checksums off (nocsum/1024 / nocsum/64)",
            t["fixed-nocsum/1024"] / t["fixed-nocsum/64"],
            "(reference)",
        ),
        ("fixed/1024 / upstream/1024", t["fixed/1024"] / t["upstream/1024"], "<= 0.6"),
        ("fixed/8 / upstream/8", t["fixed/8"] / t["upstream/8"], "(large tensors)"),
        ("upstream/1024 / upstream/64", t["upstream/1024"] / t["upstream/64"], "(reference)"),
        (
            "checksum wall cost (fixed - nocsum) / fixed",
            (t["fixed/64"] - t["fixed-nocsum/64"]) / t["fixed/64"],
            "<= 0.10",
        ),
        ("time inside checksum calls / fixed (slowest rank)", res["share"], "(overlapped)"),
        ("fixed/64 / bcast/64", t["fixed/64"] / t["bcast/64"], "(transport ref)"),
    ]
    if args.device == "cpu":
        rows += [
            (
                "packing copy alone: pack/1024 / fixed/64",
                t["pack/1024"] / t["fixed/64"],
                "(bound)",
            ),
            (
                "quantized: bytes sent / primary bytes",
                res["q_sent"] / max(res["q_primary"], 1),
                "== 1",
            ),
            (
                "quantized: primary bytes / quantized payload",
                res["q_primary"] / max(res["q_payload"], 1),
                "(dequantized)",
            ),
        ]
    print(f"{'ratio (medians)':<50}{'value':>8}  target")
    for name, val, target in rows:
        print(f"{name:<50}{val:>8.3f}  {target}")
    print(
        "\nper-rep times: "
        + "; ".join(f"{k}: " + ",".join(f"{x:.3f}" for x in v) for k, v in res["all"].items())
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
