"""One job per --save (megatron.training_ext.save_hold): a live holder on this host is refused at
once, a gone or silent one is taken over with one line, a holder on another host is alive while
its heartbeat moves, the followers of a launch wait for their leader, and the hold goes at exit.
The two-jobs scenario through torchrun is tests/functional_tests/test_save_hold.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from megatron.training_ext import save_hold as sh


@pytest.fixture(autouse=True)
def _launch_env(monkeypatch):
    for k, v in dict(
        RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29555"
    ).items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    yield
    sh.release_all()


def _args(save, **kw):
    return SimpleNamespace(save=str(save), non_persistent_ckpt_type=None, **kw)


def _holder(path, **over):
    rec = {
        "key": "another-job",
        "host": socket.gethostname(),
        "pid": os.getppid(),  # alive: pytest's parent
        "proc_start": sh._proc_start(os.getppid()),
        "pid_namespace": sh._pid_namespace(),
        "slurm_job_id": "4242",
        "started": time.time() - 60,
        "heartbeat": time.time(),
    }
    rec.update(over)
    (path / sh.HOLD_NAME).write_text(json.dumps(rec))
    return rec


def _held(path):
    return json.loads((path / sh.HOLD_NAME).read_text())


def test_first_start_holds_save_and_releases_it_at_exit(tmp_path):
    save = tmp_path / "ck"
    (hold,) = sh.acquire(_args(save))
    rec = _held(save)
    assert rec["key"] == sh.job_key() and rec["pid"] == os.getpid()
    assert rec["host"] == socket.gethostname() and hold.flag == "--save"
    sh.release_all()
    assert not (save / sh.HOLD_NAME).exists() and sorted(os.listdir(save)) == []


def test_live_holder_on_this_host_is_refused_with_who_holds_it(tmp_path):
    _holder(tmp_path)
    before = (tmp_path / sh.HOLD_NAME).read_bytes()
    with pytest.raises(SystemExit) as e:
        sh.acquire(_args(tmp_path))
    msg = str(e.value)
    assert f"--save {tmp_path} is held by another job (host {socket.gethostname()}, " in msg
    assert f"pid {os.getppid()}, SLURM job 4242, since " in msg and "--take-save-hold" in msg
    assert (tmp_path / sh.HOLD_NAME).read_bytes() == before  # untouched


def test_gone_holder_on_this_host_is_taken_over_at_once(tmp_path, capsys):
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], text=True, capture_output=True
    ).stdout.strip()
    _holder(tmp_path, pid=int(dead), proc_start="1")
    t0 = time.monotonic()
    sh.acquire(_args(tmp_path))
    assert time.monotonic() - t0 < 1.0
    assert _held(tmp_path)["pid"] == os.getpid()
    out = capsys.readouterr()
    line = out.out + out.err
    assert f"[save-hold] --save {tmp_path}: took over the hold of host " in line
    assert f"(its process {dead} on this host is gone)" in line


def test_pid_reused_by_another_process_is_gone(tmp_path):
    _holder(tmp_path, proc_start="0")  # pytest's parent is alive, but started at another time
    sh.acquire(_args(tmp_path))
    assert _held(tmp_path)["pid"] == os.getpid()


def test_other_host_with_stale_heartbeat_is_taken_over(tmp_path, capsys):
    _holder(tmp_path, host="node-b", heartbeat=time.time() - 100)
    sh.acquire(_args(tmp_path, save_hold_timeout=30.0))
    assert _held(tmp_path)["pid"] == os.getpid()
    assert "(no heartbeat for 100 s)" in capsys.readouterr().out


def test_other_host_silent_for_the_timeout_is_taken_over(tmp_path):
    _holder(tmp_path, host="node-b")
    t0 = time.monotonic()
    sh.acquire(_args(tmp_path, save_hold_timeout=0.6))
    assert 0.6 <= time.monotonic() - t0 < 3.0
    assert _held(tmp_path)["pid"] == os.getpid()


def test_other_host_whose_heartbeat_moves_is_refused(tmp_path):
    rec = _holder(tmp_path, host="node-b")
    stop = threading.Event()

    def beat():
        while not stop.wait(0.1):
            rec["heartbeat"] = time.time()
            (tmp_path / sh.HOLD_NAME).write_text(json.dumps(rec))

    t = threading.Thread(target=beat)
    t.start()
    try:
        with pytest.raises(SystemExit, match="held by another job \\(host node-b, "):
            sh.acquire(_args(tmp_path, save_hold_timeout=2.0))
    finally:
        stop.set()
        t.join()


def test_take_save_hold_overrides_a_live_holder(tmp_path):
    _holder(tmp_path)
    sh.acquire(_args(tmp_path, take_save_hold=True))
    assert _held(tmp_path)["pid"] == os.getpid()


def test_follower_waits_for_its_leader_and_refuses_a_live_stranger(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    got = []

    def leader_later():
        time.sleep(0.3)
        _holder(tmp_path, key=sh.job_key(), pid=os.getpid(), proc_start=sh._proc_start(os.getpid()))

    t = threading.Thread(target=leader_later)
    t.start()
    got = sh.acquire(_args(tmp_path))
    t.join()
    assert got == []  # a follower leads nothing
    _holder(tmp_path)  # now a live stranger
    with pytest.raises(SystemExit, match="is held by another job"):
        sh.acquire(_args(tmp_path))


def test_local_directory_is_held_by_local_rank_0(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "2")  # local rank 0 of the second node
    args = SimpleNamespace(
        save=None, non_persistent_ckpt_type="local", non_persistent_local_ckpt_dir=str(tmp_path)
    )
    (hold,) = sh.acquire(args)
    assert hold.flag == "--non-persistent-local-ckpt-dir" and _held(tmp_path)["pid"] == os.getpid()


def test_job_key_separates_launches_and_joins_ranks():
    env = dict(MASTER_ADDR="a", MASTER_PORT="1", TORCHELASTIC_RUN_ID="none")
    assert sh.job_key(env) == sh.job_key(dict(env))
    assert sh.job_key(env) != sh.job_key({**env, "MASTER_PORT": "2"})
    assert sh.job_key(env) != sh.job_key({**env, "TORCHELASTIC_RESTART_COUNT": "1"})


def test_no_save_hold_writes_nothing(tmp_path):
    assert sh.acquire(_args(tmp_path, save_hold=False)) == []
    assert list(tmp_path.iterdir()) == []
