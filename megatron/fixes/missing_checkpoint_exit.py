"""Fix: ``--exit-on-missing-checkpoint`` exits 0 when ``--load`` holds no checkpoint.

megatron-core 0.19.2's ``megatron.training.checkpointing._load_base_checkpoint`` ends a run whose
``--load`` holds neither a tracker nor a newer non-persistent checkpoint with ``sys.exit()``
when ``--exit-on-missing-checkpoint`` is set: exit status 0, having trained nothing, so a job
script, a scheduler or a CI harness sees a success (Megatron-LM PR 6321, on upstream main).

The replacement wraps ``_load_base_checkpoint`` (``load_checkpoint`` and
``load_args_from_checkpoint`` call it through the module global): a ``SystemExit`` with status
0 or ``None`` raised by upstream's while ``args.exit_on_missing_checkpoint`` is set becomes exit
status 1, after one line on rank 0 naming ``--load``. Any other exit, error or result passes as
upstream gives it. Detection of a fixed upstream is by behaviour: upstream's own function, called
on an empty directory with the flag set, exits with a non-zero status.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import tempfile
import warnings
from typing import Callable

from megatron.fixes.standins import StandInArgs, replaced, upstream_own
from megatron.overlay import Fix, Patch
from megatron.overlay.registry import wraps_upstream

_CKPT = "megatron.training.checkpointing"

#: The exit status of a start that found nothing to load (what upstream main uses).
EXIT_STATUS = 1


def missing_checkpoint_line(load_dir: str | None) -> str:
    """The line a start prints (rank 0) before exiting with :data:`EXIT_STATUS`: ``--load``
    named, what was looked for, what to do."""
    where = f"--load {load_dir}" if load_dir else "no --load given"
    return (
        f"pretrain_gpt.py: --exit-on-missing-checkpoint: {where} holds no checkpoint to resume "
        "(no latest_checkpointed_iteration.txt, and no non-persistent checkpoint); nothing was "
        f"trained, exit status {EXIT_STATUS}. Point --load at the run's checkpoint directory, or "
        "leave out --exit-on-missing-checkpoint to start from scratch."
    )


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def wrap_load_base_checkpoint(upstream: Callable) -> Callable:
    """Factory of the replacement of ``megatron.training.checkpointing._load_base_checkpoint``:
    upstream's; its ``SystemExit`` of status 0 or ``None`` under
    ``args.exit_on_missing_checkpoint`` re-raised with status :data:`EXIT_STATUS` (every rank
    reaches it: upstream's barrier precedes the exit), one line on rank 0
    (:func:`missing_checkpoint_line`)."""

    @wraps_upstream(upstream)
    def _load_base_checkpoint(load_dir, args, *rest, **kwargs):
        """Upstream's; a missing checkpoint under --exit-on-missing-checkpoint exits non-zero."""
        try:
            return upstream(load_dir, args, *rest, **kwargs)
        except SystemExit as exc:
            if exc.code not in (None, 0) or not getattr(args, "exit_on_missing_checkpoint", False):
                raise
            if _rank() == 0:
                print(missing_checkpoint_line(load_dir), file=sys.stderr, flush=True)
            raise SystemExit(EXIT_STATUS) from None

    return _load_base_checkpoint


def upstream_exit_status_on_missing_checkpoint(fn: Callable | None = None) -> int | None:
    """The exit status of upstream's ``_load_base_checkpoint`` (or ``fn``) on an empty ``--load``
    with ``--exit-on-missing-checkpoint`` (no non-persistent checkpoint type; its output and
    warnings swallowed; the loaded-iteration record put back). ``None`` when it returns instead
    of exiting, or when a process group is initialised (upstream's barrier would need every rank
    to probe at once: the probe cannot tell then).

    Returns:
        ``0`` on megatron-core 0.19.2 (the defect: ``sys.exit()``), ``1`` on upstream main.
    """
    import torch.distributed as dist
    from megatron.training import checkpointing as ckpt

    if dist.is_available() and dist.is_initialized():
        return None
    fn = fn or upstream_own(ckpt._load_base_checkpoint)
    args = StandInArgs(
        exit_on_missing_checkpoint=True,
        non_persistent_ckpt_type=None,
        non_persistent_global_ckpt_dir=None,
        ckpt_step=None,
    )
    loaded = getattr(ckpt, "_LOADED_ITERATION", None)
    out = io.StringIO()
    with tempfile.TemporaryDirectory(prefix="probe-missing-ckpt-") as empty:
        try:
            with (
                contextlib.redirect_stdout(out),
                contextlib.redirect_stderr(out),
                warnings.catch_warnings(),  # upstream's rank lookup warns without a group
                replaced(ckpt, _LOADED_ITERATION=loaded),
            ):
                warnings.simplefilter("ignore")
                fn(empty, args)
        except SystemExit as exc:
            return 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
    return None


class MissingCheckpointExitFix(Fix):
    name = "missing_checkpoint_exit"
    title = "--exit-on-missing-checkpoint with nothing to load exits non-zero, naming --load"
    upstream_refs = ("Megatron-LM PR 6321 (sys.exit() on a missing checkpoint: exit status 0)",)
    package = "megatron-core"

    patches = (
        Patch(
            f"{_CKPT}._load_base_checkpoint",
            wrap_load_base_checkpoint,
            "--exit-on-missing-checkpoint ends a run that found nothing to load with exit "
            "status 0, which job scripts and schedulers read as success",
            params=("load_dir", "args"),
        ),
    )

    def upstream_behaves(self) -> bool | None:
        """Upstream's own ``_load_base_checkpoint`` on an empty directory with the flag set
        (:func:`upstream_exit_status_on_missing_checkpoint`): behaves if it exits non-zero;
        cannot tell (``None``) when it does not exit or a process group is up."""
        status = upstream_exit_status_on_missing_checkpoint()
        return None if status is None else status != 0


FIX = MissingCheckpointExitFix()
