"""CPU backend: run upstream's real ``megatron.training.pretrain`` on CPU with gloo.

:func:`activate` installs the component :data:`COMPONENT` (:class:`CpuBackend`), a small
runtime layer instead of patching the ~35 places where Megatron-LM assumes a CUDA device:
:class:`CudaToCpuMode` (a ``TorchFunctionMode`` mapping every
``cuda`` device argument to ``cpu``, entered in every thread and around custom backwards),
stand-ins for the ``torch.cuda`` functions Megatron calls, and a CPU ``torch.Generator`` playing
the CUDA generator: every random op a GPU run would run on the GPU (:mod:`megatron.cpu.rng_routing`)
draws from it, so a resumed run is bitwise identical to an uninterrupted one, dropout included.
A few narrow Megatron-level patches (``initialize_megatron(allow_no_cuda=True)``, no CUDA
``device_id`` for gloo, the prebuilt dataset helper, ``_lazy_call``, MoE split sizes) are recorded
in :mod:`megatron.overlay.registry`. What one activation holds (the entered mode, the random
callables, the tensors kept in host memory) is its :class:`CpuBackendState`. Design notes:
``docs/cpu-backend.md``.

Raises at :func:`activate` when a CUDA device is usable (the backend would shadow it).
"""

from __future__ import annotations

import contextlib
import logging
import types
import weakref
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch.overrides import TorchFunctionMode

from megatron.cpu.cuda_standins import (  # re-exported: tests, callers
    CUDA_GENERATOR,
    CUDA_RANDOM_STANDINS,
    CUDA_STANDINS,
    cuda_generator_as_default,
    noop,
)
from megatron.cpu.rng_routing import (  # noqa: F401  (re-exported: tests, callers)
    BINDING_NAMESPACES,
    random_callables,
    seeded_aten_ops,
)
from megatron.overlay import Patch, alias_of, value, wraps_upstream
from megatron.overlay.component import Component

logger = logging.getLogger("megatron.cpu")

#: What :func:`activate` raises when a CUDA device is usable.
CUDA_PRESENT = (
    "megatron.cpu: a CUDA device is available; the CPU backend would shadow it. "
    "Run without --cpu to train on the GPU, or set CUDA_VISIBLE_DEVICES= to force the CPU "
    "backend."
)


@dataclass
class CpuBackendState:
    """What one activation of the CPU backend holds (this process).

    Attributes:
        mode: the :class:`CudaToCpuMode` entered on the activating thread (``None`` until then).
        random: every callable that draws random numbers (:func:`random_callables`): run on the
            CUDA stand-in generator when it targets a stand-in GPU tensor.
        host: the tensors a GPU run keeps in host memory (:func:`is_host_tensor`): id -> weak
            reference (a ``WeakSet`` would compare tensors with ``==``).
        logged: what was intercepted and logged already (each once).
    """

    mode: Optional["CudaToCpuMode"] = None
    random: frozenset = frozenset()
    host: dict[int, weakref.ref] = field(default_factory=dict)
    logged: set[str] = field(default_factory=set)


def _log_once(what: str) -> None:
    state = COMPONENT.state
    if state is None or what not in state.logged:
        if state is not None:
            state.logged.add(what)
        logger.debug("cpu backend: intercepted %s", what)


def is_active() -> bool:
    """True once :func:`activate` has run in this process (and :func:`deactivate` has not)."""
    return COMPONENT.installed


# ----------------------------------------------------------------------------------------------
# The torch function mode
# ----------------------------------------------------------------------------------------------
def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare index means a CUDA device to torch's factory functions and Tensor.to.
    return isinstance(device, int) and not isinstance(device, bool)


_T = torch.Tensor
_NOOP_METHODS = frozenset((_T.pin_memory, _T.record_stream))


def _in_host(host: dict, t: torch.Tensor) -> bool:
    ref = host.get(id(t))
    return ref is not None and ref() is t


def _add_host(host: dict, t: torch.Tensor) -> None:
    key = id(t)

    def forget(ref: weakref.ref, key: int = key) -> None:
        if host.get(key) is ref:
            del host[key]

    host[key] = weakref.ref(t, forget)


def _discard_host(host: dict, t: torch.Tensor) -> None:
    if _in_host(host, t):
        del host[id(t)]


#: What ``Tensor.device`` answers for a stand-in GPU tensor: a CPU device equal to any other, but
#: this very object, so that ``torch.rand(..., device=t.device)`` is known to target the "GPU".
GPU_DEVICE = torch.device("cpu")
_DEVICE_GETTER = type(torch.Tensor.device.__get__)


