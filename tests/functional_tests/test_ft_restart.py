"""Restarts with the validated local checkpoint tier (``megatron/training_ext/local_tier/``) on the
real entrypoint (2 ranks, ``--cpu``), and the helpers that run the example launcher
``examples/ft_launcher/pretrain_gpt_ft.sh`` (NVRx ``ft_launcher``) for the tests that use it.

Every run uses ``--train-iters 16 --exit-interval 12``, persistent checkpoints every 5 iterations
and local checkpoints every 2, replicated to the other rank. Faults are deterministic
(:mod:`tests.helpers.fault_injection`; those runs launch the test entrypoint
``tests/functional_tests/pretrain_gpt_faults.py``): rank 1 deletes its local checkpoint directory
and leaves with ``os._exit(1)`` just before iteration 7, after the local checkpoint at 6 was saved.

1. Corrupted replica: one byte of the replica rank 1 will retrieve is flipped. The restart (the
   same command started again, as a requeue does) rejects the local tier on both ranks (one log
   line each: checksum mismatch), loads persistent 5 and finishes, bitwise equal from iteration 6
   on.
2. NaN after a local resume (continuing run 1's directory: local 12, persistent 10): the loss turns
   NaN at 14, two iterations after resuming from local 12; both ranks write the bad-tier marker and
   exit with code 75 without saving. The next start (the same command, injection still armed)
   sees the markers, loads persistent 10, finishes, and clears the markers at its first local save.

The example launcher's in-job restart that recovers a lost rank's shard from its replica is tested
in one ``ft_launcher`` job with ``test_inprocess_restart.py`` (an in-process restart first, then the
in-job one), and with a replacement node in ``test_local_tier_faults.py``.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from megatron.training_ext import loss_log
from megatron.training_ext.local_tier import LOCAL_TIER_BAD_EXIT_CODE, MARKER_NAME
from tests.functional_tests.conftest import lose_exit_save
from tests.helpers.dist import free_port
from tests.helpers.launch import (
    ENTRY,
    FAULTS_ENTRY,
    REPO,
    TINY_GPT,
    assert_bitwise_equal,
    device,
    launch_env,
    local_tier_args,
    run_captured,
    run_pretrain,
    run_pretrain_reaped,
)

pytestmark = pytest.mark.slow

FT_LAUNCHER = Path(sys.executable).parent / "ft_launcher"
FT_EXAMPLE = REPO / "examples" / "ft_launcher" / "pretrain_gpt_ft.sh"
SCHEDULE = ["--train-iters", "16", "--exit-interval", "12"]
TIERS = [
    "--save",
    "ckpt",
    "--load",
    "ckpt",
    "--save-interval",
    "5",
    *local_tier_args(2, "local"),
]


def run_ft(
    workdir: Path,
    *args: str,
    env: dict | None = None,
    max_restarts: int = 1,
    timeout: float = 1500,
    entry: Path = ENTRY,
) -> tuple[int, str, Path]:
    """The example launcher ``examples/ft_launcher/pretrain_gpt_ft.sh`` (ft_launcher with
    ``ft_config.yaml``, 2 workers, ``--enable-ft-package``) running
    ``ENTRY [--cpu] TINY_GPT ARGS`` in ``workdir`` (``pretrain_gpt.py``, or ``FAULTS_ENTRY`` with
    fault injection); returns (exit code, output, loss log)."""
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / "losses.jsonl"
    cmd = ["bash", str(FT_EXAMPLE), str(entry)]
    if device(env) == "cpu":
        cmd.append("--cpu")
    cmd += TINY_GPT + ["--mock-data"] + list(args) + ["--loss-log", str(log)]
    full_env = {
        **launch_env(),
        "NPROC_PER_NODE": "2",
        "NNODES": "1",
        "RDZV_ENDPOINT": f"127.0.0.1:{free_port()}",
        "FT_MAX_RESTARTS": str(max_restarts),
        "FT_LAUNCHER": str(FT_LAUNCHER),
        "PYTHON": sys.executable,
        **(env or {}),
    }
    proc = run_captured(cmd, workdir, full_env, timeout)
    return proc.returncode, proc.stdout, log


def sequence(path: Path) -> list[int]:
    """Iterations in the order they were logged (restarts append to the same file)."""
    return [json.loads(line)["iteration"] for line in path.read_text().splitlines() if line.strip()]


def rejection_lines(output: str) -> list[str]:
    return [ln for ln in output.splitlines() if "[local-tier] rank" in ln and "tier rejected" in ln]


@pytest.fixture(scope="module")
def straight(straight_16_exit_14):
    """Iterations 1-12 of an uninterrupted run of :data:`SCHEDULE`: the first 12 of the shared
    reference run (same ``--train-iters 16``, so the same learning-rate schedule; exit at 14)."""
    return {i: straight_16_exit_14[i] for i in range(1, 13)}  # the fixture asserts 1-14 logged


def _fault(workdir: Path, **extra) -> dict:
    spec = f"rank=1,iteration=6,wipe_local=1,once={workdir / 'fault.done'}"
    spec += "".join(f",{k}={v}" for k, v in extra.items())
    return {"MEGATRON_TEST_FAULT": spec}


@pytest.fixture(scope="module")
def corrupted_replica_run(tmp_path_factory):
    """Rank 1 crashes before 7 (its local directory deleted, the replica rank 0 holds for it
    corrupted); the same command again (forked launches). Returns (work, exit code of the second
    launch, the outputs of both, the loss log of both: first launch's lines, then the second's)."""
    work = tmp_path_factory.mktemp("corrupt")
    # the file rank 0 holds for rank 1 and will send to it after rank 1's directory is gone
    replica = work / "local" / "0" / "iter_0000006_1_local.pt"
    env = _fault(work, corrupt=replica)
    args = (*SCHEDULE, *TIERS)
    first = run_pretrain_reaped(
        work, *args, env=env, entry=FAULTS_ENTRY, check=False, loss_file="first.jsonl", settle_s=5
    )
    assert first.returncode != 0, first.output[-4000:]
    again = run_pretrain(
        work, *args, env=env, entry=FAULTS_ENTRY, check=False, loss_file="again.jsonl"
    )
    log = work / "losses.jsonl"
    log.write_text((work / "first.jsonl").read_text() + (work / "again.jsonl").read_text())
    return work, again.returncode, first.output + again.output, log


def test_corrupted_replica_falls_back_to_persistent(corrupted_replica_run, straight):
    work, rc, out, log = corrupted_replica_run
    assert rc == 0, f"the restart failed ({rc}):\n{out[-8000:]}"
    assert "[fault-injection] rank 1: flipped a byte" in out
    lines = rejection_lines(out)
    assert sorted(ln.split(":")[0] for ln in lines) == [
        "[local-tier] rank 0",
        "[local-tier] rank 1",
    ], lines
    for ln in lines:
        assert "local checkpoint at iteration 6 failed" in ln and "ChecksumMismatchError" in ln, ln
        assert "checksum mismatch" in ln, ln
        assert "-> loading the newest persistent checkpoint: iteration 5 in ckpt" in ln, ln
    assert "successfully loaded checkpoint from ckpt" in out and "at iteration 5" in out
    # 1-6, then the restart from persistent 5 logs 6-12 again
    assert sequence(log) == list(range(1, 7)) + list(range(6, 13))
    assert_bitwise_equal(straight, loss_log.read(str(log)), range(1, 13))
    # rejected files were quarantined, then removed at the first complete local save (6)
    for holder in (0, 1):
        d = work / "local" / str(holder)
        assert sorted(p.name for p in d.iterdir()) == [
            "iter_0000012_0_local.pt",
            "iter_0000012_1_local.pt",
        ]


def test_nan_after_local_resume_marks_tier_bad_and_next_start_loads_persistent(
    corrupted_replica_run, tmp_path, straight
):
    src, rc, _, _ = corrupted_replica_run
    assert rc == 0
    work = tmp_path / "nan"
    shutil.copytree(src / "ckpt", work / "ckpt")
    shutil.copytree(src / "local", work / "local")
    lose_exit_save(work / "ckpt", 12)  # the exit's persistent save: as if the node was lost
    assert (work / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "10"
    env = {"MEGATRON_TEST_NAN_AFTER_LOCAL_LOAD": "14"}
    args = ["--train-iters", "16", *TIERS]

    first = run_pretrain(
        work, *args, env=env, check=False, loss_file="first.jsonl", entry=FAULTS_ENTRY
    )
    assert first.returncode != 0
    assert f"exitcode  : {LOCAL_TIER_BAD_EXIT_CODE}" in first.output, first.output[-4000:]
    assert "local checkpoint at iteration 12 verified on all ranks" in first.output
    assert sorted(first.losses) == [13], "iteration 14 diverged and must not be logged"
    for rank in (0, 1):
        marker = json.loads((work / "local" / str(rank) / MARKER_NAME).read_text())
        assert marker["iteration"] == 14 and marker["local_checkpoint_iteration"] == 12
        assert marker["exit_code"] == LOCAL_TIER_BAD_EXIT_CODE and marker["rank"] == rank
        assert "non-finite" in marker["reason"] or "NaN" in marker["reason"], marker
    assert (work / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "10", (
        "nothing may be saved from the diverged state"
    )

    second = run_pretrain(work, *args, env=env, loss_file="second.jsonl", entry=FAULTS_ENTRY)
    lines = rejection_lines(second.output)
    assert len(lines) == 2 and all(
        "bad-tier marker" in ln and "at iteration 14" in ln for ln in lines
    ), lines
    assert all("iteration 10 in ckpt" in ln for ln in lines), lines
    assert "[fault-injection]" not in second.output, "resumed from persistent: no injection"
    assert sorted(second.losses) == list(range(11, 17))
    assert_bitwise_equal(straight, second.losses, range(11, 13))
    for rank in (0, 1):
        d = work / "local" / str(rank)
        assert not (d / MARKER_NAME).exists() and not (d / "rejected").exists()
    assert "removed the bad-tier marker" in second.output
