"""The persistent tier's reads through the restricted unpickler
(:mod:`megatron.integrity.unpickle`): DCP's ``.metadata`` (``FileSystemReader.read_metadata``: a
plain ``pickle.load`` upstream), DCP's byte objects (``DefaultLoadPlanner.load_bytes``:
``torch.load(weights_only=False)`` upstream: the common state, RNG states, ModelOpt state) and a
legacy ``common.pt`` (megatron-core's ``load_common``). A file naming a global outside the
allowlist raises :class:`~megatron.integrity.unpickle.UnsafeCheckpointError`, which
:mod:`.fallback` treats as a failed checkpoint; nothing it names is imported.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from megatron.integrity import unpickle
from megatron.overlay import Patch, alias_of, wraps_upstream

__all__ = ["PATCHES", "find_unsafe"]


def _wrap_read_metadata(orig):
    @wraps_upstream(orig)
    def read_metadata(self, *args: Any, **kwargs: Any):
        """FileSystemReader.read_metadata with the restricted unpickler
        (megatron.training_ext.persistent_tier)."""
        from megatron.integrity.dcp_metadata import read_metadata as restricted

        return restricted(self, kwargs.get("rank"))

    return read_metadata


def _wrap_load_bytes(orig):
    @wraps_upstream(orig)
    def load_bytes(self, read_item, value):
        """DefaultLoadPlanner.load_bytes with the restricted unpickler
        (megatron.training_ext.persistent_tier)."""
        from torch.distributed.checkpoint._traverse import set_element

        fqn = read_item.dest_index.fqn
        obj = unpickle.torch_load(value, what=f"the DCP byte object {fqn!r}")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj

    return load_bytes


def _wrap_load_common(orig):
    @wraps_upstream(orig)
    def load_common(checkpoint_dir: str):
        """dist_checkpointing load_common (a legacy common.pt) with the restricted unpickler
        (megatron.training_ext.persistent_tier)."""
        from megatron.core.dist_checkpointing.core import CheckpointingException
        from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME

        path = os.path.join(str(checkpoint_dir), COMMON_STATE_FNAME)
        try:
            return unpickle.torch_load(path, map_location="cpu")
        except FileNotFoundError as e:
            raise CheckpointingException(f"Common file {path} does not exist") from e

    return load_common


def find_unsafe(e: BaseException) -> Optional[unpickle.UnsafeCheckpointError]:
    """The :class:`~megatron.integrity.unpickle.UnsafeCheckpointError` behind ``e``: ``e`` itself,
    its causes, or a rank's failure that DCP gathered into a ``CheckpointException`` (its
    ``failures``: rank -> wrapped exception), else ``None``."""
    seen, todo = set(), [e]
    while todo:
        x = todo.pop()
        if not isinstance(x, BaseException) or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, unpickle.UnsafeCheckpointError):
            return x
        todo += [x.__cause__, x.__context__]
        failures = getattr(x, "failures", None)  # torch DCP: rank -> (exception, traceback)
        if isinstance(failures, dict):
            for f in failures.values():
                todo += list(f) if isinstance(f, tuple) else [f]
    return None


_META = "torch.distributed.checkpoint.filesystem.FileSystemReader.read_metadata"
_BYTES = "torch.distributed.checkpoint.default_planner.DefaultLoadPlanner.load_bytes"
_COMMON = "megatron.core.dist_checkpointing.strategies.common.load_common"
_WHY = "a checkpoint's pickles may name only the allowlisted globals (nothing else is imported)"

#: The restricted reads (``.metadata``, byte objects, ``common.pt``).
PATCHES = (
    Patch(_META, _wrap_read_metadata, f"DCP .metadata: {_WHY}"),
    Patch(_BYTES, _wrap_load_bytes, f"DCP byte objects: {_WHY}", params=("read_item", "value")),
    Patch(_COMMON, _wrap_load_common, f"legacy common.pt: {_WHY}", params=("checkpoint_dir",)),
    Patch(
        "megatron.core.dist_checkpointing.serialization.load_common",
        alias_of(_COMMON),
        f"legacy common.pt (serialization's binding): {_WHY}",
    ),
)
