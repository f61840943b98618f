"""The decisions of the local tier's DP reshard (megatron/training_ext/local_tier/reshard.py) that
need no processes: which topology changes qualify, which rank loads which shard, which copy of a
tensor shard is written."""

from __future__ import annotations

import pytest
import torch
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

from megatron.integrity import persistent_dirs
from megatron.training_ext.local_tier import reshard

TOPO = {
    "world_size": 4,
    "tensor_model_parallel_size": 1,
    "pipeline_model_parallel_size": 1,
    "expert_model_parallel_size": 1,
    "data_parallel_size": 4,
    "use_distributed_optimizer": True,
    "non_persistent_local_ckpt_algo": "fully_parallel",
}


def test_dp_only_change_accepts_a_dp_change_and_names_anything_else():
    assert reshard.dp_only_change(TOPO, {**TOPO, "world_size": 2, "data_parallel_size": 2}) is None
    assert (
        reshard.dp_only_change(
            TOPO,
            {
                **TOPO,
                "world_size": 2,
                "data_parallel_size": 2,
                "non_persistent_local_ckpt_algo": "atomic",
            },
        )
        is None
    )
    assert reshard.dp_only_change(TOPO, dict(TOPO)) == "same topology"
    why = reshard.dp_only_change(
        TOPO, {**TOPO, "tensor_model_parallel_size": 2, "data_parallel_size": 2}
    )
    assert why == "another tensor_model_parallel_size (1 in the checkpoint, 2 now)"
    why = reshard.dp_only_change(TOPO, {**TOPO, "use_distributed_optimizer": False})
    assert why == "another use_distributed_optimizer (True in the checkpoint, False now)"
    assert reshard.dp_only_change(None, TOPO) == "no topology record"


def test_plan_loaders_is_balanced_deterministic_and_prefers_the_owner():
    # 4 old shards, 2 new ranks each holding two of them (the scenario)
    plan = reshard.plan_loaders({0: [0], 1: [1], 2: [0], 3: [1]})
    assert plan == {0: 0, 1: 1, 2: 0, 3: 1}
    # everything on both ranks: spread evenly, an old rank's own number first
    assert reshard.plan_loaders({0: [0, 1], 1: [0, 1]}) == {0: 0, 1: 1}
    assert reshard.plan_loaders({0: [1, 0], 1: [1, 0], 2: [0, 1], 3: [0, 1]}) == {
        0: 0,
        1: 1,
        2: 0,
        3: 1,
    }
    with pytest.raises(reshard.ReshardError, match="no verified copy of rank 1's shard"):
        reshard.plan_loaders({0: [0], 1: []})


def _sh(key, offset, replica, data=True):
    t = torch.arange(4, dtype=torch.float32) + offset[0] if data else None
    sh = ShardedTensor.from_rank_offsets(key, torch.zeros(4), (0, 0, 2), replica_id=replica)
    sh.global_offset = offset
    sh.global_shape = (8,)
    sh.local_shape = (4,)
    sh.data = t
    return sh


class _SD:
    def __init__(self, part):
        self.sharded_state_dict = part


def test_each_tensor_shard_is_written_once_from_its_data_holder():
    """fully_parallel: the main replica (0, 0, 0) of shard [0:4] holds no data on old rank 0,
    old rank 2 wrote it (replica (0, 0, 2)); atomic: both hold data, the main one wins."""
    old0 = _SD({"w": [_sh("w", (0,), (0, 0, 0), data=False), _sh("w", (4,), (0, 0, 0))]})
    old2 = _SD({"w": [_sh("w", (0,), (0, 0, 2)), _sh("w", (4,), (0, 0, 2), data=False)]})
    inv = reshard._inventory({0: old0, 2: old2})
    winners = reshard._winners([inv])
    assert sorted(winners.values()) == [0, 2]
    part0 = reshard._select(old0, 0, winners)
    part2 = reshard._select(old2, 2, winners)
    (w0,) = part0["w"]
    (w2,) = part2["w"]
    assert (w0.global_offset, w0.replica_id) == ((4,), (0, 0, 0))
    assert (w2.global_offset, w2.replica_id) == ((0,), (0, 0, 0))  # made the main replica
    assert torch.equal(w2.data, torch.arange(4, dtype=torch.float32))
    # atomic: every copy holds data; the main replica's is written, the other dropped
    a0 = _SD({"w": [_sh("w", (0,), (0, 0, 0))]})
    a1 = _SD({"w": [_sh("w", (0,), (0, 0, 1))], "o": ShardedObject("o", 1, (1,), (0,), (0, 0, 1))})
    winners = reshard._winners([reshard._inventory({0: a0}), reshard._inventory({1: a1})])
    assert list(winners.values()) == [0]
    assert reshard._select(a1, 1, winners) == {"o": a1.sharded_state_dict["o"]}  # objects kept


def test_write_tracker_is_atomic_and_read_back(tmp_path):
    persistent_dirs.write_tracker(tmp_path, 12)
    assert (tmp_path / persistent_dirs.TRACKER).read_text() == "12\n"
    assert persistent_dirs.read_tracker(tmp_path).iteration == 12
    assert not list(tmp_path.glob("*.tmp"))
