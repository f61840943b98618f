"""In-process restart's configuration (``megatron.training_ext.inprocess``): the CPU stand-ins are
chosen by the device, upstream's CUDA-only parts fail on CPU (guard), the start refusals, and the
test entrypoint's several faults."""

from __future__ import annotations

import argparse
import datetime

import pytest

inprocess_mod = pytest.importorskip("megatron.training_ext.inprocess")
from nvidia_resiliency_ext import inprocess  # noqa: E402


def _args(**kw):
    base = dict(
        inprocess_active_world_size=2,
        inprocess_granularity="node",
        inprocess_empty_cuda_cache=True,
        inprocess_max_iterations=3,
        inprocess_heartbeat_interval=1.0,
        inprocess_heartbeat_timeout=10.0,
        inprocess_barrier_timeout=60.0,
        inprocess_completion_timeout=60.0,
        inprocess_monitor_process_interval=0.5,
        inprocess_monitor_thread_interval=0.5,
        inprocess_progress_watchdog_interval=0.5,
        inprocess_last_call_wait=0.5,
        inprocess_soft_timeout=20.0,
        inprocess_hard_timeout=30.0,
        inprocess_termination_grace_time=1.0,
        async_strategy="nvrx",
        cpu=True,
        save="ck",
        load="ck",
    )
    base.update(kw)
    return argparse.Namespace(**base)


def _finalizers(kwargs):
    return list(kwargs["finalize"].instances)


def test_cpu_configuration_uses_the_standins(monkeypatch):
    monkeypatch.setenv("MASTER_PORT", "29000")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    kw = inprocess_mod.wrapper_kwargs(_args(), cpu=True, reset=lambda: None)
    assert isinstance(kw["health_check"], inprocess_mod.CpuHealthCheck)
    fin = _finalizers(kw)
    assert [type(f) for f in fin] == [inprocess_mod.CpuThreadedFinalize]  # no empty_cache
    node = kw["rank_assignment"].layers[1]
    assert (node.min_ranks, node.max_ranks) == (2, 2)  # LOCAL_WORLD_SIZE, not device_count
    assert kw["initialize"].instances[0].max_iterations == 3  # upstream drops the flag
    assert kw["progress_watchdog_interval"] == datetime.timedelta(seconds=0.5)
    assert kw["store_kwargs"]["port"] == 29002


def test_upstream_configuration_fails_on_cpu(monkeypatch):
    """Guard: the GPU configuration (upstream's) cannot restart on CPU: its finalize raises."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    monkeypatch.setenv("MASTER_PORT", "29000")
    kw = inprocess_mod.wrapper_kwargs(_args(cpu=False), cpu=False, reset=lambda: None)
    state = inprocess.state.State(rank=0, world_size=1).freeze()
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        kw["finalize"](state)
    assert kw["rank_assignment"].layers[1].min_ranks == torch.cuda.device_count()
    # ours on CPU: the same finalize step runs the reset
    ran = []
    ours = inprocess_mod.wrapper_kwargs(_args(), cpu=True, reset=lambda: ran.append(1))
    ours["finalize"](state)
    assert ran == [1]


def test_cpu_wrapper_has_no_nvml_health_checks(monkeypatch):
    monkeypatch.setenv("MASTER_PORT", "29000")
    monkeypatch.setenv("LOCAL_RANK", "1")
    cpu = inprocess_mod.build_wrapper(_args(), cpu=True, reset=lambda: None)
    names = [type(c).__name__ for c in cpu.restart_health_check.instances]
    assert names == ["CpuHealthCheck"]
    import os

    assert os.environ["LOCAL_RANK"] == "1"  # restored
    gpu = inprocess.Wrapper(**inprocess_mod.wrapper_kwargs(_args(), cpu=True, reset=lambda: None))
    assert "ChainedGPUHealthCheck" in [type(c).__name__ for c in gpu.restart_health_check.instances]


def test_finalize_standin_times_out():
    import time

    f = inprocess_mod.CpuThreadedFinalize(datetime.timedelta(seconds=0.1), lambda: time.sleep(2))
    with pytest.raises(TimeoutError):
        f(None)


@pytest.mark.parametrize(
    "env,kw,match",
    [
        ({"MASTER_PORT": "1"}, {}, "needs MASTER_ADDR"),
        ({"MASTER_ADDR": "a", "MASTER_PORT": "1"}, {"inprocess_max_iterations": 0}, ">= 1"),
        ({"MASTER_ADDR": "a", "MASTER_PORT": "1"}, {"load": None}, "needs --load ck"),
        ({"MASTER_ADDR": "a", "MASTER_PORT": "1"}, {"load": "other"}, "needs --load ck"),
    ],
)
def test_check_args_refuses(env, kw, match):
    with pytest.raises(SystemExit, match=match):
        inprocess_mod.check_args(_args(**kw), env=env)
    inprocess_mod.check_args(_args(), env={"MASTER_ADDR": "a", "MASTER_PORT": "1"})


def test_several_faults_and_raise():
    from tests.helpers import fault_injection

    faults = fault_injection.parse_faults("rank=1,iteration=6,raise=1;rank=0,iteration=9")
    assert [(f["rank"], f["iteration"], f["raise"]) for f in faults] == [
        (1, 6, True),
        (0, 9, False),
    ]


def test_leftover_process_groups_are_dropped(monkeypatch):
    import torch.distributed as dist
    from megatron.core import parallel_state

    class FakeGroup(dist.ProcessGroup):
        def __init__(self):
            super().__init__(0, 1)

    monkeypatch.setattr(parallel_state, "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP", FakeGroup())
    inprocess_mod._drop_leftover_groups()
    assert parallel_state._INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP is None


def test_rank_monitor_client_is_closed_and_dropped_between_attempts(monkeypatch):
    """Under ``ft_launcher`` (``--enable-ft-package``) upstream's ``ft_integration.setup`` asserts
    that no client is set: the reset closes the failed attempt's connection and drops it."""
    from megatron.training import ft_integration

    closed = []

    class Client:
        def shutdown_workload_monitoring(self):
            closed.append(True)

    monkeypatch.setattr(ft_integration, "_GLOBAL_RANK_MONITOR_CLIENT", Client())
    monkeypatch.setattr(ft_integration, "_is_setup_section_open", True, raising=False)
    inprocess_mod._close_rank_monitor_client()
    assert closed == [True]
    assert ft_integration.get_rank_monitor_client() is None
    assert ft_integration._is_setup_section_open is False
    inprocess_mod._close_rank_monitor_client()  # none set: nothing to do
    assert closed == [True]
