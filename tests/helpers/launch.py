"""Launch the real entrypoint (``pretrain_gpt.py``) for functional tests.

CPU (``--cpu``, gloo) by default; on a machine with CUDA and ``MEGATRON_TEST_DEVICE=cuda`` the same
commands run on the GPU(s) without ``--cpu``. Runs that inject faults (``MEGATRON_TEST_*``
variables, :mod:`tests.helpers.fault_injection`) launch ``entry=FAULTS_ENTRY``, the
test entrypoint that is ``pretrain_gpt.py`` plus the fault hooks.

Two launchers (``launcher=``): ``"forked"`` (:mod:`tests.helpers.fastlaunch`: the ranks are forked
from a server that imported upstream once; the default on CPU) and ``"torchrun"`` (a real
``torchrun``, for tests whose subject is the launcher; the default on CUDA, and everywhere with
``MEGATRON_TEST_LAUNCHER=torchrun``). Every real launcher process is counted
(:data:`REAL_LAUNCHES`; the suite's budget is in ``tests/conftest.py``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from megatron.training_ext import loss_log
from tests.helpers import fastlaunch
from tests.helpers.dist import free_port

REPO = Path(__file__).resolve().parents[2]
ENTRY = REPO / "pretrain_gpt.py"
#: The test entrypoint: ``pretrain_gpt.py`` plus the test-only fault hooks.
FAULTS_ENTRY = REPO / "tests" / "functional_tests" / "pretrain_gpt_faults.py"

#: A tiny GPT: 2 layers, hidden 64, dropout on (upstream defaults 0.1), 20 iterations of 4 samples.
TINY_GPT = (
    "--tokenizer-type NullTokenizer --vocab-size 257 --num-layers 2 --hidden-size 64 "
    "--num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 --micro-batch-size 2 "
    "--global-batch-size 4 --lr 1e-3 --log-interval 1 --eval-iters 0 --eval-interval 1000 "
    "--train-iters 20 --seed 1234"
).split()


#: ``torchrun`` here: every run goes through a real ``torchrun`` (the fast launcher's control).
LAUNCHER_ENV = "MEGATRON_TEST_LAUNCHER"
#: ``(test, command)`` of every real launcher process (``torchrun``, ``ft_launcher``, a launch
#: script) this test session started: the suite fails past its budget (``tests/conftest.py``).
REAL_LAUNCHES: list[tuple[str, str]] = []
#: ``test`` of every forked launch (:mod:`tests.helpers.fastlaunch`) this test session made.
FORKED_LAUNCHES: list[str] = []


def _current_test() -> str:
    return os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]


def count_real_launch(cmd: list[str]) -> None:
    """Record ``cmd`` in :data:`REAL_LAUNCHES` if it starts a launcher (``torchrun``,
    ``python -m torch.distributed.run``, ``ft_launcher``, a ``.sh`` launch script; a ``bash -c``
    block counts each ``torchrun``/``ft_launcher`` it names)."""
    if len(cmd) >= 2 and os.path.basename(str(cmd[0])) == "bash" and "-c" in cmd[:-1]:
        script = str(cmd[-1])  # a shell block (the README's): one entry per launcher it runs
        for n in range(script.count("torchrun ") + script.count("ft_launcher ")):
            REAL_LAUNCHES.append((_current_test(), f"bash -c <block> launch {n + 1}"))
        return
    names = [os.path.basename(str(c)) for c in cmd[:4]]
    if (
        "torch.distributed.run" in names
        or "torchrun" in names
        or "ft_launcher" in names
        or any(n.endswith(".sh") for n in names)
    ):
        REAL_LAUNCHES.append((_current_test(), " ".join(map(str, cmd[:6]))))


def default_launcher(env: dict | None = None) -> str:
    """``"forked"`` on CPU, ``"torchrun"`` on CUDA or when ``$MEGATRON_TEST_LAUNCHER=torchrun``."""
    if os.environ.get(LAUNCHER_ENV) == "torchrun" or device(env) != "cpu":
        return "torchrun"
    return "forked"


def device(env: dict | None = None) -> str:
    """'cuda' when asked for (``MEGATRON_TEST_DEVICE=cuda`` in ``env`` or the environment) and a
    GPU is present, else 'cpu'."""
    if (env or {}).get("MEGATRON_TEST_DEVICE", os.environ.get("MEGATRON_TEST_DEVICE")) == "cuda":
        import torch

        if torch.cuda.is_available():
            return "cuda"
    return "cpu"


@dataclass
class Run:
    returncode: int
    output: str
    losses: dict[int, dict]

    def first_iteration(self) -> int:
        return min(self.losses) if self.losses else -1


def run_pretrain(
    workdir: Path,
    *args: str,
    nproc: int = 2,
    mock: bool = True,
    loss_file: str = "losses.jsonl",
    timeout: float = 600,
    env: dict | None = None,
    check: bool = True,
    entry: Path = ENTRY,
    launcher: str | None = None,
) -> Run:
    """Run ``torchrun --nproc-per-node N ENTRY [--cpu] TINY_GPT ARGS --loss-log FILE`` (``entry``:
    ``pretrain_gpt.py``, or :data:`FAULTS_ENTRY` for runs with fault injection), through
    ``launcher`` (``"forked"`` or ``"torchrun"``; default :func:`default_launcher`).

    Returns the exit code, the combined output and the losses this run logged (iteration -> record).
    Raises AssertionError (with the output tail) when ``check`` and the run failed.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / loss_file
    if log.exists():
        log.unlink()
    if (launcher or default_launcher(env)) == "forked":
        out_path = workdir / (Path(loss_file).stem + ".out")
        FORKED_LAUNCHES.append(_current_test())
        returncode = fastlaunch.run(
            entry,
            entry_args(args, mock=mock, env=env, log=log),
            nproc,
            workdir,
            launch_env(env),
            out_path,
            timeout,
        )
        output = out_path.read_text(errors="replace")
    else:
        cmd = pretrain_command(args, nproc=nproc, mock=mock, env=env, log=log, entry=entry)
        proc = run_captured(cmd, workdir, launch_env(env), timeout)
        returncode, output = proc.returncode, proc.stdout
    losses = loss_log.read(str(log)) if log.exists() else {}
    result = Run(returncode, output, losses)
    if check:
        assert returncode == 0, f"pretrain_gpt.py failed ({returncode}):\n{output[-6000:]}"
    return result


