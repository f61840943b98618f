"""ModelOpt state (``modelopt_state``) in Megatron-LM checkpoints of quantized models.

megatron-core 0.19.2 ``megatron.training.checkpointing`` saves ModelOpt state only when
``has_nvidia_modelopt``, which it sets from an import of ``megatron.post_training.utils``; 0.19.2
does not ship that package, so the flag is False and quantized models are checkpointed without
their ModelOpt state and resume unquantized. Local (non-persistent) checkpoints skip it even with
the flag ("Local checkpointing does not support nvidia_modelopt"). This fix sets the flag with
ModelOpt's own ``save_modelopt_state`` / ``save_sharded_modelopt_state`` and
:func:`megatron.training_ext.modelopt.print_quant_summary` (``torch_dist`` checkpoints get
``<ckpt>/modelopt_state``), and wraps ``save_checkpoint``, ``generate_state_dict`` and
``_load_base_checkpoint`` so that a local checkpoint stores the per-rank ModelOpt state and its
load restores it into the model before the state dict to load is built. Unquantized models are
unchanged. A part of the ``modelopt_moe`` fix group (its name disables it). Design notes:
``docs/fixes/modelopt_moe.md``.
"""

from __future__ import annotations

import contextvars
import importlib
import inspect
import logging
import sys
from typing import Any, Callable

from megatron.overlay import Fix
from megatron.overlay.registry import Patcher, wraps_upstream

logger = logging.getLogger(__name__)

_CKPT = "megatron.training.checkpointing"
_TRAINING = "megatron.training.training"
_MCORE_PLUGIN = "modelopt.torch.opt.plugins.mcore_dist_checkpointing"
#: What upstream's save_checkpoint prints instead of storing ModelOpt state in a local checkpoint.
_LOCAL_SKIP_MESSAGE = "Local checkpointing does not support nvidia_modelopt"

#: True while ``save_checkpoint`` writes a local (non-persistent, per-rank) checkpoint.
_LOCAL_SAVE: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "modelopt_state_local_save", default=False
)
#: ModelOpt state read from a local checkpoint by the first (``rank0=True``) base load of
#: ``load_checkpoint``, waiting for the model that ``generate_state_dict`` gets next.
_PENDING_LOCAL_RESTORE: dict[str, Any] = {}


def _modelopt_state_keys(n_chunks: int) -> list[str]:
    """Keys under which ModelOpt's ``save_modelopt_state`` stores the state of ``n_chunks`` model
    chunks (virtual pipeline stages)."""
    return ["modelopt_state"] if n_chunks == 1 else [f"modelopt_state_{i}" for i in range(n_chunks)]


def _restore_from_local(model: list, states: dict[str, Any], checkpoint_name: Any) -> None:
    """Re-apply the ModelOpt state a local checkpoint holds to the (unwrapped) model chunks that
    are about to load it; chunks that already carry ModelOpt state are left as they are.

    Raises:
        RuntimeError: ModelOpt replaced a chunk's root module (the chunk is already wrapped).
    """
    import modelopt.torch.opt as mto
    from megatron.core import parallel_state as mcore_ps

    from megatron.training_ext.modelopt import print_quant_summary

    keys = _modelopt_state_keys(len(model))
    restored = []
    for i, (chunk, key) in enumerate(zip(model, keys)):
        state = states.get(key)
        if state is None or mto.ModeloptStateManager.is_converted(chunk):
            continue
        if len(model) > 1:
            mcore_ps.set_virtual_pipeline_model_parallel_rank(i)
        out = mto.restore_from_modelopt_state(chunk, state)
        if out is not chunk:
            raise RuntimeError(
                f"ModelOpt replaced the root module of model chunk {i} while restoring the state "
                f"of local checkpoint {checkpoint_name}; the chunk is already wrapped (DDP), so "
                "the replacement cannot be installed"
            )
        restored.append(i)
    if restored:
        logger.info(
            "modelopt_state: restored ModelOpt state of local checkpoint %s into model chunk(s) %s",
            checkpoint_name,
            restored,
        )
        print_quant_summary(model, f"restored from local checkpoint {checkpoint_name}")


def _wrap_save_checkpoint(original: Callable) -> Callable:
    signature = inspect.signature(original)

    @wraps_upstream(original)
    def save_checkpoint(*args, **kwargs):
        """Megatron's ``save_checkpoint``; a local checkpoint also stores the ModelOpt state.
        Reads the configuration as upstream does (``checkpointing.get_args``)."""
        bound = signature.bind_partial(*args, **kwargs)
        if not bound.arguments.get("non_persistent_ckpt", False):
            return original(*args, **kwargs)
        ckpt = sys.modules[_CKPT]
        if getattr(ckpt.get_args(), "non_persistent_ckpt_type", None) != "local":
            return original(*args, **kwargs)
        had = getattr(ckpt, "has_nvidia_modelopt", False)
        token = _LOCAL_SAVE.set(True)
        # Upstream's local branch only prints _LOCAL_SKIP_MESSAGE when this is set; the state is
        # stored (generate_state_dict) instead.
        ckpt.has_nvidia_modelopt = False
        try:
            return original(*args, **kwargs)
        finally:
            ckpt.has_nvidia_modelopt = had
            _LOCAL_SAVE.reset(token)

    return save_checkpoint


