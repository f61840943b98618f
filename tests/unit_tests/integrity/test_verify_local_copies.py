"""``verify_checkpoint(local_dir)`` alone (``tools/verify_checkpoint.py --local-dir DIR``) on
fabricated local checkpoints (no training run): every primary compared with its replicas (tensors
and identity record), the newest complete and consistent local iteration, and the leftovers of
interrupted saves (``*.dirty.pt``, ``<rank>/rejected/``, ``<rank>/LOCAL_TIER_BAD.json``).

The files are written the way NVRx's ``LocalCheckpointManager`` writes them
(``<holder>/iter_<7 digits>_<owner>_local.pt``, ``torch.save`` of an ``MCoreTensorAwareStateDict``)
with the replication fix's checksum record and the local tier's identity record."""

from __future__ import annotations

import json
import shutil
from argparse import Namespace
from pathlib import Path

import pytest
import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict

from megatron.integrity.checksum import tensor as ck
from megatron.integrity.local_identity import IDENTITY_ATTR, make_identity
from megatron.verify import verify_checkpoint
from tests.helpers.dist import run_distributed
from tools.verify_checkpoint import main as cli_main

WORLD = 2
N_TENSORS = 48  # per shard; the last one (a norm weight of ones) is the same in every run


def _shard(owner: int, seed: int, iteration: int, world: int = WORLD) -> dict:
    """``N_TENSORS`` ShardedTensors of ``owner``'s shard: float32 values drawn from ``seed``,
    ``owner`` and ``iteration`` (other runs and other iterations hold other values), plus one
    tensor of ones."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + iteration * 101 + owner)
    out = {}
    for i in range(N_TENSORS - 1):
        data = torch.randn(4, 8, generator=g)
        out[f"w{i}"] = ShardedTensor.from_rank_offsets(
            f"decoder.layers.{i}.mlp.linear_fc1.weight", data, (0, owner, world)
        )
    out["norm"] = ShardedTensor.from_rank_offsets(
        "decoder.final_layernorm.weight", torch.ones(1, 8), (0, owner, world)
    )
    return out


def write_save(
    local: Path,
    iteration: int,
    *,
    seed: int = 1,
    run_id: str = "run-a",
    save_token: str = None,
    owners=None,
    factor: int = 2,
    world: int = WORLD,
    records: bool = True,
    algorithm: str = "xxh3_64",
) -> None:
    """One local save of ``iteration`` under ``local``: for each owner (default: all ``world``) the
    primary (``<owner>/``) and ``factor - 1`` replicas on the next ranks (replication jump 1), with
    checksum records (unless ``records=False``) and identity records."""
    token = save_token or f"{run_id}-save-{iteration}"
    args = Namespace(
        world_size=world,
        replication=factor > 1,
        replication_factor=factor,
        replication_jump=1,
        seed=seed,
    )
    for r in range(world) if owners is None else owners:
        sd = MCoreTensorAwareStateDict(
            common={"iteration": iteration, "args": args},
            sharded_state_dict=_shard(r, seed, iteration, world),
        )
        if records:
            entries = [
                ck.make_entry(
                    i, sh.key, sh.data, global_offset=sh.global_offset, algorithm=algorithm
                )
                for i, sh in enumerate(sd._sharded_tensors)
            ]
            ck.attach_record(sd, ck.make_record(r, entries, algorithm))
        setattr(
            sd,
            IDENTITY_ATTR,
            make_identity(
                run_id,
                "derived",
                {"seed": seed, "save": "/ckpt"},
                {"world_size": world},
                iteration,
                r,
                token,
                f"node-{r}",
            ),
        )
        for j in range(factor):
            d = local / str((r + j) % world)
            d.mkdir(parents=True, exist_ok=True)
            torch.save(sd, d / f"iter_{iteration:07d}_{r}_local.pt")


def _name(it: int, owner: int) -> str:
    return f"iter_{it:07d}_{owner}_local.pt"


def _kinds(items) -> list:
    return sorted(p.kind for p in items)


def _flip_byte(f: Path, index: int, at: int = 13) -> str:
    """Flip bits of byte ``at`` of tensor ``index``'s data in file ``f``; returns the tensor's
    key."""
    sh = list(torch.load(f, weights_only=False)._sharded_tensors)[index]
    want = sh.data.contiguous().view(torch.uint8).numpy().tobytes()
    raw = f.read_bytes()
    assert raw.count(want) == 1
    off = raw.index(want) + at
    with open(f, "r+b") as fh:
        fh.seek(off)
        fh.write(bytes([raw[off] ^ 0x10]))
    return sh.key


# --- (a) consistent ------------------------------------------------------------------------------


def test_consistent_primaries_and_replicas_ok(tmp_path, capsys):
    local = tmp_path / "local"
    write_save(local, 12)
    rep = verify_checkpoint(local)
    assert rep.ok and rep.problems == [] and rep.warnings == [], rep.format_text()
    s = rep.summary()
    assert (s["files"], s["primary_files"], s["replica_files"]) == (4, 2, 2)
    assert s["checksums_verified"] == 4 * N_TENSORS and s["checksums_failed"] == 0
    assert rep.newest_complete_iteration == 12
    (it,) = rep.local_iterations
    assert (
        it["iteration"],
        it["complete"],
        it["consistent"],
        it["owners"],
        it["files"],
        it["reasons"],
    ) == (12, True, True, 2, 4, [])
    assert [
        (sh["owner_rank"], sh["copies"], sh["usable"], sh["consistent"]) for sh in it["shards"]
    ] == [
        (
            0,
            [f"0/{_name(12, 0)}", f"1/{_name(12, 0)}"],
            [f"0/{_name(12, 0)}", f"1/{_name(12, 0)}"],
            True,
        ),
        (
            1,
            [f"0/{_name(12, 1)}", f"1/{_name(12, 1)}"],
            [f"0/{_name(12, 1)}", f"1/{_name(12, 1)}"],
            True,
        ),
    ]
    assert "newest complete and consistent local iteration: 12" in rep.format_text()
    # CLI: exit 0, the field in the JSON report
    out = tmp_path / "r.json"
    assert cli_main(["--local-dir", str(local), "--json", str(out), "--no-progress"]) == 0
    assert "newest complete and consistent local iteration: 12\n" in capsys.readouterr().out
    d = json.loads(out.read_text())
    assert d["ok"] is True and d["newest_complete_iteration"] == 12 and d["iterations"] == [12]
    assert d["local_iterations"] == rep.to_dict()["local_iterations"]


# --- (b) a foreign primary -----------------------------------------------------------------------


@pytest.fixture
def foreign_primary(tmp_path) -> Path:
    """Rank 1's primary of iteration 12 replaced by rank 1's file of iteration 12 of another run
    (other seed: other values, its own valid checksums; another run id and save token)."""
    local = tmp_path / "local"
    write_save(local, 12, seed=1, run_id="run-a")
    other = tmp_path / "other"
    write_save(other, 12, seed=2, run_id="run-b")
    shutil.copyfile(other / "1" / _name(12, 1), local / "1" / _name(12, 1))
    return local


def test_foreign_primary_differs_from_its_replica(foreign_primary, tmp_path, capsys):
    rep = verify_checkpoint(foreign_primary)
    assert not rep.ok and rep.exit_code == 1
    assert _kinds(rep.problems) == ["copies_differ"], rep.format_text()
    (p,) = rep.problems
    assert p.message.startswith(
        f"rank 1's shard of iteration 12: primary 1/{_name(12, 1)} and replica 0/{_name(12, 1)} "
        f"differ in 47 of 48 tensors; identity records differ in run_id, save_token, "
        f"run_settings.seed"
    )
    assert "suspect: primary 1/iter_0000012_1_local.pt" in p.message
    assert (p.owner_rank, p.iteration, p.details["files"], p.details["holders"]) == (
        1,
        12,
        [f"1/{_name(12, 1)}", f"0/{_name(12, 1)}"],
        [1, 0],
    )
    assert (p.details["differing_tensors"], p.details["tensors"]) == (47, 48)
    assert p.details["identity_fields"] == ["run_id", "save_token", "run_settings.seed"]
    assert p.details["suspect"] == f"1/{_name(12, 1)}"
    # every file verifies against its own checksums: only the comparison finds it
    assert rep.summary()["checksums_failed"] == 0
    assert rep.newest_complete_iteration is None
    (it,) = rep.local_iterations
    assert (it["complete"], it["consistent"]) == (True, False)
    assert it["reasons"] == [
        f"rank 1's shard: primary 1/{_name(12, 1)} and replica 0/{_name(12, 1)} differ"
    ]
    # CLI
    assert cli_main(["--local-dir", str(foreign_primary), "--no-progress"]) == 1
    text = capsys.readouterr().out
    assert (
        f"[copies_differ] rank 1's shard of iteration 12: primary 1/{_name(12, 1)} and replica "
        f"0/{_name(12, 1)} differ in 47 of 48 tensors" in text
    )
    assert "newest complete and consistent local iteration: none" in text
    assert "RESULT: FAILED (1 problem(s))" in text


def test_same_tensors_other_save_differs_in_identity_only(tmp_path):
    """Rank 1's primary from another save of the same run and values (a re-save): all tensors
    agree, the save token does not."""
    local = tmp_path / "local"
    write_save(local, 12)
    other = tmp_path / "other"
    write_save(other, 12, save_token="another-save")
    shutil.copyfile(other / "1" / _name(12, 1), local / "1" / _name(12, 1))
    rep = verify_checkpoint(local)
    assert _kinds(rep.problems) == ["copies_differ"], rep.format_text()
    p = rep.problems[0]
    assert "hold the same 48 tensors; identity records differ in save_token" in p.message
    assert (p.details["differing_tensors"], p.details["identity_fields"]) == (0, ["save_token"])
    assert rep.newest_complete_iteration is None


def test_both_copies_of_a_shard_from_another_save_are_mixed_saves(tmp_path):
    """Both copies of rank 1's shard agree with each other but come from another save than rank
    0's: the iteration mixes saves."""
    local = tmp_path / "local"
    write_save(local, 12, owners=[0])
    write_save(local, 12, owners=[1], save_token="another-save")
    rep = verify_checkpoint(local)
    assert _kinds(rep.problems) == ["mixed_saves"], rep.format_text()
    assert "iteration 12: its files come from 2 saves" in rep.problems[0].message
    assert rep.newest_complete_iteration is None


