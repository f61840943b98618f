"""Names in a local (non-persistent) checkpoint directory, NVRx 0.7.0 ``LocalCheckpointManager``::

    <local ckpt dir>/[<session_id>/]<holder rank>/iter_<7 digits>_<owner rank>_local.pt

``holder == owner``: the primary; otherwise a replica. ``.dirty`` comes before ``.pt`` while a
file is written. The validated local tier (:mod:`megatron.training_ext.local_tier`) adds a
bad-tier marker and a quarantine directory per rank; the verifier reads all of them.
"""

from __future__ import annotations

import re
from typing import Optional, Tuple

__all__ = [
    "FILE_PATTERN_TEXT",
    "LOCAL_FILE_RE",
    "MARKER_NAME",
    "QUARANTINE_DIR",
    "is_unfinished",
    "parse_local_name",
]

LOCAL_FILE_RE = re.compile(r"iter_(\d+)_(\d+)_local(\.dirty)?\.pt")
"""NVRx ``LocalCheckpointManager`` file names: ``iter_<7-digit iteration>_<owner rank>_local.pt``;
``.dirty`` while being written (an unfinished save if it survives the process)."""

FILE_PATTERN_TEXT = "<rank>/iter_<N>_<rank>_local.pt"
"""How messages name the local checkpoint files a directory should hold."""

MARKER_NAME = "LOCAL_TIER_BAD.json"
"""Bad-tier marker, one per rank, in the rank's local checkpoint directory (written by the NaN
window of :mod:`megatron.training_ext.local_tier`)."""

QUARANTINE_DIR = "rejected"
"""Sub-directory of a rank's local checkpoint directory that receives rejected local files."""


def parse_local_name(name: str) -> Optional[Tuple[int, int, bool]]:
    """``(iteration, owner_rank, dirty)`` of a local checkpoint file name, ``None`` otherwise."""
    m = LOCAL_FILE_RE.fullmatch(name)
    return None if m is None else (int(m.group(1)), int(m.group(2)), m.group(3) is not None)


def is_unfinished(name: str) -> bool:
    """Whether ``name`` is the leftover of an unfinished save: ``iter_*`` with ``dirty`` in it
    (also names that no longer match :data:`LOCAL_FILE_RE` exactly)."""
    return name.startswith("iter_") and "dirty" in name
