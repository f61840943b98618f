"""Fix: the distributed optimizer's fully-reshardable checkpoints without apex / Transformer Engine,
and the advice upstream gives when a checkpoint cannot change TP/PP.

``--dist-ckpt-optim-fully-reshardable`` writes the distributed optimizer's state in model space
(one ``param``/``exp_avg``/``exp_avg_sq`` tensor per model parameter, global shapes): the format
that loads at another TP, PP or DP. megatron-core 0.19.2 cannot load it back with torch's Adam (no
apex, no TE: every CPU run, and GPU containers without them), dense models included
(``KeyError: 'step'``); and its refusal to change TP/PP names a flag that has no effect.

Design notes: ``docs/fixes/distopt_reshard.md``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Callable

import torch

from megatron.fixes.standins import StandInArgs, replaced, upstream_own
from megatron.overlay import Fix, Patch, alias_of
from megatron.overlay.registry import wraps_upstream

#: The part of upstream's refusal (``load_checkpoint``) that names the flag that changes nothing.
UPSTREAM_ADVICE = "Please use `--ckpt-fully-parallel-save` flag during checkpoint saving."
_REFUSAL = ": not supported for DistributedOptimizer with sharding type"
#: The flag upstream's refusal advises: deprecated, it changes nothing about the format saved.
STALE_FLAG = "--ckpt-fully-parallel-save"
#: The flag that writes the format that loads at another TP/PP.
WORKING_FLAG = "--dist-ckpt-optim-fully-reshardable"


def reshard_advice(upstream_message: str) -> str | None:
    """The refusal to change TP/PP with the message upstream should have given, or ``None`` when
    ``upstream_message`` is not that refusal.

    Args:
        upstream_message: text of a ``RuntimeError`` raised by upstream's ``load_checkpoint``, e.g.
            ``"(TP, PP) mismatch after resume ((1, 1) vs (2, 1) from checkpoint): not supported for
            DistributedOptimizer with sharding type dp_reshardable. Please use ..."``.

    Returns:
        The new message: the mismatch upstream found, why the format cannot follow it, and the two
        ways on (``--dist-ckpt-optim-fully-reshardable``, ``--no-load-optim``).
    """
    if UPSTREAM_ADVICE not in upstream_message or _REFUSAL not in upstream_message:
        return None
    mismatch, rest = upstream_message.split(_REFUSAL, 1)
    fmt = rest.split(".", 1)[0].strip() or "dp_reshardable"
    return (
        f"{mismatch}: this checkpoint holds the distributed optimizer's state in the {fmt!r} "
        "format (the default without --dist-ckpt-optim-fully-reshardable), whose layout follows "
        "the saving run's TP/PP buffers: it can change DP only. To change TP/PP, resume once at "
        "the TP/PP it was saved with, adding --dist-ckpt-optim-fully-reshardable: every "
        "checkpoint saved from then on (also one right after the load: --train-iters <its "
        "iteration> and a --save-interval that does not divide it) loads at any TP/PP/DP. Or "
        "pass --no-load-optim to load the model weights resharded and start a fresh optimizer. "
        "(Upstream's advice, --ckpt-fully-parallel-save, is deprecated and changes nothing.)"
    )


def upstream_copy_needs_step(fn: Callable | None = None) -> bool:
    """True if upstream's ``DistributedOptimizer._set_main_param_and_optimizer_states`` (or
    ``fn``) fails on a source without ``step`` for an optimizer whose per-parameter state has one
    (torch Adam): the defect, shown on a stand-in (no process group, no model; 4-element fp32
    tensors)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer as D

    main = torch.zeros(4)
    stand_in = SimpleNamespace(
        model_param_group_index_map={"p": (0, 0)},
        config=SimpleNamespace(use_precision_aware_optimizer_no_fp8_or_ds_fp8=False),
        optimizer=SimpleNamespace(
            param_groups=[{"params": [main]}],
            state={
                main: {
                    "step": torch.tensor(3.0),
                    "exp_avg": torch.zeros(4),
                    "exp_avg_sq": torch.zeros(4),
                }
            },
        ),
    )
    src = {"param": torch.ones(4), "exp_avg": torch.ones(4), "exp_avg_sq": torch.ones(4)}
    fn = fn or upstream_own(D._set_main_param_and_optimizer_states)
    try:
        with torch.no_grad():
            fn(stand_in, "p", src)
    except KeyError:
        return True
    return False


def wrap_set_main_param_and_optimizer_states(upstream: Callable) -> Callable:
    """Factory of the replacement of ``DistributedOptimizer._set_main_param_and_optimizer_states``:
    upstream's, with a source that has no ``step`` (the model-space formats keep it in the param
    groups) leaving Adam's per-parameter step alone instead of raising ``KeyError: 'step'``."""

    @wraps_upstream(upstream)
    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        """Upstream's, but a source without ``step`` leaves Adam's step alone."""
        # Upstream skips source entries that are not tensors: a missing 'step' becomes one.
        # Only 'step' (0-dim, kept in the param groups by the model-space formats); any other
        # missing key still raises upstream's KeyError.
        if "step" not in tensors:
            tensors = {**tensors, "step": None}
        return upstream(self, model_param, tensors)

    return _set_main_param_and_optimizer_states


