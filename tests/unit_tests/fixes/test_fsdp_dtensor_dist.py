"""fsdp_dtensor fix on 2-4 gloo processes (CPU): DCP save/load of fused MLA sections and renamed
MTP layers with uneven Megatron-FSDP DTensor shards, bit for bit.

One spawn per world size runs every scenario of ``fsdp_scenarios.py``:
* unfused -> fused, fused -> fused (partial load, default strictness), fused -> unfused,
  legacy fused (written without the fix) -> fused, sections being views of the fused storage;
* negative control: MLA handling off, no-strict load raises by default and keeps initial values
  silently with ``ignore_all``;
* W = 2 also: MLA section shape mismatch named on every rank.
W = 4 runs TP = 2 (fused column parallel, unfused TP-duplicated) x FSDP 2.
"""

import os
import sys

import pytest

from tests.helpers.dist import run_distributed

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # helpers, also in spawned ranks
import fsdp_scenarios

pytestmark = pytest.mark.slow  # several processes: not in the quick lane


@pytest.mark.parametrize("world,tp", [(2, 1), (3, 1), (4, 2)], ids=["W2", "W3", "W4-tp2"])
def test_fsdp_dtensor_mla_mtp_roundtrips(tmp_path, world, tp):
    run_distributed(fsdp_scenarios.run_all, world, str(tmp_path), tp, world == 2, timeout=600)
