"""A run's edges through the entrypoint (2 ranks, ``--cpu``): a planned exit on a local-save
iteration leaves a persistent checkpoint of that iteration (fix ``planned_exit_save``), a resume
begins its first step on the uninterrupted run's CPU generator (fix ``data_loader_rng``) and the
resume proof compares the state as that step begins (so a change between the load and the first
step is caught), and a launch prints few lines of this fork's own.

One run trains ``--train-iters 16 --exit-interval 12`` with persistent checkpoints every 10 and
local ones every 4 (12 is a local-save iteration); its next allocation (local storage gone)
resumes at 13. The reference is the session's uninterrupted run of the same schedule
(``straight_16_exit_14_rng``), whose CPU generator is logged as each iteration begins.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from megatron.fixes import FIX_MODULES
from tests.functional_tests.conftest import read_rng_log
from tests.helpers.launch import (
    FAULTS_ENTRY,
    assert_bitwise_equal,
    default_launcher,
    local_tier_args,
    persistent_args,
    run_pretrain,
)

pytestmark = pytest.mark.slow

SCHEDULE = ["--train-iters", "16"]
REFUSED = "differs from the state that was saved"
#: Lines this fork prints itself: its loggers, and its bracketed prefixes.
FORK_LINE = re.compile(
    r"^(?:(?:DEBUG|INFO|WARNING|ERROR):megatron\.(?:cpu|fixes|overlay|integrity|training_ext|verify)"
    r"|\[(?:warnings|fixes|local-tier|persistent-tier|resume-proof|save-hold|fault-injection)\])"
)


def tiers(work: Path) -> list[str]:
    return [*persistent_args(work, 10), *local_tier_args(4, work / "local")]


def fork_lines(output: str) -> list[str]:
    return [ln for ln in output.splitlines() if FORK_LINE.match(ln)]


@pytest.fixture(scope="module")
def stopped_at_12(tmp_path_factory):
    """The planned exit at 12 (a local-save iteration; persistent 10), its CPU generator logged."""
    work = tmp_path_factory.mktemp("exit_12")
    env = {"MEGATRON_TEST_RNG_LOG": str(work / "rng")}
    run = run_pretrain(work, *SCHEDULE, *tiers(work), "--exit-interval", "12", entry=FAULTS_ENTRY,
                       env=env)  # fmt: skip
    return work, run


def next_allocation(stopped: Path, to: Path) -> Path:
    """A copy of the stopped run's directory without its local checkpoints (other nodes)."""
    shutil.copytree(stopped, to, ignore=shutil.ignore_patterns("local", "rng.*", "*.out"))
    return to


