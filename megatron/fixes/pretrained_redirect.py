"""Fix: a restart whose only checkpoints are non-persistent is turned into a finetune.

megatron-core 0.19.2's ``megatron.training.checkpointing.load_checkpoint`` switches to
``--pretrained-checkpoint`` (and sets ``args.finetune``) whenever ``checkpoint_exists(--load)`` is
false, and ``checkpoint_exists`` reads only the persistent tracker. A fine-tuning job that restarts
after writing only non-persistent checkpoints (global ``--non-persistent-ckpt-type global``, or the
local tier) therefore starts again from the pretrained weights at iteration 0 (global), or loads
the local weights with iteration 0 and then fails (local). Megatron-Bridge PR 4900 fixed the same
class of defect in its own loader.

Design notes: ``docs/fixes/pretrained_redirect.md``.
"""

from __future__ import annotations

import inspect
import os
import tempfile
from typing import Any, Callable, Optional

import torch

from megatron.fixes.standins import StandInArgs, replaced, upstream_own
from megatron.overlay import Fix, Patch, alias_of
from megatron.overlay.registry import wraps_upstream


def run_non_persistent_iteration(
    args: Any, load_dir: Optional[str], checkpointing_context: Optional[dict]
) -> int:
    """The newest non-persistent iteration of this run, as upstream's loader would find it.

    Args:
        args: Megatron's global args (``non_persistent_ckpt_type``,
            ``non_persistent_global_ckpt_dir``).
        load_dir: ``--load`` (may be ``None``); global non-persistent checkpoints live in
            ``<load>/non_persistent`` unless ``--non-persistent-global-ckpt-dir`` is given.
        checkpointing_context: ``pretrain()``'s context; holds the local checkpoint manager for
            ``--non-persistent-ckpt-type local``.

    Returns:
        The iteration (int), or -1 when there is none (or no non-persistent tier is configured).
        For the local tier this is the manager's ``find_latest()``, a collective over all ranks
        (every rank calls ``load_checkpoint``); the validated local tier memoizes its decision, so
        upstream's own call that follows costs nothing more.
    """
    from megatron.training import checkpointing as ckpt

    kind = getattr(args, "non_persistent_ckpt_type", None)
    if kind is None:
        return -1
    if kind == "local" and not (checkpointing_context or {}).get("local_checkpoint_manager"):
        return -1
    global_dir = getattr(args, "non_persistent_global_ckpt_dir", None)
    if not global_dir and load_dir is not None:
        global_dir = os.path.join(load_dir, ckpt._NON_PERSISTENT_CKPT_SUBDIR)
    if kind == "global" and global_dir is None:
        return -1
    return int(ckpt._get_non_persistent_iteration(global_dir, args, checkpointing_context))


def wrap_load_checkpoint(upstream: Callable) -> Callable:
    """Factory of the replacement of ``megatron.training.checkpointing.load_checkpoint``:
    upstream's, with ``args.pretrained_checkpoint`` hidden (``None`` for the call, then put back)
    while ``--load`` has no persistent checkpoint but the run has a non-persistent one
    (:func:`run_non_persistent_iteration`), so that upstream resumes it instead of switching to
    ``--pretrained-checkpoint`` (and ``--finetune``)."""
    from megatron.training import checkpointing as ckpt

    params = list(inspect.signature(upstream).parameters)
    load_arg_pos = params.index("load_arg")
    context_pos = params.index("checkpointing_context")

    @wraps_upstream(upstream)
    def load_checkpoint(*a, **kw):
        """Upstream's; ``--pretrained-checkpoint`` is hidden while the run has its own."""
        args = ckpt.get_args()
        pretrained = getattr(args, "pretrained_checkpoint", None)
        load_arg = kw.get("load_arg", a[load_arg_pos] if len(a) > load_arg_pos else "load")
        load_dir = getattr(args, load_arg, None)
        if pretrained is None or ckpt.checkpoint_exists(load_dir):
            return upstream(*a, **kw)
        context = kw.get("checkpointing_context", a[context_pos] if len(a) > context_pos else None)
        iteration = run_non_persistent_iteration(args, load_dir, context)
        if iteration < 0:
            return upstream(*a, **kw)  # the run has no checkpoint: start from the pretrained one
        ckpt.print_rank_0(
            f"[resume] this run has a {args.non_persistent_ckpt_type} non-persistent "
            f"checkpoint at iteration {iteration} and no persistent one in {load_dir}: "
            f"resuming it; --pretrained-checkpoint {pretrained} is used only when the run has "
            f"no checkpoint"
        )
        args.pretrained_checkpoint = None
        try:
            return upstream(*a, **kw)
        finally:
            args.pretrained_checkpoint = pretrained

    return load_checkpoint


