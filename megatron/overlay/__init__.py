"""The bottom of the overlay: what every other package here builds on, importing none of them.

* :mod:`.registry`: the one registry of every replaced upstream attribute (``Patcher``).
* :mod:`.patch`: a patch as data (``Patch``: dotted target, module-level factory, reason).
* :mod:`.fix`: the unit of change (``Fix``, ``FixGroup``): references, proven versions,
  behavioural probe, patches, and the verdict on any upstream.
* :mod:`.component`: what the run's arguments switch on (``Component``: declared patches, state
  per install, idempotent lifecycle; the disable switch).
* :mod:`.pins`: the upstream releases written against and every upstream proven on.
* :mod:`.errors`: the exception root (``OverlayError``).
* :mod:`.collective`: all ranks agree on failures before any raises (``RankFailures``,
  ``summarize``).

Layering (``docs/layout.md``): overlay < integrity < fixes < cpu < training_ext < entrypoints.
"""

from megatron.overlay import pins
from megatron.overlay.errors import OverlayError, UnsupportedUpstreamError
from megatron.overlay.fix import Fix, FixGroup, FixStatus, PatchSpec
from megatron.overlay.patch import SKIP, Patch, alias_of, current, resolve, value
from megatron.overlay.registry import (
    REGISTRY,
    Patcher,
    PatchRecord,
    PatchRegistry,
    replace,
    wraps_upstream,
)

__all__ = [
    "REGISTRY",
    "SKIP",
    "Fix",
    "FixGroup",
    "FixStatus",
    "OverlayError",
    "Patch",
    "PatchRecord",
    "PatchRegistry",
    "PatchSpec",
    "Patcher",
    "UnsupportedUpstreamError",
    "alias_of",
    "current",
    "pins",
    "replace",
    "resolve",
    "value",
    "wraps_upstream",
]
