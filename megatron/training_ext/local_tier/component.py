"""The validated local tier as a :class:`~megatron.overlay.component.Component`: when the
arguments switch it on, what it replaces upstream, what it checks before it does, and the state
of one install (``COMPONENT.state``).

The modules of the tier read the state from :data:`COMPONENT` (this module imports none of them
at its top, so each can import it at its own); the patch factories below import the replacements
when the patches are installed.
"""

from __future__ import annotations

from typing import Any

from nvidia_resiliency_ext.checkpointing.local.ckpt_managers import local_manager
from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import (
    LocalCheckpointManager,
)

from megatron.integrity import local_identity
from megatron.overlay import Patch, alias_of
from megatron.overlay.component import Component
from megatron.training_ext.local_tier.common import (
    DEFAULT_NAN_WINDOW,
    RERUN_EXIT_CODES,
    TierState,
    logger,
)

__all__ = [
    "COMPONENT",
    "LocalTier",
    "route_schedule",
    "validated_manager",
    "wrap_maybe_finalize",
    "wrap_train_step",
    "wrap_validate_result",
]


def validated_manager(_original: Any) -> type:
    """Patch factory: :class:`~megatron.training_ext.local_tier.manager.
    ValidatedLocalCheckpointManager`, the class ``pretrain()`` builds."""
    from megatron.training_ext.local_tier.manager import ValidatedLocalCheckpointManager

    return ValidatedLocalCheckpointManager


def wrap_train_step(upstream: Any) -> Any:
    """Patch factory: :func:`megatron.training_ext.local_tier.nan_window.wrap_train_step`."""
    from megatron.training_ext.local_tier import nan_window

    return nan_window.wrap_train_step(upstream)


def wrap_validate_result(upstream: Any) -> Any:
    """Patch factory: :func:`megatron.training_ext.local_tier.nan_window.wrap_validate_result`."""
    from megatron.training_ext.local_tier import nan_window

    return nan_window.wrap_validate_result(upstream)


def route_schedule(upstream: Any) -> Any:
    """Patch factory: :func:`megatron.training_ext.local_tier.async_save.route_schedule`."""
    from megatron.training_ext.local_tier import async_save

    return async_save.route_schedule(upstream)


def wrap_maybe_finalize(upstream: Any) -> Any:
    """Patch factory: :func:`megatron.training_ext.local_tier.async_save.wrap_maybe_finalize`."""
    from megatron.training_ext.local_tier import async_save

    return async_save.wrap_maybe_finalize(upstream)


def crc32_options_per_thread(upstream: Any) -> Any:
    """Patch factory: :func:`megatron.integrity.torch_save.crc32_options_per_thread`."""
    from megatron.integrity.torch_save import crc32_options_per_thread as factory

    return factory(upstream)


def wrap_from_state_dict(upstream: Any) -> Any:
    """Patch factory: :func:`megatron.training_ext.local_tier.structure_cache.
    wrap_from_state_dict`."""
    from megatron.training_ext.local_tier import structure_cache

    return structure_cache.wrap_from_state_dict(upstream)


_WHY_ASYNC = (
    "an asynchronous local save (--async-save) stays in this process: a background thread "
    "writes it, the training loop finalizes it once done on every rank"
)


class LocalTier(Component[TierState]):
    """``--non-persistent-ckpt-type local`` with local-tier validation (the default): local
    checkpoints are used only when they are the right run, iteration and topology
    (``docs/local-tier.md``)."""

    name = "local_tier"
    title = (
        "validated local checkpoints: right run, iteration and topology, repaired from verified "
        "replicas, resharded at another DP size, NaN window"
    )
    patches = (
        Patch(
            "nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager."
            "LocalCheckpointManager",
            validated_manager,
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
        Patch("megatron.training.checkpointing.schedule_async_save", route_schedule, _WHY_ASYNC),
        Patch(
            "megatron.training.async_utils.maybe_finalize_async_save",
            wrap_maybe_finalize,
            _WHY_ASYNC,
        ),
        Patch(
            "megatron.training.training.maybe_finalize_async_save",
            alias_of(
                "megatron.training.async_utils.maybe_finalize_async_save",
                only_if_same=True,
                otherwise=wrap_maybe_finalize,
            ),
            _WHY_ASYNC + " (train()'s binding)",
        ),
        Patch(
            "torch.serialization.get_crc32_options",
            crc32_options_per_thread,
            "torch.save computes CRC-32 over every tensor record (42 of 65 ms for a 78 MB local "
            "checkpoint) that torch.load never checks; the local tier's files skip it (their "
            "tensors carry XXH3 checksums, their pickle keeps its CRC-32), per thread, so no "
            "other save changes",
        ),
        Patch(
            "megatron.core.dist_checkpointing.tensor_aware_state_dict.MCoreTensorAwareStateDict."
            "from_state_dict",
            wrap_from_state_dict,
            "every local save re-validated the sharding and recomputed the shard distribution "
            "(two all_gather_object calls in the training loop) unless the user promised a "
            "constant structure; the distribution is reused while no rank's structure changed",
            params=("sharded_state_dict", "algo", "parallelization_group", "cached_metadata"),
        ),
    )

    def enabled(self, args: Any) -> bool:
        """Local checkpoints (``--non-persistent-ckpt-type local``) and validation on (the
        default; ``--no-local-tier-validation`` restores upstream's local tier)."""
        return getattr(args, "non_persistent_ckpt_type", None) == "local" and bool(
            getattr(args, "local_tier_validation", True)
        )

    def new_state(self, args: Any) -> TierState:
        window = getattr(args, "local_tier_nan_window", None)
        return TierState(
            validation=True,
            nan_window=DEFAULT_NAN_WINDOW if window is None else int(window),
            args=args,
            settings=local_identity.run_settings(args),
            topology=local_identity.topology(args),
        )

    def check_patch_points(self) -> list[str]:
        """The declared points, and: NVRx's ``LocalCheckpointManager`` is still NVRx's own (not
        replaced by another patch), and upstream's rerun exit codes are those the NaN window
        recognises."""
        import megatron.core.rerun_state_machine as rsm

        problems = super().check_patch_points()
        if local_manager.LocalCheckpointManager is not LocalCheckpointManager:
            problems.append(
                "nvidia_resiliency_ext LocalCheckpointManager was already replaced by "
                f"{local_manager.LocalCheckpointManager!r}"
            )
        codes = (
            getattr(rsm, "EXIT_CODE_RESUME_TO_DISAMBIGUATE", None),
            getattr(rsm, "EXIT_CODE_FAILED_ON_RESULT_VALIDATION", None),
        )
        if codes != RERUN_EXIT_CODES:
            problems.append(
                f"megatron.core.rerun_state_machine exit codes are {codes}, expected "
                f"{RERUN_EXIT_CODES}"
            )
        return problems

    def install(self, args: Any = None):
        """As :meth:`Component.install`; a reinstall (a new attempt in the same process) first
        stops the background thread of the previous attempt's asynchronous local saves."""
        if self.state is not None:
            self.stopped(self.state)
        return super().install(args)

    def stopped(self, state: TierState) -> None:
        """Stop the background thread of asynchronous local saves (its unfinalized saves are
        left as a crash leaves them: the previous complete local checkpoint stays usable)."""
        writer, state.async_writer = state.async_writer, None
        state.async_pending.clear()
        if writer is not None:
            writer.close()

    def started(self, state: TierState) -> None:
        logger.debug(
            "local_tier: validated local checkpoint tier installed (NaN window %d)",
            state.nan_window,
        )


#: The component (entry point ``local_tier``).
COMPONENT = LocalTier()
