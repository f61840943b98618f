"""Benchmark of per-iteration local checkpoints: how long a save blocks training, synchronous
(this fork, upstream's unverified local tier) against asynchronous (this fork), each without and
with replication, next to a run without checkpoints.

Usage::

    python tools/bench_local_async.py [--iters 24] [--reps 2] [--only none,sync,async-repl,...]

Every variant is a real ``pretrain_gpt.py --cpu`` launch through ``torchrun`` (2 ranks, gloo; GPT
with 4 layers, hidden 512, 8 heads, sequence 256, micro batch 2, global batch 4, mock data),
``--non-persistent-ckpt-type local --non-persistent-save-interval 1`` (no persistent save inside
the training loop). Repetitions are interleaved (every repetition runs every variant once, in
turn), so load on the machine affects all variants alike. Columns:

  blocking ms     median over the run's saves (all but the first) of upstream's
                  ``save-checkpoint-non-persistent`` timer, slowest rank (the time the training
                  loop spends in ``save_checkpoint``), then the median over repetitions
  share           blocking ms / the median iteration time of the run without checkpoints
  iter ms         median ``elapsed time per iteration`` (iterations 3-N) of the run
  wall x          training-loop wall time (the first iteration's log line to ``after training is
                  done``, which includes the final wait for background saves) / the same for the
                  run without checkpoints
  per iteration   share / K for a save every K iterations
  background CPU  asynchronous saves: the CPU time of the background threads per save (median
                  over the run's saves but the first, which compiles the digest's kernels;
                  largest rank; the end-of-run line of the local tier),
                  which competes with training for the cores
  peak RSS MB     the ranks' peak resident memory (``VmHWM``), largest rank

Variants: ``none`` (no checkpoints); ``sync`` (this fork), ``upstream``
(``--no-local-tier-validation``), ``async`` (``--async-save``); ``-repl``: with ``--replication
--replication-jump 1 --replication-factor 2``; ``NAME@K`` (e.g. ``async-repl@4``): a local save
every K iterations instead of every iteration.
"""

from __future__ import annotations

import argparse
import atexit
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REPL = ["--replication", "--replication-jump", "1", "--replication-factor", "2"]
VARIANTS = {
    "none": None,
    "sync": [],
    "upstream": ["--no-local-tier-validation"],
    "async": ["--async-save"],
    "sync-repl": REPL,
    "upstream-repl": ["--no-local-tier-validation", *REPL],
    "async-repl": ["--async-save", *REPL],
}
MODEL = (
    "--cpu --mock-data --tokenizer-type NullTokenizer --vocab-size 257 --num-layers 4 "
    "--hidden-size 512 --num-attention-heads 8 --seq-length 256 --max-position-embeddings 256 "
    "--micro-batch-size 2 --global-batch-size 4 --lr 1e-4 --log-interval 1 --eval-interval 100000 "
    "--eval-iters 0 --seed 1234"
).split()
TIMER = re.compile(r"save-checkpoint-non-persistent[ .]*: \(([\d.]+), ([\d.]+)\)")
ITER = re.compile(
    r"\[([\d-]+ [\d:.]+)\] iteration +(\d+)/ *\d+ .*elapsed time per iteration \(ms\): ([\d.]+)"
)
DONE = re.compile(r"\[after training is done\] datetime: ([\d-]+ [\d:.]+)")
RSS = re.compile(r"\[bench-rss\] rank (\d+) (\d+) kB")
BG = re.compile(
    r"asynchronous local saves: \d+; background per save \(median[^)]*\) ([\d.]+) ms CPU"
)


def _rank_entry(argv: list[str]) -> None:
    """In each rank: ``pretrain_gpt.py``'s main, then the peak resident memory (one line)."""

    def peak() -> None:
        with open("/proc/self/status") as f:
            kb = next((ln.split()[1] for ln in f if ln.startswith("VmHWM")), "0")
        print(f"[bench-rss] rank {os.environ.get('RANK', '0')} {kb} kB", flush=True)

    atexit.register(peak)
    sys.argv = [str(ROOT / "pretrain_gpt.py"), *argv]
    sys.path.insert(0, str(ROOT))
    import runpy

    runpy.run_path(str(ROOT / "pretrain_gpt.py"), run_name="__main__")


def _split(variant: str) -> tuple[str, int]:
    """``name@k`` -> (name, k): the variant with a local save every k iterations (default 1)."""
    name, _, interval = variant.partition("@")
    return name, int(interval or 1)


