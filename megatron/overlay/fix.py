"""The unit of change: a fix of one upstream defect, declared.

A :class:`Fix` carries the upstream reports it answers, the distribution it patches, the versions
it is proven on (:mod:`megatron.overlay.pins`), its patches as data (:class:`~.patch.Patch`) and a
behavioural probe (:meth:`Fix.upstream_behaves`) that exercises the defect on a small stand-in.
:meth:`Fix.apply` decides, on any upstream:

* the probe shows upstream behaving: the fix **stands aside**;
* the probe shows the defect: the fix is **applied** when its patch points exist with the
  expected signatures, else **refused** (the run stops, naming what changed);
* the probe cannot tell (``None``, or it raised): applied on a proven version (the safe
  direction), else **refused**.

Design notes and the table of verdicts per upstream: ``docs/overlay.md``.
"""

from __future__ import annotations

import enum
import importlib.metadata
import logging
from dataclasses import dataclass
from typing import Any

from megatron.overlay import pins
from megatron.overlay.errors import UnsupportedUpstreamError
from megatron.overlay.patch import Patch, check_patches
from megatron.overlay.registry import Patcher, PatchRecord

__all__ = ["Fix", "FixGroup", "FixStatus", "PatchSpec", "declared_specs"]

logger = logging.getLogger("megatron.fixes")


class FixStatus(enum.Enum):
    ACTIVE = "active"  # installed onto upstream
    STANDS_ASIDE = "stands aside: upstream already behaves"
    NOT_APPLICABLE = "not applicable: upstream package not installed"
    NOT_APPLIED = "not applied"
    REFUSED = "refused: cannot tell whether upstream needs it"


@dataclass(frozen=True)
class PatchSpec:
    """One upstream attribute a fix replaces, as listed (a view of a :class:`Patch` or of a live
    :class:`PatchRecord`).

    Attributes:
        target: dotted path of the upstream attribute.
        replacement: dotted path of what takes its place (or of the factory that builds it).
        why: one sentence: the defect the replacement removes.
    """

    target: str
    replacement: str
    why: str


