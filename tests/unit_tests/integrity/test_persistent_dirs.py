"""Which iteration directories count as a finished save, per checkpoint format."""

from megatron.integrity.persistent_dirs import complete_iterations, is_complete


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
