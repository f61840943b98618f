"""CPU backend: every random op that a GPU run would run on the GPU draws from the CUDA stand-in
generator, inside and outside upstream's RNG tracker forks; host tensors keep drawing from the CPU
generator. The random ops are enumerated from torch's operator registry (``rng_routing_body.py``),
so an op added by a later torch fails this test until it is covered."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BODY = Path(__file__).with_name("rng_routing_body.py")


@pytest.mark.slow
def test_every_random_op_draws_from_its_devices_generator():
    out = subprocess.run([sys.executable, str(BODY)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1].startswith("OK"), (
        out.stdout[-4000:] + out.stderr[-2000:]
    )
