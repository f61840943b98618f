"""A component: a part of this fork that changes upstream's behaviour while the run's arguments
switch it on (the persistent tier, the resume proof, the validated local tier, the loss log, the
CPU backend), declared like a :class:`~megatron.overlay.fix.Fix`.

A :class:`Component` declares its name, its patches (:class:`~megatron.overlay.patch.Patch`),
which components it must be installed after, at which moment of a start it is installed
(:data:`INSTALLED_AT`), when the arguments enable it, and the state object each install
creates. The base owns the lifecycle: :meth:`Component.install` checks the patch points with the
code the fixes use (raising :class:`UnsupportedUpstreamError` when upstream changed), creates the
state and installs the patches; a second install (a new start of training in the same process)
starts from a fresh state in the same object, so nothing an earlier attempt decided carries over;
:meth:`Component.uninstall` undoes it. The state lives on the component,
never in module globals. Design: ``docs/overlay.md``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import fields, is_dataclass
from typing import Any, ClassVar, Generic, Optional, TypeVar

from megatron.overlay.errors import UnsupportedUpstreamError
from megatron.overlay.fix import PatchSpec, declared_specs
from megatron.overlay.patch import Patch, check_patches
from megatron.overlay.registry import Patcher, PatchRecord

__all__ = [
    "COMPONENTS_GROUP",
    "DISABLE_ENV",
    "INSTALLED_AT",
    "Component",
    "declared_components",
    "declared_names",
    "disabled",
]

logger = logging.getLogger("megatron.overlay")

S = TypeVar("S")

#: Comma-separated names of fixes or components to leave out (for bisecting a problem, and for the
#: guard tests that show the unfixed upstream still fails). Each one left out is logged.
DISABLE_ENV = "MEGATRON_FIXES_DISABLE"

#: Entry-point group naming every component (``name = "module:INSTANCE"``, in ``pyproject.toml``),
#: so that ``python -m megatron.fixes`` and the disable switch know them without importing the
#: packages above the fixes.
COMPONENTS_GROUP = "megatron.overlay.components"

#: When a component is installed (:attr:`Component.installed_at`), in the order of a start of
#: ``pretrain_gpt.py``: what each moment means.
INSTALLED_AT = {
    "startup": "at start, before the arguments are parsed (by its own flag, e.g. --cpu)",
    "training": "before pretrain(), by the training hooks, as the arguments enable it",
    "model": "when the model config is built, as the config enables it",
}


def disabled() -> set[str]:
    """Names listed in ``$MEGATRON_FIXES_DISABLE``."""
    return {n.strip() for n in os.environ.get(DISABLE_ENV, "").split(",") if n.strip()}


def declared_names() -> list[str]:
    """The components' names from their entry points (nothing is imported)."""
    from importlib.metadata import entry_points

    return sorted(ep.name for ep in entry_points(group=COMPONENTS_GROUP))


def declared_components() -> list["Component"]:
    """Every declared component (importing its module), in install order: each after those it
    names in :attr:`Component.after`, else by name.

    Raises:
        TypeError: an entry point does not name a :class:`Component`.
        ValueError: ``after`` names an unknown component, the order has a cycle, or
            ``installed_at`` is not a key of :data:`INSTALLED_AT`.
    """
    from importlib.metadata import entry_points

    found = {}
    for ep in entry_points(group=COMPONENTS_GROUP):
        obj = ep.load()
        if not isinstance(obj, Component):
            raise TypeError(f"entry point {COMPONENTS_GROUP}:{ep.name} is not a Component: {obj!r}")
        found[obj.name] = obj
    return install_order(list(found.values()))


def install_order(components: list["Component"]) -> list["Component"]:
    """``components`` sorted so that each comes after those it names in ``after`` (ties by name).

    Raises:
        ValueError: ``after`` names a component not in ``components``, or a cycle; or an
            ``installed_at`` is not a key of :data:`INSTALLED_AT` (a typo would leave the
            component never installed).
    """
    by_name = {c.name: c for c in components}
    for c in components:
        if c.installed_at not in INSTALLED_AT:
            raise ValueError(
                f"component {c.name}: installed_at {c.installed_at!r} is not one of "
                f"{sorted(INSTALLED_AT)}"
            )
        unknown = [n for n in c.after if n not in by_name]
        if unknown:
            raise ValueError(f"component {c.name} is declared after unknown {unknown}")
    order: list[Component] = []
    pending = sorted(by_name)
    while pending:
        ready = [n for n in pending if all(a in {o.name for o in order} for a in by_name[n].after)]
        if not ready:
            raise ValueError(f"components {pending} name each other in 'after' (a cycle)")
        order.append(by_name[ready[0]])
        pending.remove(ready[0])
    return order


