"""The validated local checkpoint tier: local checkpoints are used only when they are the right
run, iteration and topology; a bad copy is repaired from a verified replica; an interrupted save
never blocks a later one; a NaN right after a local resume sends the next start to the persistent
tier.

Upstream (megatron-core 0.19.2 with NVRx 0.7.0) loads whatever local files it finds (another run's,
another topology's, a corrupt primary although a replica is good), and a ``*.dirty.pt`` left by a
killed save makes every later save of that iteration fail. :func:`install` makes
:class:`ValidatedLocalCheckpointManager` the class ``pretrain()`` builds and wraps ``train_step``
for the NaN window. Modules: ``manager`` (save, load), ``resolve`` (the collective load decision),
``checks``, ``markers``, ``nan_window``, ``common``. Rules: ``docs/local-tier.md``. Flags
(``megatron/training_ext/args.py``): ``--no-local-tier-validation``, ``--local-tier-nan-window N``,
``--local-tier-run-id ID``.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import (
    LocalCheckpointManager,
)

from megatron.integrity import local_identity
from megatron.overlay import Patch, Patcher, value
from megatron.training_ext.local_tier import common
from megatron.training_ext.local_tier.checks import finite_flags, verify_state_dict
from megatron.training_ext.local_tier.common import (
    DEFAULT_NAN_WINDOW,
    FINITE_ATTR,
    LOCAL_TIER_BAD_EXIT_CODE,
    LOG_PREFIX,
    MARKER_NAME,
    QUARANTINE_DIR,
    RERUN_EXIT_CODES,
    TierState,
    logger,
)
from megatron.training_ext.local_tier.manager import ValidatedLocalCheckpointManager
from megatron.training_ext.local_tier.markers import read_marker
from megatron.training_ext.local_tier.nan_window import wrap_train_step, wrap_validate_result

__all__ = [
    "DEFAULT_NAN_WINDOW",
    "FINITE_ATTR",
    "LOCAL_TIER_BAD_EXIT_CODE",
    "LOG_PREFIX",
    "MARKER_NAME",
    "QUARANTINE_DIR",
    "ValidatedLocalCheckpointManager",
    "install",
    "installed",
    "loaded_local_iteration",
    "finite_flags",
    "read_marker",
    "verify_state_dict",
    "uninstall",
]

_PATCHER = Patcher("local_tier")

#: What :func:`install` replaces, in order.
PATCHES = (
    Patch(
        "nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager."
        "LocalCheckpointManager",
        value(ValidatedLocalCheckpointManager),
        "pretrain() builds this class: local files are verified (checksums, identity, "
        "finiteness) and a bad local tier falls back to the persistent checkpoint",
    ),
    Patch(
        "megatron.training.training.train_step",
        wrap_train_step,
        "the NaN window after a local-tier resume watches each iteration's loss and grad norm",
        params=("iteration",),
    ),
    Patch(
        "megatron.core.rerun_state_machine.RerunStateMachine.validate_result",
        wrap_validate_result,
        "a NaN/Inf loss inside the NaN window marks the local tier bad instead of a rerun",
    ),
)


def __getattr__(name: str) -> Any:
    """``_STATE``: the current decision state (:data:`common.STATE`, ``None`` when not installed);
    a module attribute lookup so that it follows :func:`install` and :func:`uninstall`."""
    if name == "_STATE":
        return common.STATE
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def installed() -> bool:
    return common.STATE is not None


def loaded_local_iteration() -> Optional[int]:
    """The local iteration this process resumed from (after validation), else ``None``."""
    return None if common.STATE is None else common.STATE.local_load_iteration


def install(args: Any) -> None:
    """Install the validated local tier for ``args`` (``install_training_hooks`` calls it).

    Does nothing unless ``args.non_persistent_ckpt_type == 'local'`` and
    ``args.local_tier_validation``. Makes ``LocalCheckpointManager`` (the name ``pretrain()``
    imports) :class:`ValidatedLocalCheckpointManager` and wraps ``train_step`` and
    ``RerunStateMachine.validate_result`` for the NaN window. Idempotent: a second call (a new
    start of training in the same process: another restart attempt) keeps the patches and starts
    from a fresh decision state, so nothing an earlier attempt decided (a rejected local tier, the
    iteration it resumed from, its NaN window, a marker written) carries over: each attempt
    resolves the local tier afresh, as a new process does.

    Raises:
        RuntimeError: the upstream functions this module wraps are missing or changed signature
            (a megatron-core other than the pinned 0.19.2), naming the function; raised on every
            rank before any process group exists.
    """
    if getattr(args, "non_persistent_ckpt_type", None) != "local":
        return
    validation = bool(getattr(args, "local_tier_validation", True))
    if not validation:
        return
    window = getattr(args, "local_tier_nan_window", None)
    window = DEFAULT_NAN_WINDOW if window is None else int(window)
    if common.STATE is not None:  # same object (holders keep it), every field as for a new process
        vars(common.STATE).update(
            vars(
                TierState(
                    validation=validation,
                    nan_window=window,
                    args=args,
                    settings=local_identity.run_settings(args),
                    topology=local_identity.topology(args),
                )
            )
        )
        return

    import megatron.core.rerun_state_machine as rsm
    import megatron.training.training as training
    from nvidia_resiliency_ext.checkpointing.local.ckpt_managers import local_manager

    fn = getattr(training, "train_step", None)
    if fn is None or "iteration" not in inspect.signature(fn).parameters:
        raise RuntimeError(
            "local_tier: megatron.training.training.train_step is missing or has "
            "changed (expected a parameter 'iteration'); this module targets "
            "megatron-core 0.19.2"
        )
    if local_manager.LocalCheckpointManager is not LocalCheckpointManager:
        raise RuntimeError(
            "local_tier: nvidia_resiliency_ext LocalCheckpointManager was already "
            f"replaced by {local_manager.LocalCheckpointManager!r}"
        )
    if (
        rsm.EXIT_CODE_RESUME_TO_DISAMBIGUATE,
        rsm.EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
    ) != RERUN_EXIT_CODES:
        raise RuntimeError("local_tier: upstream rerun exit codes changed")

    common.STATE = TierState(
        validation=validation,
        nan_window=window,
        args=args,
        settings=local_identity.run_settings(args),
        topology=local_identity.topology(args),
    )
    for patch in PATCHES:
        patch.install(_PATCHER)
    logger.info("local_tier: validated local checkpoint tier installed (NaN window %d)", window)


def uninstall() -> None:
    """Undo :func:`install` (tests)."""
    _PATCHER.restore()
    common.STATE = None
