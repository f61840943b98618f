"""No process outlives its rank (megatron.training_ext.lifetime): a "rank" process starts a helper
(forked, as NVRx's writers and async callers are; or a fresh interpreter, as spawned workers
are), the rank is killed with SIGKILL, and the helper is gone within a second. The guard: without
the hook the helper lives on under init. Through the entrypoint (a crashed ``--async-save``
rank): test_async_save_helpers_die_with_their_rank in tests/functional_tests/test_resume.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.helpers.dist import process_alive

REPO = Path(__file__).resolve().parents[3]

RANK = textwrap.dedent(
    """
    import os, subprocess, sys, time
    from megatron.training_ext import lifetime
    if {hook}:
        lifetime.helpers_die_with_this_process()
    if "{how}" == "fork":
        pid = os.fork()
        if pid == 0:
            time.sleep(120)
            os._exit(0)
    else:
        pid = subprocess.Popen([sys.executable, "-c",
            "import time; from megatron.training_ext import lifetime; "
            "lifetime.die_with_parent(); print('ready', flush=True); time.sleep(120)"],
            stdout=subprocess.PIPE, text=True).pid
    print(pid, flush=True)
    time.sleep(120)
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG)")
@pytest.mark.parametrize(
    "how, hook",
    [("fork", True), ("fork", False), ("spawn", True)],  # (fork, False): the guard
)
def test_helper_dies_with_its_killed_rank(how, hook):
    rank = subprocess.Popen(
        [sys.executable, "-c", RANK.format(hook=hook, how=how)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    helper = int(rank.stdout.readline())
    time.sleep(0.5 if how == "fork" else 1.5)  # the spawned helper imports, then asks
    assert process_alive(helper)
    os.kill(rank.pid, signal.SIGKILL)
    rank.wait()
    deadline = time.monotonic() + 3
    while process_alive(helper) and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        assert process_alive(helper) is (not hook)  # guard: without the hook it outlives the rank
    finally:
        if process_alive(helper):
            os.kill(helper, signal.SIGKILL)
