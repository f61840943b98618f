"""Cluster-only (issue 3): real Transformer Engine ``Float8Tensor`` parameters through
``pretrain_gpt.py`` with local checkpoints and replication on 2 GPUs.

Needs Transformer Engine, 2 CUDA devices with FP8 (compute capability >= 8.9: Hopper/Ada or
newer) and ``MEGATRON_CLUSTER_TESTS=1``; skipped elsewhere (CPU coverage of the same code path:
``tests/unit_tests/fixes/test_replication.py`` with a TE-faithful test double). Run on a node::

    MEGATRON_CLUSTER_TESTS=1 MEGATRON_TEST_DEVICE=cuda \\
        pytest -m cluster tests/functional_tests/test_replication_te_cluster.py

Model: the tiny GPT of ``launch.py`` in bf16 with FP8 parameters (``--fp8-format hybrid
--fp8-recipe delayed --fp8-param-gather``, the Hopper recipe; ``--use-distributed-optimizer``),
10 iterations; the local checkpoint (``--replication --replication-jump 1 --replication-factor 2``)
and the persistent ``torch_dist`` checkpoint are both written at iteration 10.

* fixed: every primary and every replica is bitwise equal to the persistent checkpoint (the
  forensic verifier, ``megatron.verify``), all checksums verify, no NaN/Inf, and each
  rank logged that it stored dequantized ``Float8Tensor`` parameters (so the test proves the real
  TE type went through the fix, not a plain-tensor model);
* guard (``MEGATRON_FIXES_DISABLE=replication``, NVRx 0.7.0 as shipped): at least one replica
  differs from its primary (NaN or garbage from TE's ``empty_like`` + ``broadcast_`` on a
  temporary), which keeps this test able to fail.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch

from tests.helpers.launch import both_tiers_at, run_pretrain

WORLD = 2


def _fp8_capable() -> bool:
    return (
        torch.cuda.is_available()
        and torch.cuda.device_count() >= WORLD
        and torch.cuda.get_device_capability(0) >= (8, 9)
    )


pytestmark = [
    pytest.mark.cluster,
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("transformer_engine") is None, reason="needs Transformer Engine"
    ),
    pytest.mark.skipif(not _fp8_capable(), reason=f"needs {WORLD} GPUs with FP8 (sm_89 or newer)"),
]

ENV = {"MEGATRON_TEST_DEVICE": "cuda", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}
ITER = 10
FP8 = [
    "--bf16",
    "--fp8-format",
    "hybrid",
    "--fp8-recipe",
    "delayed",
    "--fp8-param-gather",
    "--use-distributed-optimizer",
    "--transformer-impl",
    "transformer_engine",
]


def _train(work: Path, env: dict):
    """One run: local (replicated) and persistent checkpoints, both of iteration 10."""
    return run_pretrain(work, *FP8, *both_tiers_at(work, ITER), nproc=WORLD, env=env, timeout=1800)


def _local_files(work: Path) -> list[Path]:
    files = sorted((work / "local").rglob(f"iter_{ITER:07d}_*_local.pt"))
    assert len(files) == WORLD * 2, files  # one primary and one replica per rank
    return files


def test_fp8_param_primaries_and_replicas_equal_persistent(tmp_path):
    from megatron.verify import verify_checkpoint

    run = _train(tmp_path, ENV)
    # each rank dequantized real TE Float8Tensor parameters for its primary and replicas
    lines = re.findall(
        r"local checkpoint .* \(rank (\d+)\): primary and replicas store (\d+) quantized "
        r"tensors dequantized \(([^)]*)\)",
        run.output,
    )
    assert sorted({int(r) for r, _, _ in lines}) == list(range(WORLD)), run.output[-4000:]
    assert all(int(n) > 0 and "Float8Tensor -> bfloat16" in kinds for _, n, kinds in lines), lines
    _local_files(tmp_path)

    rep = verify_checkpoint(tmp_path / "local", tmp_path / "ckpt")
    s = rep.summary()
    assert rep.ok and rep.problems == [], rep.format_text()
    assert (s["primary_files"], s["replica_files"]) == (WORLD, WORLD)
    assert s["tensors"] > 20 and s["tensors_compared"] == s["tensors_equal"] == s["tensors"]
    assert s["checksums_verified"] == s["tensors"] and s["nonfinite_tensors"] == 0
    per = {(f.owner_rank, f.role): f.tensors for f in rep.files}
    for owner in range(WORLD):
        assert per[(owner, "primary")] == per[(owner, "replica")] > 0


def _dense_shards(path: Path) -> dict:
    """key/offset -> the values a local file holds (TE quantized tensors dequantized)."""
    sd = torch.load(path, weights_only=False)  # on the devices they were saved from
    out = {}
    for sh in sd._sharded_tensors:
        t = sh.data
        if type(t).dequantize is not torch.Tensor.dequantize:
            if t.device.type != "cuda":
                t = t.cuda()  # TE dequantizes with CUDA kernels
            t = t.dequantize()
        out[(sh.key, tuple(sh.global_offset))] = t.detach().float().cpu()
    return out


def test_guard_unfixed_upstream_writes_bad_fp8_replicas(tmp_path):
    _train(tmp_path, {**ENV, "MEGATRON_FIXES_DISABLE": "replication"})
    bad = []
    for owner in range(WORLD):
        holder = (owner + 1) % WORLD
        primary = _dense_shards(
            tmp_path / "local" / str(owner) / f"iter_{ITER:07d}_{owner}_local.pt"
        )
        replica = _dense_shards(
            tmp_path / "local" / str(holder) / f"iter_{ITER:07d}_{owner}_local.pt"
        )
        assert primary.keys() == replica.keys()
        for k, p in primary.items():
            r = replica[k]
            if not torch.equal(p.view(-1).view(torch.int32), r.view(-1).view(torch.int32)):
                bad.append((owner, k, int((~torch.isfinite(r)).sum())))
    assert bad, (
        "unfixed NVRx wrote every FP8 replica faithfully: the defect (and this guard) is gone"
    )
    # the primaries themselves are fine upstream: only what crossed the wire is wrong
