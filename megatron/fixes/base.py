"""The contract every fix of an upstream defect follows, and the patch bookkeeping they share.

A fix is an object that knows
  * which upstream distribution and versions it targets (``package``, ``supported``),
  * the upstream reports it answers (``upstream_refs``),
  * every upstream attribute it replaces and why (``patches``, shown by
    ``python -m megatron.fixes``),
  * how to tell that the installed upstream already behaves (``upstream_behaves``), in which case it
    stands aside instead of patching.

Patches go through a :class:`megatron.fixes.registry.Patcher`, which records each replacement in
the one registry so that every patch can be listed and undone (tests use
:func:`megatron.fixes.reset`).
"""

from __future__ import annotations

import abc
import enum
import importlib.metadata
import logging
from dataclasses import dataclass
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from megatron.fixes.registry import Patcher, PatchRecord, dotted_name

logger = logging.getLogger("megatron.fixes")


class UnsupportedUpstreamError(RuntimeError):
    """The installed upstream version is outside what a fix was written and tested for, and the
    upstream does not behave correctly on its own: patching it blindly could corrupt checkpoints."""


class FixStatus(enum.Enum):
    ACTIVE = "active"  # installed onto upstream
    STANDS_ASIDE = "stands aside: upstream already behaves"
    NOT_APPLICABLE = "not applicable: upstream package not installed"
    NOT_APPLIED = "not applied"


@dataclass(frozen=True)
class PatchSpec:
    """One upstream attribute a fix replaces (a view of a :class:`PatchRecord`).

    Attributes:
        target: dotted path of the upstream attribute.
        replacement: dotted path of what takes its place.
        why: one sentence: the defect the replacement removes.
    """

    target: str
    replacement: str
    why: str


class _FixPatcher(Patcher):
    """A fix's :class:`Patcher`; ``why`` may come from the fix's declared ``patches``."""

    def __init__(self, fix: "Fix") -> None:
        super().__init__(fix.name)
        self._fix = fix

    def replace(self, obj: Any, name: str, new: Any, why: str | None = None) -> Any:
        if why is None:
            declared = type(self._fix).__dict__.get("patches", ())
            why = next(
                (p.why for p in declared if p.target.rsplit(".", 1)[-1] == name),
                f"part of fix {self._fix.name}: {self._fix.title}",
            )
        return super().replace(obj, name, new, why)


class _DryRunPatcher:
    """Collects what ``install`` would replace without replacing anything."""

    def __init__(self) -> None:
        self.specs: list[PatchSpec] = []

    def replace(self, obj: Any, name: str, new: Any, why: str | None = None) -> Any:
        self.specs.append(PatchSpec(f"{dotted_name(obj)}.{name}", dotted_name(new), why or ""))
        return getattr(obj, name, None)


class Fix(abc.ABC):
    """Base class of one upstream-defect fix. Subclasses set the class attributes and implement
    :meth:`upstream_behaves` and :meth:`install`."""

    name: str
    title: str
    upstream_refs: tuple[str, ...]
    package: str
    supported: str

    def __init__(self) -> None:
        self.status = FixStatus.NOT_APPLIED
        self.reason = ""
        self._patcher = _FixPatcher(self)

    @property
    def patches(self) -> tuple[PatchSpec, ...]:
        """What this fix replaces: its registry records once installed, else what :meth:`install`
        would replace (a dry run that replaces nothing)."""
        records = self.records()
        if records:
            return tuple(PatchSpec(r.target, r.replacement, r.why) for r in records)
        dry = _DryRunPatcher()
        try:
            self.install(dry)  # type: ignore[arg-type]
        except Exception:  # a dry run must never break a listing
            logger.debug("fix %s: dry-run install failed", self.name, exc_info=True)
        return tuple(dry.specs)

    def records(self) -> list[PatchRecord]:
        """This fix's live :class:`PatchRecord` s in the registry."""
        return self._patcher.records()

    def installed_version(self) -> str | None:
        """Version of ``package`` installed in this environment, or ``None``."""
        try:
            return importlib.metadata.version(self.package)
        except importlib.metadata.PackageNotFoundError:
            return None

    def version_supported(self, version: str) -> bool:
        return Version(version) in SpecifierSet(self.supported)

    @abc.abstractmethod
    def upstream_behaves(self) -> bool:
        """True if the installed upstream already has the correct behaviour (checked by capability,
        not by version), so this fix must not patch it."""

    @abc.abstractmethod
    def install(self, patcher: Patcher) -> None:
        """Patch upstream through ``patcher``; called at most once between resets."""

    def apply(self) -> FixStatus:
        """Install this fix if needed; idempotent.

        Raises:
            UnsupportedUpstreamError: the installed ``package`` version is outside ``supported``
                and upstream does not already behave.
        """
        if self.status is not FixStatus.NOT_APPLIED:
            return self.status
        version = self.installed_version()
        if version is None:
            self.status, self.reason = FixStatus.NOT_APPLICABLE, f"{self.package} is not installed"
            logger.info("fix %s: %s", self.name, self.status.value)
            return self.status
        if self.upstream_behaves():
            self.status = FixStatus.STANDS_ASIDE
            self.reason = f"{self.package} {version} already behaves"
            logger.warning("fix %s: %s (%s)", self.name, self.status.value, self.reason)
            return self.status
        if not self.version_supported(version):
            raise UnsupportedUpstreamError(
                f"fix '{self.name}' ({', '.join(self.upstream_refs)}) targets {self.package}"
                f"{self.supported} (the pin in pyproject.toml), but {self.package} {version} is "
                f"installed and still shows the defect. Install the pinned version "
                f"(pip install '{self.package}{self.supported}') or update the fix."
            )
        self.install(self._patcher)
        self.status, self.reason = FixStatus.ACTIVE, f"{self.package} {version}"
        logger.debug(  # one summary line per process instead (megatron.fixes.apply)
            "fix %s: installed on %s %s (%s): %s",
            self.name,
            self.package,
            version,
            ", ".join(self.upstream_refs),
            "; ".join(p.target for p in self.patches),
        )
        return self.status

    def reset(self) -> None:
        """Undo this fix's patches (for tests)."""
        self._patcher.restore()
        self.status, self.reason = FixStatus.NOT_APPLIED, ""


class FixGroup(Fix):
    """Several fixes released upstream together (one PR, one flag to disable), each its own
    :class:`Fix` with its own probe: a part stands aside when upstream already behaves for it.

    Subclasses set the class attributes of :class:`Fix` and ``parts`` (instances, in install
    order). The group is active when it installed at least one part.
    """

    parts: tuple[Fix, ...] = ()

    def upstream_behaves(self) -> bool:
        return all(part.upstream_behaves() for part in self.parts)

    def install(self, patcher: Patcher) -> None:
        if isinstance(patcher, _DryRunPatcher):
            for part in self.parts:
                part.install(patcher)  # type: ignore[arg-type]
            return
        for part in self.parts:
            part.apply()

    def records(self) -> list[PatchRecord]:
        return [r for part in self.parts for r in part.records()]

    def reset(self) -> None:
        for part in reversed(self.parts):
            part.reset()
        super().reset()
