"""megatron.fixes: apply() is idempotent and reversible, guards unsupported versions, stands aside
for an upstream that behaves, and can leave named fixes out."""

from __future__ import annotations

import types

import pytest

import megatron.fixes as fixes
from megatron.overlay import Fix, FixStatus, PatchSpec, UnsupportedUpstreamError
from tests.helpers.dist import run_python


class _Fake(Fix):
    name = "fake"
    title = "fake fix for tests"
    upstream_refs = ("test",)
    package = "megatron-core"
    # not a declared Patch: its patch point cannot be checked, so outside the proven versions a
    # defect-showing probe is refused rather than patched blindly
    patches = (PatchSpec("target.attr", "replacement", "why"),)

    def __init__(self, behaves=False, proven=None, package=None):
        super().__init__()
        self.behaves = behaves
        self.installs = 0
        self.target = types.SimpleNamespace(attr="original")
        if proven:
            self.proven = proven
        if package:
            self.package = package

    def upstream_behaves(self):
        return self.behaves

    def install(self, patcher):
        self.installs += 1
        patcher.replace(self.target, "attr", "patched")


def test_apply_is_idempotent_and_reset_restores():
    fix = _Fake()
    assert fix.apply() is FixStatus.ACTIVE
    assert fix.apply() is FixStatus.ACTIVE
    assert fix.installs == 1 and fix.target.attr == "patched"
    fix.reset()
    assert fix.target.attr == "original" and fix.status is FixStatus.NOT_APPLIED


def test_unsupported_version_is_a_clear_error():
    import importlib.metadata
    import re

    installed = re.escape(importlib.metadata.version("megatron-core"))
    fix = _Fake(proven="==0.1.0")
    with pytest.raises(
        UnsupportedUpstreamError, match=rf"megatron-core==0\.1\.0.*{installed} is installed"
    ):
        fix.apply()
    assert fix.installs == 0 and fix.target.attr == "original"


def test_stands_aside_when_upstream_behaves():
    fix = _Fake(behaves=True, proven="==0.1.0")  # even outside the pin: nothing to fix
    assert fix.apply() is FixStatus.STANDS_ASIDE
    assert fix.installs == 0 and fix.target.attr == "original"


def test_missing_package_is_not_applicable():
    fix = _Fake(package="no-such-distribution-xyz")
    assert fix.apply() is FixStatus.NOT_APPLICABLE and fix.installs == 0


_MAIN_HAS_PR_5077 = pytest.mark.fixed_upstream(
    "megatron-core==0.20.0",
    "Megatron-LM PR 5077 is on upstream main: distopt_bucket_offsets stands aside there",
)


@_MAIN_HAS_PR_5077
def test_registry_apply_twice_patches_once(monkeypatch):
    monkeypatch.delenv(fixes.DISABLE_ENV, raising=False)
    first = fixes.apply()
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    patched = DistributedOptimizer.state_dict
    second = fixes.apply()
    assert first == second and all(s is FixStatus.ACTIVE for s in first.values()), first
    assert DistributedOptimizer.state_dict is patched
    assert {
        "replication",
        "modelopt_moe",
        "fsdp_dtensor",
        "distopt_resume",
        "distopt_reshard",
    } <= set(first)


def test_disable_env_names_are_checked(monkeypatch):
    monkeypatch.setenv(fixes.DISABLE_ENV, "no_such_fix")
    with pytest.raises(ValueError, match="unknown fixes"):
        fixes.apply()


@pytest.mark.upstream_defect(
    "megatron-core==0.20.0",
    "Megatron-LM PR 5748: fsdp_dtensor's functional tests (MLA + MTP) cannot run on upstream "
    "main, so it is not proven there (megatron/overlay/pins.py NARROWED)",
)
def test_every_fix_declares_its_patches_and_targets_the_pins():
    import importlib.metadata as md

    for fix in fixes.fixes():
        assert fix.patches and fix.upstream_refs and fix.title
        version = md.version(fix.package)
        assert fix.version_supported(version), (fix.name, fix.supported, version)