class Component(Generic[S]):
    """Base of every component. Subclasses set the class attributes and :meth:`new_state`;
    override :meth:`enabled` when arguments switch the component, :meth:`started` /
    :meth:`stopped` for work beyond the declared patches. One instance per component, created at
    import of its module and named by its entry point.

    Attributes:
        name: the component's name (registry owner, ``$MEGATRON_FIXES_DISABLE``, listings).
        title: one line: what the component changes.
        patches: the declared replacements, installed in order.
        after: names of the components this one is installed after (its patches wrap theirs).
        installed_at: when a start installs it (a key of :data:`INSTALLED_AT`): ``"training"``
            (default) by the training hooks for every component so declared, each deciding by
            :meth:`enabled`; ``"startup"`` and ``"model"`` by the code that owns that moment.
        state: the state of the current install (``None`` while not installed).
    """

    name: ClassVar[str]
    title: ClassVar[str]
    patches: ClassVar[tuple[Patch, ...]] = ()
    after: ClassVar[tuple[str, ...]] = ()
    installed_at: ClassVar[str] = "training"

    def __init__(self) -> None:
        self.state: Optional[S] = None
        self.patcher = Patcher(self.name)
        self._warned_disabled = False

    # -- declarations -------------------------------------------------------------------------
    def enabled(self, args: Any) -> bool:
        """Whether ``args`` switch the component on (default: always)."""
        return True

    def new_state(self, args: Any) -> S:
        """The state of one install for ``args`` (a dataclass instance, so that a reinstall can
        refresh it in place)."""
        raise NotImplementedError

    def started(self, state: S) -> None:
        """Called after the patches are installed by a first install (default: nothing)."""

    def stopped(self, state: S) -> None:
        """Called by :meth:`uninstall` before the patches are undone (default: nothing)."""

    def check_patch_points(self) -> list[str]:
        """What changed at the declared patch points (empty when all are as expected)."""
        return check_patches(self.patches)

    # -- lifecycle ----------------------------------------------------------------------------
    @property
    def installed(self) -> bool:
        return self.state is not None

    def install(self, args: Any = None) -> Optional[S]:
        """Install for ``args``; idempotent. Returns the state, or ``None`` when the component is
        not enabled by ``args`` (an installed one is then uninstalled) or is named in
        ``$MEGATRON_FIXES_DISABLE`` (logged once).

        A second call on an installed component keeps its patches and replaces every field of
        the state with a fresh one's, in the same object (holders keep it): each start of
        training in a process begins as a new process would.

        Raises:
            UnsupportedUpstreamError: a declared patch point is missing or lost a parameter the
                replacement relies on (upstream changed), naming it; nothing is installed.
        """
        if self.name in disabled():
            if not self._warned_disabled:
                logger.warning(
                    "component %s: disabled by $%s: upstream's behaviour is back",
                    self.name,
                    DISABLE_ENV,
                )
                self._warned_disabled = True
            self.uninstall()  # named after an earlier install in this process: upstream's again
            return None
        if not self.enabled(args):
            self.uninstall()
            return None
        fresh = self.new_state(args)
        if self.state is not None:
            if is_dataclass(self.state) and type(fresh) is type(self.state):
                for f in fields(fresh):  # also a slotted or frozen dataclass
                    object.__setattr__(self.state, f.name, getattr(fresh, f.name))
            else:
                self.state = fresh
            return self.state
        problems = self.check_patch_points()
        if problems:
            raise UnsupportedUpstreamError(
                f"{self.name}: {problems[0]}; this component relies on it "
                "(megatron/overlay/pins.py lists the proven upstreams)"
            )
        self.state = fresh
        try:
            for patch in self.patches:
                patch.install(self.patcher)
            self.started(fresh)
        except BaseException:
            self.uninstall()
            raise
        logger.debug("component %s: installed", self.name)
        return fresh

    def uninstall(self) -> None:
        """Undo :meth:`install` (tests; a reinstall with the component switched off)."""
        state, self.state = self.state, None
        try:
            if state is not None:
                self.stopped(state)
        finally:
            self.patcher.restore()

    def records(self) -> list[PatchRecord]:
        """This component's live records in the registry."""
        return self.patcher.records()

    # -- listing ------------------------------------------------------------------------------
    def specs(self) -> tuple[PatchSpec, ...]:
        """The declared patches as listed (target, the factory's dotted path, why); read off the
        declarations, nothing is installed."""
        return declared_specs(self.patches)

    def describe(self) -> dict[str, Any]:
        """The component as ``python -m megatron.fixes --json`` lists it: ``name``, ``title``,
        ``installed_at``, ``after`` (list), ``installed`` (bool) and ``patches`` (a list of
        ``{target, replacement, why}``, declared)."""
        return {
            "name": self.name,
            "title": self.title,
            "installed_at": self.installed_at,
            "after": list(self.after),
            "installed": self.installed,
            "patches": [
                {"target": s.target, "replacement": s.replacement, "why": s.why}
                for s in self.specs()
            ],
        }

    def __repr__(self) -> str:
        return f"<component {self.name}: {'installed' if self.installed else 'not installed'}>"