def test_identity_naming_another_iteration_makes_the_copies_unusable(tmp_path):
    """Both copies of rank 0's shard carry an identity record of iteration 11 (a renamed file):
    neither verifies, so iteration 12 is not complete."""
    local = tmp_path / "local"
    write_save(local, 12)
    sd = torch.load(local / "0" / _name(12, 0), weights_only=False)
    setattr(sd, IDENTITY_ATTR, dict(getattr(sd, IDENTITY_ATTR), iteration=11))
    for holder in (0, 1):
        torch.save(sd, local / str(holder) / _name(12, 0))
    rep = verify_checkpoint(local)
    assert [(p.kind, p.file) for p in rep.problems] == [
        ("identity", f"0/{_name(12, 0)}"),
        ("identity", f"1/{_name(12, 0)}"),
    ], rep.format_text()
    assert (
        "its identity record is of rank 0's shard of iteration 11, its name says rank 0, "
        "iteration 12" in rep.problems[0].message
    )
    (it,) = rep.local_iterations
    assert it["complete"] is False and it["shards"][0]["usable"] == []
    assert (
        it["reasons"][0] == f"rank 0's shard: no copy verifies (0/{_name(12, 0)}, 1/{_name(12, 0)})"
    )
    assert rep.newest_complete_iteration is None


