"""``MEGATRON_TEST_KILL_IN_LOCAL_SAVE`` (test-only hook of
:mod:`tests.helpers.fault_injection`): the parser (values and errors), and the hook itself
on NVRx's ``LocalCheckpointManager`` (and on a subclass of it, as the local tier installs one) in a
one-rank gloo world: each case runs in a forked child that really receives ``SIGKILL``; the files
it leaves behind are checked."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import fault_injection as fi

REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------------------
# parser
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, expected",
    [
        (
            "rank=1,iteration=12,moment=replicate",
            {"rank": 1, "iteration": 12, "moment": "replicate", "fraction": None, "once": None},
        ),
        (
            "rank=0,iteration=4,moment=write",
            {"rank": 0, "iteration": 4, "moment": "write", "fraction": 0.5, "once": None},
        ),
        (
            " rank = 3 , iteration=7, moment=write, fraction=0.125, once=/tmp/x.done ,",
            {
                "rank": 3,
                "iteration": 7,
                "moment": "write",
                "fraction": 0.125,
                "once": "/tmp/x.done",
            },
        ),
        (
            "moment=rename,iteration=0,rank=2",
            {"rank": 2, "iteration": 0, "moment": "rename", "fraction": None, "once": None},
        ),
        (
            "rank=1,iteration=12,moment=cleanup,once=done",
            {"rank": 1, "iteration": 12, "moment": "cleanup", "fraction": None, "once": "done"},
        ),
    ],
)
def test_parse_local_save_kill_values(spec, expected):
    assert fi.parse_local_save_kill(spec) == expected


@pytest.mark.parametrize(
    "spec, message",
    [
        ("rank=1,iteration=12", r"moment= required"),
        ("iteration=12,moment=write", r"rank= required"),
        ("moment=write", r"rank=, iteration= required"),
        ("", r"rank=, iteration=, moment= required"),
        (
            "rank=1,iteration=12,moment=flush",
            r"unknown moment 'flush' \(one of replicate, write, rename, cleanup\)",
        ),
        ("rank=1,iteration=12,moment=write,frac=0.5", r"unknown key 'frac'"),
        ("rank=1,iteration=12,moment=write,0.5", r"'0.5' is not key=value"),
        ("rank=one,iteration=12,moment=write", r"rank='one' is not an integer"),
        ("rank=1,iteration=1.5,moment=write", r"iteration='1.5' is not an integer"),
        ("rank=-1,iteration=12,moment=write", r"rank=-1 must be >= 0"),
        ("rank=1,iteration=12,moment=write,fraction=half", r"fraction='half' is not a number"),
        (
            "rank=1,iteration=12,moment=write,fraction=0",
            r"fraction=0 must be strictly between 0 and 1",
        ),
        (
            "rank=1,iteration=12,moment=write,fraction=1",
            r"fraction=1 must be strictly between 0 and 1",
        ),
        (
            "rank=1,iteration=12,moment=write,fraction=nan",
            r"fraction=nan must be strictly between 0 and 1",
        ),
        (
            "rank=1,iteration=12,moment=cleanup,fraction=0.5",
            r"fraction= applies only to moment=write \(got moment=cleanup\)",
        ),
        ("rank=1,rank=2,iteration=12,moment=write", r"'rank' given twice"),
        ("rank=1,iteration=12,moment=write,once=", r"once= needs a path"),
    ],
)
def test_parse_local_save_kill_errors(spec, message):
    with pytest.raises(ValueError, match=r"^MEGATRON_TEST_KILL_IN_LOCAL_SAVE: " + message):
        fi.parse_local_save_kill(spec)


def test_install_from_env_rejects_a_malformed_spec_before_installing(monkeypatch):
    for name in (fi.ENV_FAULT, fi.ENV_NAN):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(fi.ENV_KILL_LOCAL_SAVE, "rank=1,iteration=12,moment=later")
    with pytest.raises(ValueError, match="unknown moment 'later'"):
        fi.install_from_env(object())
    assert not fi._installed


def test_install_from_env_is_a_no_op_without_variables(monkeypatch):
    for name in (fi.ENV_FAULT, fi.ENV_NAN, fi.ENV_KILL_LOCAL_SAVE):
        monkeypatch.delenv(name, raising=False)
    fi.install_from_env(object())
    assert not fi._installed


# ---------------------------------------------------------------------------------------------
# the hook, for real (SIGKILL), in forked children of one driver process
# ---------------------------------------------------------------------------------------------

#: Runs every case in a child forked after the imports (one interpreter start for all cases): the
#: child builds a 1-rank gloo world, installs the hook, saves local checkpoints of iterations
#: 2, 4, 6 with NVRx's LocalCheckpointManager (no replication); the kill targets iteration 4.
DRIVER = r"""
import json, os, signal, sys, traceback
import torch
import torch.distributed as dist
from nvidia_resiliency_ext.checkpointing.local.ckpt_managers import local_manager
from tests.helpers import fault_injection as fi

