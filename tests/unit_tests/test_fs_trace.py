"""``MEGATRON_TEST_FS_TRACE`` (:mod:`tests.helpers.fs_trace`, the crash-point harness's hook): the
operations it records (keys, filtering by root, a ``uuid4`` part normalised), and that a point
kills the process and its helpers (its session) right before (``kill``) or right after
(``kill-after``) its operation. Each
case runs in a process of its own (the hook replaces ``builtins.open``, ``os.*``, ``torch.save``),
which leads its own session, so the kill reaches nothing else."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from tests.helpers import fs_trace
from tests.helpers.dist import process_alive, run_python

#: File operations of a save in miniature, inside the root ``ck`` and outside it.
SCRIPT = r"""
import os, shutil
from pathlib import Path
import torch
os.setsid()
import subprocess
helper = subprocess.Popen(["sleep", "120"])  # a helper of the "rank": same session
Path("helper.pid").write_text(str(helper.pid))
from tests.helpers import fs_trace
fs_trace.install(main=True)
os.makedirs("ck/iter_1", exist_ok=True)
with open("ck/iter_1/a.bin", "wb") as f:
    f.write(b"x")
    f.write(b"y")
    f.flush()
    os.fsync(f.fileno())
with open("outside.txt", "w") as f:
    f.write("not under a root")
torch.save({"a": 1}, "ck/iter_1/b.pt")
os.replace("ck/iter_1/a.bin", "ck/iter_1/c.bin")
Path("ck/iter_1/d.json.0123456789abcdef0123456789abcdef.tmp").write_text("z")
os.unlink("ck/iter_1/b.pt")
shutil.rmtree("ck/iter_1")
print("done")
"""

EXPECTED = [
    "0/main/mkdir/ck/iter_1#1",
    "0/main/open/ck/iter_1/a.bin#1",
    "0/main/write/ck/iter_1/a.bin#1",
    "0/main/fsync/ck/iter_1/a.bin#1",
    "0/main/torch.save/ck/iter_1/b.pt#1",
    "0/main/rename/ck/iter_1/a.bin->ck/iter_1/c.bin#1",
    "0/main/open/ck/iter_1/d.json.<uuid>.tmp#1",
    "0/main/write/ck/iter_1/d.json.<uuid>.tmp#1",
    "0/main/unlink/ck/iter_1/b.pt#1",
    "0/main/rmtree/ck/iter_1#1",
]


def _run(tmp_path, monkeypatch, points=None):
    trace = tmp_path / "trace"
    cfg = {"dir": str(trace), "roots": ["ck"], "window": "load"}
    if points:
        cfg["points"] = points
    monkeypatch.setenv(fs_trace.ENV, json.dumps(cfg))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("MEGATRON_TEST_LAUNCH_TAG", raising=False)
    work = tmp_path / "work"
    work.mkdir()
    return run_python(SCRIPT, cwd=work, timeout=120), trace, work


def test_records_each_operation_under_a_root_once(tmp_path, monkeypatch):
    proc, trace, work = _run(tmp_path, monkeypatch)
    assert proc.returncode == 0 and "done" in proc.stdout, proc.stderr[-3000:]
    os.kill(int((work / "helper.pid").read_text()), signal.SIGKILL)
    ops = [json.loads(ln) for f in trace.glob("ops.*.jsonl") for ln in f.open()]
    assert [o["key"] for o in sorted(ops, key=lambda o: o["seq"])] == EXPECTED
    assert (work / "outside.txt").exists() and not (work / "ck" / "iter_1").exists()


@pytest.mark.parametrize(
    "action, present, absent",
    [
        ("kill", ["a.bin", "b.pt"], ["c.bin"]),
        ("kill-after", ["c.bin", "b.pt"], ["a.bin"]),
    ],
)
def test_a_point_kills_right_before_or_after_its_operation(
    tmp_path, monkeypatch, action, present, absent
):
    proc, trace, work = _run(tmp_path, monkeypatch, [[EXPECTED[5], action]])
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stderr[-3000:])
    assert f"SIGKILL to the launch ({action.replace('kill-', '').replace('kill', 'before')}" in (
        proc.stderr
    )
    helper = int((work / "helper.pid").read_text())
    deadline = time.monotonic() + 10
    while process_alive(helper) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not process_alive(helper), "the kill did not reach the process's helper (its session)"
    d = work / "ck" / "iter_1"
    assert [n for n in present if not (d / n).exists()] == []
    assert [n for n in absent if (d / n).exists()] == []
    assert not list(trace.glob("ops.*.jsonl"))  # a crash launch records nothing
