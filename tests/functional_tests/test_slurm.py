"""``examples/slurm/pretrain_gpt_local_ckpt.sbatch`` on a real single-node SLURM (started by
:mod:`tests.helpers.slurm_harness`), pyxis off (``USE_PYXIS=0``): ``sbatch --wait`` runs
``pretrain_gpt.py --cpu`` as two SLURM tasks (``srun``) with local checkpoints and replication.

1. A job trains to completion: both tasks run, every iteration's loss is logged, both ranks hold
   their local checkpoint and their peer's replica, the persistent checkpoint exists.
2. The script's restart loop: a rank crashes after a local save (``RESTART_ON_FAILURE=1``), the
   next attempt resumes from the local tier (the crashed rank's directory is gone: its shard comes
   from the replica), a NaN right after that resume exits with code 75 (local tier marked bad),
   the script starts again and that attempt loads the persistent checkpoint and finishes.

Skipped, with the reason, only where SLURM cannot be installed or started here.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from megatron.training_ext import loss_log
from tests.helpers import slurm_harness
from tests.helpers.dist import free_port
from tests.helpers.launch import FAULTS_ENTRY, REPO, device, run_captured

pytestmark = [pytest.mark.slow, pytest.mark.integration]

SBATCH = REPO / "examples" / "slurm" / "pretrain_gpt_local_ckpt.sbatch"
MODEL = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
    "--max-position-embeddings 64"
)
DATA = "--mock-data --tokenizer-type NullTokenizer --vocab-size 257"
TRAIN = (
    "--micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --log-interval 1 --eval-iters 0 "
    "--eval-interval 1000 --seed 1234 --train-iters 8"
)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    cluster = slurm_harness.LocalSlurm(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
    except slurm_harness.SlurmUnavailable as e:
        pytest.skip(f"SLURM unavailable: {e}")
    yield cluster
    cluster.stop()


def _submit(slurm, work: Path, extra_env: dict, timeout: float = 1500) -> tuple[int, str]:
    """``sbatch --wait`` the example script with pyxis off; returns (exit code, job output)."""
    work.mkdir(parents=True, exist_ok=True)
    env = slurm.env()
    env.update(
        {
            "USE_PYXIS": "0",
            "MEGATRON_DIR": str(REPO),
            "PYTHON": sys.executable,
            "CKPT_DIR": str(work / "ckpt"),
            "LOCAL_CKPT_DIR": str(work / "local"),
            "GPUS_PER_NODE": "2",
            "REPLICATION_JUMP": "1",
            "REPLICATION_FACTOR": "2",
            "MASTER_PORT": str(free_port()),
            "MODEL_ARGS": MODEL,
            "DATA_ARGS": DATA,
            "TRAIN_ARGS": TRAIN,
            "EXTRA_ARGS": ("--cpu " if device() == "cpu" else "")
            + f"--loss-log {work / 'losses.jsonl'}",
            "PYTHONUNBUFFERED": "1",
            **extra_env,
        }
    )
    out = work / "job.out"
    proc = run_captured(
        [
            "sbatch",
            "--wait",
            "--nodes=1",
            "--ntasks-per-node=2",
            "--gpus-per-node=0",
            "--job-name=test-local-ckpt",
            f"--output={out}",
            str(SBATCH),
        ],
        work,
        env,
        timeout,
    )
    text = out.read_text(errors="replace") if out.exists() else ""
    return proc.returncode, f"{proc.stdout}\n{text}"


def _sequence(path: Path) -> list[int]:
    import json

    return [json.loads(line)["iteration"] for line in path.read_text().splitlines() if line.strip()]


def test_sbatch_trains_two_tasks_with_replicated_local_checkpoints(slurm, tmp_path):
    rc, output = _submit(slurm, tmp_path, {"SAVE_INTERVAL": "1000", "LOCAL_SAVE_INTERVAL": "2"})
    assert rc == 0, f"job failed ({rc}):\n{output[-6000:]}"
    assert "task 0/2 (local 0)" in output and "task 1/2 (local 1)" in output, output[-3000:]
    assert "training finished (attempt 0)" in output
    losses = loss_log.read(str(tmp_path / "losses.jsonl"))
    assert sorted(losses) == list(range(1, 9))
    first = float.fromhex(losses[1]["lm loss"])
    assert 4.0 < first < 7.0, first  # ~ln(257) at initialization
    for holder in (0, 1):  # each rank: its own shard and its peer's replica, newest only
        names = sorted(p.name for p in (tmp_path / "local" / str(holder)).iterdir())
        assert names == ["iter_0000008_0_local.pt", "iter_0000008_1_local.pt"], (holder, names)
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "8"
    status = sorted((tmp_path / "ckpt" / ".slurm-status").glob("*/exit.*"))
    assert [p.read_text().strip() for p in status] == ["0", "0"], status


def test_sbatch_restarts_and_falls_back_to_persistent_after_bad_local_tier(slurm, tmp_path):
    env = {
        "SAVE_INTERVAL": "3",
        "LOCAL_SAVE_INTERVAL": "2",  # persistent 3, 6; local 2, 4, 8
        "MAX_RESTARTS": "2",
        "RESTART_ON_FAILURE": "1",
        # attempt 0: rank 1 crashes after iteration 4 (local checkpoint 4 saved), its local
        # directory deleted; attempt 1 resumes from local 4 (replica) and diverges at 6 -> exit 75;
        # attempt 2 finds the markers and loads persistent 3.
        "MEGATRON_TEST_FAULT": f"rank=1,iteration=4,wipe_local=1,once={tmp_path / 'fault.done'}",
        "MEGATRON_TEST_NAN_AFTER_LOCAL_LOAD": "6",
        "TRAINING_SCRIPT": str(FAULTS_ENTRY),  # pretrain_gpt.py plus the fault hooks
    }
    rc, output = _submit(slurm, tmp_path, env)
    assert rc == 0, f"job failed ({rc}):\n{output[-8000:]}"
    assert "[fault-injection] rank 1: crashing" in output
    assert "restart 1/2 after failure" in output
    assert "local checkpoint at iteration 4 verified on all ranks" in output
    assert "restart 2/2: exit code 75, the local checkpoint tier was marked bad" in output
    rejected = [
        ln for ln in output.splitlines() if "local checkpoint tier rejected: bad-tier marker" in ln
    ]
    assert len(rejected) == 2 and all("iteration 3 in" in ln for ln in rejected), rejected
    assert "successfully loaded checkpoint from" in output and "at iteration 3" in output
    assert "training finished (attempt 2)" in output
    # attempt 0: 1-4; attempt 1: 5 (6 diverged, not logged); attempt 2: 4-8 from persistent 3
    assert _sequence(tmp_path / "losses.jsonl") == [1, 2, 3, 4, 5, 4, 5, 6, 7, 8]
    losses = loss_log.read(str(tmp_path / "losses.jsonl"))
    assert all(math.isfinite(float.fromhex(r["lm loss"])) for r in losses.values())
    for holder in (0, 1):  # markers cleared by the first complete local save after the fallback
        assert not (tmp_path / "local" / str(holder) / "LOCAL_TIER_BAD.json").exists()
        assert not (tmp_path / "local" / str(holder) / "rejected").exists()
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "8"
