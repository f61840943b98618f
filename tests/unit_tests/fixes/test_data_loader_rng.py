"""Fix ``data_loader_rng`` in isolation: upstream's own ``build_pretraining_data_loader`` (stand-in
args and parallel state) builds a loader whose ``iter()`` draws from torch's global CPU generator
(the guard); under the fix the loader has a generator of its own, seeded with ``--seed``, and the
global generator is untouched. The entrypoint tests (the CPU generator at the first resumed step,
bitwise) are in tests/functional_tests/test_run_edges.py."""

from __future__ import annotations

import torch

import megatron.fixes
from megatron.fixes.data_loader_rng import (
    FIX,
    upstream_loader_draws_from_cpu_generator,
    wrap_build_pretraining_data_loader,
)
from megatron.fixes.standins import StandInArgs, replaced
from tests.unit_tests.fixes.probe_copies import trivial_wrapper


def test_guard_upstream_loader_draws_from_the_cpu_generator():
    from megatron.training.datasets import data_samplers

    megatron.fixes.reset()
    state = torch.get_rng_state()
    assert upstream_loader_draws_from_cpu_generator() is True
    assert FIX.upstream_behaves() is False
    assert torch.equal(state, torch.get_rng_state())  # the probe put the generator back
    wrapped = trivial_wrapper(data_samplers.build_pretraining_data_loader)
    assert upstream_loader_draws_from_cpu_generator(wrapped) is True


def test_fixed_loader_has_its_own_seeded_generator():
    from megatron.training import training
    from megatron.training.datasets import data_samplers

    megatron.fixes.reset()
    assert FIX.apply().value == "active"
    try:
        assert training.build_pretraining_data_loader is data_samplers.build_pretraining_data_loader
        assert upstream_loader_draws_from_cpu_generator(training.build_pretraining_data_loader) is (
            False
        )
        assert FIX.upstream_behaves() is False  # the probe still reads upstream's own
    finally:
        FIX.reset()


def test_wrapper_seeds_with_seed_and_leaves_other_loaders_alone():
    from megatron.training.datasets import data_samplers

    data = list(range(8))
    own = torch.Generator()
    given = torch.utils.data.DataLoader(data, generator=own)
    for upstream, want in (
        (lambda d, c: None, None),
        (lambda d, c: d, "dataset"),  # an external loader is passed through
        (lambda d, c: given, own),
    ):
        with replaced(data_samplers, get_args=lambda: StandInArgs(seed=7)):
            got = wrap_build_pretraining_data_loader(upstream)(data, 0)
        if want == "dataset":
            assert got is data
        elif want is None:
            assert got is None
        else:
            assert got.generator is own
    with replaced(data_samplers, get_args=lambda: StandInArgs(seed=7)):
        loader = wrap_build_pretraining_data_loader(lambda d, c: torch.utils.data.DataLoader(d))(
            data, 0
        )
    assert torch.equal(loader.generator.get_state(), torch.Generator().manual_seed(7).get_state())
