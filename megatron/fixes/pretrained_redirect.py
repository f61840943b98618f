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
from typing import Any, Optional

from megatron.overlay import Fix, Patcher
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

    def upstream_behaves(self) -> bool:
        from megatron.training import checkpointing as ckpt

        src = inspect.getsource(ckpt.load_checkpoint)
        branch = src.split("pretrained_checkpoint", 1)[-1].split("args.finetune = True", 1)[0]
        return "non_persistent" in branch

    def install(self, patcher: Patcher) -> None:
        from megatron.training import checkpointing as ckpt
        from megatron.training import training

        upstream = ckpt.load_checkpoint
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
            context = kw.get(
                "checkpointing_context", a[context_pos] if len(a) > context_pos else None
            )
            iteration = run_non_persistent_iteration(args, load_dir, context)
            if iteration < 0:
                return upstream(
                    *a, **kw
                )  # the run has no checkpoint: start from the pretrained one
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

        patcher.replace(
            ckpt,
            "load_checkpoint",
            load_checkpoint,
            "a restart after only non-persistent saves starts over from the "
            "--pretrained-checkpoint weights instead of the run's newest checkpoint",
        )
        if getattr(training, "load_checkpoint", None) is upstream:
            patcher.replace(
                training,
                "load_checkpoint",
                load_checkpoint,
                "pretrain() calls load_checkpoint through training's own import",
            )


FIX = PretrainedRedirectFix()
