"""ModelOpt state (``modelopt_state``) in Megatron-LM checkpoints of quantized models.

megatron-core 0.19.2 ``megatron.training.checkpointing`` saves ModelOpt state only when
``has_nvidia_modelopt``, which it sets from an import of ``megatron.post_training.utils``; 0.19.2
does not ship that package, so the flag is False and quantized models are checkpointed without
their ModelOpt state and resume unquantized. Local (non-persistent) checkpoints skip it even with
the flag ("Local checkpointing does not support nvidia_modelopt"). This fix sets the flag with
ModelOpt's own ``save_modelopt_state`` / ``save_sharded_modelopt_state`` and
:func:`megatron.fixes.modelopt_tensors.print_quant_summary` (``torch_dist`` checkpoints get
``<ckpt>/modelopt_state``), and wraps ``save_checkpoint``, ``generate_state_dict`` and
``_load_base_checkpoint`` so that a local checkpoint stores the per-rank ModelOpt state and its
load restores it into the model before the state dict to load is built. Unquantized models are
unchanged. Probe: :func:`probe_upstream_saves_modelopt_state`, which runs upstream's own
``save_checkpoint`` for a stand-in model. A part of the ``modelopt_moe`` fix group (its name
disables it). Design notes: ``docs/fixes/modelopt_moe.md``.
"""

from __future__ import annotations

import contextvars
import importlib
import inspect
import logging
import sys
import tempfile
import types
from typing import Any, Callable

import torch

from megatron.fixes.modelopt_tensors import print_quant_summary
from megatron.overlay import REGISTRY, SKIP, Fix, Patch, alias_of
from megatron.overlay.registry import wraps_upstream

logger = logging.getLogger(__name__)

_CKPT = "megatron.training.checkpointing"
_TRAINING = "megatron.training.training"
_MCORE_PLUGIN = "modelopt.torch.opt.plugins.mcore_dist_checkpointing"

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
    """Factory of the replacement of ``megatron.training.checkpointing.save_checkpoint``
    (``original``): a local save leaves the ModelOpt state to :func:`_wrap_generate_state_dict`
    instead of skipping it."""
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
        # Upstream's local branch only prints that it skips the ModelOpt state when this is set;
        # the state is stored (generate_state_dict) instead.
        ckpt.has_nvidia_modelopt = False
        try:
            return original(*args, **kwargs)
        finally:
            ckpt.has_nvidia_modelopt = had
            _LOCAL_SAVE.reset(token)

    return save_checkpoint


def _wrap_generate_state_dict(original: Callable) -> Callable:
    """Factory of the replacement of ``megatron.training.checkpointing.generate_state_dict``
    (``original``): ModelOpt state added to a local save, restored from a local load."""
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
    """Factory of the replacement of ``megatron.training.checkpointing._load_base_checkpoint``
    (``original``): keeps a local checkpoint's ModelOpt state for the next
    ``generate_state_dict``."""
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


# ---- the patches ---------------------------------------------------------------------------------

#: Upstream's own ``has_nvidia_modelopt``, as found when the fix set it (for the probe).
_UPSTREAM_FLAG: dict[str, bool] = {}

_PERSISTENT_WHY = (
    "upstream's ModelOpt checkpoint code is guarded by an import of "
    "megatron.post_training, absent from 0.19.2: quantized models were "
    "checkpointed without modelopt_state and resumed unquantized"
)
_LOCAL_WHY = (
    "local (non-persistent) checkpoints skipped the ModelOpt state, so a run "
    "recovered from a local checkpoint or its replica resumed unquantized"
)


def _modelopt_guard_failed() -> bool:
    """True while ``megatron.training.checkpointing.has_nvidia_modelopt`` is False: upstream's
    ModelOpt guard import failed, and the fix has not set the flag yet."""
    return not getattr(sys.modules[_CKPT], "has_nvidia_modelopt", False)


def _modelopt_save_modelopt_state(original: Any) -> Any:
    """Factory of ``megatron.training.checkpointing.save_modelopt_state``: ModelOpt's own
    (``modelopt.torch.opt.plugins.mcore_dist_checkpointing``); :data:`SKIP` where upstream's
    ModelOpt guard succeeded."""
    if not _modelopt_guard_failed():
        return SKIP
    return importlib.import_module(_MCORE_PLUGIN).save_modelopt_state


