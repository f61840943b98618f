"""Constants, the decision state and the small collective and logging helpers shared by the
modules of the validated local tier.

:data:`STATE` is the one decision state of a process (``None`` until :func:`install`); every module
reads it as ``common.STATE`` so that a reinstall is seen everywhere.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any, List, Optional

import torch
import torch.distributed as dist

from megatron.integrity import local_layout
from megatron.overlay import collective
from megatron.training_ext.console import write_line

LOCAL_TIER_BAD_EXIT_CODE = 75
"""Exit code of a run that found a NaN/Inf result within the NaN window after resuming from the
local tier (``EX_TEMPFAIL``): start the job again; the next start loads the persistent tier."""

DEFAULT_NAN_WINDOW = 50
"""Default of ``--local-tier-nan-window`` (iterations after a local-tier resume)."""

MARKER_NAME = local_layout.MARKER_NAME
"""Marker file, one per rank, in the rank's local checkpoint directory \
(``<root>/<session>/<rank>``)."""

QUARANTINE_DIR = local_layout.QUARANTINE_DIR
"""Sub-directory of a rank's local checkpoint directory that receives rejected local checkpoint
files (removed with the marker by the next local save complete on all ranks)."""

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
    validation: bool
    nan_window: int
    args: Any = None
    settings: Optional[dict] = None  # local_identity.run_settings(args) at install
    topology: Optional[dict] = None  # local_identity.topology(args) at install
    force_persistent: bool = False
    rejected_reason: Optional[str] = None
    local_load_iteration: Optional[int] = None
    manager: Any = None
    marker_written: bool = False
    deferring: bool = False
    deferred: List[str] = field(default_factory=list)
    warned_unverified: bool = False


STATE: Optional[TierState] = None
"""The decision state of the installed tier; ``None`` while it is not installed."""


def process_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def say(message: str) -> None:
    """One log line of this rank (stdout, flushed: it must survive an immediate exit)."""
    write_line(f"{LOG_PREFIX} rank {process_rank()}: {message}")


def gather_objects(obj: Any) -> list:
    """``all_gather_object`` on the default group (world)."""
    return collective.all_gather_object(obj)


def _flag_device() -> torch.device:
    backend = str(dist.get_backend()).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def any_rank(flag: bool) -> bool:
    """Collective: True if ``flag`` is set on any rank (one all-reduce of one int)."""
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=_flag_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def shorten(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def exc_text(e: BaseException) -> str:
    """``Type: message`` of an exception; for a multi-line message (``ChecksumMismatchError``: a
    header, then one line per problem) the first problem line and a count."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    if len(lines) > 1:
        more = f" (+{len(lines) - 2} more)" if len(lines) > 2 else ""
        return f"{type(e).__name__}: {shorten(lines[1], 260)}{more}"
    return f"{type(e).__name__}: {shorten(lines[0] if lines else '', 260)}"


def summarize(gathered: list, limit: int = 3) -> str:
    """``[[errors of rank 0], [errors of rank 1], ...]`` -> one line: each distinct error once,
    with the ranks that reported it."""
    by_text: dict[str, list[int]] = {}
    for r, errs in enumerate(gathered):
        for e in errs or []:
            by_text.setdefault(str(e), []).append(r)
    items = list(by_text.items())
    shown = "; ".join(
        f"rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))}: {shorten(t, 300)}"
        for t, rs in items[:limit]
    )
    more = f" (+{len(items) - limit} more)" if len(items) > limit else ""
    return shown + more


def megatron_args() -> Any:
    st = STATE
    if st is not None and st.args is not None:
        return st.args
    try:
        from megatron.training.global_vars import get_args

        return get_args()
    except Exception:  # noqa: BLE001 - not inside pretrain()
        return None
