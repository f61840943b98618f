"""Fix: the DCP adapter describes a shard with prepended axes by offsets with those axes and sizes
without them (Megatron-LM PR 7162; megatron-core 0.19.2 and main).

``mcore_to_pyt_state_dict`` hands a ``ShardedTensor`` with ``prepend_axis_num > 0`` and no
regular grid (``axis_fragmentations`` None) to ``CheckpointableShardedTensor``, torch DCP's
``_Checkpointable`` protocol. Its ``__create_write_items__`` and ``__create_chunk_list__`` build
``ChunkStorageMetadata(offsets=global_offset, sizes=local_shape)``: ``global_offset`` has
``prepend_axis_num + ndim`` axes, ``local_shape`` only ``ndim``, and ``__get_tensor_shard__``
returns the data without the prepended axes. A save fails DCP's plan validation (``IndexError``
after "out of bounds chunk"), a load cannot narrow the shard. The regular-grid path
(``sharded_tensor_to_torch_sharded_tensor``) views the data as ``(1,) * prepend_axis_num +
local_shape``; the fix gives the protocol the same: sizes and the shard with the singleton axes.

Design notes: ``docs/fixes/dcp_prepend_axis.md``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

import torch

from megatron.fixes.standins import upstream_own
from megatron.overlay import Fix, Patch
from megatron.overlay.registry import wraps_upstream

_CLASS = "megatron.core.dist_checkpointing.strategies.checkpointable.CheckpointableShardedTensor"


def chunk_size(sh_ten: Any) -> torch.Size:
    """The size of ``sh_ten`` 's chunk in its global tensor: one singleton axis per prepended axis,
    then its local shape (``len == len(global_shape)``)."""
    return torch.Size((1,) * sh_ten.prepend_axis_num + tuple(sh_ten.local_shape))


def shard_view(sh_ten: Any) -> torch.Tensor:
    """``sh_ten.data`` viewed with its prepended singleton axes (:func:`chunk_size`): a view, so a
    load that writes into it writes into ``data``; ``data`` itself when nothing is prepended."""
    if not sh_ten.prepend_axis_num:
        return sh_ten.data
    return sh_ten.data.view(chunk_size(sh_ten))


# --- the replacements ---------------------------------------------------------------------------


def wrap_create_write_items(upstream: Callable) -> Callable:
    """Factory of the replacement of ``CheckpointableShardedTensor.__create_write_items__``:
    upstream's write items, each chunk's sizes given the prepended singleton axes."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    @wraps_upstream(upstream)
    def __create_write_items__(self, fqn, sh_ten, index=None):
        """Upstream's write items; the chunk sizes have as many axes as the offsets."""
        size = chunk_size(sh_ten._sh_ten)
        return [
            replace(
                item,
                tensor_data=replace(
                    item.tensor_data,
                    chunk=ChunkStorageMetadata(offsets=item.tensor_data.chunk.offsets, sizes=size),
                ),
            )
            for item in upstream(self, fqn, sh_ten, index=index)
        ]

    return __create_write_items__


def wrap_create_chunk_list(upstream: Callable) -> Callable:
    """Factory of the replacement of ``CheckpointableShardedTensor.__create_chunk_list__``:
    upstream's chunks, their sizes given the prepended singleton axes."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    @wraps_upstream(upstream)
    def __create_chunk_list__(self):
        """Upstream's chunk list; the sizes have as many axes as the offsets."""
        size = chunk_size(self._sh_ten)
        return [ChunkStorageMetadata(offsets=c.offsets, sizes=size) for c in upstream(self)]

    return __create_chunk_list__


def wrap_get_tensor_shard(upstream: Callable) -> Callable:
    """Factory of the replacement of ``CheckpointableShardedTensor.__get_tensor_shard__``:
    upstream's shard (the data), viewed with the prepended singleton axes (:func:`shard_view`)."""

    @wraps_upstream(upstream)
    def __get_tensor_shard__(self, index):
        """Upstream's shard, with as many axes as its chunk."""
        shard = upstream(self, index)
        if shard is self._sh_ten.data:
            return shard_view(self._sh_ten)
        return shard  # not the data upstream used to return: leave it alone

    return __get_tensor_shard__


