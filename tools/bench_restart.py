"""Time from a fault to the first iteration of the resumed training, for three restart paths side
by side: in-process restart (``--inprocess-restart``, the fault an exception), ``ft_launcher``'s
in-job restart (the fault ``os._exit``) and a fresh launch (``torchrun`` again after the job
exited, counting from the fault).

The quick start's model (``scripts/quickstart.sh``: 2 CPU ranks, gloo, GPT with 2 layers, hidden
64, sequence 128, micro-batch 4, global batch 8) on mock data, local checkpoints every 2
iterations replicated; rank 1 fails before iteration ``--fault-after + 1``. The runs use the test
entrypoint ``tests/functional_tests/pretrain_gpt_faults.py`` (the only one with fault injection):
the fault's time is the ``(at T)`` of its ``[fault-injection]`` line, the first resumed
iteration's the timestamp of upstream's iteration log line (printed as the iteration ends).
Repetitions are interleaved (a, b, c, a, b, c, ...) so that a loaded machine affects every path
alike; the table gives each repetition and the median.

    python tools/bench_restart.py --reps 2
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENTRY = REPO / "tests" / "functional_tests" / "pretrain_gpt_faults.py"
FT_EXAMPLE = REPO / "examples" / "ft_launcher" / "pretrain_gpt_ft.sh"
QUICKSTART_MODEL = (
    "--tokenizer-type NullTokenizer --vocab-size 257 --num-layers 2 --hidden-size 64 "
    "--num-attention-heads 4 --seq-length 128 --max-position-embeddings 128 "
    "--micro-batch-size 4 --global-batch-size 8 --lr 1e-3 --eval-iters 0 --eval-interval 1000 "
    "--log-interval 1 --mock-data --seed 1234"
).split()
#: The Wrapper's intervals of ``tests/functional_tests/test_inprocess_restart.py``.
INPROCESS = (
    "--inprocess-restart --inprocess-granularity rank --inprocess-max-iterations 3 "
    "--inprocess-monitor-thread-interval 0.5 --inprocess-monitor-process-interval 0.5 "
    "--inprocess-progress-watchdog-interval 0.5 --inprocess-last-call-wait 0.5 "
    "--inprocess-heartbeat-interval 1 --inprocess-heartbeat-timeout 10 "
    "--inprocess-soft-timeout 60 --inprocess-hard-timeout 90 --inprocess-barrier-timeout 120 "
    "--inprocess-completion-timeout 120"
).split()
FAULT_AT = re.compile(r"\[fault-injection\] rank \d+: .* before iteration (\d+) \(at ([\d.]+)\)")
ITERATION = re.compile(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+)\] iteration\s+(\d+)/")
PATHS = {
    "a": "in-process restart (exception)",
    "b": "ft_launcher in-job restart (os._exit)",
    "c": "fresh launch (os._exit, torchrun again)",
}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(fault: str) -> dict:
    path = os.environ.get("PYTHONPATH")
    return {
        **os.environ,
        "PYTHONPATH": f"{REPO}{os.pathsep + path if path else ''}",
        "PYTHONUNBUFFERED": "1",
        "TORCH_CPP_LOG_LEVEL": "error",
        "MEGATRON_TEST_FAULT": fault,
    }


def _args(work: Path, iters: int) -> list[str]:
    return [str(ENTRY), "--cpu", *QUICKSTART_MODEL, "--train-iters", str(iters)] + [
        *("--save", "ckpt", "--load", "ckpt", "--save-interval", "1000"),
        *("--non-persistent-ckpt-type", "local", "--non-persistent-save-interval", "2"),
        *("--non-persistent-local-ckpt-dir", str(work / "local")),
        *("--replication", "--replication-jump", "1", "--replication-factor", "2"),
    ]


def _torchrun(work: Path, args: list[str], env: dict, timeout: float) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd += ["--master-port", str(_port()), *args]
    return _run(cmd, work, env, timeout)


def _run(cmd: list[str], work: Path, env: dict, timeout: float) -> str:
    proc = subprocess.run(
        cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        timeout=timeout,
    )  # fmt: skip
    with open(work / "output.log", "a") as f:
        f.write(f"$ {' '.join(cmd)}\n(exit {proc.returncode})\n{proc.stdout}\n")
    return proc.stdout


def fault_to_first_iteration(output: str) -> float:
    """Seconds from the ``(at T)`` of the first ``[fault-injection]`` raise/crash line in
    ``output`` to the timestamp of the first iteration log line of the iteration it preceded
    logged after it. Raises ``ValueError`` when either is missing (the output names it)."""
    fault = FAULT_AT.search(output)
    if fault is None:
        raise ValueError("no [fault-injection] line with a time in the output")
    resumed, t_fault = int(fault.group(1)), float(fault.group(2))
    for stamp, it in ITERATION.findall(output):
        t = datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S.%f").timestamp()
        if int(it) == resumed and t > t_fault:
            return t - t_fault
    raise ValueError(f"iteration {resumed} was not logged after the fault")


def run_path(path: str, work: Path, fault_after: int, iters: int, timeout: float) -> float:
    """One run of restart path ``path`` (a key of :data:`PATHS`) in the empty directory ``work``;
    returns the seconds from the fault to the first resumed iteration. Raises ``ValueError`` when
    the output lacks them (``work/output.log`` keeps every launch's output)."""
    once = f"once={work / 'fault.done'}"
    args = _args(work, iters)
    if path == "a":
        env = _env(f"rank=1,iteration={fault_after},raise=1,{once}")
        out = _torchrun(work, args + INPROCESS, env, timeout)
    elif path == "b":
        env = {**_env(f"rank=1,iteration={fault_after},{once}"), "NPROC_PER_NODE": "2"}
        env |= {"NNODES": "1", "RDZV_ENDPOINT": f"127.0.0.1:{_port()}", "FT_MAX_RESTARTS": "1"}
        env |= {"PYTHON": sys.executable}
        ft = Path(sys.executable).parent / "ft_launcher"
        if ft.exists():
            env["FT_LAUNCHER"] = str(ft)
        out = _run(["bash", str(FT_EXAMPLE), *args], work, env, timeout)
    else:
        env = _env(f"rank=1,iteration={fault_after},{once}")
        out = _torchrun(work, args, env, timeout)  # exits non-zero after the fault
        out += _torchrun(work, args, env, timeout)  # the fault fired once: resumes
    return fault_to_first_iteration(out)


def main(argv: list[str] | None = None) -> int:
    """Run ``--reps`` interleaved repetitions of the three paths; print the table (Markdown)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--fault-after", type=int, default=6, help="fault before iteration N+1")
    p.add_argument("--train-iters", type=int, default=10)
    p.add_argument("--paths", default="abc", help="which of a, b, c (default all)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per launch")
    p.add_argument("--keep", help="keep the runs' directories under this path")
    a = p.parse_args(argv)
    root = Path(a.keep or tempfile.mkdtemp(prefix="bench_restart_"))
    times: dict[str, list[str]] = {k: [] for k in a.paths}
    for rep in range(a.reps):
        for key in a.paths:
            work = root / f"{key}{rep}"
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir(parents=True)
            t0 = time.monotonic()
            try:
                s = run_path(key, work, a.fault_after, a.train_iters, a.timeout)
                times[key].append(f"{s:.2f}")
            except (ValueError, subprocess.TimeoutExpired) as e:
                times[key].append(f"failed ({e}; see {work / 'output.log'})")
            print(f"# rep {rep + 1} {PATHS[key]}: {times[key][-1]} ({time.monotonic() - t0:.0f} s)")
    print(f"\nfault before iteration {a.fault_after + 1}, local checkpoints every 2 (replicated)\n")
    reps = " | ".join(f"rep {i + 1} (s)" for i in range(a.reps))
    print(f"| restart path | {reps} | median |")
    print("|---|" + "---|" * (a.reps + 1))
    for key, vals in times.items():
        ok = [float(v) for v in vals if not v.startswith("failed")]
        med = f"{statistics.median(ok):.2f}" if ok else "-"
        print(f"| {PATHS[key]} | " + " | ".join(vals) + f" | {med} |")
    if not a.keep:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