def _getset(name: str) -> Any:
    """The descriptor of a ``Tensor`` attribute (``Tensor``'s own, else ``TensorBase``'s)."""
    return torch.Tensor.__dict__.get(name) or torch._C.TensorBase.__dict__[name]


_DEVICE_DESCRIPTOR = _getset("device")
_TO_HOST = frozenset((_T.cpu, _T.to))


#: Attribute reads and calls that neither take a device nor return a tensor: the mode would only
#: call them (checkpoint code reads ``shape``/``dtype``/``ndim`` thousands of times per save).
_PASS_GETTERS = frozenset(
    _getset(name)
    for name in ("shape", "dtype", "ndim", "layout", "requires_grad", "is_quantized", "is_sparse")
)
_PASS_FUNCS = frozenset((torch._C._set_grad_enabled,))


def is_host_tensor(t: torch.Tensor) -> bool:
    """True if ``t`` stands in for a tensor that a GPU run holds in host memory.

    Rule (what a GPU run does): a tensor made by a factory without a ``device`` (torch's default
    device is the CPU) or with a CPU device that did not come from a stand-in GPU tensor's
    ``.device``, a copy made by ``.cpu()``/``.to("cpu")``, and results of ops whose tensor
    arguments are all such tensors (views, ``clone``, arithmetic; one GPU tensor among them makes a
    GPU result, as mixing is legal on a GPU only with 0-dim host tensors). ``.cuda()``/
    ``.to("cuda")`` makes it a GPU tensor again. Every other tensor (parameters after
    ``model.cuda()``, activations, gradients, anything made with a CUDA device) stands in for a GPU
    tensor. False while the backend is not active.
    """
    state = COMPONENT.state
    return state is not None and _in_host(state.host, t)


def _first_tensor(args: tuple, kwargs: dict) -> torch.Tensor | None:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
        if isinstance(a, (tuple, list)) and a and isinstance(a[0], torch.Tensor):
            return a[0]  # torch.cat([...]), torch.stack([...])
    if not args:  # handle_torch_function(f, (t,), tensor=t, ...) passes everything by keyword
        for a in kwargs.values():
            if isinstance(a, torch.Tensor):
                return a
    return None


def _any_gpu_tensor(host: dict, args: tuple, kwargs: dict) -> bool:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            if not _in_host(host, a):
                return True
        elif isinstance(a, (tuple, list)):
            if any(isinstance(x, torch.Tensor) and not _in_host(host, x) for x in a):
                return True
    return False


def _mark_host(host: dict, out: Any) -> None:
    if isinstance(out, torch.Tensor):
        _add_host(host, out)
    elif isinstance(out, (tuple, list)):
        for o in out:
            if isinstance(o, torch.Tensor):
                _add_host(host, o)


