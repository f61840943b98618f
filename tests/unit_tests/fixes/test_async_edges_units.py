"""The fixes of the edges of ``--async-save`` in isolation (no launch): ``async_worker_death``,
``nonpersistent_retention``, ``atomic_tracker``, ``async_queue_teardown``, ``async_final_save``.
Each fix's guard shows upstream's own function still misbehaving on a stand-in, and its probe is
not fooled by a wrapper of another text. The entrypoint tests are in
``tests/functional_tests/test_async_edges.py``."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import types
from collections import deque
from pathlib import Path

import pytest

from megatron.fixes import async_final_save as afs
from megatron.fixes import async_queue_teardown as aqt
from megatron.fixes import async_worker_death as awd
from megatron.fixes import atomic_tracker as at
from megatron.fixes import nonpersistent_retention as npr
from tests.unit_tests.fixes.probe_copies import trivial_wrapper

REPO = Path(__file__).resolve().parents[3]

# ---------------------------------------------------------------------------------------------
# async_worker_death
# ---------------------------------------------------------------------------------------------


def _nvrx_caller(process, posted=()):
    from nvidia_resiliency_ext.checkpointing.async_ckpt.core import PersistentAsyncCaller

    caller = object.__new__(PersistentAsyncCaller)
    caller.process, caller.comp_q, caller.cur_item, caller.rank = process, queue.Queue(), None, 0
    for item in posted:
        caller.comp_q.put(item)
    return caller


class _Proc:
    def __init__(self, alive: bool, pid: int = 4242, exitcode=-int(signal.SIGKILL)):
        self.alive, self.pid, self.exitcode = alive, pid, exitcode

    def is_alive(self) -> bool:
        return self.alive

    def join(self, timeout=None) -> None:
        pass


def test_guard_upstream_waits_for_a_dead_worker_forever():
    """Guard: upstream's blocking check never returns for a dead worker that posted nothing
    (still waiting after 0.3 s: it polls a queue nobody will fill); the probe releases it."""
    from nvidia_resiliency_ext.checkpointing.async_ckpt import core

    if awd.FIX.status.name == "ACTIVE":
        pytest.skip("this process has the fix installed")
    assert awd.upstream_waits_for_dead_worker() is True
    wrapped = trivial_wrapper(core.PersistentAsyncCaller.is_current_async_call_done)
    assert awd.upstream_waits_for_dead_worker(wrapped) is True  # other text, same verdict


def test_a_dead_worker_ends_the_check_with_its_rank_pid_and_signal():
    for blocking in (True, False):
        caller = _nvrx_caller(_Proc(alive=False))
        with pytest.raises(awd.AsyncWorkerDied) as got:
            awd.is_current_async_call_done(caller, blocking=blocking, no_dist=True)
        assert (got.value.rank, got.value.pid, got.value.exitcode) == (0, 4242, -9)
        assert "killed by SIGKILL" in str(got.value)
        caller.process = None


def test_a_completion_posted_before_death_counts_and_a_live_worker_is_still_writing():
    caller = _nvrx_caller(_Proc(alive=False), posted=(0,))
    assert awd.is_current_async_call_done(caller, blocking=True, no_dist=True) is True
    live = _nvrx_caller(_Proc(alive=True))
    assert awd.is_current_async_call_done(live, blocking=False, no_dist=True) is False
    caller.process = live.process = None


def test_the_staging_wait_ends_when_the_worker_dies():
    release = threading.Event()
    real = types.SimpleNamespace(join=release.wait, put=lambda x: None)
    caller = types.SimpleNamespace(process=_Proc(alive=True), rank=1)
    watched = awd.WatchedJoin(real, caller)
    threading.Timer(0.2, lambda: setattr(caller.process, "alive", False)).start()
    try:
        with pytest.raises(awd.AsyncWorkerDied, match="rank 1's checkpoint worker"):
            watched.join()
    finally:
        release.set()  # the waiting thread ends
    caller.process.alive = True
    awd.WatchedJoin(real, caller).join()  # a finished staging returns


def test_stop_every_rank_prints_one_line_and_aborts_the_queue(capsys):
    closed = []
    calls_queue = types.SimpleNamespace(
        async_calls=deque([types.SimpleNamespace(idx=3)]),
        persistent_caller=types.SimpleNamespace(sigterm_timeout=30.0),
        close=lambda abort=False: closed.append(abort),
        _fix_iterations={3: 4, 5: 6},
    )
    with pytest.raises(SystemExit) as got:
        awd.stop_every_rank(calls_queue, awd.AsyncWorkerDied(0, 77, -9), extra=5)
    assert got.value.code == awd.EXIT_STATUS and closed == [True]
    assert calls_queue.persistent_caller.sigterm_timeout == awd.ABORT_GRACE_S
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("pretrain_gpt.py:")]
    assert err == [awd.stop_line(awd.AsyncWorkerDied(0, 77, -9), [4, 6])], err
    assert "iterations 4, 6 unfinished" in err[0] and "(pid 77) died (killed by SIGKILL)" in err[0]


def test_a_worker_found_dead_while_idle_is_replaced_and_one_with_a_pending_save_is_not():
    idle = types.SimpleNamespace(
        persistent_caller=types.SimpleNamespace(process=_Proc(alive=False), rank=0),
        async_calls=deque(),
    )
    awd._replace_idle_dead_worker(idle)
    assert idle.persistent_caller.process is None  # the next schedule starts a fresh one
    busy = types.SimpleNamespace(
        persistent_caller=types.SimpleNamespace(process=_Proc(alive=False), rank=0),
        async_calls=deque([types.SimpleNamespace(idx=0)]),
    )
    awd._replace_idle_dead_worker(busy)
    assert busy.persistent_caller.process is not None  # its save is lost: the ranks must stop


# ---------------------------------------------------------------------------------------------
# nonpersistent_retention
# ---------------------------------------------------------------------------------------------


def _np_dir(root: Path, complete=(), partial=(), tracker=None) -> Path:
    for it in complete:
        (root / f"iter_{it:07d}").mkdir(parents=True)
        (root / f"iter_{it:07d}" / ".metadata").write_bytes(b"m")
    for it in partial:
        (root / f"iter_{it:07d}").mkdir(parents=True)
    if tracker is not None:
        (root / npr.TRACKER).write_text(str(tracker))
    return root


def _left(root: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in root.iterdir() if p.name.startswith("iter_"))


def test_guard_upstream_deletes_the_tracked_checkpoint_while_the_next_is_in_flight():
    from megatron.training import checkpointing as ckpt

    if npr.FIX.status.name == "ACTIVE":
        pytest.skip("this process has the fix installed")
    assert npr.upstream_deletes_tracked() is True
    assert npr.upstream_deletes_tracked(trivial_wrapper(ckpt.cleanup_old_non_persistent_checkpoint))


def test_retention_order_of_async_saves(tmp_path):
    """The order of ``--non-persistent-save-interval 1 --async-save``: each save's retention runs
    at its start, while the previous save may be in flight; at no step is the tracked checkpoint
    (or anything newer) deleted, and an old one goes once the tracker has moved past it."""
    root = _np_dir(tmp_path, complete=(1,), tracker=1)
    clean = npr.cleanup_old_non_persistent_checkpoint
    clean(root)  # save 2 starts
    _np_dir(root, partial=(2,))
    clean(root)  # save 3 starts, 2 in flight, tracker 1
    assert _left(root) == [1, 2]
    _np_dir(root, partial=(3,))
    (root / "iter_0000002" / ".metadata").write_bytes(b"m")  # 2 finalised ...
    clean(root)  # ... but the tracker still names 1: nothing goes
    assert _left(root) == [1, 2, 3]
    (root / npr.TRACKER).write_text("2")  # the tracker moved
    clean(root)  # save 4 starts
    assert _left(root) == [2, 3]


def test_retention_keeps_everything_without_a_usable_tracker(tmp_path):
    for tracker in (None, "", "abc", 7, 3):  # missing, empty, garbage, missing dir, partial dir
        root = _np_dir(tmp_path / f"t{tracker!r}", complete=(1, 2), partial=(3,))
        if tracker is not None:
            (root / npr.TRACKER).write_text(str(tracker))
        npr.cleanup_old_non_persistent_checkpoint(root)
        assert _left(root) == [1, 2, 3], tracker


def test_retention_leaves_the_newest_complete_ones_when_asked(tmp_path):
    root = _np_dir(tmp_path, complete=(1, 2, 4, 6), partial=(3, 5, 7), tracker=6)
    npr.cleanup_old_non_persistent_checkpoint(root, leave_ckpt_num=2)
    assert _left(root) == [4, 6, 7]


# ---------------------------------------------------------------------------------------------
# atomic_tracker
# ---------------------------------------------------------------------------------------------


def test_guard_upstream_truncates_the_tracker_before_writing_it():
    from megatron.core.msc_utils import maybe_msc

    assert at.upstream_truncates_tracker(maybe_msc) is True


def test_the_tracker_keeps_its_old_value_until_the_new_one_is_in_place(tmp_path):
    msc = at.AtomicTrackerMsc(types.SimpleNamespace(open=open, os=os))
    assert at.upstream_truncates_tracker(msc) is False
    tracker = tmp_path / at.TRACKER
    tracker.write_text("4")
    with pytest.raises(RuntimeError):
        with msc.open(str(tracker), "w") as f:
            f.write("8")
            raise RuntimeError("crash while writing")
    assert tracker.read_text() == "4" and sorted(os.listdir(tmp_path)) == [at.TRACKER]
    with msc.open(str(tracker), "w") as f:
        f.write("8")
    assert tracker.read_text() == "8"
    with msc.open(str(tracker)) as f:  # reading and other files: the original's
        assert f.read() == "8"
    assert msc.os is os


# ---------------------------------------------------------------------------------------------
# async_queue_teardown
# ---------------------------------------------------------------------------------------------

_TEARDOWN = """
import sys, types
import megatron.fixes
from megatron.training import async_utils
from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue
megatron.fixes.apply()
args = types.SimpleNamespace(async_save=True)
async_utils.get_args = lambda: args
async_utils._async_calls_queue = AsyncCallsQueue(persistent=True, cpu_shm_mode=True)
async_utils.maybe_finalize_async_save(blocking=True, terminate=True)
print("closed", async_utils._async_calls_queue is None)
"""


def _teardown(disable: str | None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path])}
    env.pop("MEGATRON_FIXES_DISABLE", None)
    if disable:
        env["MEGATRON_FIXES_DISABLE"] = disable
    return subprocess.Popen(
        [sys.executable, "-c", _TEARDOWN],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
def test_an_async_queue_closed_at_the_end_leaves_no_teardown_traceback():
    """A process that ends as ``pretrain()`` does with ``--async-save --async-ckpt-use-cpu-shm``
    (``maybe_finalize_async_save(blocking=True, terminate=True)``), then exits normally: no
    ``Exception ignored``; the guard (``MEGATRON_FIXES_DISABLE=async_queue_teardown``, started
    at the same time) ends with NVRx's ``AsyncCallsQueue.__del__`` traceback."""
    fixed, unfixed = _teardown(None), _teardown("async_queue_teardown")
    out = {name: p.communicate(timeout=300) for name, p in (("fixed", fixed), ("unfixed", unfixed))}
    assert fixed.returncode == 0 and "closed True" in out["fixed"][0], out["fixed"]
    assert "Exception ignored" not in out["fixed"][1], out["fixed"][1]
    assert "closed False" in out["unfixed"][0], out["unfixed"]
    assert "Exception ignored in: <function AsyncCallsQueue.__del__" in out["unfixed"][1]
    assert "sys.meta_path is None" in out["unfixed"][1]


