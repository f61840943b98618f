"""Fix: building the data iterators after a checkpoint load draws from the restored CPU generator.

megatron-core 0.19.2's ``megatron.training.datasets.data_samplers.build_pretraining_data_loader``
builds its ``torch.utils.data.DataLoader`` without a generator of its own, so every ``iter()`` of
it (``build_train_valid_test_data_iterators``, and each new epoch of a cyclic iterator) draws its
base seed from torch's global CPU generator. A resumed run restores that generator in
``load_checkpoint`` and then builds its iterators: at its first step the CPU generator is one
draw ahead of the uninterrupted run's (Megatron-Bridge issue 5257; upstream main still has it).

The replacement gives each loader upstream builds a ``torch.Generator`` of its own, seeded with
``--seed`` (the base seed only seeds the loader's worker processes; the samples come from the
batch sampler), so building and iterating loaders never touches the global CPU generator.
"""

from __future__ import annotations

from typing import Callable

from megatron.fixes.standins import StandInArgs, parallel_state, replaced, upstream_own
from megatron.overlay import Fix, Patch, alias_of
from megatron.overlay.registry import wraps_upstream

_SAMPLERS = "megatron.training.datasets.data_samplers"


def own_generator(seed: int):
    """A CPU ``torch.Generator`` seeded with ``seed`` (int): a data loader's own."""
    import torch

    generator = torch.Generator()
    generator.manual_seed(int(seed))
    return generator


def wrap_build_pretraining_data_loader(upstream: Callable) -> Callable:
    """Factory of the replacement of ``data_samplers.build_pretraining_data_loader``: upstream's;
    a ``torch.utils.data.DataLoader`` it returns without a generator gets its own
    (:func:`own_generator` of ``args.seed``). Anything else (``None``, an external loader, a
    loader with a generator) is returned as upstream gives it."""
    from megatron.training.datasets import data_samplers

    @wraps_upstream(upstream)
    def build_pretraining_data_loader(dataset, consumed_samples):
        """Upstream's; the loader draws its base seeds from a generator of its own."""
        import torch

        loader = upstream(dataset, consumed_samples)
        if isinstance(loader, torch.utils.data.DataLoader) and loader.generator is None:
            seed = getattr(data_samplers.get_args(), "seed", None)  # upstream's binding, now
            loader.generator = own_generator(1234 if seed is None else seed)
        return loader

    return build_pretraining_data_loader


class _Dataset:
    """A stand-in dataset of 8 samples."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> int:
        return i


def upstream_loader_draws_from_cpu_generator(fn: Callable | None = None) -> bool | None:
    """Whether ``iter()`` of the loader upstream's ``build_pretraining_data_loader`` (or ``fn``)
    builds draws from torch's global CPU generator (stand-in args and parallel state, an 8-sample
    dataset; the generator's state is put back afterwards).

    Returns:
        ``True`` on megatron-core 0.19.2 and upstream main (the defect), ``False`` when the
        generator is untouched, ``None`` when upstream returns no ``DataLoader``.
    """
    import torch
    from megatron.training.datasets import data_samplers

    fn = fn or upstream_own(data_samplers.build_pretraining_data_loader)
    args = StandInArgs(
        dataloader_type="single",
        micro_batch_size=2,
        global_batch_size=2,
        num_workers=0,
        hybrid_context_parallel=False,
        full_validation=False,
        exit_signal_handler=False,
        seed=1234,
    )
    state = torch.get_rng_state()
    try:
        with replaced(data_samplers, get_args=lambda: args, mpu=parallel_state()):
            loader = fn(_Dataset(), 0)
            if not isinstance(loader, torch.utils.data.DataLoader):
                return None
            before = torch.get_rng_state()
            iter(loader)
            return not torch.equal(before, torch.get_rng_state())
    finally:
        torch.set_rng_state(state)


class DataLoaderRngFix(Fix):
    name = "data_loader_rng"
    title = "data loaders draw their seeds from a generator of their own, not the restored CPU one"
    upstream_refs = (
        "Megatron-Bridge issue 5257 (after a resume the CPU generator differs at the first step: "
        "building the data iterators draws from it after the load)",
    )
    package = "megatron-core"

    patches = (
        Patch(
            f"{_SAMPLERS}.build_pretraining_data_loader",
            wrap_build_pretraining_data_loader,
            "iter() of upstream's data loader draws its base seed from the global CPU generator, "
            "which a resume restored just before: the first resumed step runs on another CPU "
            "generator state than the uninterrupted run",
            params=("dataset", "consumed_samples"),
        ),
        Patch(
            "megatron.training.training.build_pretraining_data_loader",
            alias_of(
                f"{_SAMPLERS}.build_pretraining_data_loader",
                only_if_same=True,
                otherwise=wrap_build_pretraining_data_loader,
            ),
            "the same, for training.py's binding (build_train_valid_test_data_loaders)",
        ),
    )

    def upstream_behaves(self) -> bool | None:
        """Upstream's own ``build_pretraining_data_loader`` on stand-ins
        (:func:`upstream_loader_draws_from_cpu_generator`): behaves when ``iter()`` of its loader
        leaves the CPU generator untouched."""
        draws = upstream_loader_draws_from_cpu_generator()
        return None if draws is None else not draws


FIX = DataLoaderRngFix()
