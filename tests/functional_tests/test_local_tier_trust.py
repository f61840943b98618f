"""A local checkpoint is used only when it is the right run and topology, and a bad copy is
repaired from a verified replica (``megatron/training_ext/local_tier/``), on the real entrypoint
(2 ranks, ``--cpu``).

One base run writes persistent checkpoints every 5 iterations and local ones every 2, replicated to
the other rank, and stops at 12 (persistent 10, local 12). Each test resumes a copy of it with
``--exit-interval 14``: resumed from local 12 it logs 13-14, from persistent 10 it logs 11-14; both
must be bitwise equal to an uninterrupted run. Guards run the same with
``--no-local-tier-validation`` (upstream's behaviour) and show what goes wrong there.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.functional_tests.conftest import lose_exit_save
from tests.helpers.fault_injection import flip_byte_in_largest_storage
from tests.helpers.launch import (
    FAULTS_ENTRY,
    assert_bitwise_equal,
    local_tier_args,
    persistent_args,
    run_pretrain,
    start_lines,
)

pytestmark = pytest.mark.slow

SCHEDULE = ["--train-iters", "16"]


def tiers(work: Path) -> list[str]:
    return [*persistent_args(work), *local_tier_args(2, work / "local")]


def primary(work: Path, rank: int, iteration: int = 12) -> Path:
    return work / "local" / str(rank) / f"iter_{iteration:07d}_{rank}_local.pt"


@pytest.fixture(scope="module")
def straight(straight_16_exit_14):
    return straight_16_exit_14


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    work = tmp_path_factory.mktemp("base")
    run_pretrain(work, *SCHEDULE, *tiers(work), "--exit-interval", "12")
    assert (work / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "12"
    lose_exit_save(work / "ckpt", 12)  # as a node lost right after the local save of 12
    assert (work / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "10"
    for rank in (0, 1):
        assert sorted(p.name for p in (work / "local" / str(rank)).iterdir()) == [
            "iter_0000012_0_local.pt",
            "iter_0000012_1_local.pt",
        ]
    return work


def copy_of(base: Path, dest: Path) -> Path:
    shutil.copytree(base, dest)
    return dest


def resume(work: Path, *extra: str, check: bool = True):
    return run_pretrain(work, *SCHEDULE, *tiers(work), "--exit-interval", "14", *extra, check=check)


@pytest.fixture(scope="module")
def new_experiment(base, tmp_path_factory):
    """A new experiment (other seed, empty --save/--load) started on the old run's local dir."""
    work = tmp_path_factory.mktemp("new_experiment")
    shutil.copytree(base / "local", work / "local")
    run = run_pretrain(work, *SCHEDULE, *tiers(work), "--seed", "999", "--exit-interval", "12")
    return work, run


def test_new_experiment_never_loads_another_runs_local_checkpoint(new_experiment):
    work, run = new_experiment
    lines = start_lines(run.output)
    assert sorted(lines) == [0, 1] and all(len(v) == 1 for v in lines.values()), lines
    for (ln,) in lines.values():
        assert "local checkpoint tier rejected" in ln and "written by another run" in ln, ln
        assert "seed 1234 (checkpoint) vs 999 (this run)" in ln, ln
        assert "starting from initialization" in ln, ln
    assert "successfully loaded checkpoint" not in run.output
    assert sorted(run.losses) == list(range(1, 13)), "must start from scratch"
    # its own local checkpoint of 12 replaced the old run's; the rejected ones were removed then
    for rank in (0, 1):
        assert sorted(p.name for p in (work / "local" / str(rank)).iterdir()) == [
            "iter_0000012_0_local.pt",
            "iter_0000012_1_local.pt",
        ]


def test_guard_upstream_resumes_another_runs_local_checkpoint(base, tmp_path):
    """Upstream (--no-local-tier-validation) silently resumes the old run at 13."""
    shutil.copytree(base / "local", tmp_path / "local")
    run = run_pretrain(
        tmp_path,
        *SCHEDULE,
        *tiers(tmp_path),
        "--seed",
        "999",
        "--exit-interval",
        "14",
        "--no-local-tier-validation",
    )
    assert run.first_iteration() == 13