class CudaToCpuMode(TorchFunctionMode):
    """Maps CUDA devices to CPU for every torch function called while the mode is active, and runs
    every random op that targets a stand-in GPU tensor (or a CUDA device) on the CUDA stand-in
    generator (see :func:`random_callables`, :func:`is_host_tensor`).

    The random callables and the host tensors are read from :data:`COMPONENT`'s state at each
    call, not kept on the mode: torch.compile traces this method and resolves module globals, not
    the attributes of a mode on its stack; the modes of every thread share them.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _PASS_FUNCS or (type(func) is _DEVICE_GETTER and func.__self__ in _PASS_GETTERS):
            return func(*args, **(kwargs or {}))
        state = COMPONENT.state
        host = state.host if state is not None else {}
        if type(func) is _DEVICE_GETTER and func.__self__ is _DEVICE_DESCRIPTOR:
            device = func(*args)
            if device.type == "cpu" and not (host and _in_host(host, args[0])):
                return GPU_DEVICE
            return device
        kwargs = dict(kwargs) if kwargs else {}
        if func is _T.cuda:
            _log_once("Tensor.cuda()")
            _discard_host(host, args[0])
            return args[0]
        if func in _NOOP_METHODS:
            _log_once(f"Tensor.{func.__name__}()")
            return args[0] if func is _T.pin_memory else None
        if func is _T.is_pinned:
            return False
        if func is _T.type and len(args) == 1 and not kwargs:
            name = func(*args)
            if name.startswith("torch.") and not name.startswith("torch.cuda."):
                _log_once("Tensor.type() (answers torch.cuda.*Tensor)")
                return "torch.cuda." + name[len("torch.") :]
            return name
        on_gpu = None  # None: decided by the first tensor argument
        device = kwargs.get("device", None)
        if device is not None:
            if _is_cuda_device(device):
                _log_once(f"device={device!r} in {getattr(func, '__name__', func)}")
                kwargs["device"] = "cpu"
                on_gpu = True
            else:
                on_gpu = device is GPU_DEVICE
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is _T.to and len(args) > 1:
            first = args[1]
            if not isinstance(first, (torch.dtype, torch.Tensor)) and first is not None:
                if _is_cuda_device(first):
                    _log_once("Tensor.to(cuda)")
                    args = (args[0], "cpu") + tuple(args[2:])
                    on_gpu = True
                else:
                    on_gpu = first is GPU_DEVICE
        target = _first_tensor(args, kwargs)
        if func is _T.cpu:
            on_gpu = False
        if on_gpu is None:
            # No device named: a factory (no tensor argument) makes a host tensor, as torch's
            # default device is the CPU on a GPU machine too; otherwise the op runs on the GPU if
            # any tensor argument is a GPU one (mixing is legal on GPU only for 0-dim host ones).
            on_gpu = target is not None and not (
                host and _in_host(host, target) and not _any_gpu_tensor(host, args, kwargs)
            )
        if (
            state is not None
            and func in state.random
            and kwargs.get("generator") is None
            and on_gpu
        ):
            with cuda_generator_as_default():
                out = func(*args, **kwargs)
        else:
            out = func(*args, **kwargs)
        if on_gpu:
            if func is _T.to and out is target:
                _discard_host(host, target)
        elif out is not target and (
            target is None or func in _TO_HOST or _in_host(host, target) or device is not None
        ):  # a host op: its results stay on host
            _mark_host(host, out)
        return out


def _in_mode(fn):
    """Wrap ``fn`` so that it runs with :class:`CudaToCpuMode` active (if the backend is)."""

    @wraps_upstream(fn)
    def in_cpu_mode(*args, **kwargs):
        """Runs the wrapped function with the CUDA-to-CPU torch function mode active."""
        state = COMPONENT.state
        if state is None or torch._C._is_torch_function_mode_enabled() and _mode_on_stack():
            return fn(*args, **kwargs)
        with CudaToCpuMode():
            return fn(*args, **kwargs)

    return in_cpu_mode


def _mode_on_stack() -> bool:
    from torch.overrides import _get_current_function_mode_stack

    return any(isinstance(m, CudaToCpuMode) for m in _get_current_function_mode_stack())


# ----------------------------------------------------------------------------------------------
# Megatron-level patches
# ----------------------------------------------------------------------------------------------
def wrap_initialize_megatron(upstream_init):
    """Factory: upstream's ``initialize_megatron`` with ``allow_no_cuda=True``."""

    @wraps_upstream(upstream_init)
    def initialize_megatron(*args, **kwargs):
        """Upstream's ``initialize_megatron`` with ``allow_no_cuda=True`` (CPU backend)."""
        kwargs["allow_no_cuda"] = True
        return upstream_init(*args, **kwargs)

    return initialize_megatron


def wrap_init_process_group(upstream_ipg):
    """Factory: ``torch.distributed.init_process_group`` without a CUDA ``device_id``."""

    @wraps_upstream(upstream_ipg)
    def init_process_group(*args, **kwargs):
        """``torch.distributed.init_process_group`` without a CUDA ``device_id`` (CPU backend)."""
        device_id = kwargs.get("device_id")
        if device_id is not None and _is_cuda_device(device_id):
            _log_once("init_process_group(device_id=cuda)")
            kwargs.pop("device_id")
        return upstream_ipg(*args, **kwargs)

    return init_process_group


def wrap_compile_helpers(upstream_compile):
    """Factory: no ``make`` when the prebuilt ``helpers_cpp`` imports."""

    @wraps_upstream(upstream_compile)
    def compile_helpers():
        """No-op when the prebuilt ``helpers_cpp`` imports; upstream's build otherwise."""
        try:
            from megatron.core.datasets import helpers_cpp  # noqa: F401
        except ImportError:
            return upstream_compile()
        _log_once("compile_helpers (prebuilt helpers_cpp used)")

    return compile_helpers


def lazy_call(callback):
    """Run ``callback`` now (CPU backend: CUDA never initialises)."""
    callback()


