"""Run a test body on N gloo processes (CPU), each with its own free TCP port for rendezvous.

Usage::

    def body(rank, world_size, tmp_path):   # module-level, so it pickles
        ...assert...

    def test_x(tmp_path):
        run_distributed(body, 2, tmp_path)

A failure on any rank fails the test with that rank's traceback. ``body`` runs with
``torch.distributed`` initialised (backend gloo) and is torn down afterwards. A rank whose body
passed leaves through ``os._exit(0)`` after ``destroy_process_group()`` and the ``atexit``
handlers (so multiprocessing still reaps the rank's children; no barrier: a guard
scenario may leave a peer inside a collective that fails only once this process ends): gloo's
threads can otherwise abort the process during interpreter finalization (``terminate called
without an active exception``, exit code -6), which is torch's teardown, not the body's result.

The processes come from ``multiprocessing``'s forkserver, started once per test session with torch
and megatron-core imported (:data:`FORKSERVER_PRELOAD`): a rank no longer pays those imports.
Each rank gets the caller's environment as it was at the call (the forkserver's own is older) and
torch's default number of threads (the forkserver runs single-threaded: ``OMP_NUM_THREADS=1``).
"""

from __future__ import annotations

import atexit
import multiprocessing.forkserver
import os
import socket
import sys
import traceback

import torch.multiprocessing as mp

#: Imported once by the forkserver; each rank starts with them in place.
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "megatron.core"]
#: Threads of OpenMP and OpenBLAS in the forkserver: 1, so it forks with no thread pool alive.
_SINGLE_THREADED = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, env, fn, args, errors):
    import torch
    import torch.distributed as dist

    os.environ.clear()
    os.environ.update(env)
    if "OMP_NUM_THREADS" not in env:
        torch.set_num_threads(len(os.sched_getaffinity(0)))
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        try:
            dist.destroy_process_group()
        except Exception:
            pass
        raise
    dist.destroy_process_group()
    atexit._run_exitfuncs()  # what a normal exit runs (multiprocessing reaps its children, ...)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # then skip interpreter finalization, where gloo's threads can abort


def run_distributed(fn, world_size: int, *args, timeout: float = 300.0) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo processes.

    Raises:
        AssertionError: with the first failing rank's traceback.
    """
    ctx = _context()
    errors = ctx.SimpleQueue()
    port = free_port()
    env = dict(os.environ)
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, env, fn, args, errors))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
    if not errors.empty():
        rank, tb = errors.get()
        raise AssertionError(f"rank {rank} failed:\n{tb}")
    bad = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode != 0]
    assert not bad, f"processes exited abnormally (rank, exitcode): {bad}"


def _context():
    """The forkserver context, its server started (single-threaded, :data:`FORKSERVER_PRELOAD`
    imported) on first use."""
    ctx = mp.get_context("forkserver")
    if multiprocessing.forkserver._forkserver._forkserver_pid is None:
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
        saved = {k: os.environ.get(k) for k in _SINGLE_THREADED}
        os.environ.update(_SINGLE_THREADED)
        try:
            multiprocessing.forkserver.ensure_running()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    return ctx