# --- (c) a flipped byte in a replica -------------------------------------------------------------


def test_flipped_byte_in_replica_is_a_checksum_problem(tmp_path):
    local = tmp_path / "local"
    write_save(local, 12)
    key = _flip_byte(local / "0" / _name(12, 1), 5)  # the replica of rank 1's shard, held by rank 0
    rep = verify_checkpoint(local)
    assert _kinds(rep.problems) == ["checksum_mismatch"], rep.format_text()
    (p,) = rep.problems
    assert (p.file, p.role, p.holder_rank, p.owner_rank, p.key) == (
        f"0/{_name(12, 1)}",
        "replica",
        0,
        1,
        key,
    )
    assert p.message.startswith(
        f"0/{_name(12, 1)} (replica of rank 1's shard held by rank 0): '{key}'"
    )
    assert rep.summary()["checksums_failed"] == 1 and rep.exit_code == 1
    # the primary still verifies: the iteration can be recovered from it
    assert rep.newest_complete_iteration == 12
    sh1 = rep.local_iterations[0]["shards"][1]
    assert (sh1["usable"], sh1["consistent"]) == ([f"1/{_name(12, 1)}"], True)


def test_pmix64_records_verify_and_a_flipped_byte_is_named(tmp_path):
    """Files whose records hold pmix64 (what replication over NCCL computes on the GPU) verify on
    the CPU; a flipped byte in a replica is a checksum problem naming the tensor."""
    local = tmp_path / "local"
    write_save(local, 12, algorithm="pmix64")
    rep = verify_checkpoint(local)
    assert rep.ok and rep.summary()["checksums_verified"] == 4 * N_TENSORS, rep.format_text()
    key = _flip_byte(local / "0" / _name(12, 1), 5)
    rep = verify_checkpoint(local)
    assert _kinds(rep.problems) == ["checksum_mismatch"], rep.format_text()
    assert (rep.problems[0].file, rep.problems[0].key) == (f"0/{_name(12, 1)}", key)
    assert rep.summary()["checksums_failed"] == 1


