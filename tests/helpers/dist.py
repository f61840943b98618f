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

The processes come from ``multiprocessing``'s forkserver, started once per test session with torch,
megatron-core and megatron-training imported (:data:`FORKSERVER_PRELOAD`; imported only, no fix
applied and no CPU backend activated): a rank no longer pays those imports (megatron-training,
with ModelOpt and SciPy, is what ``megatron.fixes.apply()`` imports: 2.3 s of CPU per rank on
the 2-core test machine, for most of this suite's ranks). Each rank gets the caller's environment
as it was at the call (the forkserver's own is older) and torch's default number of threads (the
forkserver runs single-threaded: ``OMP_NUM_THREADS=1``).

:func:`run_python` runs a Python script (``python -c CODE`` or ``python PATH``) in one such process,
without a process group, and returns what ``subprocess.run(..., capture_output=True, text=True)``
returns. For tests that need a process of their own (process-global state: the CPU backend, the
fixes, the registry) but nothing of a fresh interpreter; a test about the interpreter itself
(import side effects, exit at finalization, signals, a real launcher or CLI) starts a real one.
"""

from __future__ import annotations

import atexit
import multiprocessing.forkserver
import os
import runpy
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
import types

import torch.multiprocessing as mp

#: Imported once by the forkserver; each rank starts with them in place. ``megatron.training``
#: brings ModelOpt, SciPy and the rest of what ``megatron.fixes.apply()`` imports (it also sets the
#: root logger to INFO with upstream's handler, as importing it in the rank would).
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "megatron.core", "megatron.training"]
#: Threads of OpenMP and OpenBLAS in the forkserver: 1, so it forks with no thread pool alive.
_SINGLE_THREADED = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, killed and not reaped yet, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _set_env(env: dict) -> None:
    """The caller's environment, and torch's default number of threads unless it sets them."""
    import torch

    os.environ.clear()
    os.environ.update(env)
    if "OMP_NUM_THREADS" not in env:
        torch.set_num_threads(len(os.sched_getaffinity(0)))


def _worker(rank, world_size, port, env, fn, args, errors):
    import torch.distributed as dist

    _set_env(env)
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
        except Exception:  # noqa: BLE001 - teardown: a broken group is gone anyway
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


def _script_worker(code, path, argv, env, cwd, out_path, err_path):
    """Run a script as ``__main__`` the way ``python -c code`` / ``python path`` does: its
    ``sys.argv`` and ``sys.path[0]``, stdout and stderr (file descriptors 1 and 2) to files, an
    uncaught exception printed by ``sys.excepthook`` (exit status 1), ``SystemExit`` as the
    interpreter maps it; then non-daemon threads joined and the ``atexit`` handlers run, and
    ``os._exit`` (no interpreter finalization, as a passing rank of :func:`_worker`)."""
    _set_env(env)
    if cwd is not None:
        os.chdir(cwd)
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, name in ((1, out_path), (2, err_path)):
        f = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(f, fd)
        os.close(f)
    sys.argv = [path if path is not None else "-c", *argv]
    status = 0
    try:
        if path is not None:
            sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
            runpy.run_path(path, run_name="__main__")
        else:
            sys.path.insert(0, "")
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(code, "<string>", "exec"), main.__dict__)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            status = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            status = 1
    except BaseException:  # noqa: BLE001 - a worker reports any failure to its parent
        kind, value, tb = sys.exc_info()
        first = tb  # the traceback from the script's own frame on, as the interpreter prints it
        while first is not None and first.tb_frame.f_code.co_filename in (__file__, runpy.__file__):
            first = first.tb_next
        sys.excepthook(kind, value, first or tb)
        status = 1
    threading._shutdown()  # what interpreter exit does first: join the non-daemon threads
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def run_python(
    code: str | None = None,
    *,
    path: str | os.PathLike | None = None,
    argv: tuple[str, ...] = (),
    cwd: str | os.PathLike | None = None,
    timeout: float = 300.0,
) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
    timeout=timeout)`` (or ``[sys.executable, path, *argv]``), run in a process forked from the
    forkserver (torch, megatron-core and megatron-training imported, nothing applied, no process
    group) instead of a fresh interpreter; the caller's environment as it is now.

    Raises:
        subprocess.TimeoutExpired: as ``subprocess.run`` does (the process is killed).
    """
    if (code is None) == (path is None):
        raise ValueError("give either code or path")
    ctx = _context()
    cmd = [sys.executable, *(["-c", code] if path is None else [str(path)]), *argv]
    with tempfile.TemporaryDirectory(prefix="run_python_") as d:
        out, err = os.path.join(d, "stdout"), os.path.join(d, "stderr")
        proc = ctx.Process(
            target=_script_worker,
            args=(
                code,
                None if path is None else str(path),
                tuple(argv),
                dict(os.environ),
                None if cwd is None else str(cwd),
                out,
                err,
            ),
        )
        proc.start()
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join()
            raise subprocess.TimeoutExpired(cmd, timeout)
        with open(out, errors="replace") as f_out, open(err, errors="replace") as f_err:
            return subprocess.CompletedProcess(cmd, proc.exitcode, f_out.read(), f_err.read())
