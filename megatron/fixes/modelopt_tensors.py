"""ModelOpt quantizer state as the ModelOpt fixes read it: which model chunks are converted, what
their quantizers hold, and what tensors a ``torch_dist`` checkpoint holds.

Used by :mod:`megatron.fixes.modelopt_state` (:func:`print_quant_summary`, the stand-in for
Megatron-LM's ``megatron.post_training.utils.print_distributed_quant_summary``, which
megatron-core does not ship), by :mod:`megatron.fixes.modelopt_moe.legacy_layout`
(:func:`checkpoint_tensors`) and, through :mod:`megatron.training_ext.modelopt`, by
``tools/quantize.py``. ``model`` arguments are a module or a list of model chunks, wrapped (DDP,
Float16Module) or not. Design notes: ``docs/fixes/modelopt_moe.md``.
"""

from __future__ import annotations

import logging
from typing import Any, Iterator

import torch

__all__ = [
    "checkpoint_tensors",
    "enabled_quantizers",
    "is_modelopt_converted",
    "needs_amax",
    "print_quant_summary",
    "quantizer_summary",
]

logger = logging.getLogger("megatron.fixes.modelopt")


def _chunks(model: Any) -> list:
    from megatron.core.utils import unwrap_model

    return unwrap_model(model if isinstance(model, list) else [model])


def is_modelopt_converted(model: Any) -> bool:
    """True if any chunk of ``model`` carries ModelOpt state (was quantized, or restored from a
    quantized checkpoint).

    Raises:
        ImportError: nvidia-modelopt is not installed.
    """
    import modelopt.torch.opt as mto

    return any(mto.ModeloptStateManager.is_converted(m) for m in _chunks(model))


def enabled_quantizers(model: Any) -> Iterator[tuple[str, Any]]:
    """(name, quantizer) of every enabled ModelOpt ``TensorQuantizer`` of ``model`` on this rank;
    names are prefixed ``<chunk>.`` for several chunks.

    Raises:
        ImportError: nvidia-modelopt is not installed.
    """
    from modelopt.torch.quantization.nn import TensorQuantizer

    chunks = _chunks(model)
    for i, chunk in enumerate(chunks):
        for name, m in chunk.named_modules():
            if isinstance(m, TensorQuantizer) and m.is_enabled:
                yield (f"{i}.{name}" if len(chunks) > 1 else name), m


def needs_amax(quantizer: Any) -> bool:
    """True for a quantizer that calibration gives a fixed ``_amax`` (not dynamic, not MX)."""
    return not getattr(quantizer, "_dynamic", False) and not getattr(
        quantizer, "is_mx_format", False
    )


def quantizer_summary(model: Any) -> dict[str, Any]:
    """ModelOpt quantizers of ``model`` on this rank.

    Returns:
        {'quantizers': number of ``TensorQuantizer`` modules, 'enabled': enabled ones, 'static':
        enabled ones with a fixed (calibrated) range, 'calibrated': static ones holding an
        ``_amax``, 'uncalibrated': names of the static ones without (at most 8)}.

    Raises:
        ImportError: nvidia-modelopt is not installed.
    """
    from modelopt.torch.quantization.nn import TensorQuantizer

    total = sum(isinstance(m, TensorQuantizer) for chunk in _chunks(model) for m in chunk.modules())
    enabled = list(enabled_quantizers(model))
    static = [(n, q) for n, q in enabled if needs_amax(q)]
    missing = [n for n, q in static if getattr(q, "_amax", None) is None]
    return {
        "quantizers": total,
        "enabled": len(enabled),
        "static": len(static),
        "calibrated": len(static) - len(missing),
        "uncalibrated": missing[:8],
    }


def print_quant_summary(model: Any, msg: str = "") -> None:
    """Stand-in for Megatron-LM's ``megatron.post_training.utils.print_distributed_quant_summary``
    (absent from megatron-core): one log line on rank 0,
    ``ModelOpt (<msg>): rank 0 holds {<quantizer_summary>}``, if ``model`` is ModelOpt-converted;
    nothing otherwise.

    Raises:
        ImportError: nvidia-modelopt is not installed.
    """
    if not is_modelopt_converted(model):
        return
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if rank == 0:
        logger.warning(
            "ModelOpt%s: rank 0 holds %s", f" ({msg})" if msg else "", quantizer_summary(model)
        )


def checkpoint_tensors(checkpoint_dir: Any) -> dict[str, tuple[tuple, torch.dtype]] | None:
    """key -> (global shape, dtype) of the tensors in a ``torch_dist`` checkpoint, or ``None`` if
    its metadata cannot be read (another format, or no checkpoint). Reads ``.metadata`` only (no
    collective); never raises."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from megatron.integrity.dcp_metadata import DcpMetadataError, read_dcp_metadata

    try:
        md = read_dcp_metadata(checkpoint_dir)
    except DcpMetadataError:  # not a DCP checkpoint: the caller leaves it to upstream
        return None
    return {
        k: (tuple(v.size), v.properties.dtype)
        for k, v in md.state_dict_metadata.items()
        if isinstance(v, TensorStorageMetadata)
    }
