"""Identity records of local checkpoint files (``megatron/integrity/local_identity.py``)."""

from __future__ import annotations

import argparse
import json
import os
import types

import pytest
import torch

from megatron.integrity import local_identity as li


def _args(**kw):
    base = dict(
        seed=1234,
        data_path=None,
        mock_data=True,
        num_layers=2,
        hidden_size=64,
        save=None,
        world_size=2,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        data_parallel_size=2,
    )
    base.update(kw)
    return argparse.Namespace(**base)


def test_derived_run_id_is_stable_and_changes_with_what_defines_the_experiment(tmp_path):
    a = li.run_identity(_args(), token="t1")
    assert a == li.run_identity(_args(), token="t1")
    assert (
        a[1] == "derived" and len(a[0]) == 16 and a[2]["seed"] == 1234 and a[2]["run_token"] == "t1"
    )
    # schedule, logging, --load: same run
    assert li.run_identity(_args(train_iters=99, log_interval=5, load="/x"), token="t1")[0] == a[0]
    for other in (
        li.run_identity(_args(seed=999), token="t1"),
        li.run_identity(_args(hidden_size=128), token="t1"),
        li.run_identity(_args(), token="t2"),
        li.run_identity(_args(), token=None),
    ):
        assert other[0] != a[0]
    explicit = li.run_identity(_args(seed=999, local_tier_run_id="exp-7"), token="t2")
    assert explicit[:2] == ("exp-7", li.RUN_ID_FLAG)


def test_data_paths_are_resolved_and_weights_kept(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    s = li.run_settings(_args(data_path=["0.3", "a/corpus", "0.7", "b/corpus"]))
    assert s["data_path"] == [
        "0.3",
        os.path.realpath("a/corpus"),
        "0.7",
        os.path.realpath("b/corpus"),
    ]


def test_run_token_is_created_once_and_never_replaced(tmp_path):
    save = tmp_path / "ckpt"
    assert li.run_token(str(save), create=False) is None and not save.exists()
    tok = li.run_token(str(save), create=True)
    assert tok and len(tok) == 32
    assert li.run_token(str(save), create=True) == tok == li.run_token(str(save), create=False)
    assert json.loads((save / li.RUN_TOKEN_FILE).read_text())["run_token"] == tok
    assert sorted(os.listdir(save)) == [li.RUN_TOKEN_FILE]  # no temporary left
    assert li.run_token(None, create=True) is None


def _local_file(path, token, iteration):
    run_id, source, settings = li.run_identity(_args(), token=token)
    # stands in for a saved TensorAwareStateDict (tensors plus the identity record): a class the
    # restricted unpickler allows (a class of this module would be refused, as it should)
    shard = types.SimpleNamespace()
    shard.w = torch.ones(3)
    setattr(
        shard,
        li.IDENTITY_ATTR,
        li.make_identity(run_id, source, settings, li.topology(_args()), iteration, 0, "g", "h"),
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(shard, path)


@pytest.mark.parametrize("damage", ["", '{"run_tok', '{"run_token": ""}', "[1]"])
def test_an_unreadable_run_token_is_an_error_and_is_recovered_from_the_local_files(
    tmp_path, damage
):
    """Never a new identity: a truncated or damaged token file raises RunTokenError naming it;
    the token comes back from the identity record of the newest local file."""
    save, local = tmp_path / "ckpt", tmp_path / "local"
    tok = li.run_token(str(save), create=True)
    (save / li.RUN_TOKEN_FILE).write_text(damage)
    for create in (False, True):
        with pytest.raises(li.RunTokenError, match=li.RUN_TOKEN_FILE + " is unreadable"):
            li.run_token(str(save), create=create)
    assert (save / li.RUN_TOKEN_FILE).read_text() == damage  # never replaced by a new token
    assert li.recover_run_token(str(local)) == (None, None)
    _local_file(local / "0" / "iter_0000008_0_local.pt", "older", 8)
    _local_file(local / "0" / "iter_0000012_0_local.pt", tok, 12)
    (local / "0" / "iter_0000016_0_local.dirty.pt").write_bytes(b"partial")
    token, source = li.recover_run_token(str(local))
    assert token == tok and source.endswith("iter_0000012_0_local.pt")
    li.repair_run_token(str(save), token, source)
    assert li.run_token(str(save), create=False) == tok
    assert sorted(os.listdir(save)) == [li.RUN_TOKEN_FILE]


def test_identity_problems_name_what_differs():
    topo = li.topology(_args())
    run_id, source, settings = li.run_identity(_args(), token="t")
    rec = li.make_identity(run_id, source, settings, topo, 12, 1, "gen", "node-a")
    assert li.identity_problems(rec, run_id, settings, topo, 12, 1) == []
    other_id, _, other_settings = li.run_identity(_args(seed=999), token="t")
    (p,) = li.identity_problems(rec, other_id, other_settings, topo, 12, 1)
    assert "written by another run" in p and "seed 1234 (checkpoint) vs 999 (this run)" in p
    tp2 = li.topology(_args(tensor_model_parallel_size=2, data_parallel_size=1))
    (p,) = li.identity_problems(rec, run_id, settings, tp2, 12, 1)
    assert p == (
        "written under another topology: data_parallel_size 2 (checkpoint) vs 1 (this run), "
        "tensor_model_parallel_size 1 (checkpoint) vs 2 (this run)"
    )
    (p,) = li.identity_problems(rec, run_id, settings, topo, 14, 0)
    assert "holds rank 1's shard of iteration 12, its name says rank 0, iteration 14" in p
    (p,) = li.identity_problems(None, run_id, settings, topo, 12, 1)
    assert "without a run identity" in p


def test_read_header_gives_the_records_without_tensor_data(tmp_path):
    # stands in for a TensorAwareStateDict (tensors plus record attributes): an allowed class
    h = types.SimpleNamespace()
    h.tensors = [torch.arange(1000, dtype=torch.float32), torch.ones(3, dtype=torch.bfloat16)]
    setattr(h, li.IDENTITY_ATTR, {"format": li.IDENTITY_FORMAT, "version": 1, "iteration": 3})
    path = tmp_path / "iter_0000003_0_local.pt"
    torch.save(h, path)
    got = li.read_header(path)
    assert getattr(got, li.IDENTITY_ATTR)["iteration"] == 3
    assert got.tensors == [None, None]
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)
    with pytest.raises(Exception):  # noqa: B017 (zipfile, pickle or OS error by cut point)
        li.read_header(path)


def test_get_identity_rejects_unknown_records():
    h = types.SimpleNamespace()
    setattr(h, li.IDENTITY_ATTR, {"format": "something else"})
    with pytest.raises(ValueError, match="unknown identity record"):
        li.get_identity(h)
    setattr(h, li.IDENTITY_ATTR, {"format": li.IDENTITY_FORMAT, "version": 99})
    with pytest.raises(ValueError, match="version 99"):
        li.get_identity(h)


def test_parse_local_name():
    assert li.parse_local_name("iter_0000012_3_local.pt") == (12, 3, False)
    assert li.parse_local_name("iter_0000012_3_local.dirty.pt") == (12, 3, True)
    assert li.parse_local_name("iter_0000012_3_local.pt.tmp") is None
    assert li.parse_local_name("LOCAL_TIER_BAD.json") is None
