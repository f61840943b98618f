"""Test-only launcher that pays the imports once: a server process imports torch, megatron-core and
megatron-training (as ``pretrain_gpt.py`` does, fixes first) and, per launch, forks one child per
rank that runs the real entrypoint as ``__main__`` (``runpy``) with the environment ``torchrun``
gives a rank.

Why: a ``torchrun`` launch of ``pretrain_gpt.py`` costs 15-30 s on the 2-core test machine, most of
it importing upstream in every rank and finalizing the interpreter at exit; the functional tests
launch about a hundred times. Tests whose subject is the launcher itself (README commands,
``ft_launcher``, multi-node agents, SLURM) still use ``torchrun`` (``tests/README.md``).

What a rank sees, as under ``torchrun --nproc-per-node N`` (one node): ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``ROLE_*``, ``MASTER_ADDR``,
``MASTER_PORT``, ``TORCHELASTIC_*`` (``TORCHELASTIC_USE_AGENT_STORE=False``: rank 0 hosts the
store, there is no agent), ``OMP_NUM_THREADS=1`` with several ranks, its own session (the agent
signals process groups, as torchrun does), stdout and stderr to the launch's output file (shared by
the ranks, as torchrun's own stdout is), and on failure torchrun's ``ChildFailedError`` page,
formatted by torch's own code. A rank leaves with ``os._exit`` after what a normal exit runs
(non-daemon threads joined, ``atexit`` handlers), without the slow interpreter finalization.

Fork safety: the server and each launch's agent are single-threaded when they fork (checked before
every fork: one OS thread, no process group; the server runs with ``OMP_NUM_THREADS=1`` so neither
torch nor OpenBLAS starts a pool). A server is keyed by what its preload depends on: the CPU
backend and ``$MEGATRON_FIXES_DISABLE``.

    python -m tests.helpers.fastlaunch bench   # forked vs torchrun launch of the quick start model
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
#: Environment variables a server's preload depends on: a launch whose values differ gets its own
#: server (the fixes read ``$MEGATRON_FIXES_DISABLE`` when they are installed).
PRELOAD_ENV = ("MEGATRON_FIXES_DISABLE",)
#: Seconds torchrun gives the remaining ranks between SIGTERM and SIGKILL after a failure.
STOP_GRACE_S = 30.0
_POLL_S = 0.02


class ForkSafetyError(RuntimeError):
    """The process about to fork runs other threads or holds a process group."""


def fork_state() -> dict:
    """What makes a fork unsafe, read in this process: OS threads (``/proc/self/task``), Python
    threads, and whether a ``torch.distributed`` process group is initialised."""
    dist_initialized = False
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available():
        dist_initialized = bool(dist.is_initialized())
    return {
        "os_threads": len(os.listdir("/proc/self/task")),
        "python_threads": threading.active_count(),
        "process_group": dist_initialized,
    }


def check_fork_safe() -> dict:
    """:func:`fork_state`, raising :class:`ForkSafetyError` unless this process is alone (one OS
    thread, no process group)."""
    state = fork_state()
    if state["os_threads"] != 1 or state["python_threads"] != 1 or state["process_group"]:
        raise ForkSafetyError(f"refusing to fork: {state} (need 1 thread and no process group)")
    return state


# ------------------------------------------------------------------------------------------------
# server side
# ------------------------------------------------------------------------------------------------


def _preload(cpu: bool) -> None:
    """What ``pretrain_gpt.py`` runs before ``main()``, in its order: the fixes, the CPU backend,
    then upstream's modules (``import pretrain_gpt``, which as a module skips both)."""
    import megatron.fixes

    megatron.fixes.apply()
    if cpu:
        from megatron.cpu import runtime

        runtime.activate()
    sys.path.insert(0, str(REPO))
    import torch.distributed.elastic.multiprocessing.errors as _errors  # noqa: F401  (failure page)

    import pretrain_gpt  # noqa: F401

    # The resume proof's CPU kernel (numba): imported and compiled for every element width once
    # here instead of in every rank at its first checkpoint save or load.
    from megatron.integrity.digest import state as digest_state

    digest_state.warm_up()


