"""What the persistent tier's modules share: the log prefix, the names of a checkpoint directory's
entries, and the installed tier's state as the wrappers read it at call time
(:func:`tier_state`: the wrappers hold no state of their own, and this module imports the
component only when called, so the modules that declare the patches do not import it).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from megatron.integrity import persistent_dirs

if TYPE_CHECKING:
    from megatron.training_ext.persistent_tier import PersistentTierState

__all__ = ["ITER_DIR", "LOG_PREFIX", "NON_PERSISTENT", "TRACKER", "tier_state"]

LOG_PREFIX = "[persistent-tier]"
TRACKER = persistent_dirs.TRACKER
#: The name of an iteration directory (``iter_0000010``); group 1 is the iteration.
ITER_DIR = re.compile(r"iter_(\d{7})$")
NON_PERSISTENT = "non_persistent"  # upstream's _NON_PERSISTENT_CKPT_SUBDIR


def tier_state() -> "PersistentTierState":
    """The installed state, else a fresh default one (the wrappers called while not installed:
    write and verify, nothing remembered)."""
    from megatron.training_ext.persistent_tier import COMPONENT, PersistentTierState

    state = COMPONENT.state
    return state if state is not None else PersistentTierState()
