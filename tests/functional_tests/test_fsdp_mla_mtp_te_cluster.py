"""Cluster-only (issue 5): ``fsdp_dtensor`` round trips of the fused MLA + MTP GPT with Transformer
Engine layer specs, through ``pretrain_gpt.py`` on 2 GPUs.

Needs Transformer Engine, 2 CUDA devices and ``MEGATRON_CLUSTER_TESTS=1``; skipped elsewhere (the
CPU version of every check below is ``test_fsdp_mla_mtp.py``, with a plain column-parallel fused
projection because the absorbed layernorm needs TE). Run on a node::

    export MEGATRON_CLUSTER_TESTS=1
    pytest -m cluster tests/functional_tests/test_fsdp_mla_mtp_te_cluster.py

What TE adds: with ``--mla-down-proj-fusion`` the fused ``linear_qkv_down_proj`` is TE's
layernorm-linear, whose ``layer_norm_weight`` is the layer's input layernorm ("absorbed"); the fix
stores it as ``input_layernorm.weight`` next to the unfused ``linear_q_down_proj`` /
``linear_kv_down_proj`` sections, so the checkpoint is the one an unfused model writes.

* reload into a model started from another seed, re-save without training: every ``model.*`` and
  ``optimizer.*`` entry bitwise equal to what was loaded (a weight the load missed would keep its
  other-seed initial value);
* resume from iteration 2: losses and gradient norms of iterations 3-4 bitwise equal to the
  straight run (``--deterministic-mode``; ``NCCL_ALGO=Ring`` as Megatron requires for it).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.functional_tests.test_fsdp_mla_mtp import (
    ENV,
    MODEL,
    _checkpoint_at,
    assert_checkpoints_bitwise,
    assert_unfused_layout,
    resave_from_other_seed,
    train_straight,
)
from tests.helpers.launch import assert_bitwise_equal, run_pretrain

WORLD = 2
pytestmark = [
    pytest.mark.cluster,
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("transformer_engine") is None, reason="needs Transformer Engine"
    ),
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < WORLD,
        reason=f"needs {WORLD} GPUs",
    ),
]

GPU_ENV = {
    **ENV,
    "MEGATRON_TEST_DEVICE": "cuda",
    "NCCL_ALGO": "Ring",
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0",
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
}
TE_MODEL = MODEL + ["--transformer-impl", "transformer_engine", "--deterministic-mode"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    work = tmp_path_factory.mktemp("te_straight")
    return work, train_straight(work, TE_MODEL, nproc=WORLD, env=GPU_ENV, timeout=1800)


def test_te_absorbed_layernorm_stored_unfused_and_reload_is_bitwise(tmp_path, straight):
    want, got = resave_from_other_seed(
        straight[0], tmp_path, TE_MODEL, nproc=WORLD, env=GPU_ENV, timeout=1800
    )
    assert_unfused_layout(want)
    model_keys = [k for k in want if k.startswith("model.")]
    # the absorbed layernorm is stored as the layer's input_layernorm, not as TE's parameter
    assert not [k for k in model_keys if "down_proj.layer_norm" in k]
    for layer in ("decoder.layers.0.", "decoder.layers.1.", "mtp.layers.0.transformer_layer."):
        assert any(layer + "input_layernorm.weight" in k for k in model_keys), (
            layer,
            model_keys[:20],
        )
    assert_checkpoints_bitwise(want, got)


def test_te_resume_is_bitwise(tmp_path, straight):
    work, losses = straight
    load = _checkpoint_at(work / "ckpt", 2, tmp_path / "ckpt")
    resumed = run_pretrain(
        tmp_path,
        *TE_MODEL,
        "--train-iters",
        "4",
        "--load",
        str(load),
        nproc=WORLD,
        env=GPU_ENV,
        timeout=1800,
    )
    assert resumed.first_iteration() == 3
    assert_bitwise_equal(losses, resumed.losses, range(3, 5))
