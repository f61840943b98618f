"""``--exit-on-missing-checkpoint`` through the entrypoint (2 ranks; fix
``missing_checkpoint_exit``): a ``--load`` that holds nothing ends the run on every rank with exit
status 1 and one line naming ``--load``, before any iteration; a ``--load`` that holds a
checkpoint resumes as usual. Guard: upstream's (``MEGATRON_FIXES_DISABLE=missing_checkpoint_exit``)
exits 0 having trained nothing."""

from __future__ import annotations

import pytest

from tests.helpers.launch import run_pretrain

pytestmark = pytest.mark.slow

FLAG = ["--exit-on-missing-checkpoint", "--train-iters", "4"]


def test_nothing_to_load_exits_non_zero_naming_load(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    run = run_pretrain(tmp_path, "--load", str(empty), *FLAG, check=False)
    assert run.returncode != 0, run.output[-3000:]
    assert not run.losses  # nothing trained
    line = f"pretrain_gpt.py: --exit-on-missing-checkpoint: --load {empty} holds no checkpoint"
    assert run.output.count(line) == 1, run.output[-3000:]
    assert "Traceback" not in run.output.split(line)[0]  # the line, not a traceback, says why


def test_a_checkpoint_to_load_resumes(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    run_pretrain(tmp_path / "first", "--save", ckpt, "--save-interval", "2", "--train-iters", "4",
                 "--exit-interval", "2")  # fmt: skip
    run = run_pretrain(tmp_path / "again", "--load", ckpt, "--save", ckpt, "--save-interval", "2",
                       *FLAG)  # fmt: skip
    assert run.first_iteration() == 3 and sorted(run.losses) == [3, 4]


def test_guard_unfixed_upstream_exits_zero(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    run = run_pretrain(
        tmp_path,
        "--load",
        str(empty),
        *FLAG,
        env={"MEGATRON_FIXES_DISABLE": "missing_checkpoint_exit"},
        check=False,
    )
    assert run.returncode == 0 and not run.losses, run.output[-3000:]
    assert "'--exit-on-missing-checkpoint' set ... exiting" in run.output
