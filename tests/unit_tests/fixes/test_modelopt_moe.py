"""megatron.fixes.modelopt_moe: per-expert ModelOpt quantizer state in torch_dist checkpoints.

CPU, gloo. One launch per world size (2 and 4 processes) runs every save/load topology of
``modelopt_moe_cases.SAVES`` with real Megatron SequentialMLP experts and real ModelOpt fake
quantization; the tests below assert on what the launch measured. The TE grouped-experts path is
covered without TE by simulating each rank's metadata (``test_modelopt_moe_grouped_sim.py``).
"""

from __future__ import annotations

import json
import os
import re

import modelopt_moe_cases as cases
import pytest

from tests.helpers.dist import run_distributed

pytestmark = pytest.mark.slow  # several processes: not in the quick lane


def _launch(world_size: int, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp(f"modelopt_moe_ws{world_size}")
    run_distributed(cases.roundtrip_body, world_size, str(out), timeout=900)
    with open(os.path.join(out, f"results_ws{world_size}.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def ws2(tmp_path_factory):
    return _launch(2, tmp_path_factory)


@pytest.fixture(scope="module")
def ws4(tmp_path_factory):
    return _launch(4, tmp_path_factory)


@pytest.fixture(params=[2, 4], ids=["ws2", "ws4"])
def results(request):
    return request.getfixturevalue(f"ws{request.param}")


def test_modelopt_moe_fix_active(results):
    assert results["fix_status"] == "active"


def test_modelopt_moe_fixed_validation_passes_every_topology(results):
    for topo, v in results["validation"].items():
        assert v["fixed"] is None, f"{topo} ({v['recipe']}): {v['fixed']}"


def test_modelopt_moe_guard_upstream_fails_validation(results):
    """GUARD: without the fix, Megatron's validation rejects the same models (so the round trips
    below test something). Measured on 0.47.0: TP1/ETP2 -> cells written twice, TP2/ETP1 with
    per-channel amax -> cells written by nobody."""
    failing = {t: v["upstream"] for t, v in results["validation"].items() if v["upstream"]}
    assert failing, "upstream passed validation on every topology: the guard lost its meaning"
    for topo, err in failing.items():
        assert "Invalid access pattern" in err and "quantizer" in err, (topo, err[:500])
    # ETP > TP duplicates the main replica of every expert quantizer tensor.
    etp_gt_tp = [
        t for t in results["validation"] if (lambda m: int(m[2]) > int(m[0]))(re.findall(r"\d+", t))
    ]
    assert etp_gt_tp and all(t in failing for t in etp_gt_tp), (etp_gt_tp, sorted(failing))


def test_modelopt_moe_roundtrip_values_per_global_expert(results):
    assert (
        len(results["roundtrip"]) == len(cases.SAVES[results["world_size"]]) * cases.LOADS_PER_SAVE
    )
    for name, r in results["roundtrip"].items():
        assert r["mismatches"] == [], f"{name} ({r['recipe']}): {r['mismatches']}"
        # every (layer, global expert) was checked on some rank, each with 4 amax per expert
        assert r["layer_experts_checked"] == cases.NUM_LAYERS * cases.NUM_EXPERTS, (name, r)
        assert r["quantizer_tensors_checked"] >= cases.NUM_LAYERS * cases.NUM_EXPERTS * 4, (name, r)
        assert r["differed_before_load"] > 0, f"{name}: load changed nothing, test is vacuous"
        assert r["load_validation"] is None, (name, r["load_validation"])


def test_modelopt_moe_legacy_shared_layout_loads_per_expert(ws2):
    """A checkpoint in the layout from before per-expert quantizers (one tensor per grouped linear,
    built directly from the old keys, saved at ETP2) loads into per-expert models at TP2 and EP2:
    every expert takes the shared value, and each rank logs it."""
    assert set(ws2["legacy"]) == {"TP2/EP1/ETP1/PP1", "TP1/EP2/ETP1/PP1"}
    for topo, r in ws2["legacy"].items():
        assert r["mismatches"] == [], (topo, r["mismatches"])
        assert r["amax_checked"] > 0
        assert r["finite"]
        assert r["ranks_logged"] == 2 and "shared value" in r["log_line"], (topo, r)
        assert "experts.experts.linear_fc" in r["log_line"]


@pytest.mark.parametrize(
    "case", ["shared_wrong_shape", "per_tensor_into_per_channel", "missing_experts"]
)
def test_modelopt_moe_unmappable_layout_raises_on_every_rank(ws2, case):
    messages = ws2["bad_input"][case]
    assert len(messages) == 2
    assert all(m is not None for m in messages), f"some rank did not raise: {messages}"
    assert all(not m.startswith("WRONG EXCEPTION") for m in messages), messages[0][:2000]
    assert len(set(messages)) == 1, "ranks raised different errors"
    msg = messages[0]
    assert "model expects 'decoder.layers." in msg and "checkpoint" in msg
    if case == "shared_wrong_shape":
        assert "experts.experts.0.linear_fc1.weight_quantizer._amax" in msg
        assert "'decoder.layers.0.mlp.experts.experts.linear_fc1.weight_quantizer._amax'" in msg
        assert "global shape (3,)" in msg and "per-expert layout" in msg
    elif case == "per_tensor_into_per_channel":
        assert "global shape (32, 1)" in msg and "global shape (1,)" in msg
    else:
        assert "experts 0-3 only" in msg
