"""tools/plot_losses.py: launches and resumes read from a loss log and a TensorBoard directory,
the iterations each resume lost, the figure written, bad input named."""

import json

import pytest

from tools import plot_losses as pl


def _log(path, launches, ids=True):
    with open(path, "w") as f:
        for n, its in enumerate(launches):
            for it in its:
                v = 5.0 - 0.01 * it
                rec = {"iteration": it, "skipped": 0, "lm loss": v.hex()}
                if ids:
                    rec["launch"] = f"17000000{n}-{100 + n}"
                f.write(json.dumps(rec) + "\n")


def test_loss_log_launches_resumes_and_lost_iterations(tmp_path, capsys):
    log = tmp_path / "losses.jsonl"
    # launch 1 reached 12; launch 2 resumed from the local checkpoint 12 (0 lost) and reached 17;
    # launch 3 resumed from persistent 10 (7 lost).
    _log(log, [range(1, 13), range(13, 18), range(11, 21)])
    launches = pl.read_loss_log(str(log))
    assert [(x.iterations[0], x.iterations[-1]) for x in launches] == [(1, 12), (13, 17), (11, 20)]
    assert launches[0].values[0] == 5.0 - 0.01  # float.hex read back exactly
    assert [(r.resumed_from, r.reached, r.lost) for r in pl.resumes(launches)] == [
        (12, 12, 0),
        (10, 17, 7),
    ]
    out = tmp_path / "f.svg"
    assert pl.main([str(log), "--label", "quick start", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "quick start: 3 launch(es), iterations 1-20" in printed
    assert "resumed at 12 after 12 (0 iterations lost)" in printed
    assert "resumed at 10 after 17 (7 iterations lost)" in printed
    svg = out.read_text()
    assert svg.startswith("<?xml") and "7 iterations lost" in svg and "resumed at 12" in svg
    png = tmp_path / "f.png"
    assert pl.main([str(log), "-o", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_log_without_launch_ids_splits_where_the_iteration_does_not_increase(tmp_path):
    log = tmp_path / "old.jsonl"
    _log(log, [range(1, 13), range(11, 15)], ids=False)
    launches = pl.read_loss_log(str(log))
    assert [(x.iterations[0], x.iterations[-1]) for x in launches] == [(1, 12), (11, 14)]
    assert [r.lost for r in pl.resumes(launches)] == [2]


def test_tensorboard_directory_one_launch_per_event_file(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    for its in (range(1, 11), range(9, 16)):  # the second launch resumed from 8: 2 lost
        w = SummaryWriter(str(tmp_path / "tb"))
        for it in its:
            w.add_scalar("lm loss", 4.0 - 0.1 * it, it)
        w.close()
    launches = pl.read_run(str(tmp_path / "tb"))
    assert [(x.iterations[0], x.iterations[-1]) for x in launches] == [(1, 10), (9, 15)]
    assert [r.lost for r in pl.resumes(launches)] == [2]


def test_bad_input_is_named_exit_2(tmp_path, capsys):
    assert pl.main([str(tmp_path / "nope.jsonl")]) == 2
    assert "nope.jsonl: no such file or directory" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"iteration": 1, "lm loss": 1.0}\nnot json\n')
    assert pl.main([str(bad)]) == 2
    assert "bad.jsonl:2: not a loss-log line" in capsys.readouterr().err
    _log(bad, [range(1, 3)])
    assert pl.main([str(bad), "--key", "mtp loss"]) == 2
    assert "no iteration logs 'mtp loss'" in capsys.readouterr().err
    with pytest.raises(pl.InputError, match="no TensorBoard event file"):
        pl.read_run(str(tmp_path))
