"""``save_archive``: a ``torch.save`` archive without CRC-32 of its tensor records (which
``torch.load`` never checks) whose pickle keeps its CRC-32, switched per thread."""

from __future__ import annotations

import threading
import zipfile

import pytest
import torch
import torch.serialization as ser

from megatron.integrity import torch_save
from megatron.integrity.unpickle import load_without_tensors


@pytest.fixture
def per_thread_crc(monkeypatch):
    """The local tier's patch of ``torch.serialization.get_crc32_options``, for this test."""
    monkeypatch.setattr(
        ser, "get_crc32_options", torch_save.crc32_options_per_thread(ser.get_crc32_options)
    )


def _crcs(path) -> dict:
    with zipfile.ZipFile(path) as z:
        return {i.filename.split("/", 1)[1]: i.CRC for i in z.infolist()}


def _obj():
    torch.manual_seed(0)
    return {"w": torch.randn(300, 7), "b": torch.arange(5), "meta": {"iteration": 12}}


def test_the_archive_loads_bitwise_and_its_pickle_keeps_its_crc(per_thread_crc, tmp_path):
    obj = _obj()
    path = tmp_path / "a.pt"
    with open(path, "bx+") as f:
        torch_save.save_archive(obj, f)
    crcs = _crcs(path)
    assert crcs["data/0"] == 0 and crcs["data/1"] == 0  # tensor records: no CRC-32
    with zipfile.ZipFile(path) as z:  # zipfile checks the pickle's CRC-32 on read
        assert z.testzip() is not None  # ... and would flag the tensor records
        name = next(n for n in z.namelist() if n.endswith("/data.pkl"))
        assert crcs["data.pkl"] == zipfile.crc32(z.read(name)) != 0
    back = torch.load(path, weights_only=True)
    assert torch.equal(back["w"], obj["w"]) and torch.equal(back["b"], obj["b"])
    assert back["meta"] == {"iteration": 12}
    assert load_without_tensors(path)["meta"] == {"iteration": 12}


def test_a_flipped_pickle_byte_is_still_detected(per_thread_crc, tmp_path):
    path = tmp_path / "a.pt"
    with open(path, "bx+") as f:
        torch_save.save_archive({"meta": {"name": "hello"}, "w": torch.ones(3)}, f)
    raw = bytearray(path.read_bytes())
    at = raw.index(b"hello")
    raw[at] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(zipfile.BadZipFile, match="CRC"):
        load_without_tensors(path)


def test_the_switch_is_per_thread(per_thread_crc, tmp_path):
    """A save in another thread while one thread is inside ``storage_crc_off`` keeps CRC-32 (the
    persistent tier's ``common.pt``, a DCP byte item read by ``zipfile``)."""
    inside, other_done = threading.Event(), threading.Event()

    def other():
        inside.wait(10)
        torch.save(_obj(), tmp_path / "other.pt")
        other_done.set()

    t = threading.Thread(target=other)
    t.start()
    with torch_save.storage_crc_off():
        inside.set()
        assert other_done.wait(10)
        torch.save(_obj(), tmp_path / "mine.pt")
    t.join()
    assert _crcs(tmp_path / "mine.pt")["data/0"] == 0
    assert all(c != 0 for c in _crcs(tmp_path / "other.pt").values())
    assert zipfile.ZipFile(tmp_path / "other.pt").testzip() is None


def test_without_the_patch_torch_save_computes_crc_everywhere(tmp_path):
    """Guard: ``torch.save`` alone (upstream) computes CRC-32 of every record; the switch does
    nothing without the patch, so the archive is an ordinary one (slower, never wrong)."""
    with open(tmp_path / "a.pt", "bx+") as f:
        torch_save.save_archive(_obj(), f)
    assert all(c != 0 for c in _crcs(tmp_path / "a.pt").values())
    assert zipfile.ZipFile(tmp_path / "a.pt").testzip() is None