def _modelopt_save_sharded_modelopt_state(original: Any) -> Any:
    """Factory of ``megatron.training.checkpointing.save_sharded_modelopt_state``: ModelOpt's
    own; :data:`SKIP` where upstream's ModelOpt guard succeeded."""
    if not _modelopt_guard_failed():
        return SKIP
    return importlib.import_module(_MCORE_PLUGIN).save_sharded_modelopt_state


def _quant_summary(original: Any) -> Any:
    """Factory of ``megatron.training.checkpointing.print_distributed_quant_summary`` (absent
    where upstream's ModelOpt guard failed):
    :func:`~megatron.fixes.modelopt_tensors.print_quant_summary`; :data:`SKIP` where the guard
    succeeded."""
    if not _modelopt_guard_failed():
        return SKIP
    return print_quant_summary


def _modelopt_checkpointing_on(original: Any) -> Any:
    """Factory of ``megatron.training.checkpointing.has_nvidia_modelopt``: ``True`` (declared
    after the three patches it enables); :data:`SKIP` where it is already True. Keeps upstream's
    value (``original``) for :meth:`ModeloptStateFix.upstream_behaves`."""
    if not _modelopt_guard_failed():
        return SKIP
    _UPSTREAM_FLAG["has_nvidia_modelopt"] = bool(original)
    return True


_SAVE = f"{_CKPT}.save_checkpoint"
_TRAINING_SAVE = f"{_TRAINING}.save_checkpoint"
#: Each skips itself where upstream's ModelOpt guard left ``has_nvidia_modelopt`` True.
_PERSISTENT_PATCHES = (
    Patch(f"{_CKPT}.save_modelopt_state", _modelopt_save_modelopt_state, _PERSISTENT_WHY),
    Patch(
        f"{_CKPT}.save_sharded_modelopt_state",
        _modelopt_save_sharded_modelopt_state,
        _PERSISTENT_WHY,
    ),
    Patch(
        f"{_CKPT}.print_distributed_quant_summary",
        _quant_summary,
        "the quantizer summary upstream prints after loading comes from "
        "megatron.post_training, absent from 0.19.2",
        adds=True,
    ),
    Patch(f"{_CKPT}.has_nvidia_modelopt", _modelopt_checkpointing_on, _PERSISTENT_WHY),
)
_LOCAL_PATCHES = (
    Patch(_SAVE, _wrap_save_checkpoint, _LOCAL_WHY, params=("non_persistent_ckpt",)),
    # training.py's own binding (``from .checkpointing import save_checkpoint``), while it is one
    Patch(_TRAINING_SAVE, alias_of(_SAVE, only_if_same=True), _LOCAL_WHY),
    Patch(
        f"{_CKPT}.generate_state_dict",
        _wrap_generate_state_dict,
        _LOCAL_WHY,
        params=("model", "optim_sd_kwargs"),
    ),
    Patch(
        f"{_CKPT}._load_base_checkpoint",
        _wrap_load_base_checkpoint,
        _LOCAL_WHY,
        params=("sharded_state_dict",),
    ),
)


# ---- the probe -----------------------------------------------------------------------------------


class _ProbeWritten(Exception):
    """Raised by the probe's checkpoint writers, carrying what they were handed."""

    def __init__(self, written: Any) -> None:
        super().__init__("modelopt_state probe: the checkpoint reached its writer")
        self.written = written


class _ProbeArgs(types.SimpleNamespace):
    """Arguments of the probe's save; options not set read as ``None``."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return None


class _Inert:
    """Every attribute is a callable doing nothing (the one-logger and fault-tolerance hooks,
    the rerun state machine, the RNG collection): the probe touches no job state."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *args, **kwargs: None


class _ProbeModel(torch.nn.Module):
    """Stand-in model chunk: an empty state dict in every checkpoint format."""

    def sharded_state_dict(self, *args, **kwargs) -> dict:
        return {}

    def state_dict_for_save_checkpoint(self, *args, **kwargs) -> dict:
        return {}


class _ProbeDistributed:
    """``torch.distributed`` as the probe's save sees it: not initialised (no collective)."""

    @staticmethod
    def is_initialized() -> bool:
        return False

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.distributed, name)


class _ProbeTorch:
    """``torch`` as the probe's save sees it: ``torch.save`` hands the state dict back instead
    of writing it."""

    distributed = _ProbeDistributed()

    @staticmethod
    def save(obj: Any, *args, **kwargs) -> None:
        raise _ProbeWritten(obj)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