def wrap_maybe_move_tensor_to_cpu(upstream_move):
    """Factory: upstream's ``maybe_move_tensor_to_cpu``, ``as_numpy`` also for CPU tensors."""

    @wraps_upstream(upstream_move)
    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        """Upstream's, but ``as_numpy`` also converts a tensor already on CPU."""
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            _log_once("maybe_move_tensor_to_cpu(as_numpy) on a CPU tensor")
            return tensor.numpy()
        return upstream_move(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return maybe_move_tensor_to_cpu


def nvtx_range(*args, **kwargs):
    """No NVTX without CUDA: an empty context."""
    return contextlib.nullcontext()


def wrap_without_mode(upstream: Any) -> Any:
    """Patch factory for an upstream function that only reads tensors' metadata (shape, dtype,
    ndim) and builds checkpoint metadata from them: it runs without torch function modes. Each read
    would enter the mode's ``__torch_function__`` (about 2 us; a local save builds some 400
    ShardedTensors, 1,500 reads, 3 ms of the time a save blocks training), and none needs the
    mode's device mapping: nothing is created on a device. A classmethod stays one."""
    func = getattr(upstream, "__func__", None)
    if func is not None:

        @wraps_upstream(upstream)
        def classmethod_without_mode(cls, *args, **kwargs):
            """Upstream's, without torch function modes (CPU backend: metadata reads only)."""
            with torch._C.DisableTorchFunction():
                return func(cls, *args, **kwargs)

        return classmethod(classmethod_without_mode)

    @wraps_upstream(upstream)
    def without_mode(*args, **kwargs):
        """Upstream's, without torch function modes (CPU backend: metadata reads only)."""
        with torch._C.DisableTorchFunction():
            return upstream(*args, **kwargs)

    return without_mode


_METADATA_WHY = (
    "it only reads tensor shapes and dtypes, thousands of times per checkpoint save, and each read "
    "through the CUDA-to-CPU torch function mode costs about 2 us"
)

_MOE_WHY = (
    "MoE all-to-all split sizes stay tensors when is_cuda is False, and the dispatcher "
    "then fails on them (as_numpy is skipped for CPU tensors)"
)

#: Megatron-level patches of the CPU backend (installed after the torch.cuda stand-ins of
#: :func:`declared_patches`).
MEGATRON_PATCHES = (
    Patch(
        "megatron.training.training.initialize_megatron",
        wrap_initialize_megatron,
        "pretrain() asserts torch.cuda.is_available() unless allow_no_cuda is passed",
    ),
    Patch(
        "torch.distributed.init_process_group",
        wrap_init_process_group,
        "_initialize_distributed binds the gloo process group to cuda:<local_rank>",
    ),
    Patch(
        "megatron.core.datasets.utils.compile_helpers",
        wrap_compile_helpers,
        "the wheel ships helpers_cpp prebuilt and no Makefile, so upstream's `make` fails",
    ),
    Patch(
        "megatron.core.tensor_parallel.random._lazy_call",
        value(lazy_call),
        "torch.cuda._lazy_call queues callbacks until CUDA initialises, i.e. forever on CPU",
    ),
    Patch(
        "megatron.core.transformer.moe.moe_utils.maybe_move_tensor_to_cpu",
        wrap_maybe_move_tensor_to_cpu,
        _MOE_WHY,
        params=("tensor", "as_numpy", "record_stream"),
    ),
    Patch(
        "megatron.core.transformer.moe.token_dispatcher.maybe_move_tensor_to_cpu",
        alias_of("megatron.core.transformer.moe.moe_utils.maybe_move_tensor_to_cpu"),
        _MOE_WHY + " (the dispatcher's own binding)",
    ),
    Patch(
        "megatron.core.dist_checkpointing.mapping.ShardedTensor.validate_metadata_integrity",
        wrap_without_mode,
        "runs without the torch function mode: " + _METADATA_WHY,
    ),
    Patch(
        "megatron.core.dist_checkpointing.mapping.ShardedTensor.from_rank_offsets",
        wrap_without_mode,
        "runs without the torch function mode: " + _METADATA_WHY,
    ),
    Patch(
        "megatron.core.dist_checkpointing.optimizer.make_sharded_optimizer_tensor",
        wrap_without_mode,
        "runs without the torch function mode: " + _METADATA_WHY,
        params=("model_param", "optim_param", "prefix"),
    ),
)


def declared_patches() -> tuple[Patch, ...]:
    """Every patch :func:`activate` installs, in order: the ``torch.cuda`` stand-ins, NVTX no-ops,
    the function mode's re-entry points, then :data:`MEGATRON_PATCHES`."""
    standin = "CPU stand-in: upstream calls torch.cuda directly (devices, streams, RNG, memory)"
    out = [Patch(f"torch.cuda.{n}", value(_unique(v)), standin) for n, v in CUDA_STANDINS.items()]
    out += [
        Patch(
            f"torch.cuda.random.{n}",
            value(_unique(CUDA_STANDINS[n])),
            "CPU stand-in: megatron's RNG tracker imports it from torch.cuda.random",
        )
        for n in CUDA_RANDOM_STANDINS
    ]
    out += [
        Patch(f"torch.cuda.nvtx.{n}", value(_unique(noop)), "no NVTX without CUDA: a no-op")
        for n in ("range_push", "range_pop", "mark")
    ]
    out += [
        Patch("torch.cuda.nvtx.range", value(nvtx_range), "no NVTX without CUDA: an empty context"),
        # Torch function modes are per thread and disabled inside autograd's backward.
        Patch(
            "threading.Thread._bootstrap_inner",
            _in_mode,
            "torch function modes are per thread: new threads enter the CUDA-to-CPU mode",
        ),
        Patch(
            "torch.autograd.function.BackwardCFunction.apply",
            _in_mode,
            "torch function modes are off inside autograd's backward: it re-enters the mode",
        ),
    ]
    return tuple(out) + MEGATRON_PATCHES


def _unique(value: Any) -> Any:
    """A distinct function object per stand-in: torch._dynamo keys its trace rules by function
    identity and refuses one object registered under two torch.cuda names."""
    if not isinstance(value, types.FunctionType):
        return value

    def standin(*args, **kwargs):
        return value(*args, **kwargs)

    standin.__name__ = standin.__qualname__ = getattr(value, "__name__", "standin")
    return standin


# ----------------------------------------------------------------------------------------------
# The component; activate / deactivate
# ----------------------------------------------------------------------------------------------
class CpuBackend(Component[CpuBackendState]):
    """The CPU backend (``pretrain_gpt.py --cpu``): installed at start, before the arguments are
    parsed (:func:`megatron.training_ext.args.prepare_cpu_backend`); every patch of
    :func:`declared_patches`, then the mode entered on the installing thread. A second install
    keeps the activation as it is (the mode stays entered)."""

    name = "cpu"
    title = "the CPU backend (--cpu): upstream's training loop on CPU with gloo"
    installed_at = "startup"
    patches = declared_patches()

    def new_state(self, args: Any) -> CpuBackendState:
        """A fresh activation; checks first that no CUDA device is usable (before any patch).

        Raises:
            RuntimeError: a real CUDA device is present and usable (:data:`CUDA_PRESENT`).
        """
        if torch.cuda.is_available():
            raise RuntimeError(CUDA_PRESENT)
        import megatron.core  # noqa: F401  (upstream imports see the real torch.cuda first)

        return CpuBackendState()

    def install(self, args: Any = None) -> Optional[CpuBackendState]:
        """:meth:`Component.install`, but a second call changes nothing (the entered mode and
        the tensors kept in host memory stay those of the first)."""
        if self.state is not None:
            return self.state
        return super().install(args)

    def started(self, state: CpuBackendState) -> None:
        """Seed the CUDA stand-in generator and enter the mode on this thread."""
        state.random = random_callables()
        CUDA_GENERATOR.manual_seed(0)
        state.mode = CudaToCpuMode()
        state.mode.__enter__()
        logger.debug(
            "cpu backend: active (torch %s, %d threads)", torch.__version__, torch.get_num_threads()
        )

    def stopped(self, state: CpuBackendState) -> None:
        """Leave the mode (on the thread that entered it)."""
        if state.mode is not None:
            state.mode.__exit__(None, None, None)


#: The component (entry point ``cpu``).
COMPONENT = CpuBackend()


def activate() -> None:
    """Install the CPU backend in this process; idempotent.

    Call before ``pretrain()`` (``pretrain_gpt.py --cpu`` does). Requires the process group backend
    to be gloo (``--distributed-backend gloo``).

    Raises:
        RuntimeError: a real CUDA device is present and usable; the CPU backend refuses to shadow it
            (set ``CUDA_VISIBLE_DEVICES=`` to force CPU).
        UnsupportedUpstreamError: a declared patch point changed upstream; nothing is installed.
    """
    COMPONENT.install()


def deactivate() -> None:
    """Undo :func:`activate` (for tests). Must be called on the thread that activated."""
    COMPONENT.uninstall()
