"""Fixes of upstream checkpointing defects, installed onto the pinned upstream releases.

Usage::

    import megatron.fixes
    megatron.fixes.apply()          # idempotent; pretrain_gpt.py calls it before anything else

``python -m megatron.fixes [--json]`` lists each fix, the upstream report it answers, whether it is
active, every component above the fixes (:mod:`megatron.overlay.component`, as declared) and every
upstream attribute replaced (:mod:`megatron.overlay.registry`). ``$MEGATRON_FIXES_DISABLE`` names
fixes or components to leave out. Importing this
package does no work beyond definitions: the fix modules (which import upstream) are loaded by
:func:`fixes`.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys

from megatron.overlay import Fix, FixStatus, PatchSpec, UnsupportedUpstreamError
from megatron.overlay.component import DISABLE_ENV, declared_names, disabled

# One module per upstream defect; each defines ``FIX``. Order matters only for logging.
FIX_MODULES = (
    "megatron.fixes.replication",
    "megatron.fixes.modelopt_moe",
    "megatron.fixes.fsdp_dtensor",
    "megatron.fixes.distopt_resume",
    "megatron.fixes.distopt_reshard",
    "megatron.fixes.distopt_bucket_offsets",
    "megatron.fixes.distopt_padded_bucket",
    "megatron.fixes.dcp_prepend_axis",
    "megatron.fixes.training_log",
    "megatron.fixes.help_text",
    "megatron.fixes.pretrained_redirect",
    "megatron.fixes.async_reset",
    "megatron.fixes.rng_state_ep",
    "megatron.fixes.fsdp_rng",
    "megatron.fixes.missing_checkpoint_exit",
    "megatron.fixes.planned_exit_save",
    "megatron.fixes.data_loader_rng",
    "megatron.fixes.async_queue_teardown",
    "megatron.fixes.async_final_save",
    "megatron.fixes.async_worker_death",
    "megatron.fixes.nonpersistent_retention",
    "megatron.fixes.atomic_tracker",
)

__all__ = [
    "DISABLE_ENV",
    "Fix",
    "FixStatus",
    "PatchSpec",
    "UnsupportedUpstreamError",
    "apply",
    "disabled",
    "fixes",
    "reset",
]


def fixes() -> list[Fix]:
    """The registered fixes (importing their modules on first call)."""
    return [importlib.import_module(name).FIX for name in FIX_MODULES]


def apply(strict: bool = True) -> dict[str, FixStatus]:
    """Decide every fix on the installed upstream and install those found active; idempotent (a
    second call changes nothing). Each fix decides by its behavioural probe
    (:meth:`megatron.overlay.Fix.decide`): active, standing aside, or refused.

    Fixes named in ``$MEGATRON_FIXES_DISABLE`` are left out (status ``NOT_APPLIED``, with a
    warning).

    Leaves no process-group state behind: ``torch.distributed.is_initialized()`` is what it was
    before the call, and ``sys.excepthook`` too (``init_process_group`` installs a hook that
    prefixes tracebacks with ``[rankN]:``; a capability probe that needs a group starts a private
    1-rank one and must not leave it, nor its ``[rank0]:`` prefix, to the job).

    Args:
        strict: raise when any fix is refused (``pretrain_gpt.py``); ``False`` records the refusal
            in the fix's status and reason and goes on (``python -m megatron.fixes``).

    Returns:
        fix name -> :class:`FixStatus`.

    Raises:
        UnsupportedUpstreamError: with ``strict``, after every fix was decided, when any was
            refused (its probe cannot tell on an unproven upstream, or the defect is there but its
            patch points changed); the message names each refused fix.
        ValueError: ``$MEGATRON_FIXES_DISABLE`` names something that is neither a fix nor a
            declared component (raised before anything is installed; the message lists both).
    """
    import torch.distributed as dist

    was_initialized = dist.is_available() and dist.is_initialized()
    hook = sys.excepthook
    before = {f.name: f.status for f in fixes()}
    try:
        statuses, refused = _apply_all()
        _log_summary(before)
        if refused and strict:
            raise UnsupportedUpstreamError("\n".join(refused))
        return statuses
    finally:
        if dist.is_available() and dist.is_initialized() and not was_initialized:
            logging.getLogger("megatron.fixes").warning(
                "a fix left a process group initialised; destroying it"
            )
            dist.destroy_process_group()
        sys.excepthook = hook


def _log_summary(before: dict) -> None:
    """One line, on rank 0 (``$RANK``; apply runs before any process group), when this call
    installed fixes: how many are active on which upstream versions. Each fix's own line is at
    DEBUG; ``python -m megatron.fixes`` lists them."""
    fresh = [f for f in fixes() if f.status is FixStatus.ACTIVE and before.get(f.name) != f.status]
    if not fresh or os.environ.get("RANK", "0") != "0":
        return
    active = [f for f in fixes() if f.status is FixStatus.ACTIVE]
    aside = [f for f in fixes() if f.status is FixStatus.STANDS_ASIDE]
    versions = {}
    for f in active:
        versions.setdefault(f.package, f.installed_version())
    on = " / ".join(f"{p} {v}" for p, v in sorted(versions.items()))
    also = f", {len(aside)} standing aside (upstream behaves)" if aside else ""
    logging.getLogger("megatron.fixes").info(
        "[fixes] %d active on %s%s (python -m megatron.fixes for details)", len(active), on, also
    )


def _apply_all() -> tuple[dict[str, FixStatus], list[str]]:
    off = disabled()
    known = {f.name for f in fixes()}
    components = set(declared_names())
    unknown = off - known - components
    if unknown:  # before anything is installed: a typo must not run with a fix left out
        raise ValueError(
            f"${DISABLE_ENV} names unknown fixes or components {sorted(unknown)}; "
            f"known: {sorted(known)}; components: {sorted(components)}"
        )
    statuses, refused = {}, []
    for fix in fixes():
        if fix.name in off:
            logging.getLogger("megatron.fixes").warning(
                "fix %s: disabled by $%s: upstream's defect is back", fix.name, DISABLE_ENV
            )
            statuses[fix.name] = fix.status
            continue
        try:
            statuses[fix.name] = fix.apply()
        except UnsupportedUpstreamError as exc:
            statuses[fix.name] = fix.status
            refused.append(str(exc))
    return statuses, refused


def reset() -> None:
    """Undo every installed fix (test isolation)."""
    for fix in reversed(fixes()):
        fix.reset()