class _ProbeLocalManager:
    """Stand-in NVRx local checkpoint manager: ``save`` hands the state dict back."""

    def __init__(self, local_ckpt_dir: str) -> None:
        self.local_ckpt_dir = local_ckpt_dir

    def save(self, state_dict: Any, iteration: int, is_async: bool = False) -> None:
        raise _ProbeWritten(state_dict)


def probe_upstream_saves_modelopt_state(
    save_checkpoint: Callable,
    generate_state_dict: Callable,
    has_nvidia_modelopt: bool,
    local: bool,
) -> bool | None:
    """Run ``save_checkpoint`` (its own code) for a one-chunk stand-in model whose ModelOpt state
    ModelOpt's save hook would store, and report whether the state reaches the checkpoint.

    The save runs with the names it reads from its module replaced by stand-ins: arguments
    (``torch`` format for a persistent save; ``local`` with the ``atomic`` algorithm and a cached
    structure for a local one), no RNG, rerun, one-logger or fault-tolerance state,
    ``torch.distributed`` not initialised, ``generate_state_dict`` as given, the ModelOpt flag
    ``has_nvidia_modelopt`` as given, and as ModelOpt's hooks recorders that store
    ``modelopt_state`` as ModelOpt does for a converted model. The writer (``torch.save``, the
    local checkpoint manager's ``save``) hands back what it got instead of writing. No collective
    runs, no file is written, no module attribute is changed: the save runs on a copy of its
    module's namespace.

    Args:
        save_checkpoint: upstream's ``megatron.training.checkpointing.save_checkpoint``.
        generate_state_dict: upstream's ``generate_state_dict``, which the save calls.
        has_nvidia_modelopt: the value of the module's ModelOpt flag for the save.
        local: probe a local (non-persistent, per-rank) save instead of a persistent one.

    Returns:
        True if what reaches the writer holds ``modelopt_state`` (or the sharded hook ran), False
        if it does not (megatron-core 0.19.2: persistent saves with its flag False, and every
        local save), None if the save does not reach a writer or fails on the stand-ins.
    """
    hooks = _ProbeModeloptHooks()
    try:
        with tempfile.TemporaryDirectory(prefix="modelopt_state_probe_") as d:
            save = _probe_save(
                save_checkpoint,
                _probe_args(d, local),
                {
                    "generate_state_dict": generate_state_dict,
                    "has_nvidia_modelopt": has_nvidia_modelopt,
                    "save_modelopt_state": hooks.save_modelopt_state,
                    "save_sharded_modelopt_state": hooks.save_sharded_modelopt_state,
                },
            )
            save(1, [_ProbeModel()], None, None, 0, **_probe_kwargs(save_checkpoint, d, local))
    except _ProbeWritten as w:
        written = w.written
        common = (
            written if isinstance(written, dict) else getattr(written, "common_state_dict", None)
        )
        if not isinstance(common, dict):
            logger.info("modelopt_state probe: the writer got a %s", type(written).__name__)
            return None
        return "modelopt_state" in common or "save_sharded_modelopt_state" in hooks.stored
    except Exception as e:  # noqa: BLE001 - a probe that cannot run proves nothing
        logger.info("modelopt_state probe (local=%s) could not run: %r", local, e)
        return None
    logger.info("modelopt_state probe (local=%s): the save reached no writer", local)
    return None


class _ProbeModeloptHooks:
    """ModelOpt's save hooks as the probe's save sees them: each records in :attr:`stored` that
    it ran, and ``save_modelopt_state`` stores ``modelopt_state`` as ModelOpt does for a
    converted model."""

    def __init__(self) -> None:
        self.stored: list[str] = []

    def save_modelopt_state(self, model: list, state_dict: dict) -> None:
        self.stored.append("save_modelopt_state")
        state_dict["modelopt_state"] = {"modelopt_state_dict": [], "modelopt_version": "probe"}

    def save_sharded_modelopt_state(
        self, model: list, checkpoint_name: Any, *args, **kwargs
    ) -> None:
        self.stored.append("save_sharded_modelopt_state")


