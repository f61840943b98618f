"""``megatron.fixes.apply()`` leaves no process-group state behind.

The ModelOpt capability probe needs ``torch.distributed`` and starts a private 1-rank gloo group
when there is none. If that group (or the ``[rank0]:`` traceback prefix its ``init_process_group``
installs as ``sys.excepthook``) outlived ``apply()``, every later traceback of the job would read
``[rank1]: [rank0]: ...``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.helpers.dist import free_port
from tests.helpers.launch import REPO

pytestmark = pytest.mark.slow  # torchrun with 2 ranks: not in the quick lane

_SCRIPT = textwrap.dedent("""
    import os, sys
    import torch.distributed as dist
    import megatron.fixes

    before, hook = dist.is_initialized(), sys.excepthook
    statuses = megatron.fixes.apply()
    assert statuses["modelopt_moe"].value == "active", statuses  # its probe ran
    print(f"check: not initialised: before={before} after={dist.is_initialized()} "
          f"hook kept={sys.excepthook is hook}", flush=True)
    dist.init_process_group("gloo")
    rank_hook = sys.excepthook
    megatron.fixes.reset()
    megatron.fixes.apply()  # with the job's group up: the probe uses it and leaves it up
    print(f"check: initialised: rank={dist.get_rank()} after={dist.is_initialized()} "
          f"hook kept={sys.excepthook is rank_hook}", flush=True)
    dist.barrier()
    if dist.get_rank() == 1:
        raise RuntimeError("boom on rank 1")
    dist.destroy_process_group()
""")


def test_apply_leaves_no_group_and_no_rank_prefix(tmp_path):
    script = tmp_path / "apply_then_fail.py"
    script.write_text(_SCRIPT)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node=2",
            f"--master-port={free_port()}",
            str(script),
        ],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )
    out = proc.stdout
    assert proc.returncode != 0, out  # rank 1 raised
    lines = out.splitlines()
    assert (
        sum(
            "check: not initialised: before=False after=False hook kept=True" in line
            for line in lines
        )
        == 2
    ), out
    assert (
        sum("check: initialised:" in line and "after=True hook kept=True" in line for line in lines)
        == 2
    ), out
    errors = [line for line in lines if "RuntimeError: boom on rank 1" in line]
    assert errors, out
    assert all(line.startswith("[rank1]: RuntimeError") for line in errors), errors
    assert not [line for line in lines if "[rank0]" in line and "[rank1]" in line], out