def test_guard_upstream_keeps_the_closed_queue():
    from megatron.training import async_utils

    if aqt.FIX.status.name == "ACTIVE":
        pytest.skip("this process has the fix installed")
    assert aqt.upstream_keeps_closed_queue() is True
    assert aqt.upstream_keeps_closed_queue(trivial_wrapper(async_utils.maybe_finalize_async_save))
    fixed = aqt.wrap_maybe_finalize_async_save(async_utils.maybe_finalize_async_save)
    assert aqt.upstream_keeps_closed_queue(fixed) is False


# ---------------------------------------------------------------------------------------------
# async_final_save
# ---------------------------------------------------------------------------------------------


def test_train_defers_the_terminate_and_pays_it_on_a_planned_exit(monkeypatch):
    calls = []

    def finalize(blocking=False, terminate=False):
        calls.append((blocking, terminate))

    from megatron.training import async_utils

    monkeypatch.setattr(async_utils, "maybe_finalize_async_save", finalize)
    in_training = afs.wrap_finalize_in_training(finalize)

    def upstream_train(exit_code=None):
        in_training(blocking=True, terminate=True)  # train()'s end
        if exit_code is not None:
            raise SystemExit(exit_code)
        return 12

    train = afs.wrap_train(upstream_train)
    assert train() == 12 and calls == [(True, False)]  # returns: the worker stays up
    in_training(blocking=True, terminate=True)  # pretrain()'s end, after the final save
    assert calls[-1] == (True, True)
    calls.clear()
    with pytest.raises(SystemExit):
        train(exit_code=0)
    assert calls == [(True, False), (True, True)]  # a planned exit terminates on the way out
