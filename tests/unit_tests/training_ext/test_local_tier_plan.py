"""The decision table of a local-tier start (``docs/local-tier.md``, "What a start does"): one test
per row, on the pure function ``megatron.training_ext.local_tier.plan.decide`` over hand-made
inventories (no processes, no files). Each asserts the plan and its reason."""

from __future__ import annotations

from dataclasses import replace

import pytest

from megatron.training_ext.local_tier import plan
from megatron.training_ext.local_tier.inventory import Inventory, LocalCopy, ReshardSettings

RUN = "run-a"
TOPO = {"world_size": 2, "data_parallel_size": 2, "tensor_model_parallel_size": 1}
OLD_TOPO = {"world_size": 4, "data_parallel_size": 4, "tensor_model_parallel_size": 1}
OTHER_TOPO = "written under another topology: tensor_model_parallel_size 1 (checkpoint) vs 2"


def _copy(it, owner, holder, problem=None, token="save-1", fp=None, **kw) -> LocalCopy:
    """A copy of ``owner``'s shard held by ``holder`` (in ``holder``'s directory): a primary
    when they are equal, verified (bytes read) unless ``bytes_verified=False`` is given."""
    kw.setdefault("dir_rank", holder)
    kw.setdefault("bytes_verified", holder == owner)
    return LocalCopy(
        iteration=it,
        owner=owner,
        holder=holder,
        problem=problem,
        run_id=kw.pop("run_id", RUN),
        token=token,
        fingerprint=fp if fp is not None else f"fp-{it}-{owner}",
        path=f"/local/{kw['dir_rank']}/iter_{it:07d}_{owner}_local.pt",
        **kw,
    )


def _inventory(rank, copies, *, persistent=None, marker=None, can_repair=True, **kw) -> Inventory:
    return Inventory(
        rank=rank,
        host=f"node-{rank}",
        identity=(RUN, "run token", {}, kw.pop("topo", TOPO)),
        generation=f"gen-{rank}",
        marker=marker,
        persistent=persistent,
        copies=tuple(copies),
        load_dir="ckpt",
        can_repair=can_repair,
        reshard=kw.pop("reshard", ReshardSettings(save="ckpt")),
    )


def _replicated(it=12, world=2, **kw) -> list:
    """Every rank holds its own verified primary of ``it`` and a replica of the next rank's."""
    return [
        _inventory(r, [_copy(it, r, r), _copy(it, (r + 1) % world, r)], **kw) for r in range(world)
    ]


def _with(inventories, rank, *copies) -> list:
    """``inventories`` with rank ``rank`` holding ``copies`` instead of its own."""
    out = list(inventories)
    out[rank] = replace(out[rank], copies=tuple(copies))
    return out


# -- the start as a whole -------------------------------------------------------------------------
# row 1
def test_a_bad_tier_marker_on_any_rank_falls_back():
    marker = {"iteration": 9, "local_checkpoint_iteration": 8, "reason": "loss is nan", "time": "t"}
    invs = _replicated()
    invs[1] = replace(invs[1], marker=marker)
    p = plan.decide(invs)
    assert isinstance(p, plan.Fallback)
    assert p.reason == (
        "bad-tier marker LOCAL_TIER_BAD.json found: rank 1 marked the local tier bad at "
        "iteration 9 (resumed from local iteration 8, t): loss is nan"
    )


# row 2
def test_no_local_file_on_any_rank_falls_back_without_a_reason():
    p = plan.decide([_inventory(0, []), _inventory(1, [])])
    assert p == plan.Fallback(None)


# row 3
def test_a_newer_persistent_checkpoint_is_loaded():
    p = plan.decide(_replicated(12, persistent=14))
    assert p == plan.PersistentNewer(
        12,
        14,
        "local checkpoint at iteration 12 is older than the persistent checkpoint at iteration 14",
    )


# row 4
def test_every_shard_with_its_verified_primary_is_used():
    p = plan.decide(_replicated(12, persistent=10))
    assert isinstance(p, plan.Use) and p.iteration == 12
    assert p.reason == "every shard of iteration 12 has a verified primary"
    assert all(c.problem is None for c in p.copies)


# -- one copy unusable ----------------------------------------------------------------------------
# row 5
def test_a_missing_primary_is_repaired_from_a_verified_replica():
    invs = _with(_replicated(), 1, _copy(12, 0, 1))  # rank 1 lost its own file
    p = plan.decide(invs)
    assert isinstance(p, plan.Repair) and (p.iteration, p.need) == (12, (1,))
    assert (1, 0) in p.sources  # rank 0's replica of rank 1's shard
    assert p.reason == "rank(s) [1] have no usable primary of iteration 12: repaired from replicas"


