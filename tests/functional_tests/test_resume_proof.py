"""Resume proof through the entrypoint: every save writes ``state_digest.json`` from the live state,
every load is proven equal to it before training (or refused naming what differs), and
``tools/check_state_digest.py`` recomputes it from the files."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys

import pytest
import torch

from megatron.integrity import manifest as mf
from tests.helpers.launch import REPO, assert_bitwise_equal, run_pretrain

DISTOPT_FR = ["--use-distributed-optimizer", "--dist-ckpt-optim-fully-reshardable"]
PROOF_LINE = "[resume-proof] iteration 8:"


def _save_args(ck, iters, *extra):
    return [
        "--train-iters", str(iters), "--save", str(ck), "--save-interval", "8",
        "--ckpt-format", "torch_dist", *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def saved_at_8(tmp_path_factory):
    """A 2-rank run with the distributed optimizer (fully-reshardable format) to 16, saving at 8
    and 16; and the straight losses."""
    work = tmp_path_factory.mktemp("proof")
    run = run_pretrain(work, *_save_args(work / "ck", 16, *DISTOPT_FR))
    assert sorted(run.losses) == list(range(1, 17))
    return work, run


def _check_tool(path, *extra):
    return subprocess.run(
        [sys.executable, str(REPO / "tools" / "check_state_digest.py"), str(path), "--no-progress",
         *extra],
        capture_output=True, text=True, cwd=REPO, timeout=300,
    )  # fmt: skip


def test_save_writes_a_readable_digest_the_tool_confirms(saved_at_8):
    work, _ = saved_at_8
    record = json.loads((work / "ck" / "iter_0000008" / "state_digest.json").read_text())
    assert record["iteration"] == 8 and record["scalars"]["consumed_train_samples"] == 32
    kinds = {t["kind"] for t in record["tensors"].values()}
    assert kinds == {"model", "optimizer"}
    names = set(record["tensors"])
    assert "embedding.word_embeddings.weight" in names
    assert "optimizer.state.exp_avg_sq.embedding.word_embeddings.weight" in names
    assert record["layout"]["world_size"] == 2 and len(record["rng"]) == 2
    # the manifest covers it (written before integrity.json)
    manifest = mf.read_manifest(work / "ck" / "iter_0000008")
    assert "state_digest.json" in manifest["files"]
    # recomputed from the files alone, one process: every tensor equal
    r = _check_tool(work / "ck" / "iter_0000008")
    assert r.returncode == 0, r.stdout + r.stderr
    n = len(record["tensors"])
    assert f"{n} of {n} tensors equal" in r.stdout


@pytest.mark.compat
def test_resume_is_proven_and_bitwise(saved_at_8, tmp_path):
    work, straight = saved_at_8
    ck = tmp_path / "ck"
    shutil.copytree(work / "ck", ck)
    shutil.rmtree(ck / "iter_0000016")
    (ck / "latest_checkpointed_iteration.txt").write_text("8")
    resumed = run_pretrain(tmp_path, *_save_args(ck, 16, *DISTOPT_FR), "--load", str(ck))
    assert resumed.first_iteration() == 9
    line = [x for x in resumed.output.splitlines() if x.startswith(PROOF_LINE)]
    assert len(line) == 1, resumed.output[-3000:]
    n = len(json.loads((ck / "iter_0000008" / "state_digest.json").read_text())["tensors"])
    assert f"{n} tensors and the scalar state equal to the saved state" in line[0]
    assert_bitwise_equal(straight.losses, resumed.losses, range(9, 17))


def _tamper(checkpoint_dir, key):
    """Change one element of ``key``'s first stored chunk in place, re-serialised as DCP stores it
    (``torch.save`` of the chunk, same length), then rewrite integrity.json: the bytes verify, the
    values are not the saved state."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(checkpoint_dir)).read_metadata()
    index, info = next((i, s) for i, s in meta.storage_data.items() if i.fqn == key)
    path = checkpoint_dir / info.relative_path
    with open(path, "r+b") as f:
        f.seek(info.offset)
        chunk = torch.load(io.BytesIO(f.read(info.length)), weights_only=True)
        chunk.view(-1)[0] += 0.5
        buf = io.BytesIO()
        torch.save(chunk, buf)
        assert len(buf.getvalue()) == info.length
        f.seek(info.offset)
        f.write(buf.getvalue())
    mf.save_manifest(checkpoint_dir)


def test_values_changed_after_the_digest_are_refused(saved_at_8, tmp_path):
    work, _ = saved_at_8
    ck = tmp_path / "ck"
    shutil.copytree(work / "ck", ck)
    shutil.rmtree(ck / "iter_0000016")  # the tracker is a hint: the newest complete one loads
    (ck / "latest_checkpointed_iteration.txt").write_text("8")
    key = "optimizer.state.exp_avg.decoder.layers.mlp.linear_fc2.weight"
    _tamper(ck / "iter_0000008", key)
    r = _check_tool(ck / "iter_0000008")
    assert r.returncode == 1 and f"DIFFERS: {key}" in r.stdout, r.stdout + r.stderr
    refused = run_pretrain(
        tmp_path, *_save_args(ck, 16, *DISTOPT_FR), "--load", str(ck), check=False
    )
    assert refused.returncode != 0
    assert not refused.losses, "trained on a state that differs from the saved one"
    assert "verified" in refused.output  # the bytes pass their checksums
    msg = [x for x in refused.output.splitlines() if "differs from the state that was saved" in x]
    assert msg and key in msg[0] and "1 of" in msg[0], refused.output[-3000:]
    assert "persistent torch_dist" in msg[0]
    # warn: continues, loudly
    warned = run_pretrain(
        tmp_path, *_save_args(ck, 16, *DISTOPT_FR), "--load", str(ck), "--resume-proof", "warn",
        "--save-interval", "1000", "--exit-interval", "10", loss_file="warned.jsonl",
    )  # fmt: skip
    assert warned.first_iteration() == 9 and "WARNING: [resume-proof]" in warned.output