NVRX_CLASS = local_manager.LocalCheckpointManager


class StateDict:  # what save()/_save() use of a TensorAwareStateDict (no replication)
    def __init__(self):
        self.t = torch.arange(8192, dtype=torch.float32)

    def copy_tensors_to_cpu(self, non_blocking=False):
        pass


class TierManager(NVRX_CLASS):  # stands for the local tier's subclass
    def _save(self, state_dict, ckpt_id):
        print(f"tier-subclass _save {ckpt_id[0]}", flush=True)
        return super()._save(state_dict, ckpt_id)


def child(case, root):
    dist.init_process_group("gloo", init_method=f"file://{root}/store", rank=0, world_size=1)
    if case["subclass"]:
        local_manager.LocalCheckpointManager = TierManager
    base = local_manager.LocalCheckpointManager
    cls = fi.install_local_save_kill(fi.parse_local_save_kill(case["spec"]))
    assert local_manager.LocalCheckpointManager is cls and cls.__bases__ == (base,), cls.__mro__
    manager = local_manager.LocalCheckpointManager(f"{root}/local")
    for iteration in (2, 4, 6):
        manager.save(StateDict(), iteration)
        print(f"saved {iteration}", flush=True)
    fi.uninstall()
    assert local_manager.LocalCheckpointManager is base


results = {}
for case in json.loads(sys.argv[1]):
    root = case["root"]
    os.makedirs(root, exist_ok=True)
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            child(case, root)
        except BaseException:
            traceback.print_exc()
            code = 3
        sys.stdout.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    local = os.path.join(root, "local", "0")
    files = {n: open(os.path.join(local, n), "rb").read().hex() for n in sorted(os.listdir(local))}
    results[case["name"]] = {
        "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
        "exit": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
        "files": files,
    }
print("RESULTS " + json.dumps(results), flush=True)
"""


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """name -> {"signal", "exit", "files" (name -> bytes)} and the driver's output."""
    tmp = tmp_path_factory.mktemp("kill")
    cases = [
        dict(name="replicate", spec="rank=0,iteration=4,moment=replicate"),
        dict(name="write", spec="rank=0,iteration=4,moment=write,fraction=0.25"),
        dict(name="rename", spec="rank=0,iteration=4,moment=rename"),
        dict(name="cleanup", spec="rank=0,iteration=4,moment=cleanup"),
        dict(
            name="write_subclass",
            spec="rank=0,iteration=4,moment=write,fraction=0.75",
            subclass=True,
        ),
        dict(name="other_rank", spec="rank=1,iteration=4,moment=write"),
        dict(name="once_done", spec=f"rank=0,iteration=4,moment=write,once={tmp / 'done.flag'}"),
        dict(
            name="once_fires", spec=f"rank=0,iteration=4,moment=cleanup,once={tmp / 'fires.flag'}"
        ),
    ]
    (tmp / "done.flag").touch()
    for c in cases:
        c.setdefault("subclass", False)
        c["root"] = str(tmp / c["name"])
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    for name in (fi.ENV_FAULT, fi.ENV_NAN, fi.ENV_KILL_LOCAL_SAVE):
        env.pop(name, None)
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, json.dumps(cases)],
        env=env,
        cwd=tmp,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-6000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS "))
    results = json.loads(line[len("RESULTS ") :])
    for r in results.values():
        r["files"] = {n: bytes.fromhex(h) for n, h in r["files"].items()}
    return results, proc.stdout, tmp


F2, F4, F6 = (f"iter_000000{i}_0_local.pt" for i in (2, 4, 6))
D4 = "iter_0000004_0_local.dirty.pt"


def _lines(out: str) -> list[str]:
    return [ln for ln in out.splitlines() if ln.startswith("[fault-injection]")]