# row 5, 6
@pytest.mark.parametrize(
    "problem",
    [
        "unreadable: RuntimeError: PytorchStreamReader failed reading zip archive",
        "written without a run identity (by upstream NVRx or an older version of this fork): "
        "cannot tell which run it belongs to",
        "holds rank 0's shard of iteration 12, its name says rank 1, iteration 12",
        "ChecksumMismatchError: rank 1's primary: 'layer.weight' checksum mismatch",
        "rank 1's primary: 1 tensor(s) hold NaN/Inf where the primary (rank 1) saved finite "
        "values: ['layer.weight']",
    ],
    ids=["unreadable", "no-identity", "other-owner", "checksum", "nan"],
)
def test_an_unusable_primary_is_repaired_and_without_replica_falls_back(problem):
    invs = _with(_replicated(), 1, _copy(12, 1, 1, problem=problem), _copy(12, 0, 1))
    p = plan.decide(invs)
    assert isinstance(p, plan.Repair) and p.need == (1,)
    alone = [_inventory(0, [_copy(12, 0, 0)]), _inventory(1, [_copy(12, 1, 1, problem=problem)])]
    p = plan.decide(alone)
    assert p == plan.Fallback(
        "local checkpoint at iteration 12 failed verification: no verified copy of rank 1's "
        f"shard (rank 1's primary: {problem})"
    )


# row 7
def test_a_copy_of_another_run_is_unusable():
    other = "written by another run (run id run-b vs run-a here: seed 1 (checkpoint) vs 2"
    invs = _with(_replicated(), 1, _copy(12, 1, 1, run_id="run-b", foreign=other), _copy(12, 0, 1))
    p = plan.decide(invs)
    assert isinstance(p, plan.Repair) and p.need == (1,)
    (primary,) = [c for c in p.copies if c.holder == c.owner == 1]
    assert primary.problem == other
    every = [_inventory(r, [_copy(12, r, r, run_id="run-b", foreign=other)]) for r in range(2)]
    assert plan.decide(every) == plan.Fallback(
        f"local checkpoint at iteration 12 failed verification: every copy on every rank was "
        f"{other}"
    )


# row 8
def test_every_copy_of_another_topology_falls_back_naming_it():
    invs = [_inventory(r, [_copy(12, r, r, problem=OTHER_TOPO)]) for r in range(2)]
    assert plan.decide(invs, ()) == plan.Fallback(
        f"local checkpoint at iteration 12 failed verification: every copy on every rank was "
        f"{OTHER_TOPO}"
    )


# row 9
def test_a_copy_of_an_outvoted_save_is_unusable():
    invs = _with(_replicated(), 1, _copy(12, 1, 1), _copy(12, 0, 1, token="save-2"))
    p = plan.decide(invs)
    assert isinstance(p, plan.Use)
    (replica,) = [c for c in p.copies if c.holder == 1 and c.owner == 0]
    assert replica.problem == (
        "from another save of iteration 12 (save token save-2, the others save-1)"
    )


# row 10
def test_copies_of_two_saves_without_a_majority_fall_back():
    invs = [_inventory(0, [_copy(12, 0, 0)]), _inventory(1, [_copy(12, 1, 1, token="save-2")])]
    assert plan.decide(invs) == plan.Fallback(
        "local checkpoint at iteration 12 failed verification: copies of 2 different saves, "
        "none in a majority"
    )


# row 11
def test_a_replica_whose_checksums_differ_from_the_primary_is_unusable():
    invs = _with(_replicated(), 1, _copy(12, 1, 1), _copy(12, 0, 1, fp="other"))
    p = plan.decide(invs)
    assert isinstance(p, plan.Use)
    (replica,) = [c for c in p.copies if c.holder == 1 and c.owner == 0]
    assert replica.problem == "its checksums differ from the primary of rank 0's shard"


