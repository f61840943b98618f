"""CPU backend: every random op that a GPU run would run on the GPU draws from the CUDA stand-in
generator, inside and outside upstream's RNG tracker forks; host tensors keep drawing from the CPU
generator. The random ops are enumerated from torch's operator registry (``rng_routing_body.py``),
so an op added by a later torch fails this test until it is covered.

The body runs in a process of its own (the CPU backend is process-global), forked from the test
forkserver (``tests.helpers.dist.run_python``: torch and upstream imported, nothing applied or
activated; ``activate()`` imports upstream before it patches anyway), not a fresh interpreter."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.dist import run_python

BODY = Path(__file__).with_name("rng_routing_body.py")


@pytest.mark.slow
def test_every_random_op_draws_from_its_devices_generator():
    out = run_python(path=BODY, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1].startswith("OK"), (
        out.stdout[-4000:] + out.stderr[-2000:]
    )