def local_tier_args(
    interval: int = 2, local_dir: str | Path | None = "local", replication: bool = True
) -> list[str]:
    """The local-tier flags the functional tests use: local checkpoints every ``interval``
    iterations (in ``local_dir``, relative to the run's directory, when given), replicated to the
    next rank (``--replication-jump 1 --replication-factor 2``) when ``replication``."""
    out = ["--non-persistent-ckpt-type", "local", "--non-persistent-save-interval", str(interval)]
    if local_dir is not None:
        out += ["--non-persistent-local-ckpt-dir", str(local_dir)]
    if replication:
        out += ["--replication", "--replication-jump", "1", "--replication-factor", "2"]
    return out


def persistent_args(work: Path, interval: int = 5) -> list[str]:
    """The persistent-tier flags of a test that saves and resumes in one directory: ``torch_dist``
    checkpoints every ``interval`` iterations in ``work/ckpt``, loaded from there."""
    ckpt = str(work / "ckpt")
    return ["--save", ckpt, "--load", ckpt, "--save-interval", str(interval),
            "--ckpt-format", "torch_dist"]  # fmt: skip


def both_tiers_at(work: Path, iteration: int) -> list[str]:
    """Arguments for a run of ``iteration`` iterations that ends with a local checkpoint
    (``work/local``, replicated: jump 1, factor 2) and a persistent ``torch_dist`` one
    (``work/ckpt``) of that same iteration: the local one at the last step, the persistent one at
    the end of training (``iteration`` is not a multiple of the save interval)."""
    return [
        "--train-iters",
        str(iteration),
        "--save",
        str(work / "ckpt"),
        "--save-interval",
        "1000",
        "--ckpt-format",
        "torch_dist",
        "--non-persistent-ckpt-type",
        "local",
        "--non-persistent-save-interval",
        str(iteration),
        "--non-persistent-local-ckpt-dir",
        str(work / "local"),
        "--replication",
        "--replication-jump",
        "1",
        "--replication-factor",
        "2",
    ]


