"""Fix ``dcp_prepend_axis`` on the DCP adapter (``CheckpointableShardedTensor``, the path that
``mcore_to_pyt_state_dict`` takes for a ``ShardedTensor`` with ``prepend_axis_num > 0`` and no
regular grid): the chunk metadata alone (no process group), then real ``torch_dist`` saves and
loads through megatron-core's ``dist_checkpointing`` on gloo ranks.

The tensor: ``dec.w`` of shape (4, 5, 3), a prepended layer axis of 4 over (5, 3) matrices.
Stored unevenly (:data:`PIECES`: layer 1 split 2 + 3 rows between the ranks, several pieces on a
rank) through the adapter, or as whole layers on a regular grid through upstream's other path
(``sharded_tensor_to_torch_sharded_tensor``, which views the data as ``(1, 5, 3)``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import megatron.fixes
from megatron.fixes import FixStatus
from megatron.fixes.dcp_prepend_axis import (
    FIX,
    metadata_problems,
    prepended_stand_in,
    upstream_describes_prepended_axes,
)
from tests.helpers.dist import run_distributed
from tests.unit_tests.fixes.probe_copies import rewritten_copy, trivial_wrapper

SHAPE = (4, 5, 3)
FULL = torch.arange(60, dtype=torch.float32).reshape(SHAPE) / 7
#: world size -> rank -> the pieces it holds: (layer, first row, end row).
PIECES = {
    2: {0: [(0, 0, 5), (1, 0, 2)], 1: [(1, 2, 5), (2, 0, 5), (3, 0, 5)]},
    1: {0: [(0, 0, 5), (1, 0, 2), (1, 2, 5), (2, 0, 5), (3, 0, 5)]},
}


def _wrapped():
    from megatron.core.dist_checkpointing.strategies.checkpointable import (
        CheckpointableShardedTensor,
    )

    return CheckpointableShardedTensor.from_sh_ten(prepended_stand_in())


# --- the chunk metadata, no process group --------------------------------------------------------


def test_guard_unfixed_upstream_chunk_has_offsets_of_3_axes_and_sizes_of_2():
    megatron.fixes.reset()
    assert not upstream_describes_prepended_axes()
    wrapped = _wrapped()
    (chunk,) = wrapped.__create_chunk_list__()
    assert (tuple(chunk.offsets), tuple(chunk.sizes)) == ((1, 0, 0), (2, 3))
    (item,) = wrapped.__create_write_items__("w", wrapped)
    assert (tuple(item.tensor_data.chunk.offsets), tuple(item.tensor_data.chunk.sizes)) == (
        (1, 0, 0),
        (2, 3),
    )
    assert tuple(item.tensor_data.size) == (4, 2, 3)
    assert metadata_problems(wrapped) == [
        "write item: offsets (1, 0, 0), sizes (2, 3)",
        "chunk list: offsets (1, 0, 0), sizes (2, 3)",
    ]


def test_fixed_chunk_sizes_have_the_prepended_axis(fixed):
    wrapped = _wrapped()
    data = wrapped._sh_ten.data
    (chunk,) = wrapped.__create_chunk_list__()
    assert (tuple(chunk.offsets), tuple(chunk.sizes)) == ((1, 0, 0), (1, 2, 3))
    (item,) = wrapped.__create_write_items__("w", wrapped)
    assert tuple(item.tensor_data.chunk.sizes) == (1, 2, 3)
    assert (item.index.fqn, tuple(item.index.offset)) == ("w", (1, 0, 0))  # upstream's index
    assert item.tensor_data.properties.dtype == torch.float32
    shard = wrapped.__get_tensor_shard__(item.index)
    assert shard.shape == (1, 2, 3) and shard.data_ptr() == data.data_ptr()
    shard[0, 1, 2] = -1.0  # a load writes through the view into the ShardedTensor's data
    assert data[1, 2] == -1.0
    assert wrapped._sh_ten.data is data and data.shape == (2, 3)  # the data itself is unchanged
    # the probe still sees upstream's own methods, not the fix's
    assert not upstream_describes_prepended_axes()


def test_fixed_shard_without_prepended_axes_is_upstreams(fixed):
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.strategies.checkpointable import (
        CheckpointableShardedTensor,
    )

    data = torch.ones(2, 3)
    plain = ShardedTensor("p", data, data.dtype, (2, 3), (4, 3), (2, 0), axis_fragmentations=None)
    wrapped = CheckpointableShardedTensor.from_sh_ten(plain)
    (chunk,) = wrapped.__create_chunk_list__()
    assert (tuple(chunk.offsets), tuple(chunk.sizes)) == ((2, 0), (2, 3))
    (item,) = wrapped.__create_write_items__("p", wrapped)
    assert wrapped.__get_tensor_shard__(item.index) is data


@pytest.mark.parametrize("method", ["__create_chunk_list__", "__create_write_items__"])
def test_probe_sees_the_defect_through_other_source_text(method):
    from megatron.core.dist_checkpointing.strategies import checkpointable as ck

    from megatron.fixes.standins import replaced

    megatron.fixes.reset()
    upstream = ck.CheckpointableShardedTensor.__dict__[method]
    rewritten = rewritten_copy(upstream, {"chunk_size": "chunk_extent"})
    for copy in (rewritten, trivial_wrapper(upstream)):
        with replaced(ck.CheckpointableShardedTensor, **{method: copy}):
            assert not upstream_describes_prepended_axes()


# --- torch_dist saves and loads on gloo ranks -----------------------------------------------------


def _uneven(rank: int, world: int, zero: bool = False) -> dict:
    """This rank's pieces (:data:`PIECES`) as ShardedTensors with the prepended layer axis and no
    regular grid (the adapter's path); zeros for a load template."""
    from megatron.core.dist_checkpointing import ShardedTensor

    out = {}
    for i, (layer, first, end) in enumerate(PIECES[world][rank]):
        rows = end - first
        data = torch.zeros(rows, 3) if zero else FULL[layer, first:end].clone()
        out[f"piece{i}"] = ShardedTensor(
            "dec.w",
            data,
            data.dtype,
            (rows, 3),
            SHAPE,
            (layer, first, 0),
            axis_fragmentations=None,
            prepend_axis_num=1,
        )
    return out


def _whole_layers(rank: int, world: int, zero: bool = False) -> dict:
    """This rank's whole layers on a regular grid, prepended layer axis (upstream's other path)."""
    from megatron.core.dist_checkpointing import ShardedTensor

    per = SHAPE[0] // world
    return {
        f"layer{layer}": ShardedTensor.from_rank_offsets(
            "dec.w",
            torch.zeros(SHAPE[1:]) if zero else FULL[layer].clone(),
            (0, layer, SHAPE[0]),
            prepend_axis_num=1,
        )
        for layer in range(rank * per, (rank + 1) * per)
    }


LAYOUTS = {"uneven": _uneven, "whole layers": _whole_layers}


def _fresh(path: Path, rank: int) -> Path:
    import torch.distributed as dist

    if rank == 0:
        path.mkdir(parents=True)
    dist.barrier()
    return path


def _loads(ckpt: Path, rank: int, world: int, layout: str) -> bool:
    """Load ``ckpt`` into zero templates of ``layout``: True if every piece equals its part of
    :data:`FULL`, bitwise."""
    from megatron.core import dist_checkpointing

    make = LAYOUTS[layout]
    got = dist_checkpointing.load(make(rank, world, zero=True), str(ckpt))
    return all(torch.equal(got[k], sh.data) for k, sh in make(rank, world).items())


def _saved_chunk_sizes(ckpt: Path) -> set[tuple[int, ...]]:
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata["dec.w"]
    assert tuple(md.size) == SHAPE
    return {tuple(c.sizes) for c in md.chunks}


def _fixed_round_trips(rank: int, world: int, tmp: str) -> None:
    from megatron.cpu import runtime

    runtime.activate()  # megatron-core's torch_dist writer calls torch.cuda.synchronize()
    megatron.fixes.reset()
    assert FIX.apply().value == "active"
    uneven = _fresh(Path(tmp) / "uneven", rank)
    whole = _fresh(Path(tmp) / "whole", rank)
    from megatron.core import dist_checkpointing

    dist_checkpointing.save(_uneven(rank, world), str(uneven))
    dist_checkpointing.save(_whole_layers(rank, world), str(whole))
    # the adapter's chunks are stored as the regular path stores its own: 3 axes each
    assert _saved_chunk_sizes(uneven) == {(1, 5, 3), (1, 2, 3), (1, 3, 3)}
    assert _saved_chunk_sizes(whole) == {(1, 5, 3)}
    for ckpt in (uneven, whole):
        for layout in LAYOUTS:
            assert _loads(ckpt, rank, world, layout), (ckpt.name, layout)


def _unfixed(rank: int, world: int, tmp: str) -> None:
    from megatron.core import dist_checkpointing

    from megatron.cpu import runtime

    runtime.activate()
    os.environ[megatron.fixes.DISABLE_ENV] = FIX.name  # this rank's process only
    megatron.fixes.apply()  # every other fix, as pretrain_gpt.py applies them
    assert FIX.status is FixStatus.NOT_APPLIED
    whole = _fresh(Path(tmp) / "whole", rank)
    dist_checkpointing.save(_whole_layers(rank, world), str(whole))  # upstream's other path works
    assert _loads(whole, rank, world, "whole layers")
    # the adapter can neither load it (torch's CheckpointException is a BaseException) ...
    with pytest.raises(BaseException, match="IndexError: tuple index out of range"):
        _loads(whole, rank, world, "uneven")  # its chunk: 3 offsets, 2 sizes
    # ... nor save: DCP's check of the plan indexes the sizes by the offsets' axes
    with pytest.raises(IndexError, match="tuple index out of range"):
        dist_checkpointing.save(_uneven(rank, world), str(_fresh(Path(tmp) / "uneven", rank)))
    assert not (Path(tmp) / "uneven" / ".metadata").exists()


def test_fixed_uneven_prepended_shards_round_trip_on_two_ranks(tmp_path):
    """Saved through the adapter and through upstream's regular path, each loaded into both
    layouts: every value back, bitwise, on both ranks."""
    run_distributed(_fixed_round_trips, 2, str(tmp_path))


def test_guard_unfixed_upstream_cannot_save_or_load_uneven_prepended_shards(tmp_path):
    """``MEGATRON_FIXES_DISABLE=dcp_prepend_axis``, every other fix applied; one rank (the save's
    failure is raised by the coordinator alone; a second rank would go on and wait): upstream
    saves and loads the regular path, but neither through the adapter."""
    run_distributed(_unfixed, 1, str(tmp_path))
