"""Fixtures shared by the functional tests."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.helpers.launch import FAULTS_ENTRY, run_pretrain

#: ``--train-iters 16 --exit-interval 14``: the schedule of the local-tier tests (faults, trust).
SCHEDULE_16_EXIT_14 = ["--train-iters", "16", "--exit-interval", "14"]


@pytest.fixture(scope="session")
def straight_16_exit_14_rng(tmp_path_factory) -> tuple[dict[int, dict], dict[int, list[str]]]:
    """An uninterrupted run of :data:`SCHEDULE_16_EXIT_14` (iterations 1-14): its losses, and
    the digest of each rank's CPU generator as each iteration began (iteration -> one digest per
    rank; ``MEGATRON_TEST_RNG_LOG`` of the test entrypoint)."""
    work = tmp_path_factory.mktemp("straight_16_exit_14")
    env = {"MEGATRON_TEST_RNG_LOG": str(work / "rng")}
    run = run_pretrain(work, *SCHEDULE_16_EXIT_14, entry=FAULTS_ENTRY, env=env)
    assert sorted(run.losses) == list(range(1, 15))
    return run.losses, read_rng_log(work / "rng")


@pytest.fixture(scope="session")
def straight_16_exit_14(straight_16_exit_14_rng) -> dict[int, dict]:
    """Losses of an uninterrupted run of :data:`SCHEDULE_16_EXIT_14` (iterations 1-14): the
    reference of every bitwise comparison in the local-tier tests."""
    return straight_16_exit_14_rng[0]


def read_rng_log(prefix: Path, nproc: int = 2) -> dict[int, list[str]]:
    """``MEGATRON_TEST_RNG_LOG`` files ``<prefix>.<rank>``: iteration -> the CPU generator's
    digest on each rank as it began (the last record of an iteration run twice)."""
    out: dict[int, list[str]] = {}
    for rank in range(nproc):
        path = Path(f"{prefix}.{rank}")
        for line in path.read_text().splitlines() if path.exists() else ():
            rec = json.loads(line)
            out.setdefault(rec["iteration"], [""] * nproc)[rank] = rec["torch"]
    return out


def lose_exit_save(ckpt: Path, iteration: int) -> None:
    """Make ``ckpt`` what a node lost right after the local save of ``iteration`` leaves: the
    persistent checkpoint that the planned exit at ``iteration`` wrote after it (fix
    ``planned_exit_save``) is removed, and the tracker names the newest older one (or is removed
    when there is none). For the tests whose subject is a resume from the local tier while the
    persistent tier is older."""
    shutil.rmtree(ckpt / f"iter_{iteration:07d}")
    tracker = ckpt / "latest_checkpointed_iteration.txt"
    older = sorted(int(p.name[5:]) for p in ckpt.glob("iter_*") if int(p.name[5:]) < iteration)
    if older:
        tracker.write_text(str(older[-1]))
    else:
        tracker.unlink()
