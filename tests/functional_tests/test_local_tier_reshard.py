"""A node lost with no spare costs no iterations: the local tier resumed at another data-parallel
size, on the real entrypoint (``pretrain_gpt.py --cpu``, gloo).

The job: 4 ranks as two ``torchrun`` agents of 2 ranks (``--nnodes 2``, c10d rendezvous on
127.0.0.1), node A = ranks 0-1 with ``nodeA/local``, node B = ranks 2-3 with ``nodeB/local``, a
shared persistent ``ckpt`` (every 10). Local checkpoints every 4, replicated to the other node
(``--replication-jump 2 --replication-factor 2``). Dropout is off (its masks come from each rank's
RNG stream, which a DP change alters), the global batch is 8 (micro batch 2: DP 4 and DP 2 both
hold it).

Rank 2 crashes before iteration 13 (after the local save of 12); node B's processes are killed and
its local directory deleted. The restart runs on node A alone, 2 ranks (DP 4 -> 2, jump 1): every
shard of 12 is on node A (primaries of old ranks 0-1, replicas of old ranks 2-3), so it resumes at
13, not at the persistent 10 (2 iterations lost before this fork, the persistent interval at
scale). Losses 13-16 equal an uninterrupted 4-rank run's within the reduction order of a DP change
(measured: 9e-8 relative at 13, bitwise after); the state after the resharded load is proven equal
to the state saved at 12 by the resume proof's digests (bitwise, model and optimizer state). Then
the spares return: 4 ranks resume from the local checkpoint 16 written at DP 2.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from megatron.training_ext import loss_log
from tests.functional_tests.conftest import lose_exit_save
from tests.helpers.dist import free_port
from tests.helpers.fault_injection import ENV_FAULT
from tests.helpers.launch import (
    FAULTS_ENTRY,
    local_files,
    run_pretrain,
    start_lines,
    start_node,
    wait_for_injected_crash,
)

pytestmark = pytest.mark.slow

LOST_AT = 12  # local save (every 4), persistent at 10
PERSISTENT = 10
MODEL = ["--global-batch-size", "8", "--hidden-dropout", "0", "--attention-dropout", "0"]
TIERS = [
    "--save",
    "ckpt",
    "--load",
    "ckpt",
    "--save-interval",
    "10",
    "--ckpt-format",
    "torch_dist",
    "--non-persistent-ckpt-type",
    "local",
    "--non-persistent-save-interval",
    "4",
]
DISTOPT = ["--use-distributed-optimizer"]
#: Reduction order of a DP change: measured 9e-8 at the first iteration, at most 6.4e-8 with
#: MKL's and ATen's AVX-512 kernels and with both at AVX2 (docs/tests.md, "Kernel paths").
REL_TOL = 1e-6


def _args(local: str, jump: int | None, exit_at: int, extra=()) -> list[str]:
    """The job's flags; ``jump`` None: no replication."""
    repl = [] if jump is None else ["--replication", "--replication-jump", str(jump)]
    repl += ["--replication-factor", "2"] if jump is not None else []
    return [
        *MODEL,
        *TIERS,
        "--non-persistent-local-ckpt-dir",
        local,
        *repl,
        "--exit-interval",
        str(exit_at),
        *extra,
    ]


def _name(iteration: int, rank: int) -> str:
    return f"iter_{iteration:07d}_{rank}_local.pt"


