"""The NaN window: after a resume from the local tier, a non-finite loss or grad norm within
``--local-tier-nan-window`` iterations writes the bad-tier marker and exits with code 75, so that
the next start loads the persistent tier.
"""

from __future__ import annotations

import inspect
import math
import os
import sys
from typing import Any

import torch

from megatron.overlay.collective import summarize
from megatron.overlay.registry import wraps_upstream
from megatron.training_ext.console import rank_line
from megatron.training_ext.local_tier.common import (
    LOCAL_TIER_BAD_EXIT_CODE,
    LOG_PREFIX,
    NONFINITE_WORDS,
    RERUN_EXIT_CODES,
    any_rank,
    gather_objects,
    shorten,
)
from megatron.training_ext.local_tier.component import COMPONENT
from megatron.training_ext.local_tier.markers import write_marker


def _is_finite_value(v: Any) -> bool:
    if v is None:
        return True
    if isinstance(v, torch.Tensor):
        if not (v.is_floating_point() or v.is_complex()):
            return True
        return bool(torch.isfinite(v.detach()).all().item())
    if isinstance(v, (list, tuple)):
        return all(_is_finite_value(x) for x in v)
    try:
        return math.isfinite(float(v))
    except (TypeError, ValueError):
        return True


def _exit_now(iteration: int, reason: str) -> None:
    """Rank-local failure inside the window: marker on this rank, then ``os._exit(75)`` (the
    other ranks may be blocked in a collective; the launcher stops them)."""
    st = COMPONENT.state
    path = write_marker(st.manager, iteration, reason)
    rank_line(
        LOG_PREFIX,
        f"non-finite result at iteration {iteration} after resuming from the local checkpoint at "
        f"iteration {st.local_load_iteration} ({shorten(reason, 300)}); wrote {path}; exiting "
        f"with code {LOCAL_TIER_BAD_EXIT_CODE}",
    )
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(LOCAL_TIER_BAD_EXIT_CODE)


def wrap_train_step(upstream):
    sig = inspect.signature(upstream)

    @wraps_upstream(upstream)
    def train_step(*a, **kw):
        """Upstream's ``train_step``; inside the NaN window after a local-tier resume, a
        non-finite loss or grad norm marks the local tier bad and exits."""
        st = COMPONENT.state
        iteration = sig.bind(*a, **kw).arguments.get("iteration")
        if (
            st is None
            or st.nan_window <= 0
            or st.local_load_iteration is None
            or st.manager is None
            or iteration is None
            or not iteration < st.local_load_iteration + st.nan_window
        ):
            return upstream(*a, **kw)
        st.deferred = []
        st.deferring = True
        try:
            out = upstream(*a, **kw)
        except Exception as e:
            st.deferring = False
            if NONFINITE_WORDS.search(str(e)):
                _exit_now(iteration + 1, f"{type(e).__name__}: {e}")
            raise
        finally:
            st.deferring = False
        reasons = list(st.deferred)
        if not (isinstance(out, tuple) and len(out) >= 6):
            return out
        loss_dict, _, _, should_exit, exit_code, grad_norm = out[:6]
        if should_exit and exit_code in RERUN_EXIT_CODES:
            reasons.append(
                f"rerun state machine requested exit code {exit_code} (result validation failed)"
            )
        for key, value in (loss_dict or {}).items():
            if not _is_finite_value(value):
                reasons.append(f"'{key}' is {value}")
        if not _is_finite_value(grad_norm):
            reasons.append(f"grad norm is {grad_norm}")
        if not any_rank(bool(reasons)):
            return out
        gathered = gather_objects(reasons)
        reason = f"non-finite training result: {summarize(gathered)}"
        path = write_marker(st.manager, iteration + 1, reason)
        rank_line(
            LOG_PREFIX,
            f"non-finite result at iteration {iteration + 1}, "
            f"{iteration + 1 - st.local_load_iteration} "
            f"iteration(s) after resuming from the local checkpoint at iteration "
            f"{st.local_load_iteration}: marked the local tier bad ({path}) and exiting with code "
            f"{LOCAL_TIER_BAD_EXIT_CODE} without saving; the next start loads the persistent "
            f"checkpoint",
        )
        out = list(out)
        out[0], out[2], out[3], out[4] = {}, False, True, LOCAL_TIER_BAD_EXIT_CODE
        return tuple(out)

    return train_step


def wrap_validate_result(upstream):
    @wraps_upstream(upstream)
    def validate_result(
        self, result, rejection_func, message, comparison_func=None, tolerance=0.0, fatal=True
    ):
        """Upstream's ``validate_result``; deferred while the NaN window decides."""
        st = COMPONENT.state
        if st is not None and st.deferring and fatal:
            from megatron.core.rerun_state_machine import RerunMode

            if bool(rejection_func(result)):
                text = f"{message} (result {shorten(result, 60)})"
                if text not in st.deferred:
                    st.deferred.append(text)
                if self.mode == RerunMode.DISABLED:
                    return None  # decided collectively at the end of the iteration
        return upstream(self, result, rejection_func, message, comparison_func, tolerance, fatal)

    return validate_result
