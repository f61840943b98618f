"""Which iteration directories count as a finished save, per checkpoint format."""

from megatron.integrity.persistent_dirs import (
    complete_iterations,
    interrupted_torch_dist,
    is_complete,
)


def _touch(p):
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(b"x")


def test_each_format_finished_save_is_complete_and_partial_ones_are_not(tmp_path):
    torch_dist = tmp_path / "iter_0000002"  # .metadata and metadata.json
    _touch(torch_dist / ".metadata")
    _touch(torch_dist / "metadata.json")
    fsdp_dtensor = tmp_path / "iter_0000004"  # DCP's .metadata only
    _touch(fsdp_dtensor / ".metadata")
    torch_fmt = tmp_path / "iter_0000006"  # legacy torch format
    _touch(torch_fmt / "mp_rank_00" / "model_optim_rng.pt")
    partial = tmp_path / "iter_0000008"  # rank files, no coordinator metadata
    _touch(partial / "__0_0.distcp")
    _touch(partial / "metadata.json")
    empty_rank_dir = tmp_path / "iter_0000010"
    (empty_rank_dir / "mp_rank_00").mkdir(parents=True)

    assert [is_complete(d) for d in (torch_dist, fsdp_dtensor, torch_fmt)] == [True] * 3
    assert not is_complete(partial)
    assert not is_complete(empty_rank_dir)
    assert not is_complete(tmp_path / "iter_0000099")  # absent
    assert complete_iterations(tmp_path) == [2, 4, 6]


def test_a_torch_dist_save_stopped_before_metadata_json_is_not_complete(tmp_path):
    """megatron-core writes DCP's ``.metadata`` (holding its ``common_state`` object), then
    ``metadata.json``: killed in between, upstream's load reads the directory as ``torch_dcp`` and
    fails (``Missing key in checkpoint state_dict: args``), so it is not a finished save; an
    ``fsdp_dtensor`` / ``torch_dcp`` save (``.metadata`` without megatron's common state) is."""
    common = b"\x80\x04...common_state/shard_0_1...embedding.word_embeddings.weight..."
    stopped = tmp_path / "iter_0000004"
    (stopped / ".metadata").parent.mkdir(parents=True)
    (stopped / ".metadata").write_bytes(common)
    _touch(stopped / "__0_0.distcp")
    finished = tmp_path / "iter_0000002"
    finished.mkdir()
    (finished / ".metadata").write_bytes(common)
    (finished / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    dcp_only = tmp_path / "iter_0000006"
    dcp_only.mkdir()
    (dcp_only / ".metadata").write_bytes(b"\x80\x04...model.decoder.layers.0.weight...")
    empty = tmp_path / "iter_0000008"
    (empty / "metadata.json").parent.mkdir()
    (empty / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    (empty / ".metadata").write_bytes(b"")
    torn = tmp_path / "iter_0000010"  # killed between metadata.json's open and its write
    torn.mkdir()
    (torn / ".metadata").write_bytes(common)
    (torn / "metadata.json").write_bytes(b"")

    assert [interrupted_torch_dist(d) for d in (stopped, finished, dcp_only, torn)] == [
        True,
        False,
        False,
        True,
    ]
    assert [is_complete(d) for d in (stopped, finished, dcp_only)] == [False, True, True]
    assert complete_iterations(tmp_path) == [2, 6, 8]
