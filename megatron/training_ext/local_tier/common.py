"""Constants, the decision state of one install and the small helpers shared by the modules of the
validated local tier.

:class:`TierState` is created by the component (:mod:`.component`, ``COMPONENT.state``) at each
install; nothing here holds state.
"""

from __future__ import annotations

import logging
import re
from collections import deque
from dataclasses import dataclass, field
from typing import Any, List, Optional

import torch
import torch.distributed as dist

from megatron.integrity import local_layout
from megatron.overlay import collective
from megatron.overlay.collective import shorten

LOCAL_TIER_BAD_EXIT_CODE = 75
"""Exit code of a run that found a NaN/Inf result within the NaN window after resuming from the
local tier (``EX_TEMPFAIL``): start the job again; the next start loads the persistent tier."""

DEFAULT_NAN_WINDOW = 50
"""Default of ``--local-tier-nan-window`` (iterations after a local-tier resume)."""

MARKER_NAME = local_layout.MARKER_NAME
"""Marker file, one per rank, in the rank's local checkpoint directory \
(``<root>/<session>/<rank>``)."""

QUARANTINE_DIR = local_layout.QUARANTINE_DIR
"""Sub-directory of a rank's local checkpoint directory into which earlier versions of this fork
moved rejected local files. Nothing is moved there any more (a start sets unusable files aside in
place, deleted once this run's first local save completes); a directory left by those versions is
removed with the marker by the next local save complete on all ranks."""

FINITE_ATTR = "_megatron_local_tier_finite"
"""Attribute of a saved ``TensorAwareStateDict``: ``{"format", "version", "owner_rank",
"finite": [True | False | None per tensor, in ``tensors`` order]}``."""

FINITE_FORMAT = "megatron.local_tier.finite"

MARKER_FORMAT = "megatron.local_tier.bad_marker"

LOG_PREFIX = "[local-tier]"

logger = logging.getLogger("megatron.training_ext.local_tier")

RERUN_EXIT_CODES = (16, 17)  # megatron.core.rerun_state_machine EXIT_CODE_* (checked at install)

FINITE_CHUNK = 1 << 26  # elements per isfinite() pass in the fallback (bounds the bool temporary)

NONFINITE_WORDS = re.compile(r"\bnan\b|\binf\b|non-?finite", re.IGNORECASE)


@dataclass
class TierState:
    """The decision state of one install of the tier (``COMPONENT.state``).

    Attributes:
        validation: ``--local-tier-validation`` (always True while installed).
        nan_window: ``--local-tier-nan-window`` (iterations after a local resume).
        args: the run's arguments at install.
        settings, topology: :func:`megatron.integrity.local_identity.run_settings` and
            ``topology`` of ``args`` at install.
        force_persistent, rejected_reason: the start rejected the local tier, and why.
        local_load_iteration: the local iteration this process resumed from.
        manager: the manager that served the local load (the NaN window writes its marker).
        marker_written: this process wrote the bad-tier marker (the next save keeps it).
        deferring, deferred: result validations deferred inside an iteration of the NaN window.
        warned_unverified: a file without a checksum record was reported once.
        async_writer: the background thread of asynchronous local saves
            (:class:`~.async_save.AsyncLocalWriter`), started by the first one.
        async_pending: their scheduled requests not finalized yet, oldest first.
        distribution_cache: ``((algo, group id, structure fingerprint), distribution)`` of the
            last local save (:mod:`.structure_cache`).
    """

    validation: bool
    nan_window: int
    args: Any = None
    settings: Optional[dict] = None
    topology: Optional[dict] = None
    force_persistent: bool = False
    rejected_reason: Optional[str] = None
    local_load_iteration: Optional[int] = None
    manager: Any = None
    marker_written: bool = False
    deferring: bool = False
    deferred: List[str] = field(default_factory=list)
    warned_unverified: bool = False
    async_writer: Any = None
    async_pending: deque = field(default_factory=deque)
    distribution_cache: Optional[tuple] = None


def gather_objects(obj: Any) -> list:
    """``all_gather_object`` on the default group (world)."""
    return collective.all_gather_object(obj)


def flag_device() -> torch.device:
    """Where a small collective's tensor lives: the current CUDA device under NCCL, else the
    CPU (gloo)."""
    backend = str(dist.get_backend()).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def any_rank(flag: bool) -> bool:
    """Collective: True if ``flag`` is set on any rank (one all-reduce of one int)."""
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=flag_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def exc_text(e: BaseException) -> str:
    """``Type: message`` of an exception; for a multi-line message (``ChecksumMismatchError``: a
    header, then one line per problem) the first problem line and a count."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    if len(lines) > 1:
        more = f" (+{len(lines) - 2} more)" if len(lines) > 2 else ""
        return f"{type(e).__name__}: {shorten(lines[1], 260)}{more}"
    return f"{type(e).__name__}: {shorten(lines[0] if lines else '', 260)}"


def megatron_args(state: Optional[TierState]) -> Any:
    """The run's arguments: those ``state`` was installed with, else megatron's global ones
    (``None`` outside ``pretrain()``)."""
    if state is not None and state.args is not None:
        return state.args
    try:
        from megatron.training.global_vars import get_args

        return get_args()
    except Exception:  # noqa: BLE001 - not inside pretrain()
        return None