def assert_bitwise_equal(
    reference: dict[int, dict],
    other: dict[int, dict],
    iterations: range,
    keys=("lm loss", "grad norm"),
) -> None:
    """Assert that ``other`` logged exactly (float.hex) the same values as ``reference``."""
    missing = [i for i in iterations if i not in other]
    assert not missing, f"iterations {missing} not logged by the resumed run"
    diffs = [
        (i, k, reference[i][k], other[i][k])
        for i in iterations
        for k in keys
        if reference[i].get(k) != other[i].get(k)
    ]
    assert not diffs, "not bitwise equal (iteration, key, reference, resumed):\n" + "\n".join(
        map(str, diffs)
    )


#: Environment variable that tags every process of one launch (agent, workers, whatever they spawn):
#: a rank that dies by ``SIGKILL`` or ``os._exit`` leaves its children running (torchrun signals
#: only the process groups of workers that are still alive), e.g. the ``multiprocessing`` manager
#: megatron-core's ``torch_dist`` writer spawns at the first persistent save, which then holds the
#: launcher's stdout open. :func:`kill_tagged` finds and ends them by this tag.
TAG_ENV = "MEGATRON_TEST_LAUNCH_TAG"


def tagged_pids(tag: str) -> list[int]:
    """Processes (other than this one) whose environment holds ``TAG_ENV=tag``."""
    needle = f"\0{TAG_ENV}={tag}\0".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:  # gone, or not ours
            continue
        if needle in b"\0" + environ + b"\0":
            pids.append(int(entry.name))
    return pids


def kill_tagged(tag: str) -> list[str]:
    """``SIGKILL`` every process tagged ``tag`` (until none is left); returns ``"pid: cmdline"`` of
    each one killed."""
    killed: dict[int, str] = {}
    for _ in range(10):
        pids = [p for p in tagged_pids(tag) if p not in killed]
        if not pids:
            break
        for pid in pids:
            try:
                cmdline = (
                    Path(f"/proc/{pid}/cmdline")
                    .read_bytes()
                    .replace(b"\0", b" ")
                    .decode(errors="replace")
                )
                os.kill(pid, signal.SIGKILL)
                killed[pid] = f"{pid}: {cmdline.strip()[:200]}"
            except (ProcessLookupError, PermissionError, FileNotFoundError):
                pass
        time.sleep(0.2)
    return list(killed.values())


def pretrain_command(
    args,
    nproc: int = 2,
    mock: bool = True,
    env: dict | None = None,
    launcher: list[str] | None = None,
    log: Path | None = None,
    entry: Path = ENTRY,
) -> list[str]:
    """The command :func:`run_pretrain` runs through torchrun (``launcher`` defaults to ``python
    -m torch.distributed.run --nproc-per-node N --master-port <free>``), ``--loss-log log`` last."""
    cmd = (
        list(launcher)
        if launcher is not None
        else [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={nproc}",
            f"--master-port={free_port()}",
        ]
    )
    cmd.append(str(entry))
    return cmd + entry_args(args, mock=mock, env=env, log=log)


def entry_args(args, mock: bool = True, env: dict | None = None, log: Path | None = None):
    """The entrypoint's arguments in :func:`pretrain_command`: ``[--cpu] TINY_GPT [--mock-data]
    ARGS [--loss-log log]`` (on CUDA without Transformer Engine ``--transformer-impl local``
    instead of ``--cpu``)."""
    cmd = []
    if device(env) == "cpu":
        cmd.append("--cpu")
    else:
        import importlib.util

        if importlib.util.find_spec("transformer_engine") is None:
            cmd += ["--transformer-impl", "local"]
    cmd += TINY_GPT + (["--mock-data"] if mock else []) + list(args)
    if log is not None:
        cmd += ["--loss-log", str(log)]
    return cmd


def launch_env(env: dict | None = None, tag: str | None = None) -> dict:
    """The environment of a launched run: this one, with this repository on ``PYTHONPATH``,
    unbuffered output, ``CUDA_DEVICE_MAX_CONNECTIONS=1``, then ``env``; with ``tag``, also
    :data:`TAG_ENV` (see :func:`kill_tagged`)."""
    full = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "PYTHONUNBUFFERED": "1",
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",
        **(env or {}),
    }
    if tag is not None:
        full[TAG_ENV] = tag
    return full