def test_planned_exit_on_a_local_save_iteration_saves_persistently(
    stopped_at_12, straight_16_exit_14_rng
):
    work, run = stopped_at_12
    straight, straight_rng = straight_16_exit_14_rng
    assert sorted(run.losses) == list(range(1, 13))
    assert_bitwise_equal(straight, run.losses, range(1, 13))
    assert (work / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "12"
    iters = sorted(p.name for p in (work / "ckpt").glob("iter_*"))
    assert iters == ["iter_0000010", "iter_0000012"]
    assert (work / "ckpt" / "iter_0000012" / "state_digest.json").is_file()
    for rank in (0, 1):  # the local checkpoint of 12 is there too
        assert sorted(p.name for p in (work / "local" / str(rank)).iterdir()) == [
            "iter_0000012_0_local.pt",
            "iter_0000012_1_local.pt",
        ]
    # saving does not touch the CPU generator: as in the uninterrupted run at every iteration
    rng = read_rng_log(work / "rng")
    assert rng == {i: straight_rng[i] for i in range(1, 13)}


def test_a_launch_prints_few_lines_of_its_own(stopped_at_12):
    """12 iterations, persistent and local saves, 2 ranks: this fork's own lines are the fixes
    summary and the CPU backend's line (rank 0), and each rank's ``[local-tier]`` line saying what
    it started from; the CPU backend's interceptions, the probes' findings and the components'
    installs are at DEBUG (see the last test)."""
    _, run = stopped_at_12
    lines = fork_lines(run.output)
    active = f"INFO:megatron.fixes:[fixes] {len(FIX_MODULES)} active on "  # every fix, on 0.19.2
    fixes = [ln for ln in lines if ln.startswith(active)]
    # the forked launcher replays the server's start (the fixes) in every rank, torchrun's rank 0
    # alone prints it
    assert len(fixes) == (2 if default_launcher() == "forked" else 1), "\n".join(lines)
    rest = [ln for ln in lines if ln not in fixes and not ln.startswith("[warnings] ")]
    assert len(rest) == 3, "\n".join(lines)
    assert rest[0].startswith("INFO:megatron.training_ext:cpu backend: active (torch ")
    ranks = sorted(ln.split(":")[0] for ln in rest[1:])
    assert ranks == ["[local-tier] rank 0", "[local-tier] rank 1"]
    assert len([ln for ln in lines if ln.startswith("[warnings] ")]) <= 1


def test_next_allocation_resumes_at_13_on_the_uninterrupted_cpu_generator(
    stopped_at_12, straight_16_exit_14_rng, tmp_path
):
    """Local storage gone: the persistent checkpoint of 12 resumes at 13, bitwise; the CPU
    generator as 13 and 14 begin is the uninterrupted run's, bitwise; the resume proof compares
    the state as 13 begins."""
    straight, straight_rng = straight_16_exit_14_rng
    work = next_allocation(stopped_at_12[0], tmp_path / "run")
    env = {"MEGATRON_TEST_RNG_LOG": str(work / "rng")}
    run = run_pretrain(work, *SCHEDULE, *tiers(work), "--exit-interval", "14", entry=FAULTS_ENTRY,
                       env=env)  # fmt: skip
    assert run.first_iteration() == 13, run.output[-3000:]
    assert_bitwise_equal(straight, run.losses, range(13, 15))
    assert read_rng_log(work / "rng") == {13: straight_rng[13], 14: straight_rng[14]}
    proven = [ln for ln in run.output.splitlines() if ln.startswith("[resume-proof] iteration 12")]
    assert len(proven) == 1 and "equal to the saved state (persistent torch_dist" in proven[0]


def test_guard_unfixed_data_loader_moves_the_cpu_generator_and_the_proof_says_so(
    stopped_at_12, straight_16_exit_14_rng, tmp_path
):
    """Upstream's loaders draw from the CPU generator restored by the load: at 13 it differs
    from the uninterrupted run's, and the proof, taken as 13 begins, stops every rank."""
    straight_rng = straight_16_exit_14_rng[1]
    work = next_allocation(stopped_at_12[0], tmp_path / "run")
    env = {"MEGATRON_TEST_RNG_LOG": str(work / "rng"), "MEGATRON_FIXES_DISABLE": "data_loader_rng"}
    run = run_pretrain(work, *SCHEDULE, *tiers(work), entry=FAULTS_ENTRY, env=env, check=False)
    assert run.returncode != 0 and not run.losses, run.output[-3000:]
    rng = read_rng_log(work / "rng")
    assert set(rng) == {13} and all(a != b for a, b in zip(rng[13], straight_rng[13]))
    refused = [ln for ln in run.output.splitlines() if REFUSED in ln]
    assert refused and "RNG state of rank(s) 0 (torch); 1 (torch)" in refused[0], refused


def test_a_change_between_the_load_and_the_first_step_is_caught(stopped_at_12, tmp_path):
    """A model value changed after ``load_checkpoint`` returned, before the first step: the proof
    (which used to run inside ``load_checkpoint``) names the tensor and stops every rank. Run at
    ``--logging-level 10``: the CPU backend's interceptions are listed there."""
    work = next_allocation(stopped_at_12[0], tmp_path / "run")
    env = {"MEGATRON_TEST_PERTURB_AFTER_LOAD": "1"}
    run = run_pretrain(work, *SCHEDULE, *tiers(work), "--logging-level", "10", entry=FAULTS_ENTRY,
                       env=env, check=False)  # fmt: skip
    assert run.returncode != 0 and not run.losses, run.output[-3000:]
    assert run.output.count("[fault-injection] rank 0: changed a model value") == 1
    refused = [ln for ln in run.output.splitlines() if REFUSED in ln]
    # the value and its optimizer's fp32 copy (the same tensor in an fp32 run), nothing else
    assert refused and (
        ": 2 of 64 items differ: 1 optimizer state (optimizer.state.fp32_param.embedding."
        "word_embeddings.weight); 1 model (embedding.word_embeddings.weight)" in refused[0]
    ), refused[0]
    assert "DEBUG:megatron.cpu:cpu backend: intercepted" in run.output