def _command(variant: str, work: Path, iters: int, port: int) -> list[str]:
    args = [*MODEL, "--train-iters", str(iters)]
    name, interval = _split(variant)
    extra = VARIANTS[name]
    if extra is not None:
        args += ["--save", str(work / "ckpt"), "--save-interval", "100000"]
        args += ["--ckpt-format", "torch_dist", "--non-persistent-ckpt-type", "local"]
        args += ["--non-persistent-local-ckpt-dir", str(work / "local")]
        args += ["--non-persistent-save-interval", str(interval), *extra]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    launcher += ["--master-port", str(port)]
    return [*launcher, str(Path(__file__).resolve()), "--rank-entry", *args]


def _ts(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%d %H:%M:%S.%f").timestamp()


def parse(output: str) -> dict:
    """The figures of one run's output (see the module docstring)."""
    saves = [float(m.group(2)) for m in TIMER.finditer(output)]
    iters = [(int(m.group(2)), _ts(m.group(1)), float(m.group(3))) for m in ITER.finditer(output)]
    done = DONE.search(output)
    return {
        "blocking": statistics.median(saves[1:]) if len(saves) > 1 else None,
        "iter": statistics.median([ms for i, _, ms in iters if i >= 3]) if iters else None,
        "wall": (_ts(done.group(1)) - iters[0][1]) if done and iters else None,
        "rss": max((int(m.group(2)) for m in RSS.finditer(output)), default=0) / 1024,
        "bg": max((float(m.group(1)) for m in BG.finditer(output)), default=None),
    }


def run_one(variant: str, iters: int, port: int, log_dir: Path) -> dict:
    """One launch of ``variant``; raises RuntimeError (with the output's tail) when it fails."""
    work = Path(tempfile.mkdtemp(prefix=f"bench-{variant}-"))
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    env.setdefault("OMP_NUM_THREADS", "1")
    try:
        proc = subprocess.run(
            _command(variant, work, iters, port),
            cwd=work,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=3600,
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    (log_dir / f"{variant}.log").write_text(proc.stdout)
    if proc.returncode != 0:
        raise RuntimeError(f"{variant} failed ({proc.returncode}):\n{proc.stdout[-4000:]}")
    return parse(proc.stdout)


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def table(results: dict[str, list[dict]]) -> str:
    """The table of the medians over repetitions."""

    def med(variant: str, key: str):
        vals = [r[key] for r in results.get(variant, []) if r[key] is not None]
        return statistics.median(vals) if vals else None

    base_iter, base_wall = med("none", "iter"), med("none", "wall")
    lines = [
        "| variant | blocking ms | share | per iteration | iter ms | wall x | background CPU ms "
        "| peak RSS MB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for variant in results:
        b, it, w = med(variant, "blocking"), med(variant, "iter"), med(variant, "wall")
        share = b / base_iter if b is not None and base_iter else None
        per_iter = share / _split(variant)[1] if share is not None else None
        ratio = w / base_wall if w is not None and base_wall else None
        lines.append(
            f"| {variant} | {_fmt(b, '.1f')} | {_fmt(share and share * 100, '.1f')}% | "
            f"{_fmt(per_iter and per_iter * 100, '.1f')}% | {_fmt(it, '.0f')} | "
            f"{_fmt(ratio, '.2f')} | {_fmt(med(variant, 'bg'), '.0f')} | "
            f"{_fmt(med(variant, 'rss'), '.0f')} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the interleaved repetitions and print the table (and each run's figures)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=24)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument(
        "--only",
        default=",".join(VARIANTS),
        help="comma-separated variants; NAME@K saves every K iterations (default 1)",
    )
    p.add_argument("--port", type=int, default=29611)
    p.add_argument("--logs", default=None, help="directory for each variant's last output")
    a = p.parse_args(argv)
    variants = [v for v in a.only.split(",") if v]
    unknown = [v for v in variants if _split(v)[0] not in VARIANTS or _split(v)[1] < 1]
    if unknown:
        p.error(f"unknown variant(s) {unknown}; known: {', '.join(VARIANTS)}")
    log_dir = Path(a.logs or tempfile.mkdtemp(prefix="bench-local-async-logs-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {v: [] for v in variants}
    t0 = time.perf_counter()
    for rep in range(a.reps):
        for i, variant in enumerate(variants):
            r = run_one(variant, a.iters, a.port + (rep * len(variants) + i) % 50, log_dir)
            results[variant].append(r)
            print(f"rep {rep + 1} {variant}: {r}", flush=True)
    print(
        f"\n{a.reps} repetition(s) of {a.iters} iterations, interleaved; "
        f"{time.perf_counter() - t0:.0f} s; logs in {log_dir}\n"
    )
    print(table(results))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank-entry":
        _rank_entry(sys.argv[2:])
    else:
        sys.exit(main())