def test_flipped_byte_without_checksum_records_is_found_by_comparing_copies(tmp_path):
    """Files written without checksum records: the copies are compared by the checksums of their
    bytes, so the damaged replica differs from its primary in exactly one tensor."""
    local = tmp_path / "local"
    write_save(local, 12, records=False)
    key = _flip_byte(local / "0" / _name(12, 1), 7)
    rep = verify_checkpoint(local)
    assert _kinds(rep.problems) == ["copies_differ"], rep.format_text()
    (p,) = rep.problems
    assert p.message == (
        f"rank 1's shard of iteration 12: primary 1/{_name(12, 1)} and replica 0/{_name(12, 1)} "
        "differ in 1 of 48 tensors"
    )
    assert p.details["first_differing_keys"] == [key] and p.details["suspect"] is None
    assert _kinds(rep.warnings) == ["no_checksum_record"] * 4
    assert rep.newest_complete_iteration is None


def test_three_copies_the_odd_one_is_the_suspect(tmp_path):
    """Replication factor 3 on 3 ranks: rank 0's replica on rank 2 holds other values under the
    same run id and save token; the two other copies agree, so the odd one is named."""
    local = tmp_path / "local"
    write_save(local, 12, world=3, factor=3)
    other = tmp_path / "other"
    write_save(other, 12, world=3, factor=3, seed=2)
    shutil.copyfile(other / "2" / _name(12, 0), local / "2" / _name(12, 0))
    rep = verify_checkpoint(local)
    assert _kinds(rep.problems) == ["copies_differ"], rep.format_text()
    (p,) = rep.problems
    assert p.message == (
        f"rank 0's shard of iteration 12: primary 0/{_name(12, 0)} and replica 2/{_name(12, 0)} "
        "differ in 47 of 48 tensors; identity records differ in run_settings.seed [suspect: "
        f"replica 2/{_name(12, 0)}: the other copies agree with each other]"
    )
    assert rep.local_iterations[0]["owners"] == 3 and rep.local_iterations[0]["files"] == 9


# --- (d) newest iteration incomplete --------------------------------------------------------------


