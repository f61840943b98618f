"""The validated local checkpoint tier (``megatron/training_ext/local_tier/``) piece by piece, on
two gloo processes with the real NVRx ``LocalCheckpointManager``, the real
``MCoreTensorAwareStateDict`` and (where named) the replication fix's strategy.

Spawning processes that import megatron costs tens of seconds on a loaded machine, so one pair of
processes runs every distributed scenario, each in its own directory; each check names its
scenario. The end-to-end flows (pretrain_gpt.py, ft_launcher, SLURM) are in test_ft_restart.py and
test_slurm.py.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import zipfile

import pytest
import torch

from tests.helpers import fault_injection
from tests.helpers.dist import run_distributed

WORLD = 2


# ------------------------------------------------------------------------- helpers (in workers)


def _tasd(rank: int, tensors: dict):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict

    sharded = {
        k: ShardedTensor.from_rank_offsets(k, t, (0, rank, WORLD), prepend_axis_num=1)
        for k, t in tensors.items()
    }
    tasd, _ = MCoreTensorAwareStateDict.from_state_dict(sharded, algo="fully_parallel")
    return tasd


def _tensors(rank: int, nan: bool = False) -> dict:
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4) + 100 * rank
    if nan:
        w[1, 1] = float("nan")
    return {
        "layer.weight": w,
        "layer.bias": torch.full((4,), float(rank)),
        "step": torch.tensor([7 + rank], dtype=torch.int64),
    }


def _manager(root, replicated: bool):
    from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import (
        LocalCheckpointManager,
    )
    from nvidia_resiliency_ext.checkpointing.local.replication import strategies

    strategy = (
        strategies.CliqueReplicationStrategy.from_replication_params(1, WORLD)
        if replicated
        else None
    )
    return LocalCheckpointManager(str(root), repl_strategy=strategy)


def _save(root, rank, replicated, iteration=1, nan=False):
    _manager(root, replicated).save(_tasd(rank, _tensors(rank, nan)), iteration)
    torch.distributed.barrier()


def _file(root, holder, owner, iteration=1):
    return os.path.join(str(root), str(holder), f"iter_{iteration:07d}_{owner}_local.pt")


def _load(root, replicated):
    """(state_dict, None, manager) when the validated resolution uses local iteration 1 (the
    newest), else (None, reason, manager) after it rejected the tier."""
    from megatron.training_ext import local_tier as lt

    m = _manager(root, replicated)
    st = lt.COMPONENT.state
    st.force_persistent, st.rejected_reason = False, None
    it = m.find_latest()
    if it == -1:
        assert st.force_persistent and st.rejected_reason, "rejected without a reason"
        return None, st.rejected_reason, m
    sd, cid = m.load()
    assert cid[1] == torch.distributed.get_rank()
    return sd, None, m


def _load_at(root, iteration):
    from megatron.training_ext import local_tier as lt

    m = _manager(root, True)
    lt.COMPONENT.state.force_persistent, lt.COMPONENT.state.rejected_reason = False, None
    if m.find_latest() != iteration:
        return None, lt.COMPONENT.state.rejected_reason, m
    return m.load()[0], None, m


def _values(sd) -> dict:
    return {sh.key: sh.data for sh in sd._sharded_tensors}


def _scenarios(rank, world, root):
    import torch.distributed as dist

    from megatron.fixes.replication import FIX as replication_fix
    from megatron.integrity.checksum import tensor as ck
    from megatron.training_ext import local_tier as lt

    replication_fix.apply()  # as pretrain_gpt.py does: checksummed replicas, retrieval over gloo
    args = argparse.Namespace(
        non_persistent_ckpt_type="local",
        local_tier_validation=True,
        local_tier_nan_window=3,
        seed=1234,
        tensor_model_parallel_size=1,
    )
    lt.install(args)
    st = lt.COMPONENT.state
    try:
        # A: no replication, intact: own checksum record + finiteness record, values back.
        a = os.path.join(root, "a")
        _save(a, rank, replicated=False)
        stored = torch.load(_file(a, rank, rank), weights_only=False)
        record = ck.get_record(stored)
        assert (
            record is not None and record["owner_rank"] == rank and len(record["entries"]) == 3
        ), "A"
        assert getattr(stored, lt.FINITE_ATTR)["finite"] == [True, True, True], "A"
        sd, err, _ = _load(a, replicated=False)
        assert err is None, f"A: {err}"
        assert torch.equal(_values(sd)["layer.weight"], _tensors(rank)["layer.weight"]), "A"

        # B: no replication, one flipped byte in rank 1's file: rejected on BOTH ranks, naming
        # rank 1 and the checksum; each rank's files are set aside, not moved.
        b = os.path.join(root, "b")
        _save(b, rank, replicated=False)
        if rank == 1:
            fault_injection.flip_byte_in_largest_storage(_file(b, 1, 1))
        dist.barrier()
        sd, err, m = _load(b, replicated=False)
        assert sd is None and err is not None, "B: corrupted file accepted"
        assert "local checkpoint at iteration 1 failed" in err and "rank 1" in err, f"B: {err}"
        assert "checksum mismatch" in err and "no verified copy of rank 1's shard" in err, (
            f"B: {err}"
        )
        assert m.latest_iteration == -1, "B"
        # nothing is moved at start: the files stay in place, set aside until a local save of
        # this run completes (a failed or refused start loses nothing)
        assert sorted(os.listdir(os.path.join(b, str(rank)))) == [
            f"iter_0000001_{rank}_local.pt"
        ], "B"

        # C: no replication, rank 0's file truncated (torch.load raises on rank 0 only): both
        # ranks get the same verdict instead of rank 1 waiting in a collective.
        c = os.path.join(root, "c")
        _save(c, rank, replicated=False)
        if rank == 0:
            with open(_file(c, 0, 0), "r+b") as f:
                f.truncate(100)
        dist.barrier()
        sd, err, _ = _load(c, replicated=False)
        assert sd is None and "unreadable" in err and "rank 0" in err, f"C: {err}"

        # D: replication; rank 1's directory is lost and the replica rank 0 holds for it has a NaN
        # whose checksum was forged to match: only the finiteness check can tell.
        d = os.path.join(root, "d")
        _save(d, rank, replicated=True)
        if rank == 0:
            path = _file(d, 0, 1)
            forged = torch.load(path, weights_only=False)
            tensors = list(forged.tensors)
            tensors[0].view(-1)[0] = float("nan")
            rec = ck.get_record(forged)
            entries = [
                ck.make_entry(i, e["key"], t, global_offset=e["global_offset"])
                for i, (e, t) in enumerate(zip(rec["entries"], tensors))
            ]
            ck.attach_record(forged, ck.make_record(rec["owner_rank"], entries))
            torch.save(forged, path)
        else:
            shutil.rmtree(os.path.join(d, "1"))
        dist.barrier()
        sd, err, _ = _load(d, replicated=True)
        assert sd is None, "D: NaN replica accepted"
        assert "NaN/Inf where the primary (rank 1) saved finite values" in str(err), f"D: {err}"

        # D2: replication, rank 1's directory lost, replica intact: retrieved and verified.
        d2 = os.path.join(root, "d2")
        _save(d2, rank, replicated=True)
        if rank == 1:
            shutil.rmtree(os.path.join(d2, "1"))
        dist.barrier()
        sd, err, _ = _load(d2, replicated=True)
        assert err is None, f"D2: {err}"
        assert torch.equal(_values(sd)["layer.bias"], _tensors(rank)["layer.bias"]), "D2"

        # E: a tensor that was already NaN when its owner saved it is not a reason to reject.
        e = os.path.join(root, "e")
        _save(e, rank, replicated=False, nan=(rank == 0))
        flags = getattr(torch.load(_file(e, rank, rank), weights_only=False), lt.FINITE_ATTR)[
            "finite"
        ]
        assert flags == ([False, True, True] if rank == 0 else [True, True, True]), f"E: {flags}"
        sd, err, _ = _load(e, replicated=False)
        assert err is None, f"E: {err}"

        # F: a marker on rank 1 only rejects the tier on both ranks; a complete local save by a
        # process that did not write it removes it (and the rejected files).
        f_root = os.path.join(root, "f")
        _save(f_root, rank, replicated=True)
        if rank == 1:
            with open(os.path.join(f_root, "1", lt.MARKER_NAME), "w") as fh:
                json.dump(
                    {
                        "iteration": 9,
                        "local_checkpoint_iteration": 8,
                        "reason": "loss is nan",
                        "time": "t",
                    },
                    fh,
                )
            os.makedirs(os.path.join(f_root, "1", lt.QUARANTINE_DIR))
        dist.barrier()
        sd, reason, _ = _load(f_root, replicated=True)
        assert sd is None and "rank 1 marked the local tier bad at iteration 9" in reason, (
            f"F: {reason}"
        )
        assert "loss is nan" in reason, f"F: {reason}"
        st.marker_written = False
        _save(f_root, rank, replicated=True, iteration=2)
        assert lt.read_marker(os.path.join(f_root, str(rank))) is None, "F: marker not cleared"
        assert not os.path.exists(os.path.join(f_root, str(rank), lt.QUARANTINE_DIR)), "F"
        m = _manager(f_root, replicated=True)
        assert m.find_latest() == 2 and m.load()[1][0] == 2, "F: the new checkpoint is used"

        # I: replication; rank 1's primary replaced by the same-iteration file of another run
        # (other seed): detected by its identity, rank 1 repaired from rank 0's replica.
        i_root = os.path.join(root, "i")
        _save(i_root, rank, replicated=True)
        st.args.seed = 999
        lt.install(st.args)  # settings are taken at install
        _save(os.path.join(root, "i_other"), rank, replicated=True)
        st.args.seed = 1234
        lt.install(st.args)
        if rank == 1:
            shutil.copy(_file(os.path.join(root, "i_other"), 1, 1), _file(i_root, 1, 1))
        dist.barrier()
        sd, err, m = _load(i_root, replicated=True)
        assert err is None, f"I: {err}"
        assert torch.equal(_values(sd)["layer.weight"], _tensors(rank)["layer.weight"]), "I"
        if rank == 1:  # the foreign primary is set aside in place, not moved
            assert [os.path.basename(str(p)) for _, p in m._set_aside] == [
                "iter_0000001_1_local.pt"
            ], "I"
            assert not os.path.exists(os.path.join(i_root, "1", lt.QUARANTINE_DIR)), "I"

        # J: saved under TP=1, loaded with TP=2: every copy is of another topology; rejected on
        # both ranks with the setting named, no collective on the files' contents.
        j_root = os.path.join(root, "j")
        _save(j_root, rank, replicated=True)
        st.args.tensor_model_parallel_size = 2
        lt.install(st.args)
        sd, err, _ = _load(j_root, replicated=True)
        st.args.tensor_model_parallel_size = 1
        lt.install(st.args)
        assert sd is None and "tensor_model_parallel_size 1 (checkpoint) vs 2 (this run)" in err, (
            f"J: {err}"
        )

        # K: a leftover of a killed save (a partial .dirty.pt of the iteration about to be saved)
        # neither blocks the save (upstream: SameMachineReplicationException) nor survives it.
        k_root = os.path.join(root, "k")
        for owner in range(WORLD):
            os.makedirs(os.path.join(k_root, str(rank)), exist_ok=True)
            with open(
                os.path.join(k_root, str(rank), f"iter_0000003_{owner}_local.dirty.pt"), "wb"
            ) as fh:
                fh.write(b"partial")
        from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.base_manager import (
            SameMachineReplicationException,
        )
        from nvidia_resiliency_ext.checkpointing.local.replication import strategies

        upstream = lt.LocalCheckpointManager(  # guard: NVRx's own class fails on the leftover
            k_root,
            repl_strategy=strategies.CliqueReplicationStrategy.from_replication_params(1, WORLD),
        )
        assert upstream.__class__.__module__.startswith("nvidia_resiliency_ext")
        with pytest.raises(SameMachineReplicationException, match="already exists"):
            upstream.save(_tasd(rank, _tensors(rank)), 3)
        dist.barrier()
        _save(k_root, rank, replicated=True, iteration=3)
        assert sorted(os.listdir(os.path.join(k_root, str(rank)))) == [
            "iter_0000003_0_local.pt",
            "iter_0000003_1_local.pt",
        ], "K"
        sd, err, _ = _load_at(k_root, 3)
        assert err is None and torch.equal(
            _values(sd)["layer.bias"], _tensors(rank)["layer.bias"]
        ), f"K: {err}"

        # M: --local-tier-run-id keeps the tier across a deliberate change of a run setting.
        m_root = os.path.join(root, "m")
        st.args.local_tier_run_id = "exp-7"
        lt.install(st.args)
        _save(m_root, rank, replicated=True)
        st.args.seed = 4321
        lt.install(st.args)
        sd, err, _ = _load(m_root, replicated=True)
        st.args.seed, st.args.local_tier_run_id = 1234, None
        lt.install(st.args)
        assert err is None and torch.equal(
            _values(sd)["layer.bias"], _tensors(rank)["layer.bias"]
        ), f"M: {err}"

        # L: replication; a flipped byte in rank 0's own primary: repaired from rank 1's replica.
        l_root = os.path.join(root, "l")
        _save(l_root, rank, replicated=True)
        if rank == 0:
            fault_injection.flip_byte_in_largest_storage(_file(l_root, 0, 0))
        dist.barrier()
        sd, err, _ = _load(l_root, replicated=True)
        assert err is None, f"L: {err}"
        assert torch.equal(_values(sd)["layer.weight"], _tensors(rank)["layer.weight"]), "L"

        # G: the NaN window. A NaN loss on rank 1 only, inside the window: both ranks write the
        # marker and get exit code 75 without a checkpoint; outside the window: untouched.
        g = os.path.join(root, "g")
        st.manager, st.local_load_iteration, st.marker_written = _manager(g, False), 10, False

        def upstream(
            forward_step_func,
            data_iterator,
            model,
            optimizer,
            opt_param_scheduler,
            config,
            forward_backward_func,
            iteration=None,
        ):
            loss = float("nan") if (model == "nan" and rank == 1) else 1.5
            return {"lm loss": torch.tensor(loss)}, 0, False, False, 0, 0.5, None, None

        step = lt.wrap_train_step(upstream)
        ok = step(None, None, "finite", None, None, None, None, iteration=10)
        assert ok[3:5] == (False, 0) and not os.path.exists(
            os.path.join(g, str(rank), lt.MARKER_NAME)
        ), "G"
        bad = step(None, None, "nan", None, None, None, None, iteration=11)
        assert bad[0] == {} and bad[2:5] == (False, True, lt.LOCAL_TIER_BAD_EXIT_CODE), f"G: {bad}"
        marker = lt.read_marker(os.path.join(g, str(rank)))
        assert marker["iteration"] == 12 and marker["local_checkpoint_iteration"] == 10, (
            f"G: {marker}"
        )
        assert (
            marker["rank"] == rank and "rank 1" in marker["reason"] and "nan" in marker["reason"]
        ), marker
        late = step(None, None, "nan", None, None, None, None, iteration=13)  # 10 + 3: outside
        assert late[4] == 0, "G: outside the window"

        # H: rerun mode "disabled" raises on a rejected result on one rank; inside the window the
        # rejection is deferred and decided collectively (both ranks exit with 75).
        from megatron.core.rerun_state_machine import RerunMode, RerunStateMachine

        h = os.path.join(root, "h")
        st.manager, st.local_load_iteration, st.marker_written = _manager(h, False), 10, False
        rsm = RerunStateMachine(mode=RerunMode.DISABLED)

        def upstream_h(
            forward_step_func,
            data_iterator,
            model,
            optimizer,
            opt_param_scheduler,
            config,
            forward_backward_func,
            iteration=None,
        ):
            value = torch.tensor(float("nan") if rank == 0 else 2.0)
            rsm.validate_result(
                result=value,
                rejection_func=torch.isnan,
                message="found NaN in local forward loss calculation",
                fatal=True,
            )
            return {"lm loss": torch.tensor(2.0)}, 0, False, False, 0, 0.5, None, None

        out = lt.wrap_train_step(upstream_h)(None, None, None, None, None, None, None, iteration=10)
        assert out[4] == lt.LOCAL_TIER_BAD_EXIT_CODE, f"H: {out}"
        reason = lt.read_marker(os.path.join(h, str(rank)))["reason"]
        assert "found NaN in local forward loss calculation" in reason and "rank 0" in reason, (
            reason
        )
        st.deferring = False
        # outside an iteration of the window upstream raises again (on CPU without the runtime
        # layer its message-building call to torch.cuda.current_device() is what raises)
        with pytest.raises(RuntimeError):
            rsm.validate_result(
                result=torch.tensor(float("nan")),
                rejection_func=torch.isnan,
                message="found NaN",
                fatal=True,
            )
    finally:
        lt.uninstall()
        replication_fix.reset()


# ------------------------------------------------------------------------------------ the tests


def test_local_tier_scenarios_on_two_ranks(tmp_path):
    run_distributed(_scenarios, WORLD, str(tmp_path))


def _fork_parser():
    from megatron.training_ext.args import add_fork_args

    return add_fork_args(argparse.ArgumentParser())


def test_flags_default_and_validation():
    from megatron.training_ext.args import validate_fork_args
    from megatron.training_ext.local_tier import DEFAULT_NAN_WINDOW

    args = _fork_parser().parse_args([])
    assert args.local_tier_validation is True and args.local_tier_nan_window is None
    validate_fork_args(args)
    assert args.local_tier_nan_window == DEFAULT_NAN_WINDOW == 50
    off = _fork_parser().parse_args(["--no-local-tier-validation"])
    validate_fork_args(off)
    assert off.local_tier_validation is False and off.local_tier_nan_window == 0
    zero = _fork_parser().parse_args(["--local-tier-nan-window", "0"])
    validate_fork_args(zero)
    assert zero.local_tier_nan_window == 0
    with pytest.raises(SystemExit, match="must be >= 0"):
        validate_fork_args(_fork_parser().parse_args(["--local-tier-nan-window", "-1"]))
    with pytest.raises(SystemExit, match="needs local-tier validation"):
        validate_fork_args(
            _fork_parser().parse_args(
                ["--no-local-tier-validation", "--local-tier-nan-window", "5"]
            )
        )
    run_id = _fork_parser().parse_args(["--local-tier-run-id", "exp-7"])
    validate_fork_args(run_id)
    assert run_id.local_tier_run_id == "exp-7" and args.local_tier_run_id is None
    with pytest.raises(SystemExit, match="needs a non-empty ID and local-tier validation"):
        validate_fork_args(
            _fork_parser().parse_args(["--local-tier-run-id", "x", "--no-local-tier-validation"])
        )
    with pytest.raises(SystemExit, match="must not be empty"):
        validate_fork_args(_fork_parser().parse_args(["--local-tier-run-id", " "]))


def test_install_is_a_no_op_without_local_checkpoints():
    from megatron.training_ext import local_tier

    local_tier.install(argparse.Namespace(non_persistent_ckpt_type=None))
    local_tier.install(
        argparse.Namespace(non_persistent_ckpt_type="local", local_tier_validation=False)
    )
    assert not local_tier.installed()


def test_exit_code_is_distinct_from_upstream_and_nvrx():
    from megatron.core import rerun_state_machine as rsm
    from nvidia_resiliency_ext.fault_tolerance.utils import DEFAULT_NO_RESTART_EXIT_CODE

    from megatron.training_ext.local_tier import LOCAL_TIER_BAD_EXIT_CODE

    used = {
        0,
        1,
        rsm.EXIT_CODE_RESUME_TO_DISAMBIGUATE,
        rsm.EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
        DEFAULT_NO_RESTART_EXIT_CODE,
    }
    assert LOCAL_TIER_BAD_EXIT_CODE == 75 and LOCAL_TIER_BAD_EXIT_CODE not in used
    assert LOCAL_TIER_BAD_EXIT_CODE < 128  # not a "killed by signal" code


def test_parse_fault_spec():
    spec = fault_injection.parse_fault(
        "rank=1,iteration=6,wipe_local=1,corrupt=/x/y.pt,once=/t/done"
    )
    assert spec == {
        "rank": 1,
        "iteration": 6,
        "wipe_local": True,
        "corrupt": "/x/y.pt",
        "once": "/t/done",
        "raise": False,
    }
    assert fault_injection.parse_fault("rank=0,iteration=3")["wipe_local"] is False
    assert fault_injection.parse_fault("rank=0,iteration=3,raise=1")["raise"] is True
    for bad, why in (
        ("rank=1", "required"),
        ("rank=1,iteration=x", "invalid literal"),
        ("rank=1,iteration=2,color=red", "unknown key"),
        ("rank", "key=value"),
    ):
        with pytest.raises(ValueError, match=why):
            fault_injection.parse_fault(bad)


def test_flip_byte_changes_one_tensor_value_and_keeps_the_file_loadable(tmp_path):
    path = tmp_path / "t.pt"
    a, b = torch.arange(1000, dtype=torch.float32), torch.ones(10)
    torch.save({"a": a, "b": b}, path)
    pos = fault_injection.flip_byte_in_largest_storage(str(path))
    assert pos > 0
    loaded = torch.load(path)
    assert torch.equal(loaded["b"], b)
    diff = (loaded["a"] != a).nonzero().flatten().tolist()
    assert len(diff) == 1, diff
    with zipfile.ZipFile(path) as z:
        assert any("/data/" in n for n in z.namelist())


def test_finite_flags_per_dtype():
    from megatron.training_ext.local_tier import finite_flags

    nan32 = torch.randn(1000)
    nan32[5] = float("nan")
    inf16 = torch.randn(10).half()
    inf16[3] = float("inf")
    big16 = torch.full((100_000,), 60000.0, dtype=torch.float16)  # fp16 sum would overflow
    nan_c = torch.randn(10, dtype=torch.complex64)
    nan_c[2] = complex(float("nan"), 0.0)
    neg_pos_inf = torch.tensor([float("inf"), -float("inf")])
    flags = finite_flags(
        [
            nan32,
            inf16,
            big16,
            nan_c,
            neg_pos_inf,
            torch.ones(3, dtype=torch.int64),
            torch.tensor(3.0),
            torch.empty(0),
            torch.randn(7, dtype=torch.bfloat16),
        ]
    )
    assert flags == [False, False, True, False, False, True, True, True, True]


def test_each_start_in_one_process_decides_the_local_tier_afresh():
    """A second start of training in the same process (a restart attempt) forgets what the first
    decided: the local iteration it resumed from (whose NaN window would otherwise judge the new
    attempt's iterations), a rejection of the local tier, a marker written; the patches stay
    installed once."""
    import megatron.training.training as training

    from megatron.training_ext import local_tier

    args = argparse.Namespace(
        non_persistent_ckpt_type="local", local_tier_validation=True, local_tier_nan_window=5
    )
    try:
        local_tier.install(args)
        wrapped = training.train_step
        st = local_tier.COMPONENT.state
        st.force_persistent, st.rejected_reason = True, "NaN at iteration 9 after the local resume"
        st.local_load_iteration, st.manager, st.marker_written = 8, object(), True
        st.deferred.append("nan")
        assert local_tier.loaded_local_iteration() == 8

        local_tier.install(argparse.Namespace(**{**vars(args), "local_tier_nan_window": 7}))
        fresh = local_tier.COMPONENT.state
        assert local_tier.loaded_local_iteration() is None
        assert (
            fresh.force_persistent,
            fresh.rejected_reason,
            fresh.manager,
            fresh.marker_written,
            fresh.deferred,
            fresh.nan_window,
        ) == (False, None, None, False, [], 7)
        assert training.train_step is wrapped  # not wrapped a second time
    finally:
        local_tier.uninstall()
    assert training.train_step is not wrapped
