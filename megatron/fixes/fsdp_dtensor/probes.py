"""Helpers of the ``fsdp_dtensor`` parts' behavioural probes: upstream's objects seen through this
overlay's own wrappers (which keep ``__wrapped__``), and temporary attribute swaps that a probe
undoes before it returns."""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator

_MISSING = object()


def is_ours(obj: Any) -> bool:
    """True for a function or class defined by this overlay (``megatron.fixes.*``)."""
    return (getattr(obj, "__module__", None) or "").startswith("megatron.fixes.")


def upstream_of(fn: Any) -> Any:
    """``fn`` with this overlay's wrappers peeled off (following ``__wrapped__``)."""
    while is_ours(fn) and hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


@contextlib.contextmanager
def swapped(owner: Any, **values: Any) -> Iterator[None]:
    """Set ``owner.<name> = value`` for each item while the block runs; afterwards every attribute
    is back as it was (deleted again where ``owner`` had none), also when the block raises."""
    saved = {name: getattr(owner, name, _MISSING) for name in values}
    try:
        for name, value in values.items():
            setattr(owner, name, value)
        yield
    finally:
        for name, old in saved.items():
            if old is _MISSING:
                with contextlib.suppress(AttributeError):
                    delattr(owner, name)
            else:
                setattr(owner, name, old)


@contextlib.contextmanager
def upstream_names(module: Any, *names: str) -> Iterator[None]:
    """While the block runs, the globals ``names`` of ``module`` that this overlay replaced hold
    upstream's objects again (a probe of upstream's code path must not run through our fix)."""
    ours = {
        name: upstream_of(getattr(module, name))
        for name in names
        if is_ours(getattr(module, name, None)) and hasattr(getattr(module, name), "__wrapped__")
    }
    with swapped(module, **ours):
        yield


#: upstream's logger of the fsdp_dtensor checkpoint helpers (its INFO lines are not a probe's)
UPSTREAM_LOGGER = "megatron.core.transformer.fsdp_dtensor_checkpoint"


def quiet_upstream() -> contextlib.AbstractContextManager:
    """While the block runs, upstream's ``fsdp_dtensor`` checkpoint logger is disabled."""
    return swapped(logging.getLogger(UPSTREAM_LOGGER), disabled=True)
