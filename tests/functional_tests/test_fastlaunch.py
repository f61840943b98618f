"""The test-only fast launcher (:mod:`tests.helpers.fastlaunch`) against real ``torchrun``: the
same rank environment, exit codes and failure page, fork safety, and bitwise the same losses for
the same ``pretrain_gpt.py`` command (this file's torchrun launches are the control)."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.functional_tests.conftest import SCHEDULE_16_EXIT_14
from tests.helpers import fastlaunch
from tests.helpers.dist import free_port
from tests.helpers.launch import (
    assert_bitwise_equal,
    launch_env,
    run_captured,
    run_pretrain,
)

pytestmark = pytest.mark.slow

#: Prints its rank's launcher variables as one JSON line; ``exit=R:C`` makes rank R exit with C,
#: ``sleep=S`` sleeps S seconds first.
PROBE = """
import json, os, sys, time
keys = sorted(k for k in os.environ if k.startswith(("TORCHELASTIC_", "ROLE_", "GROUP_", "LOCAL_"))
              or k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS",
                       "TORCH_NCCL_ASYNC_ERROR_HANDLING"))
opts = dict(a.split("=", 1) for a in sys.argv[1:])
time.sleep(float(opts.get("sleep", 0)))
# one write per line (print writes the text and the newline separately: ranks sharing a pipe
# interleave them under load, "ENV {...}ENV {...}")
env = {k: os.environ[k] for k in keys} | {"cwd": os.getcwd()}
sys.stdout.write("ENV " + json.dumps(env) + "\\n")
sys.stdout.flush()
rank, _, code = opts.get("exit", "-1:0").partition(":")
sys.exit(int(code) if int(rank) == int(os.environ["RANK"]) else 0)
"""

#: Values that differ between any two launches (ports, temporary files) or by design (no agent).
PER_LAUNCH = {"MASTER_PORT", "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_USE_AGENT_STORE"}


def _probe(tmp_path: Path) -> Path:
    path = tmp_path / "probe.py"
    path.write_text(PROBE)
    return path


def _envs(output: str) -> dict[int, dict]:
    envs = [json.loads(ln[4:]) for ln in output.splitlines() if ln.startswith("ENV ")]
    return {int(e["RANK"]): e for e in envs}


def _torchrun(tmp_path: Path, script: Path, *args: str):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        f"--master-port={free_port()}",
        str(script),
        *args,
    ]
    return run_captured(cmd, tmp_path, launch_env(), 300)


def test_rank_environment_is_torchruns(tmp_path):
    script = _probe(tmp_path)
    real = _envs(_torchrun(tmp_path, script).stdout)
    code = fastlaunch.run(script, [], 2, tmp_path, launch_env(), tmp_path / "fast.out", 300)
    fast = _envs((tmp_path / "fast.out").read_text())
    assert code == 0 and sorted(real) == sorted(fast) == [0, 1]
    for rank in (0, 1):
        assert set(real[rank]) == set(fast[rank]), (real[rank], fast[rank])
        differ = {k for k in real[rank] if real[rank][k] != fast[rank][k]}
        assert differ <= PER_LAUNCH, {k: (real[rank][k], fast[rank][k]) for k in differ}
    assert real[0]["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    assert fast[0]["TORCHELASTIC_USE_AGENT_STORE"] == "False"  # rank 0 hosts the store
    assert fast[0]["cwd"] == str(tmp_path) and fast[0]["OMP_NUM_THREADS"] == "1"


def test_exit_code_and_failure_page_are_torchruns(tmp_path):
    script = _probe(tmp_path)
    real = _torchrun(tmp_path, script, "exit=1:3")
    out = tmp_path / "fast.out"
    started = fastlaunch.launch(script, ["exit=1:3"], 2, tmp_path, launch_env(), out)
    codes = started.wait(300)
    page = out.read_text()
    assert real.returncode == 1 and codes == [0, 3]
    assert fastlaunch.run(script, ["exit=1:3"], 2, tmp_path, launch_env(), out, 300) == 1
    for text in (real.stdout, page):
        assert "ChildFailedError" in text and "exitcode  : 3" in text, text[-3000:]
        assert "rank      : 1 (local_rank: 1)" in text, text[-3000:]


def test_sigkill_of_a_rank_stops_the_others_and_is_reported(tmp_path):
    script = _probe(tmp_path)
    out = tmp_path / "fast.out"
    srv = fastlaunch.server_for({})
    before = _forked_from(srv.sock)
    started = fastlaunch.launch(script, ["sleep=60"], 2, tmp_path, launch_env(), out)
    time.sleep(1.0)
    t0 = time.monotonic()
    started.kill(1)
    codes = started.wait(60)
    assert time.monotonic() - t0 < 10, "the surviving rank was not stopped"
    assert codes == [-signal.SIGTERM, -signal.SIGKILL], codes  # torchrun: SIGTERM to the rest
    page = out.read_text()
    assert "exitcode  : -9" in page and "Signal 9 (SIGKILL) received by PID" in page, page
    # no process outlives its rank: the ranks' checkpoint write-results helpers die with them
    deadline = time.monotonic() + 10
    while (left := _forked_from(srv.sock) - before) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"processes left behind by the killed launch: {sorted(left)}"


def _forked_from(sock: str) -> set[int]:
    """Pids of the processes forked from the server listening on ``sock`` (its command line),
    the server itself included."""
    out = set()
    for entry in os.listdir("/proc"):
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if entry.isdigit() and sock.encode() in cmd:
            out.add(int(entry))
    return out


def test_server_and_agent_fork_with_one_thread_and_no_process_group(tmp_path):
    srv = fastlaunch.server_for({})
    assert srv.state() == {"os_threads": 1, "python_threads": 1, "process_group": False}
    started = fastlaunch.launch(_probe(tmp_path), [], 2, tmp_path, launch_env(), tmp_path / "o")
    assert started.fork_state == {"os_threads": 1, "python_threads": 1, "process_group": False}
    assert started.wait(300) == [0, 0]


def test_check_fork_safe_refuses_while_a_thread_runs():
    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    try:
        with pytest.raises(fastlaunch.ForkSafetyError, match="refusing to fork"):
            fastlaunch.check_fork_safe()
    finally:
        stop.set()
        t.join()


def test_forked_launch_is_bitwise_a_torchrun_launch(tmp_path, straight_16_exit_14):
    """The shared reference run (forked) against the same command through torchrun."""
    real = run_pretrain(tmp_path, *SCHEDULE_16_EXIT_14, launcher="torchrun")
    assert sorted(real.losses) == list(range(1, 15))
    assert_bitwise_equal(real.losses, straight_16_exit_14, range(1, 15))
