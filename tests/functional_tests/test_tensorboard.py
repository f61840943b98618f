"""TensorBoard on the CPU path: ``--tensorboard-dir`` writes upstream's scalars (the setup installs
``tensorboard``, as NVIDIA's containers have it); the event file holds the run's ``lm loss`` series,
equal to the loss log's values (TensorBoard stores float32)."""

from __future__ import annotations

import struct

import pytest

from tests.helpers.launch import run_pretrain


@pytest.mark.slow
def test_tensorboard_dir_gets_the_lm_loss_series(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = run_pretrain(tmp_path, "--tensorboard-dir", str(tmp_path / "tb"))
    assert "TensorBoard is not available" not in run.output
    files = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert len(files) == 1, files  # one writer: upstream's last rank
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0}).Reload()
    assert "lm loss" in acc.Tags()["scalars"], acc.Tags()
    series = {e.step: e.value for e in acc.Scalars("lm loss")}
    assert sorted(series) == list(range(1, 21))

    def f32(x: float) -> float:
        return struct.unpack("f", struct.pack("f", x))[0]

    for it, rec in run.losses.items():
        assert series[it] == f32(float.fromhex(rec["lm loss"])), (it, series[it], rec)
