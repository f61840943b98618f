"""The fallback of ``load_checkpoint``: a persistent checkpoint that fails verification gives way
to the previous complete one, on every rank together (upstream has no fallback: with
``--verify-integrity`` the run stops at the first bad checkpoint); the tracker is overruled by
:func:`~megatron.training_ext.persistent_tier.resume.resume_point` and the model shape checked
before anything is read. When nothing is left to fall back to, the error says what to do.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import List, Optional

from megatron.integrity import persistent_dirs, unpickle
from megatron.integrity.manifest import CheckpointIntegrityError, FileProblem
from megatron.overlay import Patch, alias_of, wraps_upstream
from megatron.training_ext.console import rank0_line
from megatron.training_ext.persistent_tier.common import (
    ITER_DIR,
    LOG_PREFIX,
    NON_PERSISTENT,
    TRACKER,
    tier_state,
)
from megatron.training_ext.persistent_tier.restricted import find_unsafe
from megatron.training_ext.persistent_tier.resume import check_model_shape, resume_point

__all__ = ["PATCHES"]


def _wrap_load_checkpoint(orig, get_args):
    @wraps_upstream(orig)
    def load_checkpoint(*args, **kwargs):
        """megatron.training load_checkpoint that falls back to the previous complete persistent
        checkpoint when the newest fails verification (megatron.training_ext.persistent_tier)."""
        margs = get_args()
        user_step = getattr(margs, "ckpt_step", None)
        tried: set = set()
        failures: List[CheckpointIntegrityError] = []
        load_dir = getattr(margs, _bound_load_arg(args, kwargs), None)
        if not user_step:
            step, line = resume_point(load_dir)
            if step is not None:
                rank0_line(LOG_PREFIX, line)
                tier_state().overruled.add(os.path.realpath(os.path.join(load_dir, TRACKER)))
                margs.ckpt_step = step
        if load_dir:
            target = margs.ckpt_step or persistent_dirs.read_tracker(load_dir).iteration
            if target:
                check_model_shape(os.path.join(load_dir, f"iter_{int(target):07d}"), margs)
        try:
            while True:
                try:
                    try:
                        return orig(*args, **kwargs)
                    except CheckpointIntegrityError:
                        raise
                    except (KeyboardInterrupt, SystemExit):
                        raise
                    except BaseException as x:  # DCP's CheckpointException is a BaseException
                        failed_ckpt = _as_integrity_error(x, load_dir, margs)
                        if failed_ckpt is None:
                            raise
                        raise failed_ckpt from x
                except CheckpointIntegrityError as e:
                    failed = Path(e.checkpoint_dir)
                    failures.append(e)
                    tried.add(os.path.realpath(failed))
                    nxt = None
                    if not user_step and failed.parent.name != NON_PERSISTENT:
                        nxt = _previous_complete(failed, tried)
                    if nxt is None:
                        raise CheckpointIntegrityError(
                            failed,
                            e.problems,
                            e.detail,
                            _no_fallback_advice(failed, user_step, failures),
                        ) from None
                    rank0_line(
                        LOG_PREFIX,
                        f"{failed.name} failed verification:\n"
                        + "\n".join(f"  {p}" for p in e.problems)
                        + f"\n{LOG_PREFIX} falling back to the previous complete checkpoint, "
                        f"iter_{nxt:07d}",
                    )
                    margs.ckpt_step = nxt
        finally:
            margs.ckpt_step = user_step

    return load_checkpoint


def _as_integrity_error(x: Exception, load_dir, margs) -> Optional[CheckpointIntegrityError]:
    """``x`` as a failed checkpoint when an unsafe pickle caused it (a file of the checkpoint
    names a global outside the allowlist: :func:`~.restricted.find_unsafe`), else ``None``. The
    checkpoint is the one the file lies in, else the iteration being loaded."""
    unsafe = find_unsafe(x)
    if unsafe is None or not load_dir:
        return None
    where = Path(unsafe.path)
    ckpt = next((p for p in where.parents if ITER_DIR.match(p.name)), None)
    if ckpt is None:
        step = margs.ckpt_step or persistent_dirs.read_tracker(load_dir).iteration
        ckpt = Path(load_dir) / f"iter_{int(step or 0):07d}"
    name = os.path.relpath(where, ckpt) if ckpt in where.parents else unsafe.path
    problem = FileProblem(
        name,
        f"names {unsafe.global_name}, outside the unpickling allowlist: not loaded "
        f"({unpickle.UNRESTRICTED_FLAG} loads files you trust)",
    )
    return CheckpointIntegrityError(ckpt, [problem], "restricted unpickling")


def _bound_load_arg(args, kwargs) -> str:
    """``load_arg`` of a ``load_checkpoint(ddp_model, optimizer, opt_param_scheduler, load_arg,
    ...)`` call (default ``"load"``)."""
    if "load_arg" in kwargs:
        return kwargs["load_arg"]
    return args[3] if len(args) > 3 else "load"


def _no_fallback_advice(failed: Path, user_step, failures) -> str:
    earlier = (
        ""
        if len(failures) == 1
        else (
            "; earlier checkpoints also failed: "
            + ", ".join(Path(f.checkpoint_dir).name for f in failures[:-1])
        )
    )
    if user_step:
        why = f"--ckpt-step {user_step} asks for this one"
    elif failed.parent.name == NON_PERSISTENT:
        why = "a global non-persistent checkpoint; remove it to resume from the persistent tier"
    else:
        why = f"no earlier complete checkpoint in {failed.parent} to fall back to"
    return (
        f"{why}{earlier}. Restore the files from a copy, or choose another --ckpt-step; "
        f"--no-verify-integrity loads without checksums, as upstream does (not recommended)"
    )


def _wrap_load_checkpoint_of_run(upstream):
    """Factory: :func:`_wrap_load_checkpoint` of ``upstream`` with the run's arguments."""
    import megatron.training.checkpointing as ckpt

    return _wrap_load_checkpoint(upstream, lambda: ckpt.get_args())


_LOAD_WHY = (
    "a checkpoint that fails verification falls back to the previous complete one, on "
    "every rank together; a missing, damaged or stale tracker is overruled by the newest "
    "complete checkpoint"
)


def _previous_complete(failed: Path, tried: set) -> Optional[int]:
    """The newest ``iter_*`` below ``failed``'s iteration in the same directory that is complete
    (:func:`~megatron.integrity.persistent_dirs.is_complete`) and not tried yet, else ``None``."""
    m = ITER_DIR.match(failed.name)
    if not m:
        return None
    below = int(m.group(1))
    cands = [
        it
        for it in persistent_dirs.complete_iterations(failed.parent)
        if it < below and os.path.realpath(failed.parent / f"iter_{it:07d}") not in tried
    ]
    return max(cands, default=None)


#: The patches of ``load_checkpoint`` (``checkpointing``'s, then ``training``'s own binding).
PATCHES = (
    Patch(
        "megatron.training.checkpointing.load_checkpoint", _wrap_load_checkpoint_of_run, _LOAD_WHY
    ),
    Patch(
        "megatron.training.training.load_checkpoint",
        alias_of("megatron.training.checkpointing.load_checkpoint"),
        _LOAD_WHY + " (train()'s own binding)",
    ),
)
