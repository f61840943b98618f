"""ModelOpt-quantized models in this fork's training entrypoints: inspect, summarise, restore.

Used by ``tools/quantize.py`` (:func:`is_modelopt_converted`, :func:`quantizer_summary`) and
``pretrain_gpt.py --restore-modelopt-state`` (:func:`restore_modelopt_state_pre_wrap_hook`). The
inspection helpers live with the fixes that need them (:mod:`megatron.fixes.modelopt_tensors`:
:func:`print_quant_summary`, the stand-in for Megatron-LM's
``megatron.post_training.utils.print_distributed_quant_summary``, which megatron-core does not
ship, and :func:`checkpoint_tensors`) and are re-exported here. ``model`` arguments are a module
or a list of model chunks, wrapped (DDP, Float16Module) or not. Design notes:
``docs/fixes/modelopt_moe.md``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from megatron.fixes.modelopt_tensors import (
    checkpoint_tensors,
    enabled_quantizers,
    is_modelopt_converted,
    print_quant_summary,
    quantizer_summary,
)
from megatron.fixes.modelopt_tensors import needs_amax as _needs_amax

__all__ = [
    "checkpoint_tensors",
    "enabled_quantizers",
    "is_modelopt_converted",
    "latest_checkpoint_dir",
    "print_quant_summary",
    "quantizer_summary",
    "request_checkpointed_amax",
    "restore_modelopt_state_pre_wrap_hook",
]

logger = logging.getLogger("megatron.training_ext.modelopt")

_MCORE_PLUGIN = "modelopt.torch.opt.plugins.mcore_dist_checkpointing"


def latest_checkpoint_dir(load_dir: str | None) -> str | None:
    """The directory of the checkpoint that ``load_checkpoint`` reads from ``load_dir``
    (``iter_XXXXXXX`` named by ``latest_checkpointed_iteration.txt``, ``--ckpt-step``, or
    ``release``), or ``None`` if ``load_dir`` holds no tracker file. Reads the tracker with
    upstream's ``read_metadata`` (an all-reduce over the default group when initialised: call
    on every rank)."""
    from megatron.training import checkpointing as ckpt

    if not load_dir:
        return None
    tracker = ckpt.get_checkpoint_tracker_filename(load_dir)
    if not os.path.isfile(tracker):
        return None
    iteration, release = ckpt.read_metadata(tracker)
    step = getattr(ckpt.get_args(), "ckpt_step", None)  # as load_checkpoint reads it
    if step:
        iteration, release = step, False
    return ckpt.get_checkpoint_name(load_dir, iteration, release, return_base_dir=True)


def restore_modelopt_state_pre_wrap_hook(model: list) -> list:
    """``GPTModelConfig.pre_wrap_hooks`` entry behind ``pretrain_gpt.py --restore-modelopt-state``.

    The restore step of Megatron-LM's ``megatron.post_training`` model builder (not shipped by
    megatron-core 0.19.2, which keeps only ``GPTModelConfig.restore_modelopt_state``), with
    ModelOpt's ``restore_sharded_modelopt_state``: on the freshly built chunk, before the
    mixed-precision/DDP wrappers and the optimizer, it re-applies the ModelOpt modes of the
    checkpoint ``--load`` (or ``--pretrained-checkpoint``) names and loads the quantizers'
    ``_extra_state``; ``load_checkpoint`` then loads the quantizer tensors with the weights, under
    the current TP/EP/ETP. Without ``<ckpt>/modelopt_state`` it logs and changes nothing.

    Args:
        model: the list of built model chunks (one: ModelOpt's sharded state has no virtual
            pipeline support).

    Returns:
        ``model`` (chunks converted in place).

    Raises:
        ValueError: virtual pipeline parallelism, or a checkpoint format other than ``torch_dist``
            (both raised on every rank, before any collective).
    """
    from megatron.training import get_args

    args = get_args()
    if len(model) != 1:
        raise ValueError(
            "--restore-modelopt-state: ModelOpt's sharded modelopt_state does not "
            "support virtual pipeline parallelism (got %d model chunks)" % len(model)
        )
    if args.ckpt_format != "torch_dist":
        raise ValueError(
            "--restore-modelopt-state needs --ckpt-format torch_dist (got "
            f"{args.ckpt_format}); ModelOpt keeps its state in <ckpt>/modelopt_state"
        )
    ckpt_dir = latest_checkpoint_dir(args.load)
    if ckpt_dir is None and getattr(args, "pretrained_checkpoint", None):
        ckpt_dir = latest_checkpoint_dir(args.pretrained_checkpoint)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if ckpt_dir is None or not os.path.isdir(os.path.join(ckpt_dir, "modelopt_state")):
        if rank == 0:
            logger.warning(
                "--restore-modelopt-state: %s holds no ModelOpt state (no <ckpt>/modelopt_state); "
                "the model is built without it (a local checkpoint that holds ModelOpt state "
                "restores it when it is loaded)",
                ckpt_dir or args.load,
            )
        return model
    plugin = __import__(_MCORE_PLUGIN, fromlist=["restore_sharded_modelopt_state"])
    plugin.restore_sharded_modelopt_state(model, ckpt_dir)
    request_checkpointed_amax(model, ckpt_dir)
    print_quant_summary(model, f"restored from {ckpt_dir}")
    return model


def request_checkpointed_amax(model: list, ckpt_dir: str) -> list[str]:
    """Give restored quantizers whose calibration ModelOpt's sharded restore dropped an ``_amax``
    placeholder, so that ``load_checkpoint`` loads the saved value into it.

    ModelOpt keeps per-quantizer state in the ``_extra_state`` of quantized *Megatron linears*
    only, and ``restore_sharded_modelopt_state`` strips it from the global state: quantizers of
    other modules (``torch.nn.LayerNorm`` input quantizers of the local spec) come back enabled but
    without ``_amax`` and would quantize with a per-batch dynamic range. Each enabled static
    quantizer without ``_amax`` whose sharded key the checkpoint holds gets a NaN placeholder of
    the checkpoint's shape and dtype (a load that misses it shows as NaN, not as a silent dynamic
    range); the others are left as ModelOpt restored them.

    Args:
        model: the model chunks (one), already restored.
        ckpt_dir: the ``torch_dist`` checkpoint directory (``iter_XXXXXXX``).

    Returns:
        the sharded keys given a placeholder.
    """
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    missing = [
        (n, q)
        for n, q in enabled_quantizers(model)
        if _needs_amax(q) and getattr(q, "_amax", None) is None
    ]
    if not missing:
        return []
    ckpt = checkpoint_tensors(ckpt_dir) or {}
    device = next((p.device for m in model for p in m.parameters()), torch.device("cpu"))
    by_ptr = {}
    for name, q in missing:
        q.amax = torch.full((), float("nan"), dtype=torch.float32, device=device)
        by_ptr[q._amax.data_ptr()] = (name, q)
    found: dict[int, Any] = {}
    for m in model:
        for st in nested_values(m.sharded_state_dict()):
            if type(st) is ShardedTensor and st.data is not None and st.data.data_ptr() in by_ptr:
                found[st.data.data_ptr()] = st
    requested = []
    for ptr, (name, q) in by_ptr.items():
        st = found.get(ptr)
        have = ckpt.get(st.key) if st is not None else None
        if have is None:
            del q._amax  # not in the checkpoint: stays as ModelOpt restored it
            continue
        shape, dtype = have
        if tuple(shape) != tuple(st.global_shape):
            del q._amax
            if tuple(st.local_shape) != tuple(st.global_shape):
                logger.warning(
                    "modelopt: %s: checkpoint %s holds '%s' with shape %s, the "
                    "model's placeholder is split %s of %s; not requested",
                    name,
                    ckpt_dir,
                    st.key,
                    shape,
                    st.local_shape,
                    st.global_shape,
                )
                continue
            q.amax = torch.full(tuple(shape), float("nan"), dtype=dtype, device=device)
        requested.append(st.key)
    if requested:
        logger.info(
            "modelopt: requested %d quantizer amax tensor(s) that ModelOpt's sharded "
            "restore leaves out (e.g. '%s') from %s",
            len(requested),
            requested[0],
            ckpt_dir,
        )
    return requested
