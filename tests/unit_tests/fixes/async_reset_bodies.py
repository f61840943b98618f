"""Rank bodies for ``test_async_reset.py`` (module level, so that they pickle into spawned ranks).

Each rank runs upstream's own async-save API as the training loop drives it
(``megatron.training.async_utils``: ``init_persistent_async_worker``, ``schedule_async_save``,
``reset_persistent_async_worker``, ``maybe_finalize_async_save``) over ``dist_checkpointing.save``
with the nvrx strategy, the persistent worker and CPU shared memory, as ``pretrain_gpt.py --cpu
--async-save`` does.
"""

from __future__ import annotations

import json
import os
import time
import types
from pathlib import Path

import torch


def _setup(fixed: bool):
    import megatron.fixes
    from megatron.cpu import runtime

    if not fixed:
        os.environ[megatron.fixes.DISABLE_ENV] = "async_reset"
    megatron.fixes.apply()  # every other fix, as pretrain_gpt.py applies them
    runtime.activate()
    from megatron.training import global_vars

    global_vars.set_args(
        types.SimpleNamespace(
            async_save=True,
            async_strategy="nvrx",
            use_persistent_ckpt_worker=True,
            async_ckpt_use_cpu_shm=True,
            async_ckpt_cpu_priority=10,
            async_ckpt_io_priority=None,
        )
    )


def _state(rank: int, world: int, key: str, per_rank: int, value: float) -> dict:
    """One ShardedTensor ``key`` of ``world * per_rank`` float32 values, ``per_rank`` on each
    rank."""
    from megatron.core.dist_checkpointing import ShardedTensor

    local = torch.arange(per_rank, dtype=torch.float32) + value + 100 * rank
    return {key: ShardedTensor.from_rank_offsets(key, local, (0, rank, world), replica_id=0)}


def _request(state: dict, directory: Path):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    if torch.distributed.get_rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
    torch.distributed.barrier()
    return dist_checkpointing.save(
        state,
        str(directory),
        TorchDistSaveShardedStrategy(cpu_shm_mode=True),
        async_sharded_save=True,
        async_strategy="nvrx",
    )


def _results_queue():
    from nvidia_resiliency_ext.checkpointing.async_ckpt import filesystem_async

    return filesystem_async._results_queue


def save_abort_save_load(rank: int, world: int, tmp: Path, fixed: bool) -> None:
    """Save A (async), let the worker finish writing it, abort (upstream's
    ``reset_persistent_async_worker``, what its in-process restart calls), then save B (async) to a
    new directory, finalize it and load it back. Writes ``result_<rank>.json``: whether B loaded,
    its values equal what was saved (bitwise), the error otherwise, and what was left in the
    results queue."""
    _setup(fixed)
    from megatron.core import dist_checkpointing
    from megatron.training import async_utils
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    async_utils.init_persistent_async_worker(rank, "forkserver")
    async_utils.schedule_async_save(_request(_state(rank, world, "a", 4, 1.0), tmp / "a"))
    deadline = time.monotonic() + 120  # the worker's write results of A are in the queue
    while _results_queue().qsize() < 1:
        assert time.monotonic() < deadline, "the async worker did not write checkpoint A"
        time.sleep(0.05)
    torch.distributed.barrier()
    async_utils.reset_persistent_async_worker("nvrx")  # abort: A is never finalized
    if not fixed:
        # Unfixed, the queue rebuilt after the reset drops cpu_shm_mode and its worker dies on CPU
        # (the trainer would wait forever; test_rebuilt_queue_keeps_cpu_shm shows that part).
        # Build it as init_persistent_async_worker does, to show the stale-results defect alone.
        from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue

        async_utils._async_calls_queue = AsyncCallsQueue(persistent=True, cpu_shm_mode=True)

    saved = _state(rank, world, "b", 6, 7.0)
    expected = saved["b"].data.clone()
    async_utils.schedule_async_save(_request(saved, tmp / "b"))
    async_utils.maybe_finalize_async_save(blocking=True)
    result = {
        "fixed": fixed,
        "loaded": False,
        "bitwise": False,
        "error": None,
        "left_in_queue": _results_queue().qsize(),
    }
    try:
        template = _state(rank, world, "b", 6, -1.0)
        loaded = dist_checkpointing.load(template, str(tmp / "b"))
        result["loaded"] = True
        result["bitwise"] = bool(torch.equal(loaded["b"], expected))
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - unfixed: B's metadata describes A's files
        result["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    torch.distributed.barrier()
    async_utils.maybe_finalize_async_save(blocking=True, terminate=True)
    (tmp / f"result_{rank}.json").write_text(json.dumps(result))
