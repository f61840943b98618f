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

import inspect
from types import SimpleNamespace

import torch

from megatron.overlay import Fix, Patcher
from megatron.overlay.registry import wraps_upstream

#: The part of upstream's refusal (``load_checkpoint``) that names the flag that changes nothing.
UPSTREAM_ADVICE = "Please use `--ckpt-fully-parallel-save` flag during checkpoint saving."
_REFUSAL = ": not supported for DistributedOptimizer with sharding type"


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


def upstream_copy_needs_step() -> bool:
    """True if upstream's ``DistributedOptimizer._set_main_param_and_optimizer_states`` fails on a
    source without ``step`` for an optimizer whose per-parameter state has one (torch Adam): the
    defect, shown on a stand-in (no process group, no model; 4-element fp32 tensors)."""
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
    fn = D._set_main_param_and_optimizer_states
    while hasattr(fn, "__wrapped__"):  # upstream's own function, under any fix's wrapper
        fn = fn.__wrapped__
    try:
        with torch.no_grad():
            fn(stand_in, "p", src)
    except KeyError:
        return True
    return False


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

    def upstream_behaves(self) -> bool:
        from megatron.training import checkpointing

        loader = checkpointing.load_checkpoint
        while hasattr(loader, "__wrapped__"):
            loader = loader.__wrapped__
        stale_advice = UPSTREAM_ADVICE in inspect.getsource(loader)
        return not upstream_copy_needs_step() and not stale_advice

    def install(self, patcher: Patcher) -> None:
        from megatron.core.optimizer import distrib_optimizer as dopt
        from megatron.training import checkpointing, training

        D = dopt.DistributedOptimizer
        upstream_set = D._set_main_param_and_optimizer_states

        @wraps_upstream(upstream_set)
        def _set_main_param_and_optimizer_states(self, model_param, tensors):
            """Upstream's, but a source without ``step`` leaves Adam's step alone."""
            # Upstream skips source entries that are not tensors: a missing 'step' becomes one.
            # Only 'step' (0-dim, kept in the param groups by the model-space formats); any other
            # missing key still raises upstream's KeyError.
            if "step" not in tensors:
                tensors = {**tensors, "step": None}
            return upstream_set(self, model_param, tensors)

        patcher.replace(
            D,
            "_set_main_param_and_optimizer_states",
            _set_main_param_and_optimizer_states,
            "fully-reshardable loads raise KeyError: 'step' on every rank with torch Adam",
        )

        upstream_load = checkpointing.load_checkpoint

        @wraps_upstream(upstream_load)
        def load_checkpoint(*args, **kwargs):
            """Upstream's; its TP/PP refusal names the flags that work."""
            try:
                return upstream_load(*args, **kwargs)
            except RuntimeError as e:
                better = reshard_advice(str(e))
                if better is None:
                    raise
                # from None: upstream's text, chained, would repeat the advice that does not work.
                raise RuntimeError(better) from None

        patcher.replace(
            checkpointing,
            "load_checkpoint",
            load_checkpoint,
            "the refusal to change TP/PP names --ckpt-fully-parallel-save, which has "
            "no effect; the replacement names the flags that work",
        )
        if getattr(training, "load_checkpoint", None) is upstream_load:
            patcher.replace(
                training,
                "load_checkpoint",
                load_checkpoint,
                "pretrain() calls the load_checkpoint it imported by name",
            )


FIX = DistOptReshardFix()
