"""Fix ``pretrained_redirect`` in isolation: the behavioural probe (upstream's ``load_checkpoint``
on a temporary ``--load`` with only a global non-persistent checkpoint, stopped once it has chosen
the directory to load) and the replacement's decision. The entrypoint tests (global and local
non-persistent tiers) are in tests/functional_tests/test_pretrained_redirect.py.

Megatron-LM PR 6321 (``--exit-on-missing-checkpoint`` exits non-zero) is another defect: it does
not change which directory a restart with only non-persistent checkpoints loads."""

from __future__ import annotations

import pytest

import megatron.fixes
from megatron.fixes.pretrained_redirect import FIX, upstream_resumes_non_persistent
from tests.unit_tests.fixes.probe_copies import rewritten_copy, trivial_wrapper


@pytest.fixture
def ckpt():
    from megatron.training import checkpointing

    megatron.fixes.reset()
    yield checkpointing
    FIX.reset()


def _collaborators(ckpt):
    names = ("get_args", "print_rank_0", "_load_base_checkpoint", "load_checkpoint")
    return {n: vars(ckpt)[n] for n in names}


def test_probe_sees_the_redirect_and_leaves_nothing_behind(ckpt):
    before = _collaborators(ckpt)
    assert upstream_resumes_non_persistent() is False
    assert FIX.upstream_behaves() is False
    assert _collaborators(ckpt) == before


def test_probe_is_not_fooled_by_a_rewritten_or_wrapped_upstream(ckpt, monkeypatch):
    copy = rewritten_copy(ckpt.load_checkpoint, {"pretrained_dir": "finetune_from"})
    assert upstream_resumes_non_persistent(copy) is False
    monkeypatch.setattr(ckpt, "load_checkpoint", trivial_wrapper(copy))
    assert FIX.upstream_behaves() is False


def test_probe_sees_the_fixed_loader_resume_the_run(ckpt):
    from megatron.training import training

    assert FIX.apply().value == "active"
    assert training.load_checkpoint is ckpt.load_checkpoint
    assert upstream_resumes_non_persistent(ckpt.load_checkpoint) is True
    assert FIX.upstream_behaves() is False  # upstream's own, under the fix's wrapper


def test_probe_cannot_tell_when_the_load_is_not_reached(ckpt):
    def refuses_early(*args, **kwargs):
        raise FileNotFoundError("no checkpoint")

    with pytest.raises(FileNotFoundError):
        upstream_resumes_non_persistent(refuses_early)
    assert upstream_resumes_non_persistent(lambda *a, **k: (0, 0)) is None
