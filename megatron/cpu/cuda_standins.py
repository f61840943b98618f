"""Stand-ins for the ``torch.cuda`` functions Megatron calls on the training path, installed by
:func:`megatron.cpu.runtime.activate`: device queries, streams and events (CPU work is
synchronous), memory statistics (zeros), device properties, and the "CUDA" RNG: a dedicated CPU
``torch.Generator`` playing ``torch.cuda.default_generators[0]``."""

from __future__ import annotations

import contextlib
import os
import time
import types
from typing import Any

import torch

# ----------------------------------------------------------------------------------------------
# The "CUDA" RNG stand-in
# ----------------------------------------------------------------------------------------------
CUDA_GENERATOR = torch.Generator(device="cpu")


@contextlib.contextmanager
def cuda_generator_as_default():
    """Run the body with the CUDA stand-in generator as the CPU default generator.

    Random ops that would run on a GPU tensor (dropout) draw from the "CUDA" stream, not from the
    CPU stream used by initialisation and data code. Not re-entrant-safe across threads by design:
    Megatron draws dropout masks on the training thread only.
    """
    cpu = torch.default_generator
    saved = cpu.get_state()
    cpu.set_state(CUDA_GENERATOR.get_state())
    try:
        yield
    finally:
        CUDA_GENERATOR.set_state(cpu.get_state())
        cpu.set_state(saved)


def _cuda_get_rng_state(device: Any = "cuda") -> torch.Tensor:
    return CUDA_GENERATOR.get_state()


def _cuda_set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
    CUDA_GENERATOR.set_state(
        new_state.to("cpu", torch.uint8) if new_state.dtype != torch.uint8 else new_state
    )


def _cuda_manual_seed(seed: int) -> None:
    CUDA_GENERATOR.manual_seed(int(seed))


def _cuda_seed() -> None:
    CUDA_GENERATOR.seed()


def _cuda_initial_seed() -> int:
    return CUDA_GENERATOR.initial_seed()


# ----------------------------------------------------------------------------------------------
# torch.cuda stand-ins
# ----------------------------------------------------------------------------------------------
class _Stream:
    """Stand-in for ``torch.cuda.Stream``: CPU work is synchronous, so every wait is a no-op."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.cuda_stream = 0
        self.device = torch.device("cpu")

    def wait_stream(self, stream: Any) -> None: ...
    def wait_event(self, event: Any) -> None: ...
    def synchronize(self) -> None: ...
    def query(self) -> bool:
        return True

    def record_event(self, event: Any = None) -> "_Event":
        event = event or _Event()
        event.record(self)
        return event

    def __enter__(self) -> "_Stream":
        return self

    def __exit__(self, *exc: Any) -> None: ...

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, _Stream)

    def __hash__(self) -> int:
        return 0


class _Event:
    """Stand-in for ``torch.cuda.Event``; ``elapsed_time`` returns wall-clock milliseconds."""

    def __init__(
        self,
        enable_timing: bool = False,
        blocking: bool = False,
        interprocess: bool = False,
        **kwargs: Any,
    ) -> None:
        self._t: float | None = None

    def record(self, stream: Any = None) -> None:
        self._t = time.perf_counter()

    def wait(self, stream: Any = None) -> None: ...
    def synchronize(self) -> None: ...
    def query(self) -> bool:
        return True

    def elapsed_time(self, end: "_Event") -> float:
        if self._t is None or end._t is None:
            return 0.0
        return (end._t - self._t) * 1000.0


def _device_properties(device: Any = None) -> types.SimpleNamespace:
    try:
        import psutil

        total = psutil.virtual_memory().total
    except Exception:  # noqa: BLE001 - pragma: no cover - psutil is an NVRx dependency
        total = 0
    return types.SimpleNamespace(
        name="cpu (megatron.cpu stand-in)",
        total_memory=total,
        major=0,
        minor=0,
        multi_processor_count=os.cpu_count() or 1,
        is_integrated=False,
        L2_cache_size=0,
        uuid="cpu",
    )


def _mem_get_info(device: Any = None) -> tuple[int, int]:
    import psutil

    vm = psutil.virtual_memory()
    return vm.available, vm.total


def noop(*args: Any, **kwargs: Any) -> None:
    return None


def _zero(*args: Any, **kwargs: Any) -> int:
    return 0


CUDA_STANDINS: dict[str, Any] = {
    "device_count": lambda: 1,
    "current_device": lambda: 0,
    "set_device": noop,
    "synchronize": noop,
    "Stream": _Stream,
    "Event": _Event,
    "current_stream": lambda device=None: _Stream(),
    "default_stream": lambda device=None: _Stream(),
    "set_stream": noop,
    "stream": lambda stream=None: contextlib.nullcontext(),
    "memory_allocated": _zero,
    "max_memory_allocated": _zero,
    "memory_reserved": _zero,
    "max_memory_reserved": _zero,
    "memory_stats": lambda device=None: {},
    "memory_summary": lambda *a, **k: "(cpu backend: no CUDA memory)",
    "reset_peak_memory_stats": noop,
    "reset_max_memory_allocated": noop,
    "empty_cache": noop,
    "ipc_collect": noop,
    "mem_get_info": _mem_get_info,
    "get_device_properties": _device_properties,
    "get_device_capability": lambda device=None: (0, 0),
    "get_device_name": lambda device=None: "cpu",
    "get_rng_state": _cuda_get_rng_state,
    "set_rng_state": _cuda_set_rng_state,
    "manual_seed": _cuda_manual_seed,
    "manual_seed_all": _cuda_manual_seed,
    "seed": _cuda_seed,
    "seed_all": _cuda_seed,
    "initial_seed": _cuda_initial_seed,
    "default_generators": (CUDA_GENERATOR,),
}
CUDA_RANDOM_STANDINS = (
    "get_rng_state",
    "set_rng_state",
    "manual_seed",
    "manual_seed_all",
    "seed",
    "seed_all",
    "initial_seed",
)
