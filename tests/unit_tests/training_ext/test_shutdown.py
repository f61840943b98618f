"""pretrain_gpt.py destroys the process groups when training is done: gloo otherwise can abort the
process at interpreter exit (``terminate called without an active exception``, exit code -6)."""

from __future__ import annotations

import os
import sys

import pytest
import torch.multiprocessing as mp

from megatron.training_ext import shutdown
from tests.helpers.dist import free_port

WORLD = 4
RUNS = 3


def _rank(rank: int, port: int, destroy: bool) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3]), dist.new_group(list(range(WORLD)))]
    t = torch.ones(1 << 16)

    def train():  # collectives left un-waited, as async checkpointing / overlapped comms may
        for _ in range(20):
            dist.all_reduce(t)
            for g in groups:
                if rank in dist.get_process_group_ranks(g):
                    dist.all_reduce(t.clone(), group=g, async_op=True)

    if destroy:
        shutdown.run_then_destroy_process_groups(train)
    else:
        train()


def _crashed_runs(destroy: bool) -> int:
    ctx = mp.get_context("spawn")
    crashed = 0
    for _ in range(RUNS):
        port = free_port()
        procs = [ctx.Process(target=_rank, args=(r, port, destroy)) for r in range(WORLD)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        crashed += any(p.exitcode != 0 for p in procs)
    return crashed


@pytest.mark.slow
def test_process_groups_destroyed_after_training_exit_cleanly():
    assert _crashed_runs(destroy=True) == 0


@pytest.mark.slow
def test_guard_without_destroy_gloo_can_abort_at_exit():
    """Crashed in 12 of 15 runs here; skipped (not failed) if no run happens to crash."""
    crashed = _crashed_runs(destroy=False)
    if crashed == 0:
        pytest.skip(f"no crash in {RUNS} runs this time")
    assert crashed > 0


def test_destroy_only_on_success(monkeypatch):
    calls = []
    monkeypatch.setattr(shutdown, "destroy_process_groups", lambda: calls.append(1) or True)
    assert shutdown.run_then_destroy_process_groups(lambda: 7) == 7 and calls == [1]
    for code, destroyed in ((0, True), (None, True), (75, False), (1, False)):
        calls.clear()
        with pytest.raises(SystemExit):
            shutdown.run_then_destroy_process_groups(lambda: sys.exit(code))  # noqa: B023 (called in this iteration)
        assert calls == ([1] if destroyed else []), code
    calls.clear()
    with pytest.raises(RuntimeError):
        shutdown.run_then_destroy_process_groups(lambda: (_ for _ in ()).throw(RuntimeError("x")))
    assert calls == []
