"""The one registry of every upstream attribute this overlay replaces at runtime.

Fixes, the CPU backend, the training hooks and the local/persistent tiers all replace upstream
attributes through :func:`replace` (or a :class:`Patcher`, its per-owner view). Each replacement is
recorded with its target, replacement, owner and reason, and can be undone; ``python -m
megatron.fixes [--json]`` prints the records. A wrapper keeps its own name and docstring and points
at what it wraps through ``__wrapped__`` (:func:`wraps_upstream`).
"""

from __future__ import annotations

import inspect
import threading
from dataclasses import asdict, dataclass
from typing import Any, Callable, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class PatchRecord:
    """One replacement of an upstream attribute.

    Attributes:
        target: dotted path of the replaced attribute, e.g.
            ``megatron.training.checkpointing.save_checkpoint``.
        replacement: dotted path of the object put in its place.
        owner: the fix or component that made it (``replication``, ``cpu``, ``local_tier``, ...).
        why: one sentence: what the replacement changes and why.
        adds_attribute: True when upstream had no such attribute before.
        depth: 1 for the first replacement of ``target``; n when it stacks on n-1 earlier ones
            (each wrapping the one before it).
    """

    target: str
    replacement: str
    owner: str
    why: str
    adds_attribute: bool
    depth: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Entry:
    obj: Any
    name: str
    old: Any
    new: Any
    had: bool
    record: PatchRecord
    token: object = None  # the Patcher that made it


def dotted_name(obj: Any) -> str:
    """``module.qualname`` of a module, class or function; ``module.Type instance`` otherwise."""
    if inspect.ismodule(obj):
        return obj.__name__
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if module and qualname and not isinstance(obj, (str, int, float, bool)):
        return f"{module}.{qualname}"
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__} instance"


class PatchRegistry:
    """Records and undoes replacements of upstream attributes, in the order they were made."""

    def __init__(self) -> None:
        self._entries: list[_Entry] = []
        self._lock = threading.Lock()

    def replace(
        self, obj: Any, name: str, new: Any, *, owner: str, why: str, token: object = None
    ) -> Any:
        """Set ``obj.name = new`` and record it.

        Args:
            obj: upstream module, class or object holding the attribute.
            name: attribute name.
            new: the replacement.
            owner: fix or component name (shown by ``python -m megatron.fixes``).
            why: one sentence on what the replacement changes and why.
            token: identifies the :class:`Patcher` that made it (for :meth:`restore`).

        Returns:
            The replaced object (``None`` if the attribute did not exist).

        Raises:
            ValueError: ``owner`` or ``why`` is empty.
        """
        if not owner or not why:
            raise ValueError(f"replacing {dotted_name(obj)}.{name}: owner and why are required")
        had = name in vars(obj) if hasattr(obj, "__dict__") else hasattr(obj, name)
        old = getattr(obj, name, None)
        raw_old = _raw(obj, name)  # a class's classmethod itself, not the bound method: restored
        target = f"{dotted_name(obj)}.{name}"
        with self._lock:
            depth = 1 + sum(1 for e in self._entries if e.obj is obj and e.name == name)
            record = PatchRecord(
                target,
                dotted_name(new),
                owner,
                why,
                adds_attribute=not hasattr(obj, name),
                depth=depth,
            )
            self._entries.append(_Entry(obj, name, raw_old, new, had, record, token))
        setattr(obj, name, new)
        return old

    def restore(self, owner: str | None = None, token: object = None) -> None:
        """Undo the replacements of ``owner`` (every owner if None; only those made through
        ``token`` if given), newest first."""
        with self._lock:
            mine = [
                e
                for e in self._entries
                if (owner is None or e.record.owner == owner)
                and (token is None or e.token is token)
            ]
            self._entries = [e for e in self._entries if e not in mine]
        for e in reversed(mine):
            if e.had:
                setattr(e.obj, e.name, e.old)
            else:
                try:
                    delattr(e.obj, e.name)
                except AttributeError:
                    pass

    def records(self, owner: str | None = None) -> list[PatchRecord]:
        """The live records, oldest first (only ``owner``'s if given)."""
        with self._lock:
            return [e.record for e in self._entries if owner is None or e.record.owner == owner]

    def stacked(self) -> dict[str, list[PatchRecord]]:
        """target -> its records, oldest first, for targets replaced more than once."""
        out: dict[str, list[PatchRecord]] = {}
        for r in self.records():
            out.setdefault(r.target, []).append(r)
        return {t: rs for t, rs in out.items() if len(rs) > 1}

    def is_recorded(self, obj: Any, name: str) -> bool:
        """True if the current value of ``obj.name`` was put there through this registry."""
        with self._lock:
            entries = [e for e in self._entries if e.obj is obj and e.name == name]
        return any(_raw(obj, name) is e.new for e in entries)


def _raw(obj: Any, name: str) -> Any:
    """``obj.name`` as stored: a class's own ``classmethod``/``staticmethod`` object rather than
    what attribute access makes of it (a new bound method each time), else ``getattr``."""
    if isinstance(obj, type) and name in vars(obj):
        return vars(obj)[name]
    return getattr(obj, name, None)


#: The process-wide registry.
REGISTRY = PatchRegistry()


def replace(obj: Any, name: str, new: Any, *, owner: str, why: str) -> Any:
    """:meth:`PatchRegistry.replace` on :data:`REGISTRY`."""
    return REGISTRY.replace(obj, name, new, owner=owner, why=why)


class Patcher:
    """One owner's view of :data:`REGISTRY`: its replacements, undone together."""

    def __init__(self, owner: str, registry: PatchRegistry | None = None) -> None:
        self.owner = owner
        self._registry = registry or REGISTRY
        self._originals: list[tuple[Any, str]] = []  # (obj, name) it replaced, oldest first

    def replace(self, obj: Any, name: str, new: Any, why: str) -> Any:
        """Set ``obj.name = new`` (recorded with this patcher's owner); returns the original."""
        old = self._registry.replace(obj, name, new, owner=self.owner, why=why, token=self)
        self._originals.append((obj, name))
        return old

    def restore(self) -> None:
        """Undo every replacement made through this patcher, newest first."""
        self._registry.restore(self.owner, token=self)
        self._originals.clear()

    def records(self) -> list[PatchRecord]:
        """The live records of this patcher's owner."""
        return self._registry.records(self.owner)


def wraps_upstream(original: Any) -> Callable[[F], F]:
    """Decorator: mark a wrapper as wrapping ``original`` (``__wrapped__``), keeping the wrapper's
    own name, module and docstring, so tracebacks and ``help()`` show the fork's code."""

    def mark(fn: F) -> F:
        fn.__wrapped__ = original  # type: ignore[attr-defined]
        return fn

    return mark