class _Decided(Exception):
    """Raised by the probe's ``_load_base_checkpoint`` once upstream has chosen a directory."""


def upstream_resumes_non_persistent(fn: Callable | None = None) -> bool | None:
    """Whether upstream's ``load_checkpoint`` (or ``fn``) resumes the run's own non-persistent
    checkpoint rather than switching to ``--pretrained-checkpoint`` when ``--load`` holds only a
    global non-persistent checkpoint.

    Runs it in this process on a temporary directory: ``--load`` with
    ``non_persistent/latest_checkpointed_iteration.txt`` (iteration 5) and no persistent tracker,
    ``--pretrained-checkpoint`` with a persistent tracker (iteration 3),
    ``--non-persistent-ckpt-type global``; stand-in args and a ``_load_base_checkpoint`` that
    records the directory upstream chose and stops the load there (nothing else is read). The
    stand-ins and the directory are gone afterwards.

    Returns:
        True if upstream loads from ``--load`` without setting ``args.finetune``; False if it
        loads from ``--pretrained-checkpoint`` or sets ``finetune`` (the defect); None if it does
        not reach ``_load_base_checkpoint`` (this probe cannot tell).
    """
    from megatron.training import checkpointing as ckpt

    fn = fn or upstream_own(ckpt.load_checkpoint)
    chosen: list[tuple[Any, Any]] = []
    with tempfile.TemporaryDirectory(prefix="pretrained_redirect_probe_") as tmp:
        load_dir = os.path.join(tmp, "load")
        pretrained_dir = os.path.join(tmp, "pretrained")
        trackers = (
            (os.path.join(load_dir, ckpt._NON_PERSISTENT_CKPT_SUBDIR), "5"),
            (pretrained_dir, "3"),
        )
        for where, iteration in trackers:
            os.makedirs(where)
            with open(ckpt.get_checkpoint_tracker_filename(where), "w") as f:
                f.write(iteration)
        args = StandInArgs(
            load=load_dir,
            pretrained_checkpoint=pretrained_dir,
            non_persistent_ckpt_type="global",
            non_persistent_global_ckpt_dir=None,
            ckpt_format="torch_dist",
            auto_detect_ckpt_format=False,
            exit_on_missing_checkpoint=False,
            finetune=False,
            tensor_model_parallel_size=1,
            pipeline_model_parallel_size=1,
        )

        def load_base(*a, **k):
            chosen.append((k.get("load_dir", a[0] if a else None), args.finetune))
            raise _Decided

        with replaced(
            ckpt,
            get_args=lambda: args,
            print_rank_0=lambda *a, **k: None,
            _load_base_checkpoint=load_base,
        ):
            try:
                fn([torch.nn.Module()], None, None)
            except _Decided:
                pass
    if not chosen:
        return None
    where, finetune = chosen[0]
    return where == load_dir and not finetune


class PretrainedRedirectFix(Fix):
    name = "pretrained_redirect"
    title = (
        "a restart with only non-persistent checkpoints resumes them, not --pretrained-checkpoint"
    )
    upstream_refs = (
        "Megatron-Bridge PR 4900 (same defect class)",
        "megatron-core load_checkpoint: checkpoint_exists() reads only the persistent tracker",
    )
    package = "megatron-core"

    patches = (
        Patch(
            "megatron.training.checkpointing.load_checkpoint",
            wrap_load_checkpoint,
            "a restart after only non-persistent saves starts over from the "
            "--pretrained-checkpoint weights instead of the run's newest checkpoint",
            params=("load_arg", "checkpointing_context"),
        ),
        Patch(
            "megatron.training.training.load_checkpoint",
            alias_of("megatron.training.checkpointing.load_checkpoint", only_if_same=True),
            "pretrain() calls load_checkpoint through training's own import",
        ),
    )

    def upstream_behaves(self) -> bool | None:
        """:func:`upstream_resumes_non_persistent` on upstream's own ``load_checkpoint``."""
        return upstream_resumes_non_persistent()


FIX = PretrainedRedirectFix()
