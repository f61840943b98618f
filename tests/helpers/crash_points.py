"""The crash-point harness: every file-system operation of a checkpoint save is a point where a
crash must leave a resumable run (method: ALICE, OSDI 2014; CrashMonkey, OSDI 2018).

For each kind of save (:data:`KINDS`): one recorded launch of the kind's command lists the save's
operations (:mod:`tests.helpers.fs_trace`) and gives the reference losses; then, for each
operation, the same command is launched again from the same starting directory and every process
of the launch is killed (``SIGKILL``) right before that operation, and the command is launched once
more, unchanged. The restart passes when it exits 0, resumes from the newest checkpoint complete
before the kill or from the one being written (the resume proof's line names the iteration and
says the state equals the saved one), and logs bitwise the reference's losses from there on.
Cross-rank points: one rank completes its ``j``-th rename (its ``j``-th operation when it renames
nothing) and the launch is killed while the other rank waits before its own.

    python -m tests.helpers.crash_points                   # the full sweep: a table per save kind
    python -m tests.helpers.crash_points --kind local --every 5
    scripts/test.sh -m sweep tests/functional_tests/test_crash_points.py   # same, as tests

Documentation and the latest table: ``docs/crash-points.md``.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

from tests.helpers import fs_trace
from tests.helpers.fault_injection import ENV_FAULT
from tests.helpers.launch import FAULTS_ENTRY, run_pretrain_reaped

#: Seconds a launch of the tiny model may take before it counts as hung.
LAUNCH_TIMEOUT_S = 240.0
PROOF = re.compile(r"\[resume-proof\] iteration (\d+): (.*)")
LOADED = re.compile(r"successfully loaded checkpoint from .* at iteration\s+(\d+)")
_PERSISTENT = ["--save", "ckpt", "--load", "ckpt", "--ckpt-format", "torch_dist"]
_LOCAL = [
    "--non-persistent-ckpt-type", "local", "--non-persistent-local-ckpt-dir", "local",
    "--replication", "--replication-jump", "1", "--replication-factor", "2",
]  # fmt: skip
_FSDP = [
    "--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params",
    "--use-distributed-optimizer", "--no-gradient-reduce-div-fusion",
]  # fmt: skip


@dataclass
class SaveKind:
    """One kind of save: the command (run in a copy of the starting directory), which directories
    hold its files (``roots``), the trace window, the iteration of the save under test
    (``target``) and of the newest checkpoint complete before it (``older``)."""

    name: str
    args: list[str]
    roots: list[str]
    target: int
    older: int
    train_iters: int
    window: str = ""
    nproc: int = 2
    env: dict = field(default_factory=dict)
    #: Prepares the starting directory (launches of its own), or None: an empty one.
    setup: Optional[Callable[[Path], None]] = None
    #: Known upstream or fork defects that make some of its points fail: ``(row, reason)``.
    known: tuple = ()

    def command(self) -> list[str]:
        return ["--train-iters", str(self.train_iters), *self.args]

    def trace_window(self) -> str:
        return self.window or f"save:{self.target}"


def _reshard_setup(start: Path) -> None:
    """Two ranks write local checkpoints 2 and 4 (replicated to each other); rank 1 crashes
    before iteration 5, so the start of :data:`KINDS` ``local-reshard`` (one rank) finds
    iteration 4 only in the local tier, written at DP 2."""
    run = run_pretrain_reaped(
        start,
        "--train-iters", "6", *_PERSISTENT, "--save-interval", "1000",
        "--non-persistent-save-interval", "2", *_LOCAL, *_NO_DROPOUT,
        env={ENV_FAULT: "rank=1,iteration=4"},
        entry=FAULTS_ENTRY,
        check=False,
        timeout=LAUNCH_TIMEOUT_S,
        settle_s=5,
        loss_file="setup.jsonl",
    )  # fmt: skip
    assert run.returncode != 0 and "crashing (os._exit(1)) before iteration 5" in run.output, (
        run.output[-4000:]
    )


def _async_setup(start: Path) -> None:
    """The asynchronous save of iteration 2, finalised (the run stops there, ``--exit-interval``;
    same ``--train-iters``, which the scheduler's state holds): the save under
    test is then the only one in flight, whatever the worker's speed (a save of 2 in the same run
    is finalised whenever every rank sees it done, before or during the save of 4)."""
    run = run_pretrain_reaped(
        start, "--train-iters", "4", "--exit-interval", "2", *_PERSISTENT, "--save-interval", "2",
        "--async-save", entry=FAULTS_ENTRY, check=False, timeout=LAUNCH_TIMEOUT_S,
        loss_file="setup.jsonl",
    )  # fmt: skip
    tracker = start / "ckpt" / "latest_checkpointed_iteration.txt"
    assert run.returncode == 0 and tracker.read_text().strip() == "2", run.output[-4000:]


_NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]

#: The save kinds this fork performs, each as small as shows its file operations.
KINDS: dict[str, SaveKind] = {
    k.name: k
    for k in (
        SaveKind(
            "local",
            [*_PERSISTENT, "--save-interval", "1000", "--non-persistent-save-interval", "2",
             *_LOCAL],
            ["local"], target=4, older=2, train_iters=4,
        ),
        SaveKind(
            "local-async",
            [*_PERSISTENT, "--save-interval", "1000", "--non-persistent-save-interval", "2",
             *_LOCAL, "--async-save"],
            ["local"], target=4, older=2, train_iters=4,
        ),
        SaveKind(
            "torch_dist",
            [*_PERSISTENT, "--save-interval", "2"],
            ["ckpt"], target=4, older=2, train_iters=4,
        ),
        SaveKind(
            "async",
            [*_PERSISTENT, "--save-interval", "2", "--async-save"],
            ["ckpt"], target=4, older=2, train_iters=4, setup=_async_setup,
        ),
        SaveKind(
            "global",
            [*_PERSISTENT, "--save-interval", "1000", "--non-persistent-ckpt-type", "global",
             "--non-persistent-save-interval", "2"],
            ["ckpt/non_persistent"], target=6, older=4, train_iters=6,
        ),
        SaveKind(
            "local-reshard",
            [*_PERSISTENT, "--save-interval", "1000", "--non-persistent-save-interval", "2",
             *_LOCAL[:4], *_NO_DROPOUT],
            ["ckpt"], target=4, older=4, train_iters=6, window="load", nproc=1,
            setup=_reshard_setup,
        ),
        SaveKind(
            "fsdp_dtensor",
            ["--save", "ckpt", "--load", "ckpt", "--ckpt-format", "fsdp_dtensor",
             "--save-interval", "2", *_FSDP],
            ["ckpt"], target=4, older=2, train_iters=4,
            env={"CUDA_DEVICE_MAX_CONNECTIONS": "8"},
        ),
    )
}  # fmt: skip


@dataclass
class Point:
    """One crash point: ``targets`` = ``[[op key, action], ...]`` (see
    :mod:`tests.helpers.fs_trace`)."""

    label: str
    targets: list
    op: dict


@dataclass
class Outcome:
    point: Point
    ok: bool
    resumed: Optional[int]
    what: str
    seconds: float


def _launch(kind: SaveKind, work: Path, env: dict, loss_file: str, settle: float = 0.0):
    """One launch of ``kind``'s command in ``work``; launched again (up to twice) when rank 0's
    store could not listen on the port it was given (another process took it meanwhile: the
    launch ended before it touched any file)."""
    for _ in range(3):
        run = run_pretrain_reaped(
            work,
            *kind.command(),
            nproc=kind.nproc,
            env={**kind.env, **env},
            entry=FAULTS_ENTRY,
            check=False,
            timeout=LAUNCH_TIMEOUT_S,
            loss_file=loss_file,
            settle_s=settle,
        )
        if run.returncode == 0 or "EADDRINUSE" not in run.output:
            return run
    return run


def _trace_env(kind: SaveKind, trace_dir: Path, points=None) -> dict:
    cfg = {
        "dir": str(trace_dir),
        "roots": kind.roots,
        "window": kind.trace_window(),
        "exclude": ["JOB_HOLD"],
    }
    if points:
        cfg["points"] = points
    return {fs_trace.ENV: json.dumps(cfg)}


def prepare(kind: SaveKind, base: Path) -> Path:
    """The starting directory of ``kind`` (``base/<name>/start``), made once."""
    start = base / kind.name / "start"
    if not (start / ".ready").exists():
        shutil.rmtree(start, ignore_errors=True)
        start.mkdir(parents=True)
        if kind.setup is not None:
            kind.setup(start)
        (start / ".ready").touch()
    return start


def _fresh(start: Path, work: Path) -> Path:
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(start, work, symlinks=True)
    (work / ".ready").unlink(missing_ok=True)
    return work


@dataclass
class Recording:
    ops: list[dict]
    losses: dict
    output: str


def record(kind: SaveKind, base: Path) -> Recording:
    """One uninterrupted launch with the trace on: the save's operations (by rank, each rank's in
    its order) and the reference losses.

    Raises:
        AssertionError: the launch failed or recorded no operation.
    """
    start = prepare(kind, base)
    work = _fresh(start, base / kind.name / "record")
    trace = work / ".fs-trace"
    run = _launch(kind, work, _trace_env(kind, trace), "record.jsonl")
    assert run.returncode == 0, f"{kind.name}: the recorded launch failed:\n{run.output[-6000:]}"
    ops = [json.loads(ln) for f in sorted(trace.glob("ops.*.jsonl")) for ln in f.open()]
    # one order for every recording of the same command: by rank, the rank's own operations
    # before its helpers', each process's in its own order (a helper's pid is not part of it)
    ops.sort(key=lambda o: (o["rank"], o["role"] != "main", o["role"], o["seq"], o["key"]))
    assert ops, f"{kind.name}: no file operation recorded in window {kind.trace_window()}"
    return Recording(ops, run.losses, run.output)


def points(rec: Recording) -> list[Point]:
    """Every recorded operation as a kill-before point (:func:`record`'s order), then the
    cross-rank points:
    for each ``j``, rank A past its ``j``-th rename (or ``j``-th operation) and rank B held
    before its own, both ways."""
    out = [Point(f"before {o['key']}", [[o["key"], "kill"]], o) for o in rec.ops]
    ranks = sorted({o["rank"] for o in rec.ops})
    if len(ranks) < 2:
        return out
    by_rank = {r: [o for o in rec.ops if o["rank"] == r] for r in ranks[:2]}
    renames = {r: [o for o in ops if o["kind"] == "rename"] for r, ops in by_rank.items()}
    pick = renames if all(renames.values()) else by_rank
    a, b = ranks[:2]
    for j in range(min(len(pick[a]), len(pick[b]))):
        for past, held in ((a, b), (b, a)):
            op_p, op_h = pick[past][j], pick[held][j]
            out.append(
                Point(
                    f"rank {past} past {op_p['key']}, rank {held} held before {op_h['key']}",
                    [[op_p["key"], "kill-after"], [op_h["key"], "hold"]],
                    op_p,
                )
            )
    return out


def sample(pts: list[Point], every: int) -> list[Point]:
    """Every ``every``-th point (the first included), always with the last cross-rank point."""
    chosen = pts[::every]
    cross = [p for p in pts if len(p.targets) > 1]
    if cross and cross[-1] not in chosen:
        chosen.append(cross[-1])
    return chosen


def check_restart(kind: SaveKind, restart, reference: dict) -> tuple[bool, Optional[int], str]:
    """The invariant after a restart (module docstring): ``(ok, resumed iteration, what)``."""
    proofs = [m for m in map(PROOF.search, restart.output.splitlines()) if m]
    loaded = [int(m.group(1)) for m in map(LOADED.search, restart.output.splitlines()) if m]
    resumed = int(proofs[-1].group(1)) if proofs else (loaded[-1] if loaded else None)
    if restart.returncode != 0:
        return False, resumed, f"restart exited {restart.returncode}: {error_line(restart.output)}"
    if resumed is None:
        first = restart.first_iteration()
        return False, None, f"restart loaded nothing (trained from iteration {first}: scratch)"
    if resumed not in (kind.older, kind.target):
        return False, resumed, f"resumed at {resumed}, expected {kind.older} or {kind.target}"
    if not proofs or "equal to the saved state" not in proofs[-1].group(2):
        what = proofs[-1].group(0) if proofs else "no [resume-proof] line"
        return False, resumed, f"resume proof did not pass: {what[:300]}"
    want = range(resumed + 1, kind.train_iters + 1)
    missing = [i for i in want if i not in restart.losses]
    if missing or sorted(restart.losses) != list(want):
        return False, resumed, f"logged iterations {sorted(restart.losses)}, expected {list(want)}"
    diffs = [
        i
        for i in want
        for k in ("lm loss", "grad norm")
        if reference[i].get(k) != restart.losses[i].get(k)
    ]
    if diffs:
        return False, resumed, f"losses differ from the uninterrupted run at {sorted(set(diffs))}"
    return True, resumed, f"resumed at {resumed}"


def error_line(output: str) -> str:
    """The last line of ``output`` that names an exception or a refusal (else its last line)."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    pattern = re.compile(r"(\w+(Error|Exception)\b:|pretrain_gpt\.py: |\[fs-trace\])")
    hits = [ln for ln in lines if pattern.search(ln) and "error_file" not in ln]
    return (hits or lines or [""])[-1][:400]


def run_point(kind: SaveKind, base: Path, rec: Recording, point: Point, n: int) -> Outcome:
    """Crash ``kind``'s command at ``point`` (in ``base/<kind>/p<n>``), restart it unchanged,
    check the restart; the directory is removed when the restart resumed right."""
    t0 = time.monotonic()
    work = _fresh(prepare(kind, base), base / kind.name / f"p{n:03d}")
    crash = _launch(kind, work, _trace_env(kind, work / ".fs-trace", point.targets), "crash.jsonl")
    if "[fs-trace]" not in crash.output or "SIGKILL to the launch" not in crash.output:
        what = f"crash launch exited {crash.returncode} without reaching the point"
        return Outcome(point, False, None, what, time.monotonic() - t0)
    restart = _launch(kind, work, {}, "restart.jsonl", settle=2.0)
    ok, resumed, what = check_restart(kind, restart, rec.losses)
    if ok:  # a failing point's directory stays for a look
        shutil.rmtree(work, ignore_errors=True)
    return Outcome(point, ok, resumed, what, time.monotonic() - t0)


def sweep(
    kind: SaveKind,
    base: Path,
    every: int = 1,
    report: Callable[[str], None] = print,
    only: Optional[slice] = None,
    match: Sequence[str] = (),
) -> tuple[Recording, list[Outcome]]:
    """Record ``kind``'s save, then crash and restart at every ``every``-th point (``only``: of
    those, this slice, to share one kind's sweep between processes; ``match``: only the points
    whose label holds one of these strings)."""
    rec = record(kind, base)
    pts = points(rec)
    chosen = pts if every == 1 else sample(pts, every)
    if only is not None:
        chosen = chosen[only]
    if match:
        chosen = [p for p in chosen if any(m in p.label for m in match)]
    report(
        f"{kind.name}: {len(rec.ops)} operations, {len(pts)} crash points, running {len(chosen)}"
    )
    outcomes = []
    first = (only.start or 0) if only is not None else 0
    for n, p in enumerate(chosen, start=first):
        o = run_point(kind, base, rec, p, n)
        report(f"  {'ok  ' if o.ok else 'FAIL'} {p.label}: {o.what} ({o.seconds:.0f} s)")
        outcomes.append(o)
    return rec, outcomes


def table(results: dict[str, tuple[int, list[Outcome]]]) -> str:
    """Markdown table: per save kind, operations, points run, restarts that resumed right, and
    each failure with its point."""
    lines = [
        "| save kind | crash points run | resumed right | resumed at older / at the new one |",
        "|---|---|---|---|",
    ]
    fails = []
    for name, (n_points, outs) in results.items():
        good = sum(o.ok for o in outs)
        older = sum(o.ok and o.resumed == KINDS[name].older for o in outs)
        newer = sum(o.ok and o.resumed == KINDS[name].target for o in outs)
        if KINDS[name].older == KINDS[name].target:
            split = f"{good} at {KINDS[name].target}"
        else:
            split = f"{older} / {newer}"
        lines.append(f"| {name} | {len(outs)} of {n_points} | {good} | {split} |")
        fails += [f"- {name}: {o.point.label}: {o.what}" for o in outs if not o.ok]
    return "\n".join(lines + ([""] + ["Failures:"] + fails if fails else []))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kind", action="append", choices=list(KINDS), help="default: all")
    ap.add_argument("--every", type=int, default=1, help="run every N-th point (default 1: all)")
    ap.add_argument("--work", type=Path, default=None, help="work directory (default: a temp)")
    ap.add_argument("--json", type=Path, default=None, help="write the outcomes here")
    ap.add_argument("--slice", default=None, help="A:B: only points A..B-1 of each kind's run")
    ap.add_argument("--match", action="append", default=[], help="only points whose label has it")
    a = ap.parse_args(argv)
    base = a.work or Path(tempfile.mkdtemp(prefix="crash-points-"))
    t0 = time.monotonic()
    results: dict[str, tuple[int, list[Outcome]]] = {}
    for name in a.kind or list(KINDS):
        t = time.monotonic()
        only = slice(*(int(x) if x else None for x in a.slice.split(":"))) if a.slice else None
        rec, outs = sweep(KINDS[name], base, a.every, lambda s: print(s, flush=True), only, a.match)
        results[name] = (len(points(rec)), outs)
        print(f"{name}: {time.monotonic() - t:.0f} s", flush=True)
    print(table(results))
    print(f"wall time: {time.monotonic() - t0:.0f} s; work directory {base}")
    if a.json:
        a.json.write_text(
            json.dumps(
                {
                    n: {
                        "points": c,
                        "outcomes": [
                            {"point": o.point.label, "ok": o.ok, "resumed": o.resumed,
                             "what": o.what, "seconds": round(o.seconds, 1)}
                            for o in outs
                        ],
                    }
                    for n, (c, outs) in results.items()
                },
                indent=1,
            )
        )  # fmt: skip
    return 0 if all(o.ok for _, outs in results.values() for o in outs) else 1


if __name__ == "__main__":
    sys.exit(main())