def _probe_args(save_dir: str, local: bool) -> _ProbeArgs:
    """The arguments of the probe's save into ``save_dir``: ``torch`` format for a persistent
    save; for a ``local`` one, ``local`` non-persistent checkpoints with the ``atomic`` algorithm
    and a cached structure. No optimizer, no RNG state, synchronous."""
    return _ProbeArgs(
        save=save_dir,
        use_dist_ckpt=local,
        ckpt_format="torch_dist" if local else "torch",
        non_persistent_ckpt_type="local",
        non_persistent_local_ckpt_algo="atomic",
        ckpt_assume_constant_structure=True,
        async_save=False,
        use_distributed_optimizer=False,
        no_save_optim=True,
        no_save_rng=True,
    )


def _probe_save(save_checkpoint: Callable, args: _ProbeArgs, given: dict[str, Any]) -> Callable:
    """``save_checkpoint``'s own code over a copy of its module's namespace in which the names it
    reads are the probe's stand-ins (``args``; no RNG, rerun, one-logger or fault-tolerance state;
    :class:`_ProbeTorch`) and then ``given`` (the state dict builder, the ModelOpt flag and
    hooks). No module attribute is changed."""
    namespace = {
        **save_checkpoint.__globals__,
        "get_args": lambda: args,
        "get_rng_state": lambda *a, **k: None,
        "get_rerun_state_machine": lambda: _Inert(),
        "on_save_checkpoint_start": lambda *a, **k: None,
        "ft_integration": _Inert(),
        "print_rank_0": lambda *a, **k: None,
        "torch": _ProbeTorch(),
        "_build_sharded_state_dict_metadata": lambda *a, **k: {},
        **given,
    }
    save = types.FunctionType(
        save_checkpoint.__code__,
        namespace,
        save_checkpoint.__name__,
        save_checkpoint.__defaults__,
        save_checkpoint.__closure__,
    )
    save.__kwdefaults__ = save_checkpoint.__kwdefaults__
    return save


def _probe_kwargs(save_checkpoint: Callable, save_dir: str, local: bool) -> dict[str, Any]:
    """The keyword arguments of the probe's save (those ``save_checkpoint`` accepts): a
    checkpointing context whose local manager hands the state dict back, rank 0 of every
    parallel group, no parallelism, placeholder groups (never used as groups: distributed is not
    initialised)."""
    kwargs = {
        "checkpointing_context": {
            "local_checkpoint_manager": _ProbeLocalManager(save_dir),
            "local_checkpoint_cache": (None, None, None, None),
        },
        "non_persistent_ckpt": local,
        "pipeline_rank": 0,
        "tensor_rank": 0,
        "expert_rank": 0,
        "pipeline_parallel": False,
        "expert_parallel": False,
        "tp_group": object(),  # never used as a group: distributed is not initialised
        "pp_group": object(),
        "dp_cp_group": object(),
    }
    accepted = inspect.signature(save_checkpoint).parameters
    return {k: v for k, v in kwargs.items() if k in accepted}


def _upstream_modelopt_flag(ckpt: Any) -> bool:
    """Upstream's own ``has_nvidia_modelopt`` (the value before this fix set it, if it did)."""
    if (
        REGISTRY.is_recorded(ckpt, "has_nvidia_modelopt")
        and "has_nvidia_modelopt" in _UPSTREAM_FLAG
    ):
        return _UPSTREAM_FLAG["has_nvidia_modelopt"]
    return bool(getattr(ckpt, "has_nvidia_modelopt", False))


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
    patches = _PERSISTENT_PATCHES + _LOCAL_PATCHES

    def upstream_behaves(self) -> bool | None:
        """True if upstream's own ``save_checkpoint`` stores the ModelOpt state of a stand-in
        model in a persistent save (with upstream's ``has_nvidia_modelopt``) and in a local one
        (with the flag on); False if either leaves it out; None if a probe cannot run
        (:func:`probe_upstream_saves_modelopt_state`)."""
        ckpt = importlib.import_module(_CKPT)
        save = inspect.unwrap(ckpt.save_checkpoint)  # upstream's own, without overlay wrappers
        generate = inspect.unwrap(ckpt.generate_state_dict)
        persistent = probe_upstream_saves_modelopt_state(
            save, generate, _upstream_modelopt_flag(ckpt), local=False
        )
        local = probe_upstream_saves_modelopt_state(save, generate, True, local=True)
        logger.debug(
            "modelopt_state probe: ModelOpt state stored by a persistent save = %s, by a local "
            "save = %s",
            persistent,
            local,
        )
        if persistent is False or local is False:
            return False
        return True if persistent and local else None


FIX = ModeloptStateFix()
