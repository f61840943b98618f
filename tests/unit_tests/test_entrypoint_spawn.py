"""A process that ``multiprocessing`` spawns from a training run re-runs the run's script as
``__mp_main__`` before it unpickles its task (megatron-core's ``torch_dist`` writer starts one per
rank at the first save, a ``Manager``). The entrypoints keep upstream's training modules out of
such processes: importing them there cost each rank seconds at its first save."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers.launch import ENTRY, FAULTS_ENTRY, REPO

#: Runs an entrypoint as ``run_name`` in a fresh interpreter (what multiprocessing's spawn does
#: with ``__mp_main__``) and prints which of the heavy modules it imported.
PROBE = """
import json, runpy, sys
sys.path.insert(0, {repo!r})
runpy.run_path({entry!r}, run_name={run_name!r})
print(json.dumps([m for m in ("torch", "megatron.core", "megatron.training") if m in sys.modules]))
"""


def _imported(entry, run_name: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(repo=str(REPO), entry=str(entry), run_name=run_name)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("entry", [ENTRY, FAULTS_ENTRY], ids=["pretrain_gpt", "faults_entry"])
def test_spawned_process_imports_no_training_modules(entry):
    assert _imported(entry, "__mp_main__") == []


def test_probe_sees_the_training_modules_of_an_ordinary_import():
    """The probe can fail: imported under another name (as ``tools/quantize.py`` imports
    ``pretrain_gpt``), the entrypoint imports torch and upstream's training modules."""
    assert _imported(ENTRY, "pretrain_gpt") == ["torch", "megatron.core", "megatron.training"]
