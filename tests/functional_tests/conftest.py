"""Fixtures shared by the functional tests."""

from __future__ import annotations

import pytest

from tests.helpers.launch import run_pretrain

#: ``--train-iters 16 --exit-interval 14``: the schedule of the local-tier tests (faults, trust).
SCHEDULE_16_EXIT_14 = ["--train-iters", "16", "--exit-interval", "14"]


@pytest.fixture(scope="session")
def straight_16_exit_14(tmp_path_factory) -> dict[int, dict]:
    """Losses of an uninterrupted run of :data:`SCHEDULE_16_EXIT_14` (iterations 1-14): the
    reference of every bitwise comparison in the local-tier tests."""
    run = run_pretrain(tmp_path_factory.mktemp("straight_16_exit_14"), *SCHEDULE_16_EXIT_14)
    assert sorted(run.losses) == list(range(1, 15))
    return run.losses
