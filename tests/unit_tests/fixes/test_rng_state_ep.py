"""Fix ``rng_state_ep``: with EP=2 on 2 gloo ranks, each rank's expert-parallel RNG stream comes
back from a ``torch_dist`` checkpoint as that rank saved it; the unfixed upstream layout gives
rank 1 rank 0's stream (guard); checkpoints of the old layout still load (rank 1's expert stream
is then its own, reseeded one, never rank 0's). Upstream report: Megatron-LM PR 6858."""

from __future__ import annotations

import types

import pytest
import torch

from megatron.fixes import rng_state_ep
from megatron.fixes.rng_state_ep import FIX, upstream_saves_every_ep_rank
from tests.helpers.dist import run_distributed
from tests.unit_tests.fixes.probe_copies import rewritten_copy, trivial_wrapper

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


@pytest.mark.slow
def test_each_rank_restores_its_own_rng_streams(tmp_path):
    run_distributed(_body, 2, tmp_path)


# --- the behavioural probe and the pieces of the replacements (one process, no group) ----------


def _collaborators():
    from megatron.training import checkpointing

    names = ("get_args", "mpu", "get_pg_rank", "get_pg_size")
    return {n: vars(checkpointing)[n] for n in names}, torch.cuda.get_rng_state


def test_probe_sees_the_defect_and_leaves_nothing_behind():
    import megatron.fixes

    megatron.fixes.reset()
    before = _collaborators()
    assert upstream_saves_every_ep_rank() is False
    assert FIX.upstream_behaves() is False
    assert _collaborators() == before


def test_probe_is_not_fooled_by_a_rewritten_or_wrapped_upstream(monkeypatch):
    from megatron.training import checkpointing

    import megatron.fixes

    megatron.fixes.reset()
    upstream = checkpointing.get_rng_state
    copy = rewritten_copy(upstream, {"rng_state_list": "states", "dp_cp_rank": "replica"})
    assert upstream_saves_every_ep_rank(copy) is False
    monkeypatch.setattr(checkpointing, "get_rng_state", trivial_wrapper(upstream))
    assert FIX.upstream_behaves() is False


def test_probe_sees_an_upstream_that_keys_every_rank():
    """An upstream with the change of Megatron-LM PR 6858's kind (each rank writes its own entry:
    a data-parallel axis in the key, ``replica_id`` 0) behaves."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.training import checkpointing

    import megatron.fixes

    megatron.fixes.reset()
    upstream = checkpointing.get_rng_state

    def keyed_per_rank(ckpt_format, tp_group, pp_group, dp_cp_group=None, dp_group=None, **kw):
        out = upstream(ckpt_format, tp_group, pp_group, dp_cp_group, dp_group, **kw)
        rank, size = checkpointing.get_pg_rank(dp_cp_group), checkpointing.get_pg_size(dp_cp_group)
        shape, offset = tuple(out.global_shape) + (size,), tuple(out.global_offset) + (rank,)
        return ShardedObject(out.key, out.data, shape, offset, replica_id=0)

    assert upstream_saves_every_ep_rank(keyed_per_rank) is True


def test_load_mode_follows_the_checkpoint_keys(monkeypatch):
    entry = types.SimpleNamespace(
        key="rng_state_per_rank", unique_key="rng_state_per_rank/shard_1_2"
    )
    for keys, mode in (
        ({"rng_state_per_rank/shard_1_2", "rng_state/shard_0.0_1.1"}, "per_rank"),
        ({"rng_state_per_rank/shard_1_4"}, "other_world"),
        ({"rng_state/shard_0.0_1.1"}, "old_layout"),
        (None, "per_rank"),
    ):
        monkeypatch.setattr(rng_state_ep, "_checkpoint_object_keys", lambda d, k=keys: k)
        assert rng_state_ep.rng_load_mode(entry, "ckpt") == mode, keys


def test_restore_keeps_own_streams_and_reseeds_other_expert_layouts(monkeypatch):
    topo = {"world": 2, "rank": 1, "ep": 2, "ep_rank": 1, "etp": 1, "etp_rank": 0}
    mine = {"model-parallel-rng": "dense-now", EXPERT: "expert-now"}
    current = [{"rng_tracker_states": mine, "rng_topology": topo}]
    saved = {"model-parallel-rng": "dense-saved", EXPERT: "expert-saved"}
    loaded = [{"rng_tracker_states": saved, "rng_topology": dict(topo)}]
    restored, how = rng_state_ep.restore_rank_states(current, loaded, "per_rank")
    assert restored == [{"rng_tracker_states": saved}] and how.startswith("its own states")
    loaded = [{"rng_tracker_states": saved, "rng_topology": dict(topo, ep=1, ep_rank=0)}]
    restored, how = rng_state_ep.restore_rank_states(current, loaded, "per_rank")
    assert restored[0]["rng_tracker_states"] == {
        "model-parallel-rng": "dense-saved",
        EXPERT: "expert-now",
    }
    assert "expert streams reseeded for EP=2" in how
    monkeypatch.setattr(rng_state_ep, "_dp_cp_rank", lambda: 1)
    restored, how = rng_state_ep.restore_rank_states(
        current, [{"rng_tracker_states": saved}], "old_layout"
    )
    assert restored[0]["rng_tracker_states"][EXPERT] == "expert-now"
    assert "written by data-parallel rank 0" in how