def test_kill_at_replicate_leaves_no_file_of_the_iteration(killed):
    results, out, _ = killed
    r = results["replicate"]
    assert r["signal"] == signal.SIGKILL
    assert sorted(r["files"]) == [F2]
    assert (
        "[fault-injection] rank 0: SIGKILL during its local save of iteration 4 (moment replicate: "
        "start of save(), before replication and before any file)"
    ) in _lines(out)


@pytest.mark.parametrize("name, fraction", [("write", 0.25), ("write_subclass", 0.75)])
def test_kill_mid_write_leaves_a_prefix_of_the_file(killed, name, fraction):
    results, out, tmp = killed
    r = results[name]
    assert r["signal"] == signal.SIGKILL
    assert sorted(r["files"]) == [F2, D4]
    full = r["files"][F2]  # iteration 4 holds the same state dict: the same bytes
    n = int(fraction * len(full))
    assert 0 < n < len(full)
    assert r["files"][D4] == full[:n]
    path = Path(tmp) / name / "local" / "0" / D4
    assert (
        f"[fault-injection] rank 0: SIGKILL during its local save of iteration 4 (moment write: "
        f"{n} of {len(full)} bytes (fraction {fraction}) of {path} written)"
    ) in _lines(out)


def test_write_hook_wraps_the_class_installed_before_it(killed):
    _, out, _ = killed
    assert "tier-subclass _save 2" in out and "tier-subclass _save 4" in out


def test_kill_after_rename_and_at_cleanup_leave_both_iterations(killed):
    results, out, tmp = killed
    for name in ("rename", "cleanup", "once_fires"):
        r = results[name]
        assert r["signal"] == signal.SIGKILL, name
        assert sorted(r["files"]) == [F2, F4], name  # 4 final, 2 not cleaned up yet
        assert r["files"][F4] == r["files"][F2], name
    local = Path(tmp) / "rename" / "local" / "0"
    assert (
        f"[fault-injection] rank 0: SIGKILL during its local save of iteration 4 (moment rename: "
        f"right after {local / D4} -> {local / F4})"
    ) in _lines(out)
    assert (
        _lines(out).count(
            "[fault-injection] rank 0: SIGKILL during its local save of iteration 4 "
            "(moment cleanup: start of _cleanup(4), older local checkpoints not "
            "removed yet)"
        )
        == 2
    )  # cleanup and once_fires
    assert (Path(tmp) / "fires.flag").exists()


def test_no_kill_for_another_rank_or_when_once_exists(killed):
    results, out, _ = killed
    for name in ("other_rank", "once_done"):
        r = results[name]
        assert r["signal"] is None and r["exit"] == 0, (name, r, out[-3000:])
        assert sorted(r["files"]) == [F6], name
    # one line per kill: replicate, write, write_subclass, rename, cleanup, once_fires
    assert len(_lines(out)) == 6, _lines(out)


@pytest.mark.parametrize("spec, async_save", [("five", True), ("5", False)])
def test_abort_async_save_spec_errors(monkeypatch, spec, async_save):
    """``MEGATRON_TEST_ABORT_ASYNC_SAVE`` needs an iteration number and ``--async-save``; nothing
    is installed otherwise."""
    import types

    from tests.helpers import fault_injection as fi

    monkeypatch.setenv(fi.ENV_ABORT_ASYNC, spec)
    with pytest.raises(ValueError, match="needs an iteration number and --async-save"):
        fi.install_from_env(types.SimpleNamespace(async_save=async_save, async_strategy="nvrx"))
    assert "abort_async" not in fi._installed


def test_async_worker_kill_parser():
    assert fi.parse_async_worker_kill("rank=0,iteration=4") == {
        "rank": 0,
        "iteration": 4,
        "moment": "write",
    }
    assert (
        fi.parse_async_worker_kill(" rank=1 , iteration=8, moment=preload")["moment"] == "preload"
    )
    for bad, match in (
        ("rank=0", "required"),
        ("rank=0,iteration=x", "not a non-negative integer"),
        ("rank=0,iteration=4,moment=finalize", "unknown moment"),
        ("rank=0,iteration=4,when=now", "unknown key"),
        ("rank", "not key=value"),
    ):
        with pytest.raises(ValueError, match=match):
            fi.parse_async_worker_kill(bad)
