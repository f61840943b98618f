"""Fix ``help_text``: ``--help`` of upstream's parser works (an unescaped ``%`` broke it)."""

from __future__ import annotations

import argparse

import pytest

import megatron.fixes
from megatron.fixes.help_text import FIX, escape_help, unexpandable_help
from tests.unit_tests.fixes.probe_copies import trivial_wrapper


def _upstream_parser():
    from megatron.training import arguments

    return arguments.add_megatron_arguments(argparse.ArgumentParser(prog="pretrain_gpt.py"))


#: The flags whose help has a bare ``%``, per upstream (the defect moved on upstream main).
UNEXPANDABLE = {
    "0.19.2": ["--moe-paged-stash-buffer-size-factor-cuda"],
    "0.20.0": ["--mhc-recompute-layer-num"],  # upstream main, d98e8a6
}


def test_guard_unfixed_upstream_help_raises():
    import importlib.metadata

    megatron.fixes.reset()
    parser = _upstream_parser()
    expected = UNEXPANDABLE[importlib.metadata.version("megatron-core")]
    assert [a.option_strings[0] for a in unexpandable_help(parser)] == expected
    with pytest.raises(ValueError, match="unsupported format character"):
        parser.format_help()


def test_fixed_help_prints_and_keeps_the_text():
    megatron.fixes.reset()
    assert FIX.apply().value == "active"
    try:
        text = _upstream_parser().format_help()
    finally:
        FIX.reset()
    assert "--moe-paged-stash-buffer-size-factor-cuda" in text and "10%)" in text
    assert "--tensor-model-parallel-size" in text


def test_escape_keeps_default_references():
    p = argparse.ArgumentParser()
    p.add_argument("--a", default=3, help="x %(default)s and 5%")
    p.add_argument("--b", help="fine 5%% already")
    assert escape_help(p) == ["--a"]
    text = p.format_help()
    assert "x 3 and 5%" in text and "fine 5% already" in text


def test_probe_sees_the_defect_through_a_wrapper_and_not_under_the_fix(monkeypatch):
    from megatron.training import arguments

    megatron.fixes.reset()
    assert FIX.upstream_behaves() is False
    monkeypatch.setattr(
        arguments, "add_megatron_arguments", trivial_wrapper(arguments.add_megatron_arguments)
    )
    assert FIX.upstream_behaves() is False
    monkeypatch.undo()
    assert FIX.apply().value == "active"
    try:
        assert FIX.upstream_behaves() is False  # upstream's own parser, under the fix's wrapper
        assert not unexpandable_help(_upstream_parser())
    finally:
        FIX.reset()