# -- iterations -----------------------------------------------------------------------------------
# row 12
def test_an_older_iteration_is_used_after_its_primaries_are_verified():
    invs = [
        _inventory(
            r,
            [
                _copy(14, r, r, problem=OTHER_TOPO) if r == 1 else _copy(14, r, r),
                _copy(12, r, r, bytes_verified=False),
            ],
        )
        for r in range(2)
    ]
    p = plan.decide(invs)
    assert p == plan.Verify(12, (0, 1), "the primaries of rank(s) [0, 1] are not verified yet")
    facts = [plan.PrimariesVerified(12, ((0, None), (1, None)))]
    p = plan.decide(invs, facts)
    assert isinstance(p, plan.Use) and p.iteration == 12
    bad = [plan.PrimariesVerified(12, ((0, None), (1, "unreadable: EOFError: truncated")))]
    assert plan.decide(invs, bad) == plan.Fallback(
        "local checkpoint at iteration 14 failed verification: iteration 14: no verified copy "
        f"of rank 1's shard (rank 1's primary: {OTHER_TOPO}); iteration 12: no verified copy of "
        "rank 1's shard (rank 1's primary: unreadable: EOFError: truncated)"
    )


# row 13
def test_iterations_older_than_the_persistent_one_are_not_tried():
    invs = [
        _inventory(r, [_copy(14, r, r, problem=OTHER_TOPO if r else None), _copy(8, r, r)])
        for r in range(2)
    ]
    invs = [replace(inv, persistent=10) for inv in invs]
    assert plan.decide(invs) == plan.Fallback(
        "local checkpoint at iteration 14 failed verification: no verified copy of rank 1's "
        f"shard (rank 1's primary: {OTHER_TOPO})"
    )


# row 14
def test_without_replication_an_unusable_primary_is_not_repaired():
    invs = _with(_replicated(), 1, _copy(12, 0, 1))
    invs = [replace(inv, can_repair=False) for inv in invs]
    assert plan.decide(invs) == plan.Fallback(
        "local checkpoint at iteration 12 failed verification: rank(s) [1] have no usable "
        "primary and there is no replication to repair from: rank 1: missing"
    )


# -- what the repair finds ------------------------------------------------------------------------
# row 15
def test_a_replica_that_fails_before_it_is_sent_is_replaced_by_another_or_falls_back():
    invs = _with(_replicated(), 1, _copy(12, 0, 1))
    bad = "ChecksumMismatchError: rank 0's replica of rank 1's shard: 'w' checksum mismatch"
    failed = plan.RepairAttemptFailed(12, ((1, 0, bad),))
    assert plan.decide(invs, [failed]) == plan.Fallback(
        "local checkpoint at iteration 12 failed verification: no verified copy of rank 1's "
        f"shard (rank 0's replica: {bad})"
    )
    three = [_inventory(r, [_copy(12, r, r)]) for r in range(3)]
    three[1] = replace(three[1], copies=())
    three[0] = replace(three[0], copies=(_copy(12, 0, 0), _copy(12, 1, 0)))
    three[2] = replace(three[2], copies=(_copy(12, 2, 2), _copy(12, 1, 2)))
    p = plan.decide(three, [failed])
    assert isinstance(p, plan.Repair) and p.sources == ((0, 0), (2, 2), (1, 2))
    assert plan.decide(three, [failed] * plan.REPAIR_ATTEMPTS) == plan.Fallback(
        "local checkpoint at iteration 12 failed verification: no replica verified after "
        "several attempts"
    )


# row 16
def test_a_failed_exchange_falls_back_with_its_reason():
    invs = _with(_replicated(), 1, _copy(12, 0, 1))
    why = "iteration 12: repair failed: rank 1: ChecksumMismatchError: received shard"
    assert plan.decide(invs, [plan.IterationFailed(12, why)]) == plan.Fallback(
        "local checkpoint at iteration 12 failed verification: repair failed: rank 1: "
        "ChecksumMismatchError: received shard"
    )


# -- another data-parallel size -------------------------------------------------------------------
def _old(it, owner, holder, **kw) -> LocalCopy:
    return _copy(it, owner, holder, problem=OTHER_TOPO, saved_topology=OLD_TOPO, **kw)


def _shrunk(drop=(), **kw) -> list:
    """DP 4 -> 2: rank 0 holds old ranks 0 and 2, rank 1 old ranks 1 and 3."""
    return [
        _inventory(r, [_old(12, o, r) for o in (r, r + 2) if o not in drop], **kw) for r in (0, 1)
    ]


# row 17
def test_a_checkpoint_of_another_dp_size_is_resharded():
    p = plan.decide(_shrunk())
    assert isinstance(p, plan.Reshard)
    assert (p.iteration, p.old_world, p.old_dp, p.target) == (12, 4, 4, "ckpt/iter_0000012")
    assert p.loaders == {0: 0, 1: 1, 2: 0, 3: 1}
    assert p.paths[2] == "/local/0/iter_0000012_2_local.pt"
    assert p.reason == (
        "iteration 12: written at DP 4 (world size 4), this start has DP 2 (world size 2)"
    )