def test_foreign_and_corrupt_primaries_are_repaired_from_replicas(
    base, new_experiment, straight, tmp_path
):
    """Rank 1's own primary replaced by the other run's file of the same iteration (same config,
    other seed) and one byte flipped in rank 0's own primary: each rank gets its shard from the
    replica the other holds, and training resumes at 13, bitwise."""
    work = copy_of(base, tmp_path / "work")
    other, _ = new_experiment
    shutil.copy(primary(other, 1), primary(work, 1))
    flip_byte_in_largest_storage(str(primary(work, 0)))
    run = resume(work)
    lines = start_lines(run.output)
    assert sorted(lines) == [0, 1] and all(len(v) == 1 for v in lines.values()), lines
    (l0,), (l1,) = lines[0], lines[1]
    assert (
        "iteration 12: repaired from rank 1's replica on host" in l0 and "checksum mismatch" in l0
    ), l0
    assert "iteration 12: repaired from rank 0's replica on host" in l1, l1
    assert "written by another run" in l1 and "seed 999 (checkpoint) vs 1234 (this run)" in l1, l1
    assert run.first_iteration() == 13
    assert_bitwise_equal(straight, run.losses, range(13, 15))
    # the resume proof: the repaired state equals the state the first run saved
    assert "[resume-proof] iteration 12: " in run.output
    assert "tensors and the scalar state equal to the saved state (local tier" in run.output
    # the bad primaries were set aside; the save at 14 replicated everything again
    for rank in (0, 1):
        d = work / "local" / str(rank)
        assert sorted(p.name for p in d.iterdir() if p.is_file()) == [
            "iter_0000014_0_local.pt",
            "iter_0000014_1_local.pt",
        ], rank


