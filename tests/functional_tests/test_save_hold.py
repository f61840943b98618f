"""One job per --save through two real torchrun launches (the launcher is part of the subject: the
job identity comes from its rendezvous): while job A trains, job B with the same --save refuses
on every rank naming A, and A's checkpoints are untouched; once A is killed (SIGKILL, as a node
failure or scancel does), the next start takes A's hold over with one line and resumes A's
checkpoint. Unit tests of the rules: tests/unit_tests/training_ext/test_save_hold.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time

import pytest

from megatron.training_ext import save_hold
from tests.helpers.launch import (
    count_real_launch,
    kill_tagged,
    launch_env,
    pretrain_command,
    run_pretrain,
    wait_until,
)

pytestmark = pytest.mark.slow


def test_second_job_on_one_save_is_refused_and_a_killed_holder_is_taken_over(tmp_path):
    ckpt = tmp_path / "ckpt"
    flags = [
        *("--ckpt-format", "torch_dist", "--save", str(ckpt), "--load", str(ckpt)),
        *("--train-iters", "100000"),  # one schedule for all three: A trains until killed
    ]
    a_dir = tmp_path / "a"
    a_dir.mkdir()
    cmd = pretrain_command([*flags, "--save-interval", "5"], log=a_dir / "losses.jsonl")
    count_real_launch(cmd)
    tag = f"save-hold-{os.getpid()}-{time.time_ns()}"
    with open(a_dir / "out.txt", "w") as out:
        a = subprocess.Popen(
            cmd,
            cwd=a_dir,
            env=launch_env(tag=tag),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_until(lambda: (ckpt / "iter_0000005" / "integrity.json").exists(), 240, "A's save")
        held = json.loads((ckpt / save_hold.HOLD_NAME).read_text())
        assert held["host"] == socket.gethostname() and held["pid"] != os.getpid()
        before = sorted(p.name for p in ckpt.iterdir())
        b = run_pretrain(
            tmp_path / "b", *flags, "--save-interval", "5", check=False, launcher="torchrun"
        )
        assert b.returncode != 0 and b.losses == {}
        line = (
            f"pretrain_gpt.py: --save {ckpt} is held by another job (host {socket.gethostname()}, "
            f"pid {held['pid']}, since "
        )
        assert b.output.count(line) == 2, b.output[-3000:]  # every rank of B
        assert "building GPT model" not in b.output
        assert a.poll() is None  # A trains on
        assert set(before) <= {p.name for p in ckpt.iterdir()}
    finally:
        kill_tagged(tag)  # the whole job (agent and ranks), as scancel or a node loss does
        a.wait()
    wait_until(lambda: not os.path.exists(f"/proc/{held['pid']}"), 30, "A's rank 0 to go")
    newest = max(int(p.name[5:]) for p in ckpt.glob("iter_*") if (p / "integrity.json").exists())
    c = run_pretrain(
        tmp_path / "c",
        *flags,
        "--save-interval",
        "1000",
        "--exit-interval",
        str(newest + 2),
    )
    assert (
        f"[save-hold] --save {ckpt}: took over the hold of host {socket.gethostname()}, pid "
        f"{held['pid']}, since "
    ) in c.output
    assert f"(its process {held['pid']} on this host is gone)" in c.output
    assert sorted(c.losses) == [newest + 1, newest + 2]
    assert not (ckpt / save_hold.HOLD_NAME).exists()  # released at exit