def run_captured(
    cmd: list[str], workdir: Path, env: dict, timeout: float
) -> subprocess.CompletedProcess:
    """Run ``cmd`` in ``workdir`` to completion; stdout and stderr together in ``.stdout`` (text).
    Raises ``subprocess.TimeoutExpired`` after ``timeout`` seconds."""
    count_real_launch(cmd)
    return subprocess.run(
        cmd,
        cwd=workdir,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )


@dataclass
class ReapedRun(Run):
    #: ``"pid: cmdline"`` of the processes of this launch still alive after the launcher exited
    #: (killed by :func:`run_pretrain_reaped`).
    leftovers: list[str]


def run_pretrain_reaped(
    workdir: Path,
    *args: str,
    nproc: int = 2,
    mock: bool = True,
    loss_file: str = "losses.jsonl",
    timeout: float = 600,
    env: dict | None = None,
    check: bool = True,
    entry: Path = ENTRY,
    launcher: str | None = None,
    settle_s: float = 0.0,
) -> ReapedRun:
    """:func:`run_pretrain` for runs in which a rank may be killed: output goes to a file
    (``<loss_file stem>.out`` in ``workdir``) and the call returns when the launcher exits, then
    ends whatever the run left running (see :data:`TAG_ENV`); they are listed in ``leftovers``.
    ``settle_s``: first give the run's processes up to that many seconds to exit by themselves (a
    helper killed with its rank takes a moment to go)."""
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / loss_file
    if log.exists():
        log.unlink()
    out_path = workdir / (Path(loss_file).stem + ".out")
    tag = f"{os.getpid()}-{time.time_ns()}"
    if (launcher or default_launcher(env)) == "forked":
        FORKED_LAUNCHES.append(_current_test())
        started = fastlaunch.launch(
            entry,
            entry_args(args, mock=mock, env=env, log=log),
            nproc,
            workdir,
            launch_env(env, tag),
            out_path,
        )
        try:
            codes = started.wait(timeout)
        except subprocess.TimeoutExpired:
            kill_tagged(tag)
            raise AssertionError(
                f"pretrain_gpt.py did not finish within {timeout:.0f} s:\n"
                f"{out_path.read_text(errors='replace')[-6000:]}"
            ) from None
        returncode = 0 if all(c == 0 for c in codes) else 1
        _settle(tag, settle_s)
        leftovers = kill_tagged(tag)
        output = out_path.read_text(errors="replace")
        losses = loss_log.read(str(log)) if log.exists() else {}
        result = ReapedRun(returncode, output, losses, leftovers)
        if check:
            assert returncode == 0, f"pretrain_gpt.py failed ({returncode}):\n{output[-6000:]}"
        return result
    cmd = pretrain_command(args, nproc=nproc, mock=mock, env=env, log=log, entry=entry)
    count_real_launch(cmd)
    with open(out_path, "w") as out:
        proc = subprocess.Popen(
            cmd,
            cwd=workdir,
            env=launch_env(env, tag),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        returncode = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tagged(tag)
        proc.wait()
        raise AssertionError(
            f"pretrain_gpt.py did not finish within {timeout:.0f} s:\n"
            f"{out_path.read_text(errors='replace')[-6000:]}"
        ) from None
    _settle(tag, settle_s)
    leftovers = kill_tagged(tag)
    output = out_path.read_text(errors="replace")
    losses = loss_log.read(str(log)) if log.exists() else {}
    result = ReapedRun(returncode, output, losses, leftovers)
    if check:
        assert returncode == 0, f"pretrain_gpt.py failed ({returncode}):\n{output[-6000:]}"
    return result


def _settle(tag: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while seconds and tagged_pids(tag) and time.monotonic() < deadline:
        time.sleep(0.1)


def local_files(root: Path) -> dict[int, list[str]]:
    """The files of a ``--non-persistent-local-ckpt-dir`` by holder: ``{rank: sorted file names}``
    of its ``<rank>/`` subdirectories (other entries, e.g. ``rejected/``, are left out)."""
    root = Path(root)
    if not root.is_dir():
        return {}
    return {
        int(d.name): sorted(p.name for p in d.iterdir() if p.is_file())
        for d in sorted(root.iterdir(), key=lambda d: d.name)
        if d.is_dir() and d.name.isdigit()
    }


def wait_until(predicate, timeout: float, what: str, interval: float = 0.5) -> None:
    """Poll ``predicate()`` until it is true; AssertionError naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


@dataclass
class Node:
    """One launcher agent (``torchrun`` or ``ft_launcher``) started by :func:`start_node`, and
    every process under it (tagged, :data:`TAG_ENV`)."""

    proc: subprocess.Popen
    log: Path
    tag: str

    def output(self) -> str:
        """Everything the agent and its workers printed so far (stdout and stderr)."""
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout: float) -> int:
        """The agent's exit code; on timeout the whole node is killed and AssertionError raised
        with the output tail."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill_tree()
            raise AssertionError(
                f"agent {' '.join(map(str, self.proc.args[:2]))} did not exit within "
                f"{timeout:.0f} s:\n{self.output()[-6000:]}"
            ) from None

    def kill_tree(self) -> list[str]:
        """``SIGKILL`` to the agent and every process of this node (workers run in sessions of
        their own, so a process group is not enough): a node lost at once. Returns what it killed
        (``"pid: cmdline"``); no-op for processes already gone. Reaps the agent."""
        killed = kill_tagged(self.tag)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        return killed


def wait_for_injected_crash(a: "Node", b: "Node", rank: int, before_iteration: int) -> None:
    """Wait until global rank ``rank`` on node ``b`` prints the fault injector's crash line
    (:mod:`tests.helpers.fault_injection`, ``os._exit(1)``), or an agent exits first.

    Raises:
        AssertionError: ``rank`` did not crash before ``before_iteration`` (both nodes' output
            tails in the message), or nothing happened within 900 s.
    """
    wait_until(
        lambda: f"[fault-injection] rank {rank}: crashing" in b.output()
        or a.poll() is not None
        or b.poll() is not None,
        timeout=900,
        what=f"rank {rank}'s injected crash",
    )
    assert (
        f"[fault-injection] rank {rank}: crashing (os._exit(1)) before iteration {before_iteration}"
        in b.output()
    ), f"node A:\n{a.output()[-4000:]}\nnode B:\n{b.output()[-4000:]}"


def start_node(
    workdir: Path,
    node_rank: int,
    nnodes: int,
    rdzv_endpoint: str,
    rdzv_id: str,
    args: list[str],
    *,
    output: Path,
    loss_file: Path,
    nproc: int = 1,
    mock: bool = True,
    env: dict | None = None,
    launcher: list[str] | None = None,
    launcher_args: list[str] = (),
    script_args: list[str] = (),
    entry: Path = ENTRY,
) -> Node:
    """Start one node of a multi-node job on this machine, without waiting: ``LAUNCHER --nnodes N
    --nproc-per-node P --node-rank R --rdzv-backend c10d --rdzv-endpoint E --rdzv-id I
    --local-addr 127.0.0.<R+1> --rdzv-conf is_host=<R==0> LAUNCHER_ARGS ENTRY [--cpu]
    TINY_GPT ARGS SCRIPT_ARGS --loss-log LOSS_FILE`` in ``workdir``, output to ``output``
    (``entry``: ``pretrain_gpt.py``, or :data:`FAULTS_ENTRY`).

    ``launcher`` defaults to ``python -m torch.distributed.run`` (torchrun). The c10d rendezvous
    orders nodes by address, so ``--local-addr 127.0.0.<R+1>`` (loopback, all of 127/8) makes
    node R hold global ranks ``R*P .. R*P+P-1``; node 0 hosts the rendezvous store.
    ``OMP_NUM_THREADS`` defaults to 1, as torchrun sets it for several workers per node. The agent
    runs in a session of its own (``start_new_session``) and every process of the node carries a
    tag (:data:`TAG_ENV`), so :meth:`Node.kill_tree` takes down exactly one node.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    cmd = list(launcher or [sys.executable, "-m", "torch.distributed.run"])
    cmd += [
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc}",
        f"--node-rank={node_rank}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={rdzv_endpoint}",
        f"--rdzv-id={rdzv_id}",
        f"--local-addr=127.0.0.{node_rank + 1}",
        f"--rdzv-conf=is_host={int(node_rank == 0)}",
        *launcher_args,
    ]
    cmd = pretrain_command(
        [*args, *script_args], mock=mock, env=env, launcher=cmd, log=loss_file, entry=entry
    )
    tag = f"{os.getpid()}-{time.time_ns()}-node{node_rank}"
    count_real_launch(cmd)
    full_env = launch_env(env, tag)
    # torchrun sets OMP_NUM_THREADS=1 only with --nproc-per-node > 1: with one worker per node it
    # would use every core, and its multithreaded reductions (the grad norm) differ in the last bit
    # from a run with one thread per rank
    full_env.setdefault("OMP_NUM_THREADS", "1")
    with open(output, "w") as out:
        proc = subprocess.Popen(
            cmd,
            cwd=workdir,
            env=full_env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    return Node(proc, Path(output), tag)


def start_lines(output: str) -> dict[int, list[str]]:
    """rank -> the ``[local-tier]`` lines that rank printed about what its start used."""
    out: dict[int, list[str]] = {}
    for ln in output.splitlines():
        if ln.startswith("[local-tier] rank ") and (
            "local checkpoint at iteration" in ln
            or "tier rejected" in ln
            or "no local checkpoint" in ln
        ):
            if "is complete on all ranks" in ln:
                continue
            rank = int(ln.split()[2].rstrip(":"))
            out.setdefault(rank, []).append(ln)
    return out


def printed_losses(output: str, key: str = "lm loss") -> dict[int, str]:
    """iteration -> the ``key`` value exactly as upstream's log line printed it (``%.6E`` text)."""
    import re

    pattern = re.compile(r" iteration\s+(\d+)/\s*\d+ \|.*? " + re.escape(key) + r": (\S+) \|")
    return {int(m.group(1)): m.group(2) for m in map(pattern.search, output.splitlines()) if m}


def assert_printed_losses_match_log(run: Run, key: str = "lm loss") -> None:
    """Every iteration's printed ``key`` (upstream's log line) is the value ``--loss-log`` recorded
    for that iteration, to the 7 significant digits printed."""
    printed = printed_losses(run.output, key)
    assert sorted(printed) == sorted(run.losses), (sorted(printed), sorted(run.losses))
    wrong = {
        i: (p, f"{run.losses[i][f'{key} (decimal)']:.6E}")
        for i, p in printed.items()
        if p != f"{run.losses[i][f'{key} (decimal)']:.6E}"
    }
    assert not wrong, f"printed {key} != --loss-log value (iteration: printed, logged): {wrong}"


def save_timeline(output: str) -> list[tuple[str, int]]:
    """Upstream's log lines about training and ``torch_dist`` saves, in the order rank 0 printed
    them: ``("iteration", N)`` (a training log line), ``("scheduled", N)`` (an async save of
    iteration N handed to the checkpoint worker), ``("saved", N)`` (the save of N finalised: its
    tracker file written)."""
    import re

    patterns = (
        ("iteration", re.compile(r"\] iteration\s+(\d+)/")),
        ("scheduled", re.compile(r"scheduled an async checkpoint save at iteration\s+(\d+)")),
        ("saved", re.compile(r"successfully saved checkpoint from iteration\s+(\d+)")),
    )
    events = []
    for ln in output.splitlines():
        for kind, pattern in patterns:
            m = pattern.search(ln)
            if m:
                events.append((kind, int(m.group(1))))
    return events


def iterations_during_save(output: str, iteration: int) -> list[int]:
    """The training iterations logged after the save of ``iteration`` was scheduled and before it
    was finalised (empty for a synchronous save, whose finalisation precedes the next iteration).

    Raises:
        AssertionError: the save of ``iteration`` was not finalised.
    """
    events = save_timeline(output)
    assert ("saved", iteration) in events, f"checkpoint {iteration} was not finalised: {events}"
    end = events.index(("saved", iteration))
    start = (
        events.index(("scheduled", iteration)) if ("scheduled", iteration) in events[:end] else end
    )
    return [n for kind, n in events[start:end] if kind == "iteration"]
