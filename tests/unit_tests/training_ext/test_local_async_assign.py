"""Units of the asynchronous local save's digest assignment (``assign_digest``): each block of a
deferred digest recorded for every replica is summed exactly once over the ranks, by the rank
that saves the shard it lies in, from that shard's snapshot."""

from __future__ import annotations

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor

from megatron.training_ext.local_tier.async_save import StagingSlot, assign_digest
from megatron.training_ext.resume_proof.digest import DeferredDigest, PartialDigest, shard_regions


def _sharded(key: str, data: torch.Tensor, dp: int, tp_replica: int = 0) -> ShardedTensor:
    return ShardedTensor.from_rank_offsets(key, data, replica_id=(0, tp_replica, dp))


def _rank(dp: int, saves: set, values: dict):
    """One DP rank's state: its replica of every tensor (the same values on every rank), the
    shards (one per tensor), the shards it saves, and its deferred digest of every replica."""
    live = {k: v.clone() for k, v in values.items()}
    shards = {k: _sharded(k, t, dp) for k, t in live.items()}
    saved = [shards[k] for k in shards if k in saves]
    acc = DeferredDigest(all_replicas=True, shards=shard_regions(shards))
    for k, t in live.items():
        main = dp == 0
        acc.add(
            k,
            acc.block_sum(t, (0,) * t.dim(), tuple(t.shape), main=main, replicated=True),
            t.shape,
            t.dtype,
            "model",
        )
    # a block outside every shard (e.g. a state the checkpoint copies): its main replica sums it
    outside = torch.arange(5, dtype=torch.float32)
    acc.add(
        "outside", acc.block_sum(outside, (0,), (5,), main=dp == 0), (5,), outside.dtype, "model"
    )
    return live, saved, acc


def test_every_block_is_summed_once_by_the_saving_rank_from_its_snapshot():
    torch.manual_seed(0)
    values = {"a": torch.randn(4, 8), "b": torch.randn(16), "c": torch.randn(3, 3)}
    reference = PartialDigest()
    for k, t in values.items():
        reference.add(
            k, reference.block_sum(t, (0,) * t.dim(), tuple(t.shape)), t.shape, t.dtype, "model"
        )
    outside = torch.arange(5, dtype=torch.float32)
    reference.add("outside", reference.block_sum(outside, (0,), (5,)), (5,), outside.dtype, "model")

    total: dict = {}
    staged_bytes = []
    for dp, saves in ((0, {"a", "c"}), (1, {"b"})):  # upstream's distribution: one saver each
        live, saved, acc = _rank(dp, saves, values)
        extra, bind = assign_digest(acc, saved)
        slot = StagingSlot()
        staged = slot.stage([sh.data for sh in saved] + extra)
        bind(staged[: len(saved)], staged[len(saved) :])
        staged_bytes.append(slot.nbytes)
        for t in live.values():  # training goes on: the sums read the snapshot
            t.add_(1.0)
        acc.evaluate()
        for k, v in acc.sums.items():
            total[k] = (total.get(k, 0) + v) & ((1 << 64) - 1)
    assert total == reference.sums
    # rank 0 stages its saved shards and the block outside every shard; rank 1 only its shard
    assert staged_bytes == [(32 + 9) * 4 + 5 * 4, 16 * 4]


def test_a_tp_replica_or_a_foreign_replica_id_is_not_summed_twice():
    t = torch.randn(6)
    shard = _sharded("ln", t, dp=0, tp_replica=1)  # TP rank 1's copy of a TP-replicated tensor
    acc = DeferredDigest(all_replicas=True, shards=shard_regions({"ln": shard}))
    acc.add("ln", acc.block_sum(t, (0,), (6,), main=False, replicated=True), (6,), t.dtype, "model")
    extra, _bind = assign_digest(acc, [shard])
    assert extra == [] and acc.recorded == []  # TP rank 0's copy is the one summed


def test_a_per_rank_range_inside_a_shard_another_rank_saves_is_summed_by_its_owner():
    """The distributed optimizer's ranges: each DP rank records only its own range (main), not
    every replica's; a range inside a shard that the other rank saves is still summed here."""
    param = torch.arange(8, dtype=torch.float32)
    shard = _sharded("w", param, dp=1)  # DP rank 1; upstream's distribution: rank 0 saves it
    acc = DeferredDigest(all_replicas=True, shards=shard_regions({"w": shard}))
    mine = param[4:8]  # this rank's range of the parameter
    acc.add(
        "optimizer.state.fp32_param.w",
        acc.range_sum(param, 4, 8, (8,), (0,), (8,), mine),
        (8,),
        mine.dtype,
        "optimizer",
    )
    extra, bind = assign_digest(acc, [])  # the shard is not saved here
    assert len(acc.recorded) == 1 and len(extra) == 1 and extra[0] is mine
    snapshot = StagingSlot().stage(extra)
    bind([], snapshot)
    param.zero_()
    acc.evaluate()
    want = PartialDigest()
    want.add(
        "optimizer.state.fp32_param.w",
        want.range_sum(param, 4, 8, (8,), (0,), (8,), torch.arange(4, 8, dtype=torch.float32)),
        (8,),
        mine.dtype,
        "optimizer",
    )
    assert acc.sums == want.sums


def test_a_lazy_deferred_digest_records_the_shards_as_generate_state_dict_built_them():
    """The asynchronous save's digest records its blocks off the training loop, from copies of
    upstream's model ShardedTensors taken when ``generate_state_dict`` returned: upstream's
    distribution then drops the data of the shards other ranks save (``data = None``), and the
    digest still sums every block. Guard: the originals, once dropped, cannot be digested."""
    import types

    import pytest
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    from megatron.training_ext.resume_proof.digest import _add_model

    torch.manual_seed(0)
    values = {"a": torch.randn(4, 8), "b": torch.randn(16)}
    state_dict = {"model": {k: _sharded(k, t, dp=0) for k, t in values.items()}, "iteration": 3}
    reference = PartialDigest()
    _add_model(list(nested_values(state_dict["model"])), reference)

    lazy = DeferredDigest(all_replicas=True)
    lazy.args = types.SimpleNamespace(ckpt_format="torch_dist")
    lazy.sources = ([object()], None)  # one model chunk, no optimizer
    lazy.share = ({}, {}, None)
    lazy.capture_model(state_dict)
    for sh in nested_values(state_dict["model"]):  # upstream's _remove_redundant_data
        sh.data = None
    lazy.record()
    assert lazy.share[2] is None and lazy.sources is None
    lazy.evaluate()
    assert lazy.sums == reference.sums and len(reference.sums) == 2

    with pytest.raises(AttributeError):  # guard: the dropped originals
        _add_model(list(nested_values(state_dict["model"])), PartialDigest())


def test_a_lazy_deferred_digest_reports_a_failure_as_its_share_error():
    """A failure while recording (here: a model chunk without ``sharded_state_dict``, nothing
    captured) becomes this rank's error in the exchanged share, not an exception in a thread."""
    import types

    lazy = DeferredDigest(all_replicas=True)
    lazy.args = types.SimpleNamespace(ckpt_format="torch_dist")
    lazy.sources = ([object()], None)
    lazy.share = ({"torch": "0"}, {"iteration": 3}, None)
    assert lazy.tensors() == []
    assert lazy.share[:2] == ({"torch": "0"}, {"iteration": 3})
    assert "AttributeError" in lazy.share[2]
