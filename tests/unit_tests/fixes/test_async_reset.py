"""Fix ``async_reset``: after upstream's abort of async checkpointing
(``megatron.training.async_utils.reset_persistent_async_worker``), the next async save is complete
and loads bitwise; unfixed, it consumes the aborted save's write results and cannot be loaded.

The two-rank tests drive upstream's own API (``init_persistent_async_worker``,
``schedule_async_save``, ``reset_persistent_async_worker``, ``maybe_finalize_async_save``) over
``dist_checkpointing.save`` with NVRx's persistent worker and CPU shared memory, the configuration
``pretrain_gpt.py --cpu --async-save`` runs (bodies in ``async_reset_bodies.py``). They start a
checkpoint worker twice per rank (before and after the abort), hence ``slow``.
"""

from __future__ import annotations

import json
import types

import pytest

from megatron.fixes import FixStatus
from megatron.fixes.async_reset import FIX, drop_results_queues
from tests.helpers.dist import run_distributed
from tests.unit_tests.fixes.async_reset_bodies import save_abort_save_load
from tests.unit_tests.fixes.probe_copies import trivial_wrapper


def _results(tmp_path, fixed: bool) -> list[dict]:
    run_distributed(save_abort_save_load, 2, tmp_path, fixed, timeout=420)
    return [json.loads((tmp_path / f"result_{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
def test_save_after_abort_is_complete_and_loads_bitwise(tmp_path):
    for r in _results(tmp_path, fixed=True):
        assert r == {
            "fixed": True,
            "loaded": True,
            "bitwise": True,
            "error": None,
            "left_in_queue": 0,
        }, r


@pytest.mark.slow
def test_guard_unfixed_save_after_abort_cannot_be_loaded(tmp_path):
    """Guard (``MEGATRON_FIXES_DISABLE=async_reset``): the aborted save's write results are still
    in the queue; the next save's finalisation takes them, it "succeeds", and loading it fails (or
    reads other values); its own results are left behind for the save after it."""
    for r in _results(tmp_path, fixed=False):
        assert r["fixed"] is False
        assert not (r["loaded"] and r["bitwise"]), r
        assert r["left_in_queue"] == 1, r


def _rebuilt_queue_cpu_shm(monkeypatch) -> bool:
    """Upstream's reset, then the lazily rebuilt queue as ``schedule_async_save`` gets it, with
    ``--async-ckpt-use-cpu-shm`` set; no worker is started (that happens at the first schedule)."""
    from megatron.training import async_utils

    args = types.SimpleNamespace(
        async_save=True,
        async_strategy="nvrx",
        use_persistent_ckpt_worker=True,
        async_ckpt_use_cpu_shm=True,
    )
    monkeypatch.setattr(async_utils, "get_args", lambda: args)
    monkeypatch.setattr(async_utils, "_async_calls_queue", None)
    async_utils.reset_persistent_async_worker("nvrx")
    queue = async_utils._get_async_calls_queue()
    try:
        return queue.cpu_shm_mode
    finally:
        queue.close()
        async_utils._async_calls_queue = None


@pytest.fixture
def unfixed():
    """This fix not installed during the test; afterwards as it was before (other tests of this
    process see the fixes as they left them)."""
    was_active = FIX.status is FixStatus.ACTIVE
    FIX.reset()
    yield
    FIX.reset()
    if was_active:
        FIX.apply()


def test_rebuilt_queue_keeps_cpu_shm(monkeypatch, unfixed):
    assert FIX.apply() is FixStatus.ACTIVE
    assert _rebuilt_queue_cpu_shm(monkeypatch) is True


def test_guard_unfixed_rebuilt_queue_drops_cpu_shm(monkeypatch, unfixed):
    """Guard: upstream's rebuilt queue has ``cpu_shm_mode=False``, so on CPU its worker calls
    ``torch.cuda.set_device(rank % torch.cuda.device_count())`` and dies."""
    assert _rebuilt_queue_cpu_shm(monkeypatch) is False


def test_detection_sees_the_defects_and_the_fix(unfixed):
    """``upstream_behaves`` probes behaviour: false on the pinned upstream, true once patched."""
    assert FIX.upstream_behaves() is False
    FIX.apply()
    assert FIX.upstream_behaves() is True


def test_drop_results_queues_unsets_every_module_queue(monkeypatch):
    from megatron.fixes import async_reset

    shut = []
    mgr = types.SimpleNamespace(shutdown=lambda: shut.append(1))
    modules = async_reset._queue_modules()
    assert len(modules) == 2  # NVRx's and megatron-core's filesystem_async
    for m in modules:
        monkeypatch.setattr(m, "_results_queue", types.SimpleNamespace(_manager=mgr))
    assert drop_results_queues() == 2 and len(shut) == 2
    assert all(m._results_queue is None for m in modules)
    assert drop_results_queues() == 0


def test_detection_is_not_fooled_by_a_wrapped_upstream(monkeypatch, unfixed):
    """A trivial wrapper over upstream's reset (other text, same behaviour) still shows the
    defect; the probe leaves the queues and the module's collaborators as they were."""
    from megatron.training import async_utils

    before = (async_utils._async_calls_queue, async_utils.get_args, async_utils.get_async_strategy)
    monkeypatch.setattr(
        async_utils,
        "reset_persistent_async_worker",
        trivial_wrapper(async_utils.reset_persistent_async_worker),
    )
    assert FIX.upstream_behaves() is False
    after = (async_utils._async_calls_queue, async_utils.get_args, async_utils.get_async_strategy)
    assert after == before


def test_declared_patches_alias_the_in_process_restart_name(unfixed):
    from megatron.training import async_utils, inprocess_restart

    assert FIX.apply() is FixStatus.ACTIVE
    assert inprocess_restart.reset_persistent_async_worker is (
        async_utils.reset_persistent_async_worker
    )
    assert [s.target.rsplit(".", 1)[1] for s in FIX.specs()] == [
        "reset_persistent_async_worker",
        "_get_async_calls_queue",
        "reset_persistent_async_worker",
    ]