@pytest.mark.slow
def test_pinned_upstream_still_has_every_defect():
    """In a process where no fix was ever applied (forked from the test forkserver, which imports
    upstream and applies nothing): the pinned upstream still has each defect. A fix that stood
    aside here would mean the guard tests no longer prove anything. (The probes in a fresh
    interpreter, upstream not yet imported, run in the real CLI of ``test_cli_lists_fixes``.)"""
    script = (
        "import megatron.fixes as f\n"
        "bad = [x.name for x in f.fixes() if x.upstream_behaves()]\n"
        "print('BEHAVES', bad)\n"
    )
    out = run_python(script, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "BEHAVES []" in out.stdout, out.stdout


@pytest.mark.slow
@_MAIN_HAS_PR_5077
def test_cli_lists_fixes(fixes_cli):
    out = fixes_cli["text"]  # python -m megatron.fixes (tests/unit_tests/conftest.py)
    assert out.returncode == 0, out.stderr[-3000:]
    names = (
        "replication",
        "modelopt_moe",
        "fsdp_dtensor",
        "distopt_resume",
        "distopt_reshard",
        "distopt_bucket_offsets",
        "distopt_padded_bucket",
        "dcp_prepend_axis",
        "training_log",
        "help_text",
        "pretrained_redirect",
        "async_reset",
        "rng_state_ep",
        "fsdp_rng",
        "missing_checkpoint_exit",
        "async_queue_teardown",
        "async_final_save",
        "async_worker_death",
        "nonpersistent_retention",
        "atomic_tracker",
        "planned_exit_save",
        "data_loader_rng",
    )
    for name in names:
        assert f"{name}:" in out.stdout
    assert out.stdout.count("status:    active") == len(names)


def test_apply_logs_one_summary_line_on_rank_zero(caplog, monkeypatch):
    """The fixes a call installs are summarised in one line on rank 0, none on other ranks; each
    fix's own line is DEBUG (``python -m megatron.fixes`` lists them)."""
    import importlib.metadata
    import logging

    core = importlib.metadata.version("megatron-core")
    fixes.apply()
    active = [f for f in fixes.fixes() if f.status is FixStatus.ACTIVE]
    assert active
    before = {f.name: FixStatus.NOT_APPLIED for f in fixes.fixes()}
    for rank, expected in (("0", 1), ("1", 0)):
        monkeypatch.setenv("RANK", rank)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="megatron.fixes"):
            fixes._log_summary(before)
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == expected, lines
        if expected:
            assert lines[0].startswith(f"[fixes] {len(active)} active on megatron-core {core} / ")
            assert lines[0].endswith("(python -m megatron.fixes for details)")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="megatron.fixes"):
        fixes._log_summary({f.name: f.status for f in fixes.fixes()})  # nothing new installed
    assert not caplog.records


#: The verdict of every fix and part on each proven upstream (python -m megatron.fixes there).
EXPECTED_ASIDE = {
    "0.19.2": set(),
    # upstream main, d98e8a6: Megatron-LM PRs 5077 and 6321
    "0.20.0": {"distopt_bucket_offsets", "missing_checkpoint_exit"},
}


@pytest.mark.slow
@pytest.mark.compat  # also in the compatibility lane, on upstream main
def test_every_probe_gives_its_verdict_on_this_upstream():
    """In a process where no fix was applied: each fix and part decides as recorded for the
    installed upstream (active where the probe shows the defect, standing aside where upstream
    behaves, never refused on a proven upstream)."""
    import importlib.metadata
    import json

    script = (
        "import json, megatron.fixes as f\n"
        "out = {}\n"
        "for x in f.fixes():\n"
        "    for p in (getattr(x, 'parts', ()) or (x,)):\n"
        "        status, reason = p.decide()\n"
        "        out[p.name] = [x.name, status.name, reason]\n"
        "print('VERDICTS', json.dumps(out))\n"
    )
    out = run_python(script, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("VERDICTS "))
    verdicts = json.loads(line[len("VERDICTS ") :])
    aside = EXPECTED_ASIDE[importlib.metadata.version("megatron-core")]
    expected = {
        part: "STANDS_ASIDE" if fix in aside else "ACTIVE" for part, (fix, _, _) in verdicts.items()
    }
    assert {part: v[1] for part, v in verdicts.items()} == expected, verdicts


@pytest.mark.slow
def test_cli_prints_the_listing_alone(fixes_cli):
    """No warning line before the listing: upstream's known-harmless import notices are hidden
    (megatron.overlay.quiet) and the fixes' probes cause none of their own."""
    out = fixes_cli["text"]
    assert out.returncode == 0, out.stderr[-3000:]
    warned = [ln for ln in out.stderr.splitlines() if "Warning" in ln or "warnings.warn" in ln]
    assert not warned, "\n".join(warned)
    assert out.stdout.startswith("replication: "), out.stdout[:500]
