"""The validated local tier as a component (``megatron/training_ext/local_tier/component.py``):
when the arguments switch it on, the state each install creates, and the upstream checks that
make an install raise ``UnsupportedUpstreamError`` like every patch point."""

from __future__ import annotations

import argparse

import pytest
from nvidia_resiliency_ext.checkpointing.local.ckpt_managers import local_manager

from megatron.overlay import UnsupportedUpstreamError
from megatron.training_ext import local_tier
from megatron.training_ext.local_tier import COMPONENT, DEFAULT_NAN_WINDOW, LocalTier


def _args(**kw):
    base = dict(non_persistent_ckpt_type="local", local_tier_validation=True, seed=1234)
    return argparse.Namespace(**{**base, **kw})


def test_the_component_is_the_entry_point_and_enabled_by_local_checkpoints():
    assert isinstance(COMPONENT, LocalTier) and COMPONENT.name == "local_tier"
    assert local_tier.PATCHES == LocalTier.patches and len(LocalTier.patches) == 8
    assert COMPONENT.enabled(_args())
    assert not COMPONENT.enabled(_args(non_persistent_ckpt_type=None))
    assert not COMPONENT.enabled(_args(local_tier_validation=False))
    assert COMPONENT.enabled(argparse.Namespace(non_persistent_ckpt_type="local"))


def test_new_state_is_what_an_install_builds():
    st = COMPONENT.new_state(_args())
    assert (st.validation, st.nan_window, st.local_load_iteration) == (
        True,
        DEFAULT_NAN_WINDOW,
        None,
    )
    assert st.settings is not None and st.topology is not None
    assert COMPONENT.new_state(_args(local_tier_nan_window=7)).nan_window == 7


def test_a_replaced_manager_class_or_other_exit_codes_are_an_unsupported_upstream(monkeypatch):
    import megatron.core.rerun_state_machine as rsm

    assert COMPONENT.check_patch_points() == []

    class Other(local_manager.LocalCheckpointManager):
        pass

    monkeypatch.setattr(local_manager, "LocalCheckpointManager", Other)
    (problem,) = COMPONENT.check_patch_points()
    assert "LocalCheckpointManager was already replaced" in problem
    with pytest.raises(UnsupportedUpstreamError, match="local_tier: .*already replaced"):
        local_tier.install(_args())
    assert not local_tier.installed()
    monkeypatch.undo()
    monkeypatch.setattr(rsm, "EXIT_CODE_FAILED_ON_RESULT_VALIDATION", 99)
    (problem,) = COMPONENT.check_patch_points()
    assert "exit codes are (16, 99), expected (16, 17)" in problem
