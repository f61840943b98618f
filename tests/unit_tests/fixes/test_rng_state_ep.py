"""Fix ``rng_state_ep``: with EP=2 on 2 gloo ranks, each rank's expert-parallel RNG stream comes
back from a ``torch_dist`` checkpoint as that rank saved it; the unfixed upstream layout gives
rank 1 rank 0's stream (guard); checkpoints of the old layout still load (rank 1's expert stream
is then its own, reseeded one, never rank 0's). Upstream report: Megatron-LM PR 6858."""

from __future__ import annotations

import types

import pytest

from tests.helpers.dist import run_distributed

pytestmark = pytest.mark.slow

EXPERT = "expert-parallel-rng"


def _body(rank, world_size, tmp_path):
    import torch
    from megatron.core import dist_checkpointing, tensor_parallel
    from megatron.core import parallel_state as ps
    from megatron.training import checkpointing, global_vars

    from megatron.cpu import runtime
    from megatron.fixes.rng_state_ep import FIX

    runtime.activate()
    global_vars._GLOBAL_ARGS = types.SimpleNamespace(data_parallel_random_init=False)
    ps.initialize_model_parallel(expert_model_parallel_size=2)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    groups = (ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group())

    def get():
        return checkpointing.get_rng_state("torch_dist", *groups)

    def advance():
        with tracker.fork(EXPERT):
            torch.empty(8, device="cuda").normal_()
        with tracker.fork():
            torch.empty(8, device="cuda").normal_()

    def save(path):
        path.mkdir(exist_ok=True)
        sd = {"rng_state": get()}
        saved = {k: v.clone() for k, v in tracker.get_states().items()}
        dist_checkpointing.save(sd, str(path))
        torch.distributed.barrier()
        return saved

    def load(path):
        loaded = dist_checkpointing.load({"rng_state": get()}, str(path))
        return loaded["rng_state"][0]["rng_tracker_states"]

    def gather(t):
        out = [None, None]
        torch.distributed.all_gather_object(out, t)
        return out

    # upstream (unfixed): rank 1 gets rank 0's expert stream back
    advance()
    old_saved = save(tmp_path / "old")
    all_old = gather(old_saved[EXPERT])
    advance()
    got = load(tmp_path / "old")
    assert torch.equal(got[EXPERT], all_old[0]), (
        "upstream restores rank 0's expert stream everywhere"
    )
    assert not torch.equal(all_old[0], all_old[1])
    if rank == 1:
        assert not torch.equal(got[EXPERT], old_saved[EXPERT]), (
            "guard: the defect is gone upstream?"
        )

    # fixed: every rank gets its own states back, every stream bitwise
    FIX.apply()
    try:
        advance()
        saved = save(tmp_path / "new")
        advance()
        mine_now = {k: v.clone() for k, v in tracker.get_states().items()}
        got = load(tmp_path / "new")
        assert set(got) == set(saved)
        for name in saved:
            assert torch.equal(got[name], saved[name]), (rank, name)

        # a checkpoint of the old layout still loads: dense streams from it, the writer (rank 0)
        # keeps its expert stream, rank 1 keeps its own (this run's) expert stream
        got = load(tmp_path / "old")
        assert torch.equal(got["model-parallel-rng"], old_saved["model-parallel-rng"])
        expected = old_saved[EXPERT] if rank == 0 else mine_now[EXPERT]
        assert torch.equal(got[EXPERT], expected), rank

        # resume under another EP size (2 -> 1): dense streams restored, the expert stream is the
        # one this run seeded for its new coordinates (equal on both ranks at EP=1), not rank 1's
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(expert_model_parallel_size=1)
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        groups = (ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group())
        fresh = tensor_parallel.get_cuda_rng_tracker().get_states()[EXPERT].clone()
        got = load(tmp_path / "new")
        assert torch.equal(got["model-parallel-rng"], saved["model-parallel-rng"])
        assert torch.equal(got[EXPERT], fresh)
        both = gather(got[EXPERT])
        assert torch.equal(both[0], both[1])
    finally:
        FIX.reset()


def test_each_rank_restores_its_own_rng_streams(tmp_path):
    run_distributed(_body, 2, tmp_path)
