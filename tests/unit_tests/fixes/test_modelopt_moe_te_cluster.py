"""megatron.fixes.modelopt_moe with real TE grouped experts (TEGroupedMLP, ModelOpt FP8).

Needs Transformer Engine and 4 GPUs (one rank per GPU, NCCL): run on a cluster node with
``pytest -m cluster tests/unit_tests/fixes/test_modelopt_moe_te_cluster.py``. Without them it is
skipped; the same sharding logic is covered on CPU by ``test_modelopt_moe_grouped_sim.py``.
"""

from __future__ import annotations

import importlib.util
import json
import os

import modelopt_moe_cases as cases
import pytest
import torch

from tests.helpers.dist import run_distributed

WORLD = 4

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(
        importlib.util.find_spec("transformer_engine") is None, reason="needs Transformer Engine"
    ),
    pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason=f"needs {WORLD} GPUs"),
]


@pytest.fixture(scope="module")
def te_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("modelopt_moe_te")
    run_distributed(cases.te_roundtrip_body, WORLD, str(out), timeout=1800)
    with open(os.path.join(out, f"results_te_grouped_ws{WORLD}.json")) as f:
        return json.load(f)


def test_modelopt_moe_te_grouped_validation_and_guard(te_results):
    assert te_results["fix_status"] == "active"
    for topo, v in te_results["validation"].items():
        assert v["fixed"] is None, (topo, v["fixed"])
    # TP2/EP2/ETP1 leaves the experts of EP rank 1 unwritten upstream; TP1/ETP2 writes them twice.
    assert te_results["validation"]["TP2/EP2/ETP1/PP1"]["upstream"]
    assert te_results["validation"]["TP1/EP2/ETP2/PP1"]["upstream"]


def test_modelopt_moe_te_grouped_roundtrip_values(te_results):
    assert len(te_results["roundtrip"]) == len(cases.SAVES_TE[WORLD]) * cases.LOADS_PER_SAVE
    for name, r in te_results["roundtrip"].items():
        assert r["mismatches"] == [], (name, r["mismatches"])
        assert r["layer_experts_checked"] == cases.NUM_LAYERS * cases.NUM_EXPERTS, (name, r)
        assert r["differed_before_load"] > 0, name
        assert r["load_validation"] is None, (name, r["load_validation"])