# row 17: only this run's copies
def test_a_checkpoint_of_another_dp_size_written_by_another_run_is_not_resharded():
    """Guard: the run-id check comes before the DP check; the copies of another run (at another
    DP size) must not become a reshard of someone else's state."""
    invs = [
        _inventory(
            r, [_old(12, o, r, run_id="run-b", foreign="written by run-b") for o in (r, r + 2)]
        )
        for r in (0, 1)
    ]
    assert plan.decide(invs) == plan.Fallback(
        "local checkpoint at iteration 12 failed verification: every copy on every rank was "
        f"written by run-b; {OTHER_TOPO}"
    )


# row 18
def test_a_shard_without_a_copy_cannot_be_resharded():
    assert plan.decide(_shrunk(drop=(3,), persistent=10)) == plan.Fallback(
        "local checkpoint at iteration 12 cannot be resumed at this DP size: written at DP 4 "
        "(world size 4), this start has DP 2 (world size 2): no copy of the shard of rank(s) "
        "[3] on any rank, cannot reshard"
    )


# row 19
@pytest.mark.parametrize(
    "settings, why",
    [
        (
            ReshardSettings(save=None),
            "resharding writes the checkpoint into --save and loads it from there, so it "
            "needs --save",
        ),
        (
            ReshardSettings(save="ckpt", load_elsewhere=True),
            "resharding writes the checkpoint into --save and loads it from there, so it "
            "needs --save equal to --load",
        ),
        (
            ReshardSettings(save="ckpt", ckpt_format="torch"),
            "resharding writes a torch_dist checkpoint, which a run with --ckpt-format torch "
            "does not load (add --auto-detect-ckpt-format)",
        ),
    ],
    ids=["no-save", "load-elsewhere", "format"],
)
def test_a_reshard_needs_save_equal_to_load_and_torch_dist(settings, why):
    assert plan.decide(_shrunk(reshard=settings)) == plan.Fallback(
        "local checkpoint at iteration 12 cannot be resumed at this DP size: written at DP 4 "
        f"(world size 4), this start has DP 2 (world size 2): {why}"
    )


# row 20
def test_a_copy_that_fails_in_the_reshard_is_replaced_by_another_or_falls_back():
    invs = _shrunk()
    invs[1] = replace(invs[1], copies=invs[1].copies + (_old(12, 2, 1),))
    failed = plan.ReshardAttemptFailed(12, ((2, 0),), "rank 0: rank 2's shard: checksum")
    p = plan.decide(invs, [failed])
    assert isinstance(p, plan.Reshard) and p.loaders[2] == 1
    assert p.replaced == ("rank 0: rank 2's shard: checksum",)
    gone = plan.ReshardAttemptFailed(12, ((2, 1),), "rank 1: rank 2's shard: NaN")
    assert plan.decide(invs, [failed, gone]) == plan.Fallback(
        "local checkpoint at iteration 12 cannot be resumed at this DP size: written at DP 4 "
        "(world size 4), this start has DP 2 (world size 2): no verified copy of the shard of "
        "rank(s) [2]: rank 1: rank 2's shard: NaN"
    )
    retry = plan.ReshardAttemptFailed(12, ((2, 0),), "x")
    many = [_inventory(r, [_old(12, o, r) for o in range(4)]) for r in (0, 1)]
    assert "no copies verified after several attempts" in plan.decide(many, [retry] * 3).reason


# row 21
def test_the_persistent_checkpoint_a_reshard_wrote_is_loaded():
    p = plan.decide(_shrunk(persistent=12))
    assert p == plan.PersistentResharded(
        12, 4, "local checkpoint at iteration 12 was written at DP 4"
    )


# -- the rules, once each -------------------------------------------------------------------------
def test_save_token_vote_and_reference_fingerprint():
    assert plan.save_token_vote(["a", "a", "b"]) == ("a", None)
    assert plan.save_token_vote(["a", "b"]) == (
        None,
        "copies of 2 different saves, none in a majority",
    )
    assert plan.save_token_vote([]) == (None, None)
    copies = [_copy(12, 0, 1, fp="x"), _copy(12, 0, 0, fp="p"), _copy(12, 0, 2, fp="x")]
    assert plan.reference_fingerprint(copies, 0) == ("p", True)
    assert plan.reference_fingerprint(copies[::2], 0) == ("x", False)