# --- the probe ----------------------------------------------------------------------------------


def prepended_stand_in() -> Any:
    """A ``ShardedTensor`` of a 2x3 shard at layer 1 of a (4, 2, 3) tensor (``prepend_axis_num``
    1, no regular grid: ``axis_fragmentations`` None), the case ``mcore_to_pyt_state_dict`` hands
    to ``CheckpointableShardedTensor``."""
    from megatron.core.dist_checkpointing import ShardedTensor

    data = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    return ShardedTensor(
        "probe.layers.weight",
        data,
        data.dtype,
        (2, 3),
        (4, 2, 3),
        (1, 0, 0),
        axis_fragmentations=None,
        prepend_axis_num=1,
    )


def metadata_problems(wrapped: Any) -> list[str]:
    """What is inconsistent in the DCP metadata ``wrapped`` (a ``CheckpointableShardedTensor``)
    gives through upstream's own protocol methods: chunk offsets and sizes of different lengths
    (in its write items or chunk list), or a shard whose shape is not its chunk's size. Empty when
    all agree."""
    cls = type(wrapped)
    own = {n: upstream_own(getattr(cls, n)) for n in _PROTOCOL}
    problems = []
    items = own["__create_write_items__"](wrapped, "probe", wrapped)
    chunks = own["__create_chunk_list__"](wrapped)
    for where, chunk in [("write item", i.tensor_data.chunk) for i in items] + [
        ("chunk list", c) for c in chunks
    ]:
        if len(chunk.offsets) != len(chunk.sizes):
            problems.append(f"{where}: offsets {tuple(chunk.offsets)}, sizes {tuple(chunk.sizes)}")
    for item in items:
        shard = own["__get_tensor_shard__"](wrapped, item.index)
        sizes = tuple(item.tensor_data.chunk.sizes)
        if tuple(shard.shape) != sizes:
            problems.append(f"shard of shape {tuple(shard.shape)} for a chunk of {sizes}")
    return problems


def upstream_describes_prepended_axes() -> bool:
    """True if upstream's ``CheckpointableShardedTensor`` gives a shard with a prepended axis
    (:func:`prepended_stand_in`) consistent chunk metadata (:func:`metadata_problems`); False when
    offsets and sizes disagree (the defect), and on anything unexpected."""
    from megatron.core.dist_checkpointing.strategies.checkpointable import (
        CheckpointableShardedTensor,
    )

    try:
        return not metadata_problems(CheckpointableShardedTensor.from_sh_ten(prepended_stand_in()))
    except Exception:  # noqa: BLE001 - a probe that cannot tell keeps the fix active
        return False


_PROTOCOL = ("__create_write_items__", "__create_chunk_list__", "__get_tensor_shard__")


class DcpPrependAxisFix(Fix):
    name = "dcp_prepend_axis"
    title = (
        "DCP chunk metadata of a shard with prepended axes and an irregular grid: sizes with the "
        "prepended singleton axes, as its offsets"
    )
    upstream_refs = (
        "Megatron-LM PR 7162 (CheckpointableShardedTensor: chunk sizes of ShardedTensors with "
        "prepend_axis_num)",
    )
    package = "megatron-core"

    patches = (
        Patch(
            f"{_CLASS}.__create_write_items__",
            wrap_create_write_items,
            "the chunk of a shard with prepended axes had offsets with those axes and sizes "
            "without them (DCP refuses the save plan); sizes get the singleton axes",
            params=("fqn", "sh_ten", "index"),
        ),
        Patch(
            f"{_CLASS}.__create_chunk_list__",
            wrap_create_chunk_list,
            "the load-side chunk of a shard with prepended axes: same mismatch, same remedy",
        ),
        Patch(
            f"{_CLASS}.__get_tensor_shard__",
            wrap_get_tensor_shard,
            "the shard DCP reads and writes had no prepended axes while its chunk has them; it is "
            "now the data viewed with the singleton axes",
            params=("index",),
        ),
    )

    def upstream_behaves(self) -> bool:
        return upstream_describes_prepended_axes()


FIX = DcpPrependAxisFix()