def _dotted(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def declared_specs(patches: Any) -> tuple[PatchSpec, ...]:
    """``patches`` as listed, read off the declarations (nothing is installed): each
    :class:`Patch` as (target, dotted path of its factory, why); an entry already a
    :class:`PatchSpec` as it is. Fixes and components list their declarations with it."""
    return tuple(
        PatchSpec(p.target, _dotted(p.factory), p.why) if isinstance(p, Patch) else p
        for p in patches
    )


class Fix:
    """One upstream-defect fix. Subclasses set the class attributes and :meth:`upstream_behaves`;
    ``patches`` declares what is replaced, and :meth:`install` installs them (override it only for
    work beyond the declared patches, calling ``super().install``).

    Attributes:
        name: the fix's name (``$MEGATRON_FIXES_DISABLE``, ``python -m megatron.fixes``).
        title: one line: what the fix changes.
        upstream_refs: the upstream issues, PRs or code it answers.
        package: the distribution it patches (a key of :data:`megatron.overlay.pins.PROVEN`).
        proven: a specifier narrowing the proven versions of ``package`` for this fix (``None``:
            :data:`~megatron.overlay.pins.NARROWED`'s entry for it, else every version in
            :data:`~megatron.overlay.pins.PROVEN`).
        patches: the declared replacements.
    """

    name: str
    title: str
    upstream_refs: tuple[str, ...]
    package: str
    proven: str | None = None
    patches: tuple[Patch, ...] = ()

    def __init__(self) -> None:
        self.status = FixStatus.NOT_APPLIED
        self.reason = ""
        self._patcher = _FixPatcher(self)

    # -- declarations -------------------------------------------------------------------------
    @property
    def supported(self) -> str:
        """The proven versions, for messages and listings (``==0.19.2 or ==0.20.0``)."""
        only = self._proven()
        return only if only is not None else pins.proven_specifier(self.package)

    def _proven(self) -> str | None:
        return self.proven if self.proven is not None else pins.narrowed(self.name)

    def specs(self) -> tuple[PatchSpec, ...]:
        """What this fix replaces: its registry records once installed, else its declarations
        (nothing is installed to find out)."""
        records = self.records()
        if records:
            return tuple(PatchSpec(r.target, r.replacement, r.why) for r in records)
        return declared_specs(self.patches)

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
        """True if ``version`` of ``package`` is one this fix is proven on."""
        return pins.is_proven(self.package, version, self._proven())

    # -- behaviour ----------------------------------------------------------------------------
    def upstream_behaves(self) -> bool | None:
        """The behavioural probe: True if the installed upstream already behaves (the fix must not
        patch it), False if it shows the defect, None if this probe cannot tell here (say why in
        the docstring). Never decided by upstream's source text or version."""
        raise NotImplementedError

    def check_patch_points(self) -> list[str]:
        """What changed at the declared patch points (empty when all are as expected; see
        :meth:`Patch.check`). A fix whose patches are not declared as :class:`Patch` cannot be
        checked and reports so."""
        return check_patches(self.patches)

    def install(self, patcher: Patcher) -> None:
        """Install the declared patches through ``patcher``, in order; called at most once between
        resets."""
        for p in self.patches:
            p.install(patcher)

    def decide(self) -> tuple[FixStatus, str]:
        """The verdict on the installed upstream, with its reason; installs nothing."""
        version = self.installed_version()
        if version is None:
            return FixStatus.NOT_APPLICABLE, f"{self.package} is not installed"
        try:
            behaves = self.upstream_behaves()
            why_unknown = "its probe cannot tell"
        except Exception as exc:  # noqa: BLE001 - a probe that breaks cannot tell: decided below
            logger.debug("fix %s: probe raised", self.name, exc_info=True)
            behaves, why_unknown = None, f"its probe raised {type(exc).__name__}: {exc}"
        proven = self.version_supported(version)
        if behaves is True:
            return FixStatus.STANDS_ASIDE, f"{self.package} {version} already behaves (probe)"
        if behaves is False:
            problems = self.check_patch_points()
            if not problems:
                where = "" if proven else f", outside the proven {self.package}{self.supported}"
                return FixStatus.ACTIVE, f"{self.package} {version}: probe shows the defect{where}"
            if proven:
                # a proven version whose points do not check is a declaration gap: patch as before
                return FixStatus.ACTIVE, f"{self.package} {version}"
            return FixStatus.REFUSED, (
                "it still shows the defect, but its patch points changed: " + "; ".join(problems)
            )
        if proven:
            return FixStatus.ACTIVE, f"{self.package} {version} (proven); {why_unknown}"
        return FixStatus.REFUSED, f"{why_unknown}, on a version the fix is not proven on"

    def apply(self) -> FixStatus:
        """Decide (:meth:`decide`) and install if active; idempotent.

        Raises:
            UnsupportedUpstreamError: the verdict is REFUSED (nothing was installed); the message
                names the fix, the installed and proven versions and what to check.
        """
        if self.status is not FixStatus.NOT_APPLIED:
            return self.status
        status, reason = self.decide()
        if status is FixStatus.REFUSED:
            self.status, self.reason = status, reason
            raise UnsupportedUpstreamError(self.refusal())
        if status is FixStatus.ACTIVE:
            self.install(self._patcher)
        self.status, self.reason = status, reason
        log = logger.warning if status is FixStatus.STANDS_ASIDE else logger.debug
        log("fix %s: %s (%s)", self.name, status.value, reason)
        return self.status

    def refusal(self) -> str:
        """The message of a REFUSED verdict."""
        return (
            f"fix '{self.name}' ({', '.join(self.upstream_refs)}) is proven on {self.package}"
            f"{self.supported}, but {self.package} {self.installed_version()} is installed and "
            f"{self.reason}. Install a proven version (pip install '{self.package}=="
            f"{pins.RELEASES.get(self.package, '?')}'), or check the fix against this upstream "
            f"and add it to megatron/overlay/pins.py (docs/overlay.md)."
        )

    def reset(self) -> None:
        """Undo this fix's patches (for tests)."""
        self._patcher.restore()
        self.status, self.reason = FixStatus.NOT_APPLIED, ""


class _FixPatcher(Patcher):
    """A fix's :class:`Patcher`: records under the fix's name; ``why`` defaults to the declared
    patch of the same attribute, else to the fix's title."""

    def __init__(self, fix: Fix) -> None:
        super().__init__(fix.name)
        self._fix = fix

    def replace(self, obj: Any, name: str, new: Any, why: str | None = None) -> Any:
        if why is None:
            why = next(
                (p.why for p in self._fix.patches if p.target.rsplit(".", 1)[-1] == name),
                f"part of fix {self._fix.name}: {self._fix.title}",
            )
        return super().replace(obj, name, new, why)


class FixGroup(Fix):
    """Several fixes released upstream together (one PR, one flag to disable), each its own
    :class:`Fix` with its own probe and verdict: a part stands aside when upstream already
    behaves for it.

    Subclasses set the class attributes of :class:`Fix` and ``parts`` (instances, in install
    order). The group is active when at least one part is; it stands aside when every part does.
    """

    parts: tuple[Fix, ...] = ()

    @property
    def patches(self) -> tuple[Patch, ...]:  # type: ignore[override]
        return tuple(p for part in self.parts for p in part.patches)

    def upstream_behaves(self) -> bool | None:
        verdicts = [part.upstream_behaves() for part in self.parts]
        if all(v is True for v in verdicts):
            return True
        return False if any(v is False for v in verdicts) else None

    def specs(self) -> tuple[PatchSpec, ...]:
        return tuple(s for part in self.parts for s in part.specs())

    def decide(self) -> tuple[FixStatus, str]:
        verdicts = [(part, *part.decide()) for part in self.parts]
        return self._combine([(p.name, s, r) for p, s, r in verdicts])

    @staticmethod
    def _combine(verdicts: list[tuple[str, FixStatus, str]]) -> tuple[FixStatus, str]:
        statuses = {s for _, s, _ in verdicts}
        summary = "; ".join(f"{n}: {s.value}" for n, s, _ in verdicts)
        if FixStatus.REFUSED in statuses:
            return FixStatus.REFUSED, summary
        if FixStatus.ACTIVE in statuses:
            return FixStatus.ACTIVE, summary
        if statuses == {FixStatus.NOT_APPLICABLE}:
            return FixStatus.NOT_APPLICABLE, summary
        return FixStatus.STANDS_ASIDE, summary

    def apply(self) -> FixStatus:
        if self.status is not FixStatus.NOT_APPLIED:
            return self.status
        refused = []
        for part in self.parts:
            try:
                part.apply()
            except UnsupportedUpstreamError as exc:
                refused.append(str(exc))
        self.status, self.reason = self._combine([(p.name, p.status, p.reason) for p in self.parts])
        if refused:
            raise UnsupportedUpstreamError("; ".join(refused))
        return self.status

    def records(self) -> list[PatchRecord]:
        return [r for part in self.parts for r in part.records()]

    def reset(self) -> None:
        for part in reversed(self.parts):
            part.reset()
        super().reset()
