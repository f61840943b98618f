"""What the gloo benchmarks under ``tools/`` share: a free port, the slowest rank's time, and
running ``world`` spawned worker processes that report one result through a queue."""

from __future__ import annotations

import socket
import sys
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def slowest(seconds: float) -> float:
    """The largest of every rank's ``seconds`` (collective over the world)."""
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def run_workers(worker: Callable, world: int, args: Any) -> Optional[Any]:
    """Run ``worker(rank, world, port, args, out)`` in ``world`` spawned processes and return what
    one of them put on ``out``; None (with a line on stderr) when a worker failed or none did."""
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, world, port, args, out)) for r in range(world)]
    for pr in procs:
        pr.start()
    for pr in procs:
        pr.join()
    if any(pr.exitcode for pr in procs) or out.empty():
        print("benchmark failed", file=sys.stderr)
        return None
    return out.get()
