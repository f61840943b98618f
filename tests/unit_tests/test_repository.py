"""The repository holds sources only: no committed binaries or large files (a wheel of 6.5 MB
was once committed at the root by mistake)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: Largest tracked file allowed (bytes); the largest source file is ~40 KB.
MAX_BYTES = 512 * 1024
BINARY_SUFFIXES = (".whl", ".pt", ".pth", ".so", ".tar", ".gz", ".zip", ".bin", ".safetensors")


def _tracked() -> list[Path]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [ROOT / p for p in out.decode().split("\0") if p]


def test_no_large_or_binary_files_are_tracked():
    files = [p for p in _tracked() if p.is_file()]
    assert files
    large = [
        f"{p.relative_to(ROOT)} ({p.stat().st_size} B)"
        for p in files
        if p.stat().st_size > MAX_BYTES
    ]
    binary = [str(p.relative_to(ROOT)) for p in files if p.name.endswith(BINARY_SUFFIXES)]
    assert not large, f"files over {MAX_BYTES} B: {large}"
    assert not binary, f"binary files tracked: {binary}"