def _captured_preload(cpu: bool) -> tuple[bytes, bytes]:
    """Run :func:`_preload` with fds 1 and 2 captured; returns what it printed to each (every rank
    prints it again at its start, as each torchrun rank prints its own)."""
    saved = os.dup(1), os.dup(2)
    files = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(files[0].fileno(), 1)
    os.dup2(files[1].fileno(), 2)
    try:
        _preload(cpu)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])
    out = []
    for f in files:
        f.seek(0)
        out.append(f.read())
        f.close()
    return out[0], out[1]


def _send(conn: socket.socket, msg: dict) -> None:
    conn.sendall((json.dumps(msg) + "\n").encode())


def _rank_env(base: dict, rank: int, nproc: int, port: int, error_dir: str) -> dict:
    env = dict(base)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        GROUP_RANK="0",
        GROUP_WORLD_SIZE="1",
        ROLE_NAME="default",
        ROLE_RANK=str(rank),
        ROLE_WORLD_SIZE=str(nproc),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_RESTART_COUNT="0",
        TORCHELASTIC_MAX_RESTARTS="0",
        TORCHELASTIC_RUN_ID="none",
        TORCHELASTIC_USE_AGENT_STORE="False",
        TORCHELASTIC_ERROR_FILE=os.path.join(error_dir, str(rank), "error.json"),
        TORCHELASTIC_SIGNALS_TO_HANDLE="SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        TORCH_NCCL_ASYNC_ERROR_HANDLING="1",
    )
    if nproc > 1:
        env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does for several workers
    return env


def _start_write_results_queue() -> None:
    """Start megatron-core's checkpoint write-results queue (``filesystem_async._results_queue``, a
    ``multiprocessing`` ``Manager`` queue) in the rank now, forked, instead of at its first
    ``torch_dist`` save, spawned: a spawned helper starts a fresh interpreter and imports torch
    (about 4 s of a 10 s launch here). The rank is still single-threaded (checked), so the fork is
    safe; the helper is in the rank's session (signals reach it) and the rank's ``atexit`` stops
    it. The spawned helper of a real launch is tested where the launcher is (``torchrun`` runs,
    and ``tests/unit_tests/test_entrypoint_spawn.py``)."""
    import multiprocessing
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        check_fork_safe()
        manager = SyncManager(ctx=multiprocessing.get_context("fork"))
        manager.start(initializer=_die_with_parent, initargs=(os.getpid(),))
        filesystem_async._results_queue = manager.Queue()


def _die_with_parent(parent: int) -> None:
    """In a rank's helper: be killed when the rank dies, even by ``SIGKILL`` (a fault test's), so
    no helper outlives its rank (``prctl(PR_SET_PDEATHSIG)``; Linux)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the rank died before the prctl
        os._exit(0)


def _run_rank(req: dict, rank: int, prefix: tuple[bytes, bytes], error_dir: str) -> None:
    """In the forked child: become rank ``rank`` of the launch and run the entrypoint; never
    returns."""
    code = 1
    try:
        os.setsid()  # as torchrun's workers (start_new_session): signals go to the whole group
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        fd = os.open(req["output"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.chdir(req["cwd"])
        env = _rank_env(req["env"], rank, req["nproc"], req["master_port"], error_dir)
        os.makedirs(os.path.dirname(env["TORCHELASTIC_ERROR_FILE"]), exist_ok=True)
        os.environ.clear()
        os.environ.update(env)
        for fd, data in ((1, prefix[0]), (2, prefix[1])):
            if data:
                os.write(fd, data)
        import torch

        _start_write_results_queue()  # first: set_num_threads may start an OpenMP pool
        threads = env.get("OMP_NUM_THREADS")
        torch.set_num_threads(int(threads) if threads else len(os.sched_getaffinity(0)))
        entry = req["entry"]
        sys.argv = [entry, *req["argv"]]
        sys.path[0] = os.path.dirname(os.path.abspath(entry))
        import runpy

        try:
            runpy.run_path(entry, run_name="__main__")
            code = 0
        except SystemExit as e:
            if e.code is None:
                code = 0
            elif isinstance(e.code, int):
                code = e.code
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except BaseException:  # noqa: BLE001 - a rank reports any failure as torchrun would
            sys.excepthook(*sys.exc_info())
            code = 1
        try:  # what a normal exit runs before finalization
            threading._shutdown()
        except Exception:  # noqa: BLE001 - best-effort shutdown of a rank
            pass
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001 - best-effort shutdown of a rank
        try:
            import traceback

            traceback.print_exc()
        except BaseException:  # noqa: BLE001 - best-effort shutdown of a rank
            pass
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except BaseException:  # noqa: BLE001 - best-effort shutdown of a rank
            pass
        os._exit(code & 0xFF)


def _failure_page(req: dict, failures: dict[int, tuple[int, int, str]]) -> str:
    """torchrun's ``ChildFailedError`` page for ``failures`` (rank -> (pid, exitcode, error file)),
    formatted by torch's own classes."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    procs = {
        rank: ProcessFailure(local_rank=rank, pid=pid, exitcode=code, error_file=err)
        for rank, (pid, code, err) in failures.items()
    }
    page = ChildFailedError(os.path.basename(req["entry"]), procs).format_msg()
    return (
        "Traceback (most recent call last):\n"
        "  (fast launcher: torchrun's page of the failed ranks)\n"
        f"torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n{page}\n"
    )