def _wrap_generate_state_dict(original: Callable) -> Callable:
    signature = inspect.signature(original)

    @wraps_upstream(original)
    def generate_state_dict(*args, **kwargs):
        """Megatron's ``generate_state_dict``; adds ``modelopt_state`` to a local save, and first
        restores a pending local checkpoint's ModelOpt state into the model on load."""
        bound = signature.bind_partial(*args, **kwargs)
        model = bound.arguments["model"]
        loading = bool((bound.arguments.get("optim_sd_kwargs") or {}).get("is_loading"))
        pending = _PENDING_LOCAL_RESTORE.pop("state", None) if loading else None
        if pending is not None:
            _restore_from_local(model, *pending)
        state_dict = original(*args, **kwargs)
        if _LOCAL_SAVE.get():
            plugin = __import__(_MCORE_PLUGIN, fromlist=["save_modelopt_state"])
            plugin.save_modelopt_state(model, state_dict)  # no-op for unconverted models
        return state_dict

    return generate_state_dict


def _wrap_load_base_checkpoint(original: Callable) -> Callable:
    signature = inspect.signature(original)

    @wraps_upstream(original)
    def _load_base_checkpoint(*args, **kwargs):
        """Megatron's ``_load_base_checkpoint``; keeps the ModelOpt state of a local checkpoint
        read by the first base load for the next ``generate_state_dict`` to restore."""
        bound = signature.bind_partial(*args, **kwargs)
        result = original(*args, **kwargs)
        if bound.arguments.get("sharded_state_dict") is not None:
            _PENDING_LOCAL_RESTORE.pop("state", None)  # the load proper: nothing may linger
            return result
        state_dict, checkpoint_name, _release, ckpt_type = result
        ckpt = sys.modules[_CKPT]
        if ckpt_type == ckpt.CheckpointType.LOCAL and isinstance(state_dict, dict):
            states = {
                k: v
                for k, v in state_dict.items()
                if k == "modelopt_state" or k.startswith("modelopt_state_")
            }
            if states:
                _PENDING_LOCAL_RESTORE["state"] = (states, checkpoint_name)
        return result

    return _load_base_checkpoint


def upstream_saves_modelopt_state() -> bool:
    """True if upstream's own guard import succeeds (``has_nvidia_modelopt`` would be True)."""
    try:
        # attribute probes: each raises if the attribute is missing
        importlib.import_module(  # noqa: B018 - probe raises if missing
            "megatron.post_training.utils"
        ).print_distributed_quant_summary
        importlib.import_module(  # noqa: B018 - probe raises if missing
            "modelopt.torch.opt.plugins"
        ).save_sharded_modelopt_state
    except Exception:  # noqa: BLE001 - upstream's guard catches every exception too
        return False
    return True


def upstream_skips_local_modelopt_state() -> bool:
    """True if upstream's ``save_checkpoint`` still skips ModelOpt state in local checkpoints
    (its code prints :data:`_LOCAL_SKIP_MESSAGE`; a local save cannot run in a probe). True if
    the source cannot be read."""
    try:
        ckpt = importlib.import_module(_CKPT)
        return _LOCAL_SKIP_MESSAGE in inspect.getsource(inspect.unwrap(ckpt.save_checkpoint))
    except (OSError, TypeError, ImportError):
        return True


class ModeloptStateFix(Fix):
    """ModelOpt state saved with, and restored from, persistent and local checkpoints."""

    name = "modelopt_state"
    title = "ModelOpt state saved in persistent and local checkpoints of quantized models"
    upstream_refs = (
        "megatron-core 0.19.2 checkpointing: has_nvidia_modelopt needs "
        "megatron.post_training, which 0.19.2 does not ship",
        "megatron-core save_checkpoint: 'Local checkpointing does not support nvidia_modelopt'",
    )
    package = "megatron-core"

    def upstream_behaves(self) -> bool:
        """Upstream behaves if its ModelOpt guard import succeeds and its local save keeps the
        ModelOpt state."""
        return upstream_saves_modelopt_state() and not upstream_skips_local_modelopt_state()

    def install(self, patcher: Patcher) -> None:
        from megatron.training_ext.modelopt import print_quant_summary

        ckpt = importlib.import_module(_CKPT)
        training = importlib.import_module(_TRAINING)
        plugin = importlib.import_module(_MCORE_PLUGIN)

        if not getattr(ckpt, "has_nvidia_modelopt", False):
            why = (
                "upstream's ModelOpt checkpoint code is guarded by an import of "
                "megatron.post_training, absent from 0.19.2: quantized models were "
                "checkpointed without modelopt_state and resumed unquantized"
            )
            patcher.replace(ckpt, "save_modelopt_state", plugin.save_modelopt_state, why=why)
            patcher.replace(
                ckpt, "save_sharded_modelopt_state", plugin.save_sharded_modelopt_state, why=why
            )
            patcher.replace(
                ckpt,
                "print_distributed_quant_summary",
                print_quant_summary,
                why="the quantizer summary upstream prints after loading comes from "
                "megatron.post_training, absent from 0.19.2",
            )
            patcher.replace(ckpt, "has_nvidia_modelopt", True, why=why)

        local_why = (
            "local (non-persistent) checkpoints skipped the ModelOpt state, so a run "
            "recovered from a local checkpoint or its replica resumed unquantized"
        )
        original_save = ckpt.save_checkpoint
        wrapped_save = _wrap_save_checkpoint(original_save)
        patcher.replace(ckpt, "save_checkpoint", wrapped_save, why=local_why)
        if getattr(training, "save_checkpoint", None) is original_save:  # training's own binding
            patcher.replace(training, "save_checkpoint", wrapped_save, why=local_why)
        patcher.replace(
            ckpt,
            "generate_state_dict",
            _wrap_generate_state_dict(ckpt.generate_state_dict),
            why=local_why,
        )
        patcher.replace(
            ckpt,
            "_load_base_checkpoint",
            _wrap_load_base_checkpoint(ckpt._load_base_checkpoint),
            why=local_why,
        )


FIX = ModeloptStateFix()
