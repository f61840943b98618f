"""The overlay's exception root: every error this project raises on purpose derives from
:class:`OverlayError`, so a caller (or a test) can catch the fork's errors apart from upstream's.

The classes keep a builtin base as well (``ValueError``, ``RuntimeError``, ...) where callers
already catch by it. ``docs/errors.md`` lists every class, its module and when it is raised.
"""

from __future__ import annotations

__all__ = ["OverlayError", "UnsupportedUpstreamError"]


class OverlayError(Exception):
    """Root of the exceptions this overlay raises (fixes, CPU backend, integrity, tiers)."""


class UnsupportedUpstreamError(OverlayError, RuntimeError):
    """A fix cannot tell whether the installed upstream needs it, or needs it but finds its patch
    points changed: patching blindly could corrupt checkpoints, and standing aside could leave a
    defect in place. The message names the fix, the installed version, the proven versions and
    what to check. Raised too by :meth:`megatron.overlay.component.Component.install` when a
    component's patch point changed (the message names the component and the point)."""
