"""Fix ``help_text``: ``--help`` of upstream's parser works (an unescaped ``%`` broke it)."""

from __future__ import annotations

import argparse

import pytest

import megatron.fixes
from megatron.fixes.help_text import FIX, escape_help, unexpandable_help


def _upstream_parser():
    from megatron.training import arguments

    return arguments.add_megatron_arguments(argparse.ArgumentParser(prog="pretrain_gpt.py"))


def test_guard_unfixed_upstream_help_raises():
    megatron.fixes.reset()
    parser = _upstream_parser()
    assert [a.option_strings[0] for a in unexpandable_help(parser)] == [
        "--moe-paged-stash-buffer-size-factor-cuda"
    ]
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