def _assert_close(reference: dict, run: dict, iterations) -> None:
    for i in iterations:
        for key in ("lm loss (decimal)", "grad norm (decimal)"):
            a, b = reference[i][key], run[i][key]
            assert abs(a - b) <= REL_TOL * abs(a), f"iteration {i} {key}: {b} vs {a} uninterrupted"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The uninterrupted 4-rank run: iterations 1-16."""
    work = tmp_path_factory.mktemp("reshard_reference")
    run = run_pretrain(work, *_args("local", 2, 16, DISTOPT), nproc=4)
    assert sorted(run.losses) == list(range(1, 17))
    return run.losses


@pytest.fixture(scope="module")
def node_b_lost(tmp_path_factory) -> Path:
    """The two-node job to 12, node B lost (killed, its local directory deleted): the work
    directory, as node A and the shared ``ckpt`` hold it."""
    work = tmp_path_factory.mktemp("reshard_lost_node")
    crash = {ENV_FAULT: f"rank=2,iteration={LOST_AT},once={work / 'crash.done'}"}
    port, rdzv = free_port(), f"reshard-{port_tag()}"
    nodes = [
        start_node(
            work,
            n,
            2,
            f"127.0.0.1:{port}",
            rdzv,
            _args(f"node{'AB'[n]}/local", 2, 16, DISTOPT),
            nproc=2,
            env=crash,
            output=work / f"node{'AB'[n]}.log",
            loss_file=work / "first.jsonl",
            launcher_args=["--max-restarts", "0"],
            entry=FAULTS_ENTRY,
        )
        for n in (0, 1)
    ]
    a, b = nodes
    try:
        wait_for_injected_crash(a, b, 2, LOST_AT + 1)
        b.kill_tree()
        assert a.wait(timeout=600) != 0
    finally:
        a.kill_tree()
        b.kill_tree()
    assert sorted(local_files(work / "nodeB" / "local")) == [2, 3]
    shutil.rmtree(work / "nodeB" / "local")
    # node A: the primaries of old ranks 0-1 and node B's replicas (jump 2)
    assert local_files(work / "nodeA" / "local") == {
        0: [_name(LOST_AT, 0), _name(LOST_AT, 2)],
        1: [_name(LOST_AT, 1), _name(LOST_AT, 3)],
    }
    first = loss_log.read(str(work / "first.jsonl"))
    assert max(first) == LOST_AT
    assert (work / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "10"
    return work


def port_tag() -> str:
    import time

    return str(time.time_ns())


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.log", "*.out", "*.jsonl"))
    return dst


def test_node_lost_without_spare_resumes_at_dp2_then_grows_back(tmp_path, node_b_lost, reference):
    work = _copy(node_b_lost, tmp_path / "job")
    shrink = run_pretrain(
        work, *_args("nodeA/local", 1, 16, DISTOPT), nproc=2, loss_file="dp2.jsonl"
    )
    out = shrink.output
    assert shrink.first_iteration() == LOST_AT + 1, (sorted(shrink.losses), out[-4000:])
    assert sorted(shrink.losses) == [13, 14, 15, 16]
    _assert_close(reference, shrink.losses, range(13, 17))
    lines = start_lines(out)
    for r in (0, 1):
        (line,) = [ln for ln in lines[r] if "local checkpoint" in ln]
        assert (
            f"[local-tier] rank {r}: local checkpoint at iteration {LOST_AT} written at DP 4 "
            f"(world size 4) resumed at DP 2 (world size 2): read {r}/{_name(LOST_AT, r)}, "
            f"{r}/{_name(LOST_AT, r + 2)}; all 4 shards written as the torch_dist checkpoint "
            f"ckpt/iter_{LOST_AT:07d} (shards read and verified in " in line
        ), line
    # the exact check: every model and optimizer tensor of the resharded state is the saved one
    assert re.search(
        rf"\[resume-proof\] iteration {LOST_AT}: 64 tensors and the scalar state equal to the "
        rf"saved state \(persistent torch_dist ckpt/iter_{LOST_AT:07d}, [0-9.]+ s\); not "
        r"compared: RNG states \(another parallel layout\)",
        out,
    ), out[-4000:]
    assert f"[persistent-tier] iter_{LOST_AT:07d}: verified 5 files" in out
    # a durable copy, its digest the local save's; the planned exit at 16 saved persistently too
    assert (work / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "16"
    assert (work / "ckpt" / f"iter_{LOST_AT:07d}" / "state_digest.json").is_file()
    # the DP 4 files went once the first DP 2 local save completed; 16 replicated at jump 1
    assert local_files(work / "nodeA" / "local") == {
        0: [_name(16, 0), _name(16, 1)],
        1: [_name(16, 0), _name(16, 1)],
    }

    # the spares return: 4 ranks (node B's directory empty) resume from local 16 written at DP 2
    # (the DP 2 job lost right after its local save of 16: not the planned exit's persistent one)
    lose_exit_save(work / "ckpt", 16)
    grow = run_pretrain(work, *_args("nodeA/local", 2, 18, DISTOPT), nproc=4, loss_file="dp4.jsonl")
    assert grow.first_iteration() == 17 and sorted(grow.losses) == [17, 18], grow.output[-4000:]
    assert "written at DP 2 (world size 2) resumed at DP 4 (world size 4)" in grow.output
    assert re.search(
        r"\[resume-proof\] iteration 16: 64 tensors and the scalar state equal to the saved state",
        grow.output,
    ), grow.output[-4000:]


def test_a_shard_without_any_copy_falls_back_to_persistent_with_the_reason(tmp_path, node_b_lost):
    work = _copy(node_b_lost, tmp_path / "job")
    (work / "nodeA" / "local" / "1" / _name(LOST_AT, 3)).unlink()  # node B's replica of rank 3
    run = run_pretrain(work, *_args("nodeA/local", 1, 13, DISTOPT), nproc=2)
    assert run.first_iteration() == PERSISTENT + 1, run.output[-4000:]
    # training through 12 again, its local save of 12 completes next to the DP 4 files of 12
    # (their shards of old ranks 2-3 are no part of a 2-rank checkpoint) and replaces them
    assert local_files(work / "nodeA" / "local") == {
        0: [_name(LOST_AT, 0), _name(LOST_AT, 1)],
        1: [_name(LOST_AT, 0), _name(LOST_AT, 1)],
    }
    for r in (0, 1):
        (line,) = [ln for ln in start_lines(run.output)[r] if "local checkpoint" in ln]
        assert (
            f"local checkpoint tier rejected: local checkpoint at iteration {LOST_AT} cannot be "
            f"resumed at this DP size: written at DP 4 (world size 4), this start has "
            f"DP 2 (world size 2): no copy of the shard of rank(s) [3] on any rank, cannot "
            f"reshard -> loading the newest persistent checkpoint: iteration {PERSISTENT}" in line
        ), line
    assert not (work / "ckpt" / f"iter_{LOST_AT:07d}").exists()


def test_guard_upstream_local_tier_cannot_change_dp(tmp_path, node_b_lost):
    """``--no-local-tier-validation`` (upstream's local tier): the restart at DP 2 falls back to
    persistent 10 and trains 11-12 again (then fails its local save of 12, where the DP 4 files
    are)."""
    work = _copy(node_b_lost, tmp_path / "job")
    run = run_pretrain(
        work,
        *_args("nodeA/local", 1, 14, [*DISTOPT, "--no-local-tier-validation"]),
        nproc=2,
        check=False,
    )
    assert run.first_iteration() == PERSISTENT + 1, (sorted(run.losses), run.output[-3000:])
    assert not (work / "ckpt" / f"iter_{LOST_AT:07d}").exists()


def test_without_distributed_optimizer_at_tp2(tmp_path):
    """Plain Adam (optimizer state sharded like the model) at TP 2: 4 ranks (DP 2) to 12, ranks
    2-3's directories lost, 2 ranks (DP 1) resume at 13 from the shards on ranks 0-1 (jump 2),
    proven equal to the saved state."""
    work = tmp_path / "job"
    tp2 = ["--tensor-model-parallel-size", "2"]
    first = run_pretrain(work, *_args("local", 2, 12, tp2), nproc=4, loss_file="first.jsonl")
    assert max(first.losses) == LOST_AT
    lose_exit_save(work / "ckpt", LOST_AT)  # the exit's persistent save: as if the node was lost
    shutil.rmtree(work / "local" / "2")
    shutil.rmtree(work / "local" / "3")
    run = run_pretrain(work, *_args("local", None, 13, tp2), nproc=2)
    assert run.first_iteration() == LOST_AT + 1, run.output[-4000:]
    for r in (0, 1):
        assert (
            f"[local-tier] rank {r}: local checkpoint at iteration {LOST_AT} written at DP 2 "
            f"(world size 4) resumed at DP 1 (world size 2): read {r}/{_name(LOST_AT, r)}, "
            f"{r}/{_name(LOST_AT, r + 2)}" in run.output
        ), run.output[-4000:]
    assert re.search(
        rf"\[resume-proof\] iteration {LOST_AT}: 64 tensors and the scalar state equal to the "
        r"saved state",
        run.output,
    ), run.output[-4000:]


def test_shards_in_other_rank_directories_of_the_host(tmp_path, node_b_lost):
    """Rank numbers move between nodes: the surviving node's directories are ``2/`` and ``3/``
    (as if node A had been lost and node B survived), the restarted ranks 0-1 own empty ``0/`` and
    ``1/``; they find every shard in the other rank directories of their host."""
    work = _copy(node_b_lost, tmp_path / "job")
    local = work / "nodeA" / "local"
    (local / "0").rename(local / "2")
    (local / "1").rename(local / "3")
    run = run_pretrain(work, *_args("nodeA/local", 1, 13, DISTOPT), nproc=2)
    assert run.first_iteration() == LOST_AT + 1, run.output[-4000:]
    lines = {
        r: [ln for ln in v if "local checkpoint" in ln] for r, v in start_lines(run.output).items()
    }
    assert (
        f"[local-tier] rank 0: local checkpoint at iteration {LOST_AT} written at DP 4 (world size "
        f"4) resumed at DP 2 (world size 2): read 2/{_name(LOST_AT, 0)}, 2/{_name(LOST_AT, 2)}"
        in lines[0][0]
    ), lines
    assert f"read 3/{_name(LOST_AT, 1)}, 3/{_name(LOST_AT, 3)}" in lines[1][0], lines
    assert re.search(
        rf"\[resume-proof\] iteration {LOST_AT}: 64 tensors and the scalar state equal to the "
        r"saved state",
        run.output,
    ), run.output[-4000:]
    # the other ranks' directories are read, never changed
    assert local_files(local)[2] == [_name(LOST_AT, 0), _name(LOST_AT, 2)]


def test_a_start_killed_while_writing_leaves_nothing_half_written(tmp_path, node_b_lost):
    """What a restart killed during the reshard's write leaves: its staging directory (a partial
    write) and, from an interrupted persistent save of 12, an incomplete ``iter_0000012``. The
    next start writes 12 again and resumes at 13; the incomplete directory is kept, renamed."""
    work = _copy(node_b_lost, tmp_path / "job")
    staged = work / "ckpt" / ".local_tier_reshard" / f"iter_{LOST_AT:07d}"
    staged.mkdir(parents=True)
    (staged / "__0_0.distcp").write_bytes(b"partial")
    partial = work / "ckpt" / f"iter_{LOST_AT:07d}"
    partial.mkdir()
    (partial / "__1_0.distcp").write_bytes(b"interrupted")
    run = run_pretrain(work, *_args("nodeA/local", 1, 13, DISTOPT), nproc=2)
    assert run.first_iteration() == LOST_AT + 1, run.output[-4000:]
    (line,) = [ln for ln in start_lines(run.output)[0] if "local checkpoint" in ln]
    kept = sorted((work / "ckpt").glob(f"iter_{LOST_AT:07d}.incomplete-*"))
    assert len(kept) == 1 and (kept[0] / "__1_0.distcp").read_bytes() == b"interrupted"
    assert (
        f"the incomplete ckpt/iter_{LOST_AT:07d} found there (an interrupted save) kept as" in line
    )
    assert not (work / "ckpt" / ".local_tier_reshard").exists()
    assert (partial / ".metadata").is_file() and (partial / "integrity.json").is_file()
    assert f"[persistent-tier] iter_{LOST_AT:07d}: verified 5 files" in run.output