def wrap_load_checkpoint(upstream: Callable) -> Callable:
    """Factory of the replacement of ``megatron.training.checkpointing.load_checkpoint``:
    upstream's, with its refusal to change TP/PP (``RuntimeError``) re-raised with the message of
    :func:`reshard_advice` (unchained); any other error is upstream's, unchanged."""

    @wraps_upstream(upstream)
    def load_checkpoint(*args, **kwargs):
        """Upstream's; its TP/PP refusal names the flags that work."""
        try:
            return upstream(*args, **kwargs)
        except RuntimeError as e:
            better = reshard_advice(str(e))
            if better is None:
                raise
            # from None: upstream's text, chained, would repeat the advice that does not work.
            raise RuntimeError(better) from None

    return load_checkpoint


def upstream_refusal(fn: Callable | None = None) -> str | None:
    """The message with which upstream's ``load_checkpoint`` (or ``fn``) refuses a
    ``dp_reshardable`` distributed-optimizer checkpoint saved at TP 2 when this run has TP 1.

    Runs it in this process on stand-ins: Megatron's args (``--use-distributed-optimizer``,
    ``torch_dist``, TP 1, PP 1) and a ``_load_base_checkpoint`` that returns a checkpoint whose
    args say TP 2 and whose content metadata says ``dp_reshardable``; nothing is read from disk
    and the stand-ins are put back afterwards.

    Returns:
        The ``RuntimeError``'s text naming the (TP, PP) mismatch, or ``None`` when upstream goes
        past the point of that decision without such a refusal (the stand-ins then run out: what
        fails after it is not reported).
    """
    from megatron.training import checkpointing as ckpt

    fn = fn or upstream_own(ckpt.load_checkpoint)
    args = StandInArgs(
        load="stand-in-load-dir",
        ckpt_format="torch_dist",
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        use_distributed_optimizer=True,
        world_size=1,
        data_parallel_size=1,
        finetune=False,
        no_load_optim=False,
        no_load_rng=False,
        auto_detect_ckpt_format=False,
        exit_on_missing_checkpoint=False,
    )
    saved = {
        "args": SimpleNamespace(
            tensor_model_parallel_size=2,
            pipeline_model_parallel_size=1,
            world_size=2,
            data_parallel_size=1,
        ),
        "iteration": 10,
        "content_metadata": {"distrib_optim_sharding_type": "dp_reshardable"},
    }

    def load_base(*a, **k):
        return saved, "stand-in-checkpoint", False, ckpt.CheckpointType.GLOBAL

    with replaced(
        ckpt,
        get_args=lambda: args,
        print_rank_0=lambda *a, **k: None,
        _load_base_checkpoint=load_base,
    ):
        try:
            fn([torch.nn.Module()], None, None)
        except Exception as exc:  # noqa: BLE001 - past the decision, the stand-ins run out
            if isinstance(exc, RuntimeError) and "mismatch" in str(exc):
                return str(exc)
    return None


def refusal_helps(message: str) -> bool:
    """False if a refusal to change TP/PP advises :data:`STALE_FLAG` without naming
    ``--dist-ckpt-optim-fully-reshardable`` (the flag that makes the format reshardable)."""
    return WORKING_FLAG in message or STALE_FLAG not in message


class DistOptReshardFix(Fix):
    name = "distopt_reshard"
    title = (
        "fully-reshardable distributed-optimizer checkpoints load without apex/TE; the TP/PP "
        "refusal names the flag that works"
    )
    upstream_refs = (
        "megatron-core DistributedOptimizer.load_parameter_state_from_fully_reshardable -> "
        "_set_main_param_and_optimizer_states: KeyError 'step' with torch Adam",
        "megatron-core checkpointing.load_checkpoint: TP/PP refusal advises the deprecated "
        "--ckpt-fully-parallel-save",
    )
    package = "megatron-core"

    patches = (
        Patch(
            "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer"
            "._set_main_param_and_optimizer_states",
            wrap_set_main_param_and_optimizer_states,
            "fully-reshardable loads raise KeyError: 'step' on every rank with torch Adam",
            params=("model_param", "tensors"),
        ),
        Patch(
            "megatron.training.checkpointing.load_checkpoint",
            wrap_load_checkpoint,
            "the refusal to change TP/PP names --ckpt-fully-parallel-save, which has "
            "no effect; the replacement names the flags that work",
        ),
        Patch(
            "megatron.training.training.load_checkpoint",
            alias_of("megatron.training.checkpointing.load_checkpoint", only_if_same=True),
            "pretrain() calls the load_checkpoint it imported by name",
        ),
    )

    def upstream_behaves(self) -> bool | None:
        """Upstream's own copy and refusal on stand-ins: False when the copy needs ``step``
        (:func:`upstream_copy_needs_step`) or the refusal (:func:`upstream_refusal`) does not help
        (:func:`refusal_helps`); True when neither; None when the copy behaves and no refusal
        was seen (cannot tell whether the message would help)."""
        if upstream_copy_needs_step():
            return False
        refusal = upstream_refusal()
        if refusal is None:
            return None
        return refusal_helps(refusal)


FIX = DistOptReshardFix()
