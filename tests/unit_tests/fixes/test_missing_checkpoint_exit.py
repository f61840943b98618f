"""Fix ``missing_checkpoint_exit`` in isolation: upstream's own ``_load_base_checkpoint`` on an
empty directory with ``--exit-on-missing-checkpoint`` exits 0 (the guard), the fix makes it exit 1
with one line naming ``--load``, and leaves every other exit and result alone. The entrypoint
tests are in tests/functional_tests/test_missing_checkpoint_exit.py."""

from __future__ import annotations

import sys

import pytest

import megatron.fixes
from megatron.fixes.missing_checkpoint_exit import (
    EXIT_STATUS,
    FIX,
    upstream_exit_status_on_missing_checkpoint,
    wrap_load_base_checkpoint,
)
from megatron.fixes.standins import StandInArgs
from tests.unit_tests.fixes.probe_copies import trivial_wrapper

_ON_MAIN_UPSTREAM_BEHAVES = pytest.mark.fixed_upstream(
    "megatron-core==0.20.0",
    "Megatron-LM PR 6321 is on upstream main: sys.exit(1) on a missing checkpoint (stands aside)",
)


def _args(**over) -> StandInArgs:
    return StandInArgs(
        **{
            "exit_on_missing_checkpoint": True,
            "non_persistent_ckpt_type": None,
            "non_persistent_global_ckpt_dir": None,
            **over,
        }
    )


@_ON_MAIN_UPSTREAM_BEHAVES
def test_guard_unfixed_upstream_exits_zero(tmp_path, capsys):
    from megatron.training import checkpointing as ckpt

    megatron.fixes.reset()
    assert upstream_exit_status_on_missing_checkpoint() == 0
    assert FIX.upstream_behaves() is False
    with pytest.raises(SystemExit) as exc:
        ckpt._load_base_checkpoint(str(tmp_path), _args())
    assert exc.value.code is None  # sys.exit(): status 0
    assert "--exit-on-missing-checkpoint' set ... exiting" in capsys.readouterr().out


@_ON_MAIN_UPSTREAM_BEHAVES
def test_fixed_exits_non_zero_naming_load(tmp_path, capsys, monkeypatch):
    from megatron.training import checkpointing as ckpt

    megatron.fixes.reset()
    assert FIX.apply().value == "active"
    try:
        for rank, lines in (("0", 1), ("1", 0)):
            monkeypatch.setenv("RANK", rank)
            with pytest.raises(SystemExit) as exc:
                ckpt._load_base_checkpoint(str(tmp_path / "empty"), _args())
            assert exc.value.code == EXIT_STATUS == 1
            err = capsys.readouterr().err
            assert err.count(f"--load {tmp_path / 'empty'} holds no checkpoint") == lines, err
        # what upstream does without the flag: start from scratch (nothing loaded, no exit)
        assert (
            ckpt._load_base_checkpoint(str(tmp_path), _args(exit_on_missing_checkpoint=False))[0]
            is None
        )
    finally:
        FIX.reset()


def test_wrapper_leaves_other_exits_and_results_alone():
    def exits(code):
        return lambda load_dir, args: sys.exit(code)

    for upstream, args, want in (
        (exits(3), _args(), 3),  # another failure's status stays
        (exits(None), _args(exit_on_missing_checkpoint=False), None),  # not under the flag
        (exits("bad input"), _args(), "bad input"),
    ):
        with pytest.raises(SystemExit) as exc:
            wrap_load_base_checkpoint(upstream)("d", args)
        assert exc.value.code == want
    with pytest.raises(SystemExit) as exc:
        wrap_load_base_checkpoint(exits(0))("d", _args())
    assert exc.value.code == EXIT_STATUS
    found = ({"iteration": 5}, "d/iter_0000005", False, None)
    assert wrap_load_base_checkpoint(lambda load_dir, args, **kw: found)("d", _args()) is found


def test_probe_accepts_a_behaving_upstream_and_cannot_tell_a_returning_one():
    assert upstream_exit_status_on_missing_checkpoint(lambda d, a: sys.exit(1)) == 1
    assert upstream_exit_status_on_missing_checkpoint(lambda d, a: sys.exit("no checkpoint")) == 1
    assert upstream_exit_status_on_missing_checkpoint(lambda d, a: (None, "", False, None)) is None


@_ON_MAIN_UPSTREAM_BEHAVES
def test_probe_sees_the_defect_through_a_wrapper_and_under_the_fix(monkeypatch):
    from megatron.training import checkpointing as ckpt

    megatron.fixes.reset()
    monkeypatch.setattr(ckpt, "_load_base_checkpoint", trivial_wrapper(ckpt._load_base_checkpoint))
    assert FIX.upstream_behaves() is False
    monkeypatch.undo()
    assert FIX.apply().value == "active"
    try:
        assert FIX.upstream_behaves() is False  # upstream's own function, under the fix's wrapper
    finally:
        FIX.reset()
