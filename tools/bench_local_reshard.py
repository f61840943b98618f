"""Benchmark: the local tier's resume at another DP size against a persistent load of the same
state, through ``pretrain_gpt.py --cpu`` (gloo, ``torchrun``).

Usage::

    python tools/bench_local_reshard.py [--reps 2] [--hidden 64] [--work DIR]

Once: 4 ranks train to 12 with local checkpoints every 4 (replicated to the other half of the
ranks: jump 2, factor 2) and persistent ones every 10, then ranks 2-3's local directories are
deleted (a node lost). Per repetition, interleaved: (a) 2 ranks restart from a copy of that state:
the local tier writes iteration 12 as a ``torch_dist`` checkpoint and upstream loads it resharded
(DP 4 -> 2); (b) 2 ranks load that same ``iter_0000012`` from the persistent tier (no local
files). Figures per start, seconds, the slowest rank's (upstream's ``load-checkpoint`` timer,
which includes this fork's checks and the resume proof), median and minimum, also with the
process's first persistent save added (megatron-core starts a write-results helper process at a
process's first ``torch_dist`` save: the reshard's write pays it, the run's next save does not);
and the first iteration each start trains.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(work: Path, nproc: int, args: list, log: str) -> str:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        f"--master-port={_port()}",
        str(REPO / "pretrain_gpt.py"),
        "--cpu",
        "--mock-data",
        *args,
        "--loss-log",
        f"{log}.jsonl",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    (work / f"{log}.log").write_text(out)
    if proc.returncode != 0:
        raise SystemExit(f"bench_local_reshard: {log} failed ({proc.returncode}):\n{out[-3000:]}")
    return out


def _timer(out: str, name: str) -> float:
    """Upstream's ``(min, max) time across ranks`` of timer ``name`` (its first report): the
    slowest rank's, seconds."""
    m = re.search(name + r" \.+: \(([0-9.]+), ([0-9.]+)\)", out)
    if not m:
        raise SystemExit(f"bench_local_reshard: no {name} timer in the output")
    return float(m.group(2)) / 1e3


def _first_iteration(work: Path, log: str) -> int:
    lines = (work / f"{log}.jsonl").read_text().splitlines()
    return min(json.loads(ln)["iteration"] for ln in lines if ln.strip())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--work", type=Path, default=None)
    a = p.parse_args()
    base = a.work or Path(tempfile.mkdtemp(prefix="bench_local_reshard_"))
    model = (
        f"--tokenizer-type NullTokenizer --vocab-size 257 --num-layers 2 --hidden-size {a.hidden} "
        "--num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 --micro-batch-size 2 "
        "--global-batch-size 8 --lr 1e-3 --log-interval 1 --eval-iters 0 --eval-interval 1000 "
        "--train-iters 20 --seed 1234 --hidden-dropout 0 --attention-dropout 0 "
        "--use-distributed-optimizer --save ckpt --load ckpt --save-interval 10 "
        "--ckpt-format torch_dist --non-persistent-ckpt-type local "
        "--non-persistent-save-interval 4 --non-persistent-local-ckpt-dir local"
    ).split()
    setup = base / "setup"
    setup.mkdir(parents=True, exist_ok=True)
    _launch(
        setup,
        4,
        [
            *model,
            "--replication",
            "--replication-jump",
            "2",
            "--replication-factor",
            "2",
            "--exit-interval",
            "12",
        ],
        "setup",
    )
    for r in (2, 3):
        shutil.rmtree(setup / "local" / str(r))
    times = {"reshard": [], "persistent": []}
    with_save = {"reshard": [], "persistent": []}  # + the process's first persistent save
    first = {}
    for rep in range(a.reps):
        work = base / f"rep{rep}"
        shutil.copytree(setup, work, ignore=shutil.ignore_patterns("*.log", "*.jsonl"))
        repl = ["--replication", "--replication-jump", "1", "--replication-factor", "2"]
        out = _launch(work, 2, [*model, *repl, "--exit-interval", "13"], "reshard")
        if "resumed at DP 2" not in out:
            raise SystemExit(f"bench_local_reshard: the restart did not reshard:\n{out[-3000:]}")
        times["reshard"].append(_timer(out, "load-checkpoint"))
        with_save["reshard"].append(times["reshard"][-1] + _timer(out, "save-checkpoint"))
        first["reshard"] = _first_iteration(work, "reshard")
        # the same iteration-12 state, from the persistent tier (without the local files and the
        # persistent save the first restart made when it exited at 13)
        shutil.rmtree(work / "local")
        shutil.rmtree(work / "ckpt" / "iter_0000013", ignore_errors=True)
        (work / "ckpt" / "latest_checkpointed_iteration.txt").write_text("12\n")
        out = _launch(work, 2, [*model, *repl, "--exit-interval", "13"], "persistent")
        times["persistent"].append(_timer(out, "load-checkpoint"))
        with_save["persistent"].append(times["persistent"][-1] + _timer(out, "save-checkpoint"))
        first["persistent"] = _first_iteration(work, "persistent")
    print(
        f"{'start (2 ranks, state of iteration 12 saved at DP 4)':<52} {'load median':>11} "
        f"{'min':>6} {'+ 1st save median':>17} {'min':>6} {'first iteration':>15}"
    )
    for k, label in (
        ("reshard", "local tier, resharded (write torch_dist + load)"),
        ("persistent", "persistent torch_dist load of the same iteration"),
    ):
        v, w = times[k], with_save[k]
        print(
            f"{label:<52} {statistics.median(v):>11.2f} {min(v):>6.2f} "
            f"{statistics.median(w):>17.2f} {min(w):>6.2f} {first[k]:>15}"
        )
    print(
        "seconds, slowest rank (upstream's load-checkpoint timer; '+ 1st save': with the "
        "process's first persistent save, which starts megatron-core's write-results helper "
        "process unless the reshard's write already did)"
    )
    print("without the reshard the restart loads persistent 10: first iteration 11 (2 lost)")
    if a.work is None:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
