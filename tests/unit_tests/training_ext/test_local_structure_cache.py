"""Units of the local tier's reuse of upstream's shard distribution: the structure fingerprint
ignores values and sees what the distribution and the sharding validation read."""

from __future__ import annotations

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor

from megatron.training_ext.local_tier.structure_cache import structure_fingerprint


def _sharded(key: str, data: torch.Tensor, dp: int) -> ShardedTensor:
    return ShardedTensor.from_rank_offsets(key, data, replica_id=(0, 0, dp))


def test_the_structure_fingerprint_ignores_values_and_sees_shapes_and_replicas():
    a = {"w": _sharded("w", torch.zeros(4, 4), dp=0)}
    b = {"w": _sharded("w", torch.ones(4, 4), dp=0)}
    c = {"w": _sharded("w", torch.zeros(4, 5), dp=0)}
    d = {"w": _sharded("w", torch.zeros(4, 4), dp=1)}
    assert structure_fingerprint(a) == structure_fingerprint(b)
    assert len({structure_fingerprint(x) for x in (a, c, d)}) == 3
