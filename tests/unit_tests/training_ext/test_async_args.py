"""``--cpu --async-save``: the flags that make it asynchronous on CPU are added, and the
combinations that cannot work are refused with the reason, before any process group exists.
The entrypoint checks (the save overlaps training; resume is bitwise, also after an abort) are in
``tests/functional_tests/test_resume.py``."""

from __future__ import annotations

import argparse

import pytest

from megatron.training_ext.args import (
    CPU_ASYNC_FLAGS,
    add_fork_args,
    prepare_cpu_backend,
    validate_fork_args,
)


def _added(argv: list[str]) -> list[str]:
    argv = list(argv)
    before = len(argv)
    assert prepare_cpu_backend(argv) is True
    return argv[before:]


def test_async_save_on_cpu_gets_the_persistent_worker_in_cpu_shm_mode():
    added = _added(["pretrain_gpt.py", "--cpu", "--async-save"])
    assert "--use-persistent-ckpt-worker" in added and "--async-ckpt-use-cpu-shm" in added
    assert CPU_ASYNC_FLAGS == (("--use-persistent-ckpt-worker",), ("--async-ckpt-use-cpu-shm",))


def test_given_async_flags_are_not_repeated_and_sync_runs_get_none():
    added = _added(["pretrain_gpt.py", "--cpu", "--async-save", "--use-persistent-ckpt-worker"])
    assert "--use-persistent-ckpt-worker" not in added and "--async-ckpt-use-cpu-shm" in added
    added = _added(["pretrain_gpt.py", "--cpu"])
    assert "--use-persistent-ckpt-worker" not in added and "--async-ckpt-use-cpu-shm" not in added


@pytest.mark.parametrize("strategy", [["--async-strategy", "mcore"], ["--async-strategy=mcore"]])
def test_mcore_async_strategy_is_refused_on_cpu(strategy):
    with pytest.raises(SystemExit, match="--async-strategy mcore is not supported on CPU.*nvrx"):
        prepare_cpu_backend(["pretrain_gpt.py", "--cpu", "--async-save", *strategy])
    _added(["pretrain_gpt.py", "--cpu", "--async-save", "--async-strategy", "nvrx"])  # accepted


def _parser() -> argparse.ArgumentParser:
    parser = add_fork_args(argparse.ArgumentParser())
    parser.add_argument("--async-save", action="store_true")  # upstream's flags
    parser.add_argument("--non-persistent-ckpt-type", default=None)
    parser.add_argument("--ckpt-format", default="torch_dist")
    return parser


def test_async_save_with_upstreams_local_tier_is_refused_and_with_the_validated_one_allowed():
    """Upstream's local tier (``--no-local-tier-validation``) would hand its save to the
    persistent worker (``TypeError`` at the first local save); the validated tier saves
    asynchronously in a background thread."""
    with pytest.raises(
        SystemExit,
        match="--async-save with --non-persistent-ckpt-type local and --no-local-tier-validation "
        "is not supported.*cannot pickle",
    ):
        validate_fork_args(
            _parser().parse_args(
                [
                    "--async-save",
                    "--non-persistent-ckpt-type",
                    "local",
                    "--no-local-tier-validation",
                ]
            )
        )
    validate_fork_args(
        _parser().parse_args(["--async-save", "--non-persistent-ckpt-type", "local"])
    )
    validate_fork_args(_parser().parse_args(["--async-save"]))
    validate_fork_args(_parser().parse_args(["--non-persistent-ckpt-type", "local"]))


def test_async_save_with_a_format_upstream_cannot_save_async_is_refused():
    with pytest.raises(SystemExit, match="--async-save needs --ckpt-format torch_dist.*got torch"):
        validate_fork_args(_parser().parse_args(["--async-save", "--ckpt-format", "torch"]))
    validate_fork_args(_parser().parse_args(["--async-save", "--ckpt-format", "torch_dcp"]))
    validate_fork_args(_parser().parse_args(["--ckpt-format", "torch"]))


@pytest.mark.parametrize("fsdp", ["--use-megatron-fsdp", "--use-torch-fsdp2"])
def test_cpu_leaves_cuda_device_max_connections_unset_for_fsdp(monkeypatch, fsdp):
    """Upstream asserts ``CUDA_DEVICE_MAX_CONNECTIONS != 1`` for FSDP (TP/CP only warn then): the
    CPU backend's default of 1 (for TP/CP without FSDP) would refuse every ``--cpu`` FSDP run."""
    import os

    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    prepare_cpu_backend(["pretrain_gpt.py", "--cpu", fsdp])
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in os.environ
    prepare_cpu_backend(["pretrain_gpt.py", "--cpu", "--tensor-model-parallel-size", "2"])
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
