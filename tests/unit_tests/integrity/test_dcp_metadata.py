"""The one reader of DCP ``.metadata`` (megatron.integrity.dcp_metadata), its error class, the
package interface of megatron.integrity, and the split from megatron.verify (the training path
never imports the verifier)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import megatron.integrity as integrity
from megatron.integrity import manifest as mf
from megatron.integrity.dcp_metadata import DcpMetadataError, read_dcp_metadata
from megatron.integrity.persistent import CheckpointInputError, PersistentCheckpoint
from megatron.overlay.errors import OverlayError

REPO = Path(__file__).resolve().parents[3]


def _save(path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.arange(6.0).reshape(2, 3)}, checkpoint_id=str(path), no_dist=True)


def test_reads_what_dcp_wrote(tmp_path):
    _save(tmp_path)
    md = read_dcp_metadata(tmp_path)
    assert tuple(md.state_dict_metadata["w"].size) == (2, 3)
    assert PersistentCheckpoint(tmp_path).tensors.keys() == {"w"}


def test_missing_and_damaged_raise_one_class(tmp_path):
    with pytest.raises(DcpMetadataError, match="missing") as e:
        read_dcp_metadata(tmp_path)
    assert e.value.missing and e.value.path == tmp_path / ".metadata"
    (tmp_path / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(DcpMetadataError, match="cannot read") as e:
        read_dcp_metadata(tmp_path)
    assert not e.value.missing and e.value.__cause__ is not None
    # the old bases stay: the verifier's input error (a ValueError), under the overlay's root
    assert isinstance(e.value, CheckpointInputError)
    assert isinstance(e.value, ValueError) and isinstance(e.value, OverlayError)
    with pytest.raises(CheckpointInputError):
        PersistentCheckpoint(tmp_path)


def test_storage_range_check_names_metadata_problems(tmp_path):
    (p,) = mf.check_storage_ranges(tmp_path)
    assert p.file == ".metadata" and "missing" in str(p)
    (tmp_path / ".metadata").write_bytes(b"x")
    (p,) = mf.check_storage_ranges(tmp_path)
    assert p.file == ".metadata" and "unreadable (" in str(p)


def test_package_exports_are_lazy_and_complete():
    for name in integrity.__all__:
        assert getattr(integrity, name) is not None, name
    with pytest.raises(AttributeError):
        integrity.no_such_name  # noqa: B018
    assert integrity.read_dcp_metadata is read_dcp_metadata
    code = (
        "import sys, megatron.integrity;"
        " print(sorted(m for m in sys.modules if m.startswith('megatron.')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "['megatron.integrity']"


def test_training_path_never_imports_the_verifier():
    code = (
        "import sys; import megatron.training_ext.local_tier,"
        " megatron.training_ext.persistent_tier, megatron.training_ext.resume_proof;"
        " import megatron.integrity.tensor_ops;"
        " print([m for m in sys.modules if m.startswith('megatron.verify')])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    assert out.strip().splitlines()[-1] == "[]"