def test_truncated_and_empty_primaries_are_repaired_from_replicas(base, straight, tmp_path):
    work = copy_of(base, tmp_path / "work")
    with open(primary(work, 0), "r+b") as f:
        f.truncate(primary(work, 0).stat().st_size // 2)
    primary(work, 1).write_bytes(b"")
    run = resume(work)
    lines = start_lines(run.output)
    assert all(len(lines.get(r, [])) == 1 for r in (0, 1)), lines
    for rank, peer in ((0, 1), (1, 0)):
        (ln,) = lines[rank]
        assert f"repaired from rank {peer}'s replica" in ln and "unreadable" in ln, ln
    assert run.first_iteration() == 13
    assert_bitwise_equal(straight, run.losses, range(13, 15))


def test_topology_change_falls_back_to_persistent_before_any_collective(base, tmp_path):
    work = copy_of(base, tmp_path / "work")
    run = resume(work, "--tensor-model-parallel-size", "2")
    lines = start_lines(run.output)
    assert sorted(lines) == [0, 1] and all(len(v) == 1 for v in lines.values()), lines
    for (ln,) in lines.values():
        assert "written under another topology" in ln, ln
        assert "tensor_model_parallel_size 1 (checkpoint) vs 2 (this run)" in ln, ln
        assert "data_parallel_size 2 (checkpoint) vs 1 (this run)" in ln, ln
        assert "-> loading the newest persistent checkpoint: iteration 10" in ln, ln
    assert run.first_iteration() == 11 and max(run.losses) == 14


def test_guard_upstream_fails_on_a_topology_change(base, tmp_path):
    work = copy_of(base, tmp_path / "work")
    run = resume(
        work, "--tensor-model-parallel-size", "2", "--no-local-tier-validation", check=False
    )
    assert run.returncode != 0 and not run.losses, run.output[-3000:]
    assert "AssertionError" in run.output or "Error" in run.output


def test_wrong_model_shape_is_refused_and_the_corrected_restart_loses_nothing(
    base, straight, tmp_path
):
    """A restart with another --hidden-size is refused before any load, naming the setting and
    both values, exit non-zero; it moves, deletes or hides no file, so the corrected restart
    resumes from local 12 (nothing lost), bitwise."""
    work = copy_of(base, tmp_path / "work")

    def files():
        return sorted(
            (str(p.relative_to(work)), p.stat().st_size, p.stat().st_mtime_ns)
            for p in (work / "local").rglob("*")
        ) + sorted(str(p.relative_to(work)) for p in (work / "ckpt").rglob("*"))

    before = files()
    run = resume(work, "--hidden-size", "128", check=False)
    assert run.returncode != 0 and not run.losses, run.output[-3000:]
    assert "--hidden-size: 64 (checkpoint) vs 128 (this run)" in run.output, run.output[-3000:]
    assert "CheckpointingException" not in run.output, run.output[-3000:]
    assert files() == before
    run = resume(work)
    assert run.first_iteration() == 13
    assert_bitwise_equal(straight, run.losses, range(13, 15))


def test_a_full_local_disk_skips_the_local_save_on_every_rank_and_training_continues(
    base, straight, tmp_path
):
    """Rank 1's local disk is full from its local save of 14 on (ENOSPC in ``torch.save``): the
    local save of 14 is skipped on every rank with one line naming the directory and the space
    needed, training goes on bitwise, and local 12 stays the newest complete local checkpoint."""
    work = copy_of(base, tmp_path / "work")
    run = run_pretrain(
        work,
        *SCHEDULE,
        *tiers(work),
        "--exit-interval",
        "14",
        entry=FAULTS_ENTRY,
        env={"MEGATRON_TEST_LOCAL_DISK_FULL": "rank=1,iteration=14"},
    )
    assert run.first_iteration() == 13
    assert_bitwise_equal(straight, run.losses, range(13, 15))
    skipped = [ln for ln in run.output.splitlines() if "local save of iteration 14 skipped" in ln]
    assert len(skipped) == 2, run.output[-4000:]
    for ln in skipped:
        assert "on every rank: rank 1 could not write" in ln, ln
        assert "rank 0" not in ln.split("skipped", 1)[1], ln
        assert str(work / "local" / "1") in ln and "No space left on device" in ln, ln
        assert "MB needed" in ln and "training continues" in ln, ln
    for rank in (0, 1):
        d = work / "local" / str(rank)
        assert sorted(p.name for p in d.iterdir()) == [
            "iter_0000012_0_local.pt",
            "iter_0000012_1_local.pt",
        ], rank


def test_a_truncated_run_token_is_restored_and_the_local_checkpoint_is_used(
    base, straight, tmp_path
):
    """``local_tier_run_token.json`` cut to half: the identity is not silently a new one (local 12
    would be rejected as another run's); the token comes back from local 12's identity record,
    with one line, and the run resumes at 13, bitwise."""
    work = copy_of(base, tmp_path / "work")
    token_file = work / "ckpt" / "local_tier_run_token.json"
    token = json.loads(token_file.read_text())["run_token"]
    token_file.write_text(token_file.read_text()[:20])
    run = resume(work)
    restored = [ln for ln in run.output.splitlines() if "restored run token" in ln]
    assert len(restored) == 1, run.output[-3000:]
    assert "local_tier_run_token.json is unreadable" in restored[0], restored
    assert f"restored run token {token[:8]}... from " in restored[0], restored
    assert "written by another run" not in run.output
    assert run.first_iteration() == 13
    assert_bitwise_equal(straight, run.losses, range(13, 15))
    assert json.loads(token_file.read_text())["run_token"] == token


def test_repair_uses_any_verified_copy_whatever_replication_wrote_it(tmp_path):
    """4 ranks, local checkpoints replicated with ``--replication-jump 1`` (cliques {0,1},{2,3});
    rank 1's local directory is lost; the restart uses ``--replication-jump 2`` (cliques {0,2},
    {1,3}), under which no clique holds rank 1's shard. The repair takes the replica rank 0 holds
    (before: a fallback to persistent 5, iterations 6-8 lost), the resumed state is proven equal to
    the saved one, and the next save replicates with the new settings."""
    four = ["--global-batch-size", "8", "--train-iters", "16", "--save-interval", "5"]

    def tiers4(jump: str) -> list[str]:
        args = [*four, "--save", str(tmp_path / "ckpt"), "--load", str(tmp_path / "ckpt")]
        args += ["--ckpt-format", "torch_dist"]
        args += local_tier_args(2, tmp_path / "local", replication=False)
        return [*args, "--replication", "--replication-jump", jump, "--replication-factor", "2"]

    run_pretrain(tmp_path, *tiers4("1"), "--exit-interval", "8", nproc=4)
    assert sorted(p.name for p in (tmp_path / "local" / "0").iterdir()) == [
        "iter_0000008_0_local.pt",
        "iter_0000008_1_local.pt",
    ]
    shutil.rmtree(tmp_path / "local" / "1")
    run = run_pretrain(tmp_path, *tiers4("2"), "--exit-interval", "12", nproc=4)
    lines = start_lines(run.output)
    (l1,) = lines[1]
    assert "iteration 8: repaired from rank 0's replica on host" in l1, l1
    assert run.first_iteration() == 9, run.output[-3000:]
    assert "[resume-proof] iteration 8: " in run.output
    assert "equal to the saved state (local tier" in run.output
    assert sorted(p.name for p in (tmp_path / "local" / "1").iterdir()) == [
        "iter_0000012_1_local.pt",
        "iter_0000012_3_local.pt",
    ]