def test_newest_incomplete_iteration_falls_back_to_older_complete(tmp_path, capsys):
    local = tmp_path / "local"
    write_save(local, 12)
    write_save(local, 14, owners=[0])  # rank 1's shard of 14 was never written
    rep = verify_checkpoint(local)
    assert rep.iterations == [12, 14] and rep.iteration == 14
    assert rep.newest_complete_iteration == 12
    assert rep.ok and rep.exit_code == 0, rep.format_text()
    assert _kinds(rep.warnings) == ["incomplete_iteration"]
    assert rep.warnings[0].message == (
        "iteration 14: rank 1's shard missing (interrupted save); newest complete "
        "and consistent local iteration: 12"
    )
    by_it = {it["iteration"]: it for it in rep.local_iterations}
    assert (by_it[14]["complete"], by_it[14]["reasons"]) == (
        False,
        ["rank 1's shard missing (interrupted save)"],
    )
    assert (by_it[12]["complete"], by_it[12]["consistent"]) == (True, True)
    assert rep.summary()["files"] == 6  # both iterations' files are checked
    assert cli_main(["--local-dir", str(local), "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert (
        "newest complete and consistent local iteration: 12 (iteration 14: rank 1's shard missing "
        "(interrupted save))"
    ) in text
    # asked for iteration 14 explicitly: its missing shard is a problem
    rep14 = verify_checkpoint(local, iteration=14)
    assert [(p.kind, p.owner_rank) for p in rep14.problems] == [("missing_owner", 1)], (
        rep14.format_text()
    )
    assert rep14.newest_complete_iteration is None and rep14.iterations == [14]


def test_only_iteration_incomplete_is_a_problem(tmp_path):
    local = tmp_path / "local"
    write_save(local, 14, owners=[0])
    rep = verify_checkpoint(local)
    assert [(p.kind, p.owner_rank) for p in rep.problems] == [("missing_owner", 1)], (
        rep.format_text()
    )
    assert "rank 1's shard of iteration 14" in rep.problems[0].message
    assert rep.newest_complete_iteration is None


# --- (e) leftovers --------------------------------------------------------------------------------


def test_leftovers_are_named_as_warnings(tmp_path, capsys):
    local = tmp_path / "local"
    write_save(local, 12)
    (local / "1" / "iter_0000014_1_local.dirty.pt").write_bytes(b"partial")
    (local / "0" / "rejected").mkdir()
    shutil.copyfile(local / "0" / _name(12, 0), local / "0" / "rejected" / _name(10, 0))
    (local / "0" / "LOCAL_TIER_BAD.json").write_text(
        json.dumps(
            {
                "format": "megatron.local_tier.bad_marker",
                "version": 1,
                "iteration": 13,
                "local_checkpoint_iteration": 10,
                "reason": "loss is NaN at iteration 13",
                "rank": 0,
            }
        )
    )
    rep = verify_checkpoint(local)
    assert rep.ok and rep.newest_complete_iteration == 12, rep.format_text()
    assert [(p.kind, p.file) for p in rep.warnings] == [
        ("bad_tier_marker", "0/LOCAL_TIER_BAD.json"),
        ("dirty_file", "1/iter_0000014_1_local.dirty.pt"),
        ("rejected_file", f"0/rejected/{_name(10, 0)}"),
    ]
    msgs = {p.kind: p.message for p in rep.warnings}
    assert msgs["bad_tier_marker"] == (
        "0/LOCAL_TIER_BAD.json: bad-tier marker of rank 0 (iteration 13: loss is "
        "NaN at iteration 13); the next start loads the persistent checkpoint"
    )
    assert msgs["dirty_file"].startswith("1/iter_0000014_1_local.dirty.pt: unfinished local save")
    assert msgs["rejected_file"].startswith(
        f"0/rejected/{_name(10, 0)}: quarantined by the local tier"
    )
    assert cli_main(["--local-dir", str(local), "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "Warnings (3):" in text and "[rejected_file] 0/rejected/" in text


def test_leftovers_in_a_session_directory(tmp_path):
    sess = tmp_path / "local" / "session-7"
    write_save(sess, 12)
    (sess / "1" / "rejected").mkdir()
    (sess / "1" / "rejected" / _name(10, 1)).write_bytes(b"x")
    (sess / "1" / "LOCAL_TIER_BAD.json").write_text("{not json")
    rep = verify_checkpoint(tmp_path / "local")
    assert rep.ok and rep.newest_complete_iteration == 12, rep.format_text()
    assert [(p.kind, p.file, p.holder_rank) for p in rep.warnings] == [
        ("bad_tier_marker", "session-7/1/LOCAL_TIER_BAD.json", 1),
        ("rejected_file", f"session-7/1/rejected/{_name(10, 1)}", 1),
    ]
    assert rep.warnings[0].message.startswith(
        "session-7/1/LOCAL_TIER_BAD.json: bad-tier marker of rank 1 (unreadable: JSONDecodeError"
    )


# --- distributed ---------------------------------------------------------------------------------


def _dist_body(rank, world, local_dirs, out_dir):
    import torch.distributed as dist

    for i, d in enumerate(local_dirs):
        rep = verify_checkpoint(d, group=dist.group.WORLD)
        assert rep.timing["workers"] == 2
        if rank == 0:
            Path(out_dir, f"{i}.json").write_text(
                json.dumps(rep.to_dict(include_timing=False), sort_keys=True)
            )


def test_distributed_equals_single_process(foreign_primary, tmp_path):
    """The foreign primary and an incomplete newer iteration with leftovers, verified by 2 gloo
    processes (each gets part of the files): the same report as one process."""
    second = tmp_path / "second"
    write_save(second, 12)
    write_save(second, 14, owners=[1])
    (second / "0" / "iter_0000014_0_local.dirty.pt").write_bytes(b"")
    (second / "1" / "rejected").mkdir()
    (second / "1" / "rejected" / _name(8, 1)).write_bytes(b"x")
    dirs = [str(foreign_primary), str(second)]
    run_distributed(_dist_body, 2, dirs, str(tmp_path))
    for i, d in enumerate(dirs):
        single = json.loads(
            json.dumps(verify_checkpoint(d).to_dict(include_timing=False), sort_keys=True)
        )
        assert json.loads((tmp_path / f"{i}.json").read_text()) == single
    first = json.loads((tmp_path / "0.json").read_text())
    assert [p["kind"] for p in first["problems"]] == ["copies_differ"]
    assert first["problems"][0]["details"]["differing_tensors"] == 47
    sec = json.loads((tmp_path / "1.json").read_text())
    assert sec["ok"] is True and sec["newest_complete_iteration"] == 12
    assert sorted(w["kind"] for w in sec["warnings"]) == [
        "dirty_file",
        "incomplete_iteration",
        "rejected_file",
    ]
    assert (
        "iteration 14: rank 0's shard missing (interrupted save: 0/iter_0000014_0_local.dirty.pt)"
        in [w["message"] for w in sec["warnings"] if w["kind"] == "incomplete_iteration"][0]
    )