def _agent(conn: socket.socket, req: dict, prefix: tuple[bytes, bytes]) -> None:
    """In the forked agent of one launch: fork the ranks, report their pids, wait for them (on a
    failure stop the others: SIGTERM to their process groups, SIGKILL after
    :data:`STOP_GRACE_S`), append torchrun's failure page to the output, report the exit codes."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    error_dir = tempfile.mkdtemp(prefix="fastlaunch-")
    state = check_fork_safe()
    pids = []
    for rank in range(req["nproc"]):
        pid = os.fork()
        if pid == 0:
            conn.close()
            _run_rank(req, rank, prefix, error_dir)
        pids.append(pid)
    _send(conn, {"event": "started", "pids": pids, "fork_state": state})
    codes: dict[int, int] = {}
    failures: dict[int, tuple[int, int, str]] = {}
    stop_deadline = None
    while len(codes) < len(pids):
        progressed = False
        for rank, pid in enumerate(pids):
            if rank in codes:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                progressed = True
                codes[rank] = os.waitstatus_to_exitcode(status)
                if codes[rank] != 0 and stop_deadline is None:
                    failures[rank] = (
                        pid,
                        codes[rank],
                        os.path.join(error_dir, str(rank), "error.json"),
                    )
                    stop_deadline = time.monotonic() + STOP_GRACE_S
                    for other, opid in enumerate(pids):
                        if other not in codes:
                            _killpg(opid, signal.SIGTERM)
        if stop_deadline is not None and time.monotonic() > stop_deadline:
            for other, opid in enumerate(pids):
                if other not in codes:
                    _killpg(opid, signal.SIGKILL)
        if not progressed:
            time.sleep(_POLL_S)
    if failures:
        with open(req["output"], "a") as out:
            out.write(_failure_page(req, failures))
    _send(conn, {"event": "exited", "exitcodes": [codes[r] for r in range(len(pids))]})


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def serve(sock_path: str, cpu: bool) -> None:
    """Preload, then serve launches on the Unix socket ``sock_path`` until the parent (the test
    session) is gone or asks to quit."""
    parent = os.getppid()
    prefix = _captured_preload(cpu)
    check_fork_safe()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # agents are reaped by the kernel
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(sock_path)
    srv.listen(16)
    srv.settimeout(1.0)
    print(f"fastlaunch server ready on {sock_path} (pid {os.getpid()})", flush=True)
    while os.getppid() == parent:
        try:
            conn, _ = srv.accept()
        except socket.timeout:
            continue
        conn.settimeout(None)
        req = json.loads(conn.makefile("r").readline())
        if req.get("op") == "quit":
            conn.close()
            break
        if req.get("op") == "state":
            _send(conn, {"event": "state", "fork_state": fork_state()})
            conn.close()
            continue
        try:
            check_fork_safe()
        except ForkSafetyError as e:
            _send(conn, {"event": "error", "error": str(e)})
            conn.close()
            continue
        if os.fork() == 0:
            srv.close()
            code = 0
            try:
                _agent(conn, req, prefix)
            except BaseException as e:  # noqa: BLE001 - the agent reports any failure of a launch
                code = 1
                try:
                    _send(conn, {"event": "error", "error": f"{type(e).__name__}: {e}"})
                except OSError:
                    pass
            finally:
                os._exit(code)
        conn.close()
    srv.close()


# ------------------------------------------------------------------------------------------------
# client side
# ------------------------------------------------------------------------------------------------


class Server:
    """One preloaded server (a subprocess of the test session), started on first use."""

    def __init__(self, cpu: bool, env: dict):
        self.dir = tempfile.mkdtemp(prefix="fastlaunch-srv-")
        self.sock = os.path.join(self.dir, "sock")
        self.log = os.path.join(self.dir, "server.log")
        full = {
            **env,
            "PYTHONPATH": str(REPO),
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
        }
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tests.helpers.fastlaunch",
                    "serve",
                    self.sock,
                    str(int(cpu)),
                ],
                cwd=str(REPO),
                env=full,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        deadline = time.monotonic() + 300
        while not os.path.exists(self.sock):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"fastlaunch server did not start ({self.proc.poll()}):\n"
                    f"{Path(self.log).read_text(errors='replace')[-4000:]}"
                )
            time.sleep(0.05)

    def connect(self) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        for _ in range(200):
            try:
                s.connect(self.sock)
                return s
            except (FileNotFoundError, ConnectionRefusedError):
                time.sleep(0.05)
        s.connect(self.sock)
        return s

    def request(self, msg: dict) -> socket.socket:
        s = self.connect()
        s.sendall((json.dumps(msg) + "\n").encode())
        return s

    def state(self) -> dict:
        """:func:`fork_state` of the server process, read in it now."""
        with self.request({"op": "state"}) as s:
            return json.loads(s.makefile("r").readline())["fork_state"]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.request({"op": "quit"}).close()
                self.proc.wait(timeout=10)
            except Exception:  # noqa: BLE001 - a server that does not quit is killed
                self.proc.kill()
                self.proc.wait()


_SERVERS: dict[tuple, Server] = {}


def server_for(env: dict, cpu: bool = True) -> Server:
    """The server for launches with ``env`` (see :data:`PRELOAD_ENV`), started on first use."""
    key = (cpu, *(env.get(k, "") for k in PRELOAD_ENV))
    if key not in _SERVERS or _SERVERS[key].proc.poll() is not None:
        base = {k: v for k, v in os.environ.items() if k not in PRELOAD_ENV}
        base.update({k: env[k] for k in PRELOAD_ENV if env.get(k)})
        _SERVERS[key] = Server(cpu, base)
    return _SERVERS[key]


@atexit.register
def _close_servers() -> None:
    for srv in _SERVERS.values():
        srv.close()


@dataclass
class Launch:
    """One running launch: its ranks' pids, and the connection that reports their exit codes."""

    conn: socket.socket
    pids: list[int]
    fork_state: dict
    output: Path

    def kill(self, rank: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to rank ``rank`` (its process only, as ``kill -9 <pid>``)."""
        os.kill(self.pids[rank], sig)

    def wait(self, timeout: float) -> list[int]:
        """Each rank's exit code (``-N``: killed by signal N). On timeout every rank's process
        group is killed and ``subprocess.TimeoutExpired`` raised."""
        self.conn.settimeout(timeout)
        try:
            line = self.conn.makefile("r").readline()
        except socket.timeout:
            for pid in self.pids:
                _killpg(pid, signal.SIGKILL)
            raise subprocess.TimeoutExpired("fastlaunch", timeout) from None
        finally:
            self.conn.close()
        msg = json.loads(line) if line else {"event": "error", "error": "agent vanished"}
        if msg["event"] != "exited":
            raise RuntimeError(f"fastlaunch: {msg}")
        return msg["exitcodes"]


def launch(
    entry: Path, argv: list[str], nproc: int, cwd: Path, env: dict, output: Path, cpu: bool = True
) -> Launch:
    """Start ``entry argv`` on ``nproc`` forked ranks in ``cwd`` with environment ``env`` (the
    full environment of the rank, before the torchrun variables are added); stdout and stderr of
    every rank go to ``output`` (truncated first). Returns at once.

    Raises:
        RuntimeError: the server could not start or refused to fork (:class:`ForkSafetyError`).
    """
    from tests.helpers.dist import free_port

    Path(output).write_bytes(b"")
    srv = server_for(env, cpu)
    conn = srv.request(
        {
            "entry": str(entry),
            "argv": [str(a) for a in argv],
            "nproc": nproc,
            "cwd": str(cwd),
            "env": env,
            "output": str(output),
            "master_port": free_port(),
        }
    )
    line = conn.makefile("r").readline()
    msg = json.loads(line) if line else {"event": "error", "error": "server closed"}
    if msg["event"] != "started":
        conn.close()
        raise RuntimeError(f"fastlaunch: {msg.get('error', msg)}")
    return Launch(conn, msg["pids"], msg["fork_state"], Path(output))


def run(
    entry: Path,
    argv: list[str],
    nproc: int,
    cwd: Path,
    env: dict,
    output: Path,
    timeout: float,
    cpu: bool = True,
) -> int:
    """:func:`launch`, then wait: torchrun's exit code (0 when every rank exited 0, else 1)."""
    codes = launch(entry, argv, nproc, cwd, env, output, cpu).wait(timeout)
    return 0 if all(c == 0 for c in codes) else 1


# ------------------------------------------------------------------------------------------------
# benchmark
# ------------------------------------------------------------------------------------------------


#: The quick start's run (README): 2 layers, hidden 64, 20 iterations, persistent ``torch_dist``
#: every 10, local checkpoints every 4 replicated to the other rank.
QUICKSTART_ARGS = [
    "--save", "ck", "--save-interval", "10", "--ckpt-format", "torch_dist",
    "--non-persistent-ckpt-type", "local", "--non-persistent-save-interval", "4",
    "--non-persistent-local-ckpt-dir", "local",
    "--replication", "--replication-jump", "1", "--replication-factor", "2",
]  # fmt: skip


def bench(repeats: int = 3) -> None:
    """Forked vs torchrun launch of the quick start's model (2 CPU ranks, mock data), interleaved,
    each from request to exit; prints a table of wall seconds (min / median / max), the server's
    one-time start, and the peak of the summed PSS (MiB) of the server and every process under it
    (the ranks, and the helpers they spawn at their first ``torch_dist`` save)."""
    from tests.helpers import launch as fl

    base = Path(tempfile.mkdtemp(prefix="fastlaunch-bench-"))
    t0 = time.monotonic()
    srv = server_for({})
    server_start = time.monotonic() - t0
    peak = [0.0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.1):
            peak[0] = max(peak[0], _tree_pss_mib(srv.proc.pid))

    sampler = threading.Thread(target=sample, daemon=True)
    rows: dict[str, list[float]] = {"torchrun": [], "forked": []}
    for i in range(repeats):
        for kind in ("torchrun", "forked"):
            work = base / f"{kind}{i}"
            if kind == "forked" and not sampler.is_alive():
                sampler.start()
            t = time.monotonic()
            run_ = fl.run_pretrain(work, *QUICKSTART_ARGS, launcher=kind)
            rows[kind].append(time.monotonic() - t)
            assert sorted(run_.losses) == list(range(1, 21))
    stop.set()
    sampler.join()
    print(f"quick start model, 2 CPU ranks, {repeats} launches each, interleaved")
    print(f"{'launcher':<10} {'min s':>7} {'median s':>9} {'max s':>7}")
    for kind, ts in rows.items():
        ts = sorted(ts)
        print(f"{kind:<10} {ts[0]:>7.1f} {ts[len(ts) // 2]:>9.1f} {ts[-1]:>7.1f}")
    print(f"server start, once per test session: {server_start:.1f} s")
    print(f"peak memory (PSS), server + agent + ranks + their helpers: {peak[0]:.0f} MiB")


def _tree_pss_mib(root: int) -> float:
    """Summed proportional set size (MiB, ``/proc/<pid>/smaps_rollup``) of ``root`` and all its
    descendants: pages the forked ranks share with the server are counted once in all."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        try:
            for ln in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if ln.startswith("Pss:"):
                    total += int(ln.split()[1])
                    break
        except OSError:
            pass
    return total / 1024


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2], bool(int(sys.argv[3])))
    elif sys.argv[1] == "bench":
        bench(int(sys.argv[2]) if len(sys.argv) > 2 else 3)
