"""Single-GPU lane of the entrypoint tests (``scripts/gpu_check.sh``; skipped without CUDA): resume
is bitwise on one CUDA device for torch_dist and for local checkpoints without replication."""

from __future__ import annotations

import pytest

from tests.helpers.launch import assert_bitwise_equal, run_pretrain

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
GPU_ENV = {"MEGATRON_TEST_DEVICE": "cuda"}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    return run_pretrain(tmp_path_factory.mktemp("gpu_straight"), nproc=1, env=GPU_ENV).losses


@pytest.mark.parametrize("kind", ["torch_dist", "local"])
def test_gpu_resume_is_bitwise(tmp_path, straight, kind):
    ckpt = ["--save", str(tmp_path / "ckpt")]
    extra = (
        ["--save-interval", "10"]
        if kind == "torch_dist"
        else [
            "--save-interval",
            "1000",
            "--non-persistent-ckpt-type",
            "local",
            "--non-persistent-local-ckpt-dir",
            str(tmp_path / "local"),
            "--non-persistent-save-interval",
            "5",
        ]
    )
    first = run_pretrain(tmp_path, *ckpt, "--exit-interval", "10", *extra, nproc=1, env=GPU_ENV)
    assert max(first.losses) == 10
    resumed = run_pretrain(
        tmp_path, *ckpt, "--load", str(tmp_path / "ckpt"), *extra, nproc=1, env=GPU_ENV
    )
    assert resumed.first_iteration() == 11
    assert_bitwise_equal(straight, resumed.losses, range(11, 21))
