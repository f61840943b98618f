"""The contract every fix of an upstream defect follows, and the patch bookkeeping they share.

A fix is an object that knows
  * which upstream distribution and versions it targets (``package``, ``supported``),
  * the upstream reports it answers (``upstream_refs``),
  * every upstream attribute it replaces and why (``patches``, shown by ``python -m megatron.fixes``),
  * how to tell that the installed upstream already behaves (``upstream_behaves``), in which case it
    stands aside instead of patching.

Patches go through :class:`Patcher`, which records the original object so that every patch can be
listed and undone (tests use :func:`megatron.fixes.reset`).
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
    """One upstream attribute a fix replaces or wraps.

    Attributes:
        target: dotted path of the upstream attribute, e.g.
            ``nvidia_resiliency_ext.checkpointing.local.replication.strategies.CliqueReplicationStrategy``.
        replacement: dotted path (or short description) of what takes its place.
        why: one sentence: the defect the replacement removes.
    """

    target: str
    replacement: str
    why: str


class Patcher:
    """Replaces attributes of upstream objects and remembers the originals."""

    def __init__(self) -> None:
        self._originals: list[tuple[Any, str, Any, bool]] = []

    def replace(self, owner: Any, name: str, new: Any) -> Any:
        """Set ``owner.name = new``; returns the original (``None`` if there was none)."""
        had = name in vars(owner) if hasattr(owner, "__dict__") else hasattr(owner, name)
        old = getattr(owner, name, None)
        self._originals.append((owner, name, old, had))
        setattr(owner, name, new)
        return old

    def restore(self) -> None:
        """Undo every replacement, newest first."""
        while self._originals:
            owner, name, old, had = self._originals.pop()
            if had:
                setattr(owner, name, old)
            else:
                try:
                    delattr(owner, name)
                except AttributeError:
                    pass


class Fix(abc.ABC):
    """Base class of one upstream-defect fix. Subclasses set the class attributes and implement
    :meth:`upstream_behaves` and :meth:`install`."""

    name: str
    title: str
    upstream_refs: tuple[str, ...]
    package: str
    supported: str
    patches: tuple[PatchSpec, ...]

    def __init__(self) -> None:
        self.status = FixStatus.NOT_APPLIED
        self.reason = ""
        self._patcher = Patcher()

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
        logger.info(
            "fix %s: installed on %s %s (%s): %s",
            self.name, self.package, version, ", ".join(self.upstream_refs),
            "; ".join(p.target for p in self.patches),
        )
        return self.status

    def reset(self) -> None:
        """Undo this fix's patches (for tests)."""
        self._patcher.restore()
        self.status, self.reason = FixStatus.NOT_APPLIED, ""
