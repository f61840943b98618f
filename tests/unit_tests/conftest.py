"""Fixtures shared by several unit-test files."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

#: The fixes' CLI as a user runs it, with the timeout each test gave it.
_FIXES_CLI = {
    "text": ([sys.executable, "-m", "megatron.fixes"], 300),
    "json": ([sys.executable, "-m", "megatron.fixes", "--json"], 600),
}


def _run(cmd_timeout) -> subprocess.CompletedProcess:
    cmd, timeout = cmd_timeout
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="session")
def fixes_cli() -> dict[str, subprocess.CompletedProcess]:
    """``python -m megatron.fixes`` (``"text"``) and ``python -m megatron.fixes --json``
    (``"json"``): the real CLI, each in a fresh interpreter, run once per session for the tests that
    read its output (``test_fixes_framework.py``; ``test_patch_registry.py`` and
    ``test_patch_stacking.py`` read the same ``--json`` listing). Both start at once: each is one
    single-threaded process that spends its seconds importing upstream."""
    with ThreadPoolExecutor(len(_FIXES_CLI)) as pool:
        return dict(zip(_FIXES_CLI, pool.map(_run, _FIXES_CLI.values())))
