"""The validated local checkpoint tier: local checkpoints are used only when they are the right
run, iteration and topology; a bad copy is repaired from a verified replica; a checkpoint written
at another data-parallel size is resharded; an interrupted save never blocks a later one; a NaN
right after a local resume sends the next start to the persistent tier.

Upstream (megatron-core 0.19.2 with NVRx 0.7.0) loads whatever local files it finds (another run's,
another topology's, a corrupt primary although a replica is good), and a ``*.dirty.pt`` left by a
killed save makes every later save of that iteration fail. The component (:data:`COMPONENT`,
``local_tier``) makes :class:`ValidatedLocalCheckpointManager` the class ``pretrain()`` builds and
wraps ``train_step`` for the NaN window. Modules: ``component`` (the component and its state),
``manager`` (save, load), ``inventory`` (what a rank can read at the start), ``plan`` (the
decision, a pure function), ``execute`` (the collectives that carry it out), ``reshard`` (another
DP size), ``checks``, ``markers``, ``nan_window``, ``common``. Rules: ``docs/local-tier.md``.
Flags (``megatron/training_ext/args.py``): ``--no-local-tier-validation``,
``--local-tier-nan-window N``, ``--local-tier-run-id ID``.
"""

from __future__ import annotations

from typing import Any, Optional

from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import (
    LocalCheckpointManager,
)

from megatron.training_ext.local_tier.checks import finite_flags, verify_state_dict
from megatron.training_ext.local_tier.common import (
    DEFAULT_NAN_WINDOW,
    FINITE_ATTR,
    LOCAL_TIER_BAD_EXIT_CODE,
    LOG_PREFIX,
    MARKER_NAME,
    QUARANTINE_DIR,
    TierState,
)
from megatron.training_ext.local_tier.component import COMPONENT, LocalTier
from megatron.training_ext.local_tier.manager import ValidatedLocalCheckpointManager
from megatron.training_ext.local_tier.markers import read_marker
from megatron.training_ext.local_tier.nan_window import wrap_train_step, wrap_validate_result

__all__ = [
    "COMPONENT",
    "DEFAULT_NAN_WINDOW",
    "FINITE_ATTR",
    "LOCAL_TIER_BAD_EXIT_CODE",
    "LOG_PREFIX",
    "MARKER_NAME",
    "PATCHES",
    "QUARANTINE_DIR",
    "LocalCheckpointManager",
    "LocalTier",
    "TierState",
    "ValidatedLocalCheckpointManager",
    "finite_flags",
    "install",
    "installed",
    "loaded_local_iteration",
    "read_marker",
    "uninstall",
    "verify_state_dict",
    "wrap_train_step",
    "wrap_validate_result",
]

#: What :func:`install` replaces, in order.
PATCHES = LocalTier.patches


def installed() -> bool:
    """Whether the tier is installed."""
    return COMPONENT.installed


def loaded_local_iteration() -> Optional[int]:
    """The local iteration this process resumed from (after validation), else ``None``."""
    st = COMPONENT.state
    return None if st is None else st.local_load_iteration


def install(args: Any) -> None:
    """Install the validated local tier for ``args`` (``install_training_hooks`` calls it).

    Does nothing unless ``args.non_persistent_ckpt_type == 'local'`` and
    ``args.local_tier_validation`` (then an installed tier is uninstalled). Makes
    ``LocalCheckpointManager`` (the name ``pretrain()`` imports)
    :class:`ValidatedLocalCheckpointManager` and wraps ``train_step`` and
    ``RerunStateMachine.validate_result`` for the NaN window. Idempotent: a second call (a new
    start of training in the same process: another restart attempt) keeps the patches and starts
    from a fresh state, so nothing an earlier attempt decided (a rejected local tier, the
    iteration it resumed from, its NaN window, a marker written) carries over: each attempt
    decides the local tier afresh, as a new process does.

    Raises:
        UnsupportedUpstreamError: the upstream functions this module wraps are missing or changed
            (a megatron-core other than the pinned 0.19.2: ``train_step`` without ``iteration``,
            other rerun exit codes), or NVRx's ``LocalCheckpointManager`` was already replaced,
            naming it; raised on every rank before any process group exists.
    """
    COMPONENT.install(args)


def uninstall() -> None:
    """Undo :func:`install` (tests)."""
    COMPONENT.uninstall()
