"""Capability probes of the ``fsdp_dtensor`` parts: what the installed upstream has and calls,
seen through this overlay's own wrappers (which keep ``__wrapped__``)."""

from __future__ import annotations

import importlib
import inspect
from types import CodeType, ModuleType
from typing import Any


def is_ours(obj: Any) -> bool:
    """True for a function or class defined by this overlay (``megatron.fixes.*``)."""
    return (getattr(obj, "__module__", None) or "").startswith("megatron.fixes.")


def upstream_of(fn: Any) -> Any:
    """``fn`` with this overlay's wrappers peeled off (following ``__wrapped__``)."""
    while is_ours(fn) and hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


def upstream_function(module: str, name: str) -> Any:
    """Upstream's ``module.name`` if the installed release defines it (not this overlay), else
    None."""
    try:
        value = getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None
    return None if value is None or is_ours(value) else value


def _names(code: CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, CodeType):
            names |= _names(const)
    return names


def module_calls(module: ModuleType, name: str) -> bool:
    """True if a function defined in ``module`` (upstream's, under any wrapper of ours) refers to
    the global ``name``, i.e. upstream's own code path uses it."""
    for value in list(vars(module).values()):
        fn = upstream_of(value)
        if (
            inspect.isfunction(fn)
            and fn.__module__ == module.__name__
            and name in _names(fn.__code__)
        ):
            return True
    return False
