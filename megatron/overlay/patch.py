"""A patch as data: which upstream attribute, the module-level factory that builds its
replacement from the original, and why.

``Patch("megatron.training.training.training_log", wrap_training_log, why="...")`` names its
target as a dotted string, so that a listing, the disable switches and the docs table are read off
the declarations without installing anything, and so that a fix can check its patch points (the
target exists and takes the parameters the wrapper relies on) before it patches an upstream it was
not proven on. Installing goes through :class:`megatron.overlay.registry.Patcher`.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

from megatron.overlay.registry import Patcher

__all__ = ["SKIP", "Patch", "alias_of", "check_patches", "current", "resolve", "value"]

_MISSING = object()

#: Returned by a factory to leave its target alone (e.g. an alias that no longer aliases).
SKIP = object()


@dataclass(frozen=True)
class Patch:
    """One replacement of an upstream attribute, declared.

    Attributes:
        target: dotted path of the upstream attribute: a module path, then attribute names
            (``megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.load_state_dict``).
        factory: module-level callable ``factory(original) -> replacement``; ``original`` is the
            attribute's value when the patch is installed (``None`` when ``adds`` is set).
        why: one sentence: the defect the replacement removes (shown by ``python -m
            megatron.fixes``).
        params: parameter names the replacement relies on in the original's signature; a patch
            point whose signature lacks one has changed upstream (checked by :meth:`check`).
        adds: the attribute does not exist upstream; the patch adds it.
        optional: what holds the attribute exists only with an optional dependency (e.g. a class
            defined only with Transformer Engine): when it cannot be resolved the patch is skipped
            and the point is not reported as changed.
    """

    target: str
    factory: Callable[[Any], Any]
    why: str
    params: tuple[str, ...] = field(default=())
    adds: bool = False
    optional: bool = False

    @property
    def attribute(self) -> str:
        """The last component of :attr:`target`."""
        return self.target.rsplit(".", 1)[1]

    def check(self) -> str | None:
        """``None`` when the patch point is as expected, else what changed (one sentence).

        Imports the target's module. Never raises for a missing or changed target."""
        try:
            owner, name = resolve(self.target)
        except (ImportError, AttributeError) as exc:
            if self.optional:
                return None
            return f"{self.target} cannot be resolved ({type(exc).__name__}: {exc})"
        value = getattr(owner, name, _MISSING)
        if value is _MISSING:
            return None if self.adds else f"{self.target} does not exist"
        if self.params:
            try:
                have = inspect.signature(inspect.unwrap(value)).parameters
            except (TypeError, ValueError):
                return f"{self.target} has no inspectable signature"
            lost = [p for p in self.params if p not in have]
            if lost:
                return f"{self.target} no longer takes {', '.join(lost)}"
        return None

    def install(self, patcher: Patcher) -> Any:
        """Resolve the target, build the replacement from the current value and put it in place
        through ``patcher`` (recorded in the registry). Returns the replacement, or :data:`SKIP`
        when the factory declined (nothing recorded).

        Raises:
            ImportError, AttributeError: the target cannot be resolved (and is not ``optional``).
        """
        try:
            owner, name = resolve(self.target)
        except (ImportError, AttributeError):
            if self.optional:
                return SKIP
            raise
        original = getattr(owner, name, None)
        new = self.factory(original)
        if new is not SKIP:
            patcher.replace(owner, name, new, self.why)
        return new


def check_patches(patches: Any) -> list[str]:
    """What changed at the patch points of ``patches`` (empty when all are as expected; see
    :meth:`Patch.check`); an entry that is not a declared :class:`Patch` cannot be checked and is
    reported so. Fixes and components check their points with it."""
    problems = []
    for p in patches:
        if not isinstance(p, Patch):
            problems.append(f"{p.target}: not a declared Patch, cannot be checked")
            continue
        problem = p.check()
        if problem:
            problems.append(problem)
    return problems


def resolve(target: str) -> tuple[Any, str]:
    """``(object holding the attribute, attribute name)`` for a dotted ``target``: the longest
    importable module prefix, then ``getattr`` along the rest.

    Raises:
        ImportError: no prefix of ``target`` imports.
        AttributeError: an intermediate attribute is missing.
        ValueError: ``target`` has no dot.
    """
    if "." not in target:
        raise ValueError(f"patch target {target!r} must be a dotted path (module.attribute)")
    parts = target.split(".")
    module = None
    for i in range(len(parts) - 1, 0, -1):
        try:
            module = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        rest = parts[i:]
        break
    if module is None:
        raise ImportError(f"no module of {target!r} can be imported")
    owner: Any = module
    for name in rest[:-1]:
        owner = getattr(owner, name)
    return owner, rest[-1]


def current(target: str) -> Any:
    """The live value of ``target`` (after any patches already installed).

    Raises:
        ImportError, AttributeError: as :func:`resolve`, or the attribute is missing.
    """
    owner, name = resolve(target)
    return getattr(owner, name)


def alias_of(
    target: str, *, only_if_same: bool = False, otherwise: Callable[[Any], Any] | None = None
) -> Callable[[Any], Any]:
    """A factory for a patch of a second name of ``target``'s object (``from m import f`` in
    another module); declare it after the patch of ``target``.

    The replacement is ``target``'s live value (its replacement), so both names reach one object;
    :data:`SKIP` when the name does not exist. With ``only_if_same``, only when the name still
    holds what ``target`` held before its patch; else ``otherwise(original)``, or :data:`SKIP`
    without ``otherwise``."""

    def same_object(original: Any) -> Any:
        if original is None:
            return SKIP
        live = current(target)
        if not only_if_same or original is live or original is getattr(live, "__wrapped__", None):
            return live
        return otherwise(original) if otherwise is not None else SKIP

    same_object.__qualname__ = f"alias_of({target})"
    return same_object


def value(obj: Any) -> Callable[[Any], Any]:
    """A factory whose replacement is ``obj`` itself (a class or function that does not wrap the
    original)."""

    def replacement(_original: Any) -> Any:
        return obj

    replacement.__qualname__ = f"value({getattr(obj, '__qualname__', type(obj).__name__)})"
    return replacement
