"""In-process restart (``--inprocess-restart``) on the real entrypoint (2 ranks, ``--cpu``, gloo,
the forked launcher: NVRx's Wrapper runs in the forked ranks).

One launch (``--train-iters 16 --exit-interval 14``, persistent checkpoints every 5, local every 2
replicated): rank 1 raises before iteration 7 (attempt 1 resumes from local 6 in the same PIDs),
raises again before 9 after deleting its local directory (attempt 2 resumes from local 8, its
shard repaired from the replica), the loss turns NaN at 10 after that local resume (the NaN window
marks the tier bad; attempt 3 loads persistent 5: no loop); the losses of 6-14 are bitwise those
of an uninterrupted run. A second launch raises on every attempt: every rank gives up with one
line and a non-zero exit. A third, one ``ft_launcher`` job through the example launcher: an
exception is handled in process, then rank 0 loses its local directory and leaves with ``os._exit``,
which falls through to the launcher's in-job restart; rank 0's shard of local 8 is repaired from
its replica on rank 1 (bitwise against the same reference). That job is also the suite's test of
the example launcher's in-job restart with replica recovery (``test_ft_restart.py``).

The module is in the ``slow`` lane; the fault launch's tests also run in the compatibility lane.

Budget: about 90 s for the fault launch with its shared reference run, ~20 s for the exhausted
one, ~60 s for the ``ft_launcher`` job (2-core machine).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron.training_ext import loss_log
from tests.helpers.launch import FAULTS_ENTRY, assert_bitwise_equal, local_tier_args, run_pretrain

#: Short Wrapper intervals (upstream's defaults wait up to 30 s for heartbeats).
FAST = [
    "--inprocess-restart",
    "--inprocess-granularity",
    "rank",
    "--inprocess-monitor-thread-interval",
    "0.5",
    "--inprocess-monitor-process-interval",
    "0.5",
    "--inprocess-progress-watchdog-interval",
    "0.5",
    "--inprocess-last-call-wait",
    "0.5",
    "--inprocess-heartbeat-interval",
    "1",
    "--inprocess-heartbeat-timeout",
    "10",
    "--inprocess-soft-timeout",
    "60",
    "--inprocess-hard-timeout",
    "90",
    "--inprocess-barrier-timeout",
    "120",
    "--inprocess-completion-timeout",
    "120",
]
ENV = {"TORCH_CPP_LOG_LEVEL": "error"}

pytestmark = pytest.mark.slow


def _lines(out: str, rank: int) -> list[str]:
    return [ln for ln in out.splitlines() if ln.startswith(f"[inprocess-restart] rank {rank}:")]


@pytest.fixture(scope="module")
def faulted(tmp_path_factory):
    work: Path = tmp_path_factory.mktemp("inprocess")
    faults = (
        f"rank=1,iteration=6,raise=1,once={work / 'f1'};"
        f"rank=1,iteration=8,raise=1,wipe_local=1,once={work / 'f2'}"
    )
    env = {**ENV, "MEGATRON_TEST_FAULT": faults, "MEGATRON_TEST_NAN_AFTER_LOCAL_LOAD": "10"}
    args = ["--train-iters", "16", "--exit-interval", "14", "--save", "ckpt", "--load", "ckpt"]
    args += ["--save-interval", "5", *local_tier_args(2, "local"), *FAST]
    args += ["--inprocess-max-iterations", "5"]
    return run_pretrain(work, *args, env=env, entry=FAULTS_ENTRY, check=False, timeout=600)


@pytest.mark.compat
def test_exception_restarts_in_the_same_pids_from_local_6(faulted, straight_16_exit_14):
    assert faulted.returncode == 0, faulted.output[-6000:]
    for rank in (0, 1):
        lines = _lines(faulted.output, rank)
        assert len(lines) == 4, lines
        assert len({ln.split("(pid ")[1].split(")")[0] for ln in lines}) == 1  # same PID
        assert "loaded local checkpoint at iteration 6" in lines[1]
        assert "injected fault: rank 1 before iteration 7" in lines[1]
        assert "fault -> first iteration" in lines[1]
    assert "[resume-proof] iteration 6:" in faulted.output


@pytest.mark.compat
def test_lost_local_directory_is_repaired_within_the_attempt(faulted):
    assert "rank 1: deleted its local checkpoint directory" in faulted.output
    assert "loaded local checkpoint at iteration 8" in _lines(faulted.output, 1)[2]
    assert "repaired" in faulted.output


@pytest.mark.compat
def test_nan_after_local_resume_loads_persistent_next_attempt(faulted, straight_16_exit_14):
    last = _lines(faulted.output, 0)[3]
    assert "NaN window" in last and "persistent checkpoint at iteration 5" in last
    assert_bitwise_equal(straight_16_exit_14, faulted.losses, range(6, 15))


def test_attempts_exhausted_every_rank_exits_with_the_reason(tmp_path):
    # the cheapest launch that exhausts: rank 1 raises before its first iteration in each of the
    # 2 attempts; shorter Wrapper intervals than FAST (each restart waits on them)
    env = {**ENV, "MEGATRON_TEST_FAULT": "rank=1,iteration=0,raise=1"}
    quick = [v if v != "0.5" else "0.2" for v in FAST]
    run = run_pretrain(
        tmp_path,
        "--train-iters",
        "2",
        *quick,
        "--inprocess-max-iterations",
        "2",
        env=env,
        entry=FAULTS_ENTRY,
        check=False,
        timeout=300,
    )
    assert run.returncode != 0
    raised = "[fault-injection] rank 1: raising RuntimeError before iteration 1 "
    assert run.output.count(raised) == 2, run.output[-4000:]  # once per attempt
    for rank in (0, 1):
        gave_up = [ln for ln in _lines(run.output, rank) if "giving up after 2 attempt(s)" in ln]
        assert len(gave_up) == 1 and "--inprocess-max-iterations" in gave_up[0], run.output[-4000:]


def test_inside_ft_launcher_exception_in_process_then_exit_in_job(tmp_path, straight_16_exit_14):
    """One ``ft_launcher`` job (the example launcher) with ``--inprocess-restart``: rank 1 raises
    before iteration 7 (handled in process: same PIDs, no launcher restart), then rank 0 deletes
    its local directory and leaves with ``os._exit(1)`` before iteration 9 (the launcher's in-job
    restart resumes from local 8, rank 0's shard repaired from its replica on rank 1)."""
    from tests.functional_tests.test_ft_restart import FT_LAUNCHER, rejection_lines, run_ft

    if not FT_LAUNCHER.exists():
        pytest.skip(f"ft_launcher not installed next to {FT_LAUNCHER.parent}")
    faults = (
        f"rank=1,iteration=6,raise=1,once={tmp_path / 'f1'};"
        f"rank=0,iteration=8,wipe_local=1,once={tmp_path / 'f2'}"
    )
    args = ["--train-iters", "16", "--exit-interval", "14", "--save", "ckpt", "--load", "ckpt"]
    args += ["--save-interval", "5", *local_tier_args(2, "local"), *FAST]
    args += ["--inprocess-max-iterations", "3"]
    env = {**ENV, "MEGATRON_TEST_FAULT": faults}
    rc, out, log = run_ft(tmp_path, *args, env=env, entry=FAULTS_ENTRY, timeout=600)
    assert rc == 0, f"ft_launcher failed ({rc}):\n{out[-8000:]}"
    assert "[fault-injection] rank 0: deleted its local checkpoint directory" in out
    assert "[fault-injection] rank 0: crashing (os._exit(1)) before iteration 9" in out
    assert out.count("will restart worker group") == 1, out[-6000:]
    for rank in (0, 1):
        lines = _lines(out, rank)
        # the first job: attempts 0 and 1 (same PID); the in-job restart: a new PID, attempt 0
        assert len(lines) == 3, lines
        pids = [ln.split("(pid ")[1].split(")")[0] for ln in lines]
        assert pids[0] == pids[1] != pids[2], lines
        assert "injected fault: rank 1 before iteration 7" in lines[1]
        assert "loaded local checkpoint at iteration 6" in lines[1]
        assert "loaded local checkpoint at iteration 8" in lines[2]
    # rank 0 lost its directory: it says where its shard came from, rank 1 what it verified
    repaired = (
        "[local-tier] rank 0: local checkpoint at iteration 8: repaired from rank 1's replica"
    )
    assert repaired in out, out[-6000:]
    assert "repaired rank(s) [0] from replicas" in out, out[-6000:]
    assert not rejection_lines(out)
    seq = [json.loads(ln)["iteration"] for ln in log.read_text().splitlines() if ln.strip()]
    assert seq == list(range(1, 15))  # 1-6, in process 7-8, in job 9-14: nothing twice
    assert_bitwise_equal(straight_16_exit_14, loss_log.read(str(log)), range(1, 15))
