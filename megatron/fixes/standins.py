"""Small stand-ins for the fixes' behavioural probes: upstream's own function under the overlay's
wrappers, attributes replaced for the length of one call, permissive ``args``, process groups and a
parallel state without a process group.

A probe calls upstream's function on stand-in inputs and observes the wrong or the right behaviour
(``docs/overlay.md``); everything here is undone when the probe returns or raises.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any, Callable, Iterator

__all__ = [
    "UPSTREAM_PACKAGES",
    "StandInArgs",
    "get_rng_state_stand_ins",
    "group",
    "is_upstream",
    "new_optimizer",
    "parallel_state",
    "pg_rank",
    "pg_size",
    "replaced",
    "upstream_own",
]

#: Packages whose functions are upstream's; a wrapper whose ``__module__`` is elsewhere and that
#: points at what it wraps (``__wrapped__``) is one of this overlay's (or a test's) replacements.
UPSTREAM_PACKAGES = ("megatron.core", "megatron.training")

_ABSENT = object()


def is_upstream(fn: Any) -> bool:
    """True if ``fn`` was defined in upstream's packages (:data:`UPSTREAM_PACKAGES`; a decorator
    that uses ``functools.wraps``, e.g. ``torch.no_grad()``, keeps the decorated function's
    module)."""
    module = getattr(fn, "__module__", None) or ""
    return any(module == p or module.startswith(p + ".") for p in UPSTREAM_PACKAGES)


def upstream_own(fn: Callable) -> Callable:
    """``fn`` without the wrappers put over it from outside upstream: follows ``__wrapped__`` while
    the function is not upstream's (:func:`is_upstream`). Upstream's own decorators
    (``@torch.no_grad()``, ``functools.wraps``) are kept, so the result behaves as upstream's
    function does."""
    seen = set()
    while not is_upstream(fn) and hasattr(fn, "__wrapped__") and id(fn) not in seen:
        seen.add(id(fn))
        fn = fn.__wrapped__
    return fn


@contextlib.contextmanager
def replaced(obj: Any, **values: Any) -> Iterator[None]:
    """While open, ``obj.<name>`` is ``values[name]`` for every name given; on exit each is put
    back as it was (removed where ``obj`` did not hold it itself), also when the body raises."""
    own = vars(obj) if hasattr(obj, "__dict__") else None
    saved = {
        name: own.get(name, _ABSENT) if own is not None else getattr(obj, name, _ABSENT)
        for name in values
    }
    try:
        for name, value in values.items():
            setattr(obj, name, value)
        yield
    finally:
        for name, old in saved.items():
            if old is _ABSENT:
                try:
                    delattr(obj, name)
                except AttributeError:
                    pass
            else:
                setattr(obj, name, old)


class StandInArgs(SimpleNamespace):
    """Megatron's global ``args`` for a probe: the attributes given, and ``None`` for any other
    (what most of upstream's options default to), so that an option upstream adds later does not
    stop the probe."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return None


def group(rank: int, size: int) -> SimpleNamespace:
    """A stand-in process group: ``rank()`` and ``size()`` only (no communication)."""
    return SimpleNamespace(rank=lambda: rank, size=lambda: size)


def pg_rank(group: Any = None) -> int:
    """``megatron.core.utils.get_pg_rank`` for stand-in groups: the group's rank, 0 without one."""
    return 0 if group is None else group.rank()


def pg_size(group: Any = None) -> int:
    """``megatron.core.utils.get_pg_size`` for stand-in groups: the group's size, 1 without one."""
    return 1 if group is None else group.size()


def parallel_state(
    *,
    tp: tuple[int, int] = (0, 1),
    pp: tuple[int, int] = (0, 1),
    dp: tuple[int, int] = (0, 1),
    ep: tuple[int, int] = (0, 1),
    etp: tuple[int, int] = (0, 1),
    edp: tuple[int, int] = (0, 1),
) -> SimpleNamespace:
    """A stand-in ``megatron.core.parallel_state`` (``mpu``) for one rank of a job, without a
    process group: each axis is ``(rank, size)`` (tensor, pipeline, data, expert, expert-tensor,
    expert-data parallel; context parallel size 1). Groups are :func:`group` stand-ins."""
    axes = {
        "tensor_model_parallel": tp,
        "pipeline_model_parallel": pp,
        "context_parallel": (0, 1),
        "expert_model_parallel": ep,
        "expert_tensor_parallel": etp,
        "expert_data_parallel": edp,
    }
    out: dict[str, Any] = {"model_parallel_is_initialized": lambda: True}
    for axis, (rank, size) in axes.items():
        out[f"get_{axis}_rank"] = lambda *a, _r=rank, **k: _r
        out[f"get_{axis}_world_size"] = lambda *a, _s=size, **k: _s
        out[f"get_{axis}_group"] = lambda *a, _g=group(rank, size), **k: _g
    dp_group = group(*dp)
    out["get_data_parallel_rank"] = lambda *a, **k: dp[0]
    out["get_data_parallel_world_size"] = lambda *a, **k: dp[1]
    out["get_data_parallel_group"] = lambda *a, **k: dp_group
    return SimpleNamespace(**out)


@contextlib.contextmanager
def get_rng_state_stand_ins(mpu: Any) -> Iterator[None]:
    """While open, ``megatron.training.checkpointing.get_rng_state`` runs as on the rank ``mpu``
    describes (:func:`parallel_state`), without a process group or a device: its ``mpu``,
    ``get_pg_rank``/``get_pg_size`` (:func:`pg_rank`, :func:`pg_size`: the stand-in groups' rank
    and size), ``get_args`` (``data_parallel_random_init`` off) and ``torch.cuda.get_rng_state``
    (a fixed 16-byte state) are stand-ins; all are put back on exit."""
    import torch
    from megatron.training import checkpointing as ckpt

    args = StandInArgs(data_parallel_random_init=False)
    cuda_state = torch.zeros(16, dtype=torch.uint8)
    with (
        replaced(ckpt, get_args=lambda: args, mpu=mpu, get_pg_rank=pg_rank, get_pg_size=pg_size),
        replaced(torch.cuda, get_rng_state=lambda *a, **k: cuda_state.clone()),
    ):
        yield


def new_optimizer(cls: type, params: Any, **kwargs: Any) -> Any:
    """``cls(params, **kwargs)`` (a ``torch.optim.Optimizer`` class) without leaving ``cls.step``
    wrapped: torch wraps a class's ``step`` with its profiling hooks at the first instance, and a
    probe must change nothing outside the patch registry. Steps of the returned optimizer run
    the unwrapped ``step``."""
    step = cls.__dict__.get("step")
    try:
        return cls(params, **kwargs)
    finally:
        if step is not None:
            cls.step = step
