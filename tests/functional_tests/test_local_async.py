"""Asynchronous local saves every iteration (``--async-save`` with the validated local tier), on
the real entrypoint (``pretrain_gpt.py``, 2 ranks, ``--cpu``), with asynchronous persistent
``torch_dist`` saves (NVRx's worker) in the same runs.

Five launches in all, shared between the tests: the reference (8 iterations, uninterrupted), a
run that exits at 6 and its resume after rank 1's local directory is deleted (repaired from the
replica of 6 on rank 0, proven, bitwise), and a run whose rank 1 is killed while its background
thread writes iteration 4 (no replication) and its restart, in which rank 1's local disk is full
from iteration 7 on (the asynchronous writer's failure, reported as a synchronous save's).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.helpers.fault_injection import ENV_DISK_FULL, ENV_KILL_LOCAL_SAVE
from tests.helpers.launch import (
    FAULTS_ENTRY,
    assert_bitwise_equal,
    local_files,
    local_tier_args,
    persistent_args,
    run_pretrain,
    run_pretrain_reaped,
    start_lines,
)

pytestmark = pytest.mark.slow


def _flags(work: Path, replication: bool = True) -> list[str]:
    return [
        "--async-save",
        *persistent_args(work),
        *local_tier_args(1, work / "local", replication=replication),
    ]


def _name(iteration: int, rank: int) -> str:
    return f"iter_{iteration:07d}_{rank}_local.pt"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """8 iterations, asynchronous local saves every iteration (replicated) and asynchronous
    persistent saves every 5 (upstream skips the local save at 5)."""
    work = tmp_path_factory.mktemp("async_reference")
    run = run_pretrain(work, "--train-iters", "8", *_flags(work))
    return work, run


def test_async_local_saves_with_async_persistent_saves(reference):
    work, run = reference
    assert sorted(run.losses) == list(range(1, 9))
    assert "scheduled an async checkpoint save at iteration       7 to " in run.output
    assert run.output.count("successfully saved local checkpoint from iteration") == 7
    for rank in (0, 1):  # only the newest complete iteration, with the other rank's replica
        assert sorted(local_files(work / "local")[rank]) == [_name(8, 0), _name(8, 1)]
    assert sorted(p.name for p in (work / "ckpt").glob("iter_*")) == [
        "iter_0000005",
        "iter_0000008",
    ]
    assert (work / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "8"
    assert "Traceback" not in run.output.split("[after training is done]")[0]


def test_resume_after_a_lost_local_directory_is_repaired_bitwise_and_proven(reference, tmp_path):
    _, straight = reference
    first = run_pretrain(tmp_path, "--train-iters", "8", "--exit-interval", "6", *_flags(tmp_path))
    assert_bitwise_equal(straight.losses, first.losses, range(1, 7))
    assert sorted(local_files(tmp_path / "local")[1]) == [_name(6, 0), _name(6, 1)]
    shutil.rmtree(tmp_path / "local" / "1")

    run = run_pretrain(tmp_path, "--train-iters", "8", *_flags(tmp_path), loss_file="resumed.jsonl")
    (l1,) = start_lines(run.output)[1]
    assert "local checkpoint at iteration 6: repaired from rank 0's replica" in l1, l1
    assert run.first_iteration() == 7, run.output[-3000:]
    assert_bitwise_equal(straight.losses, run.losses, range(7, 9))
    assert "[resume-proof] iteration 6: " in run.output, run.output[-3000:]
    assert "equal to the saved state (local tier" in run.output, run.output[-3000:]


def test_kill_during_a_background_write_then_a_full_disk(reference, tmp_path):
    """Rank 1 is killed (``SIGKILL``) while its background thread writes its shard of 4: the
    restart resumes from local 3, the newest iteration complete on every rank (without
    replication the partial 4 cannot be completed). In the restart rank 1's disk is full from 7
    on: each of those saves is skipped on every rank with the synchronous path's line, training
    goes on bitwise, and local 6 stays."""
    _, straight = reference
    flags = _flags(tmp_path, replication=False)
    spec = f"rank=1,iteration=4,moment=write,once={tmp_path / 'kill.done'}"
    killed = run_pretrain_reaped(
        tmp_path,
        "--train-iters",
        "8",
        *flags,
        env={ENV_KILL_LOCAL_SAVE: spec},
        check=False,
        loss_file="killed.jsonl",
        entry=FAULTS_ENTRY,
    )
    assert killed.returncode != 0, killed.output[-4000:]
    assert "[fault-injection] rank 1: SIGKILL during its local save of iteration 4" in (
        killed.output
    )
    holders = local_files(tmp_path / "local")
    assert _name(3, 1) in holders[1] and _name(4, 1) not in holders[1], holders
    assert _name(3, 0) in holders[0], holders

    env = {ENV_KILL_LOCAL_SAVE: spec, ENV_DISK_FULL: "rank=1,iteration=7"}
    run = run_pretrain_reaped(
        tmp_path,
        "--train-iters",
        "8",
        *flags,
        env=env,
        loss_file="restart.jsonl",
        entry=FAULTS_ENTRY,
    )
    assert run.first_iteration() == 4, (sorted(run.losses), holders, run.output[-3000:])
    assert_bitwise_equal(straight.losses, run.losses, range(4, 9))
    assert "equal to the saved state (local tier" in run.output
    for it in (7, 8):
        skipped = [
            ln for ln in run.output.splitlines() if f"local save of iteration {it} skipped" in ln
        ]
        assert len(skipped) == 2, run.output[-4000:]
        for ln in skipped:
            assert "on every rank: rank 1 could not write" in ln, ln
            assert str(tmp_path / "local" / "1") in ln and "No space left on device" in ln, ln
            assert "MB needed" in ln and "training continues" in ln, ln
    for rank in (0, 1):
        assert local_files(tmp_path / "local")[rank] == [_name(6, rank)], rank
