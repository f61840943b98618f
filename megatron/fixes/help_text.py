"""Fix: ``pretrain_gpt.py --help`` crashes on an unescaped ``%`` in an upstream help string.

megatron-core 0.19.2 declares ``--moe-paged-stash-buffer-size-factor-cuda`` with the help text
``... (e.g. 1.10 = 10%).``. argparse expands help strings with ``%`` formatting (``%(default)s``),
so formatting the help of that argument raises ``ValueError: unsupported format character ')'``:
``--help`` of every upstream entrypoint fails instead of printing the usage.

The replacement wraps ``megatron.training.arguments.add_megatron_arguments`` (``parse_args`` calls
it through the module global): after upstream has added its arguments, every help string that
argparse cannot expand gets each ``%`` that does not start a ``%(name)s`` reference doubled.
Arguments whose help expands already are left exactly as upstream wrote them.

Detection of a fixed upstream is by capability: every help string of upstream's parser expands.
"""

from __future__ import annotations

import argparse
import re
from typing import Callable

from megatron.fixes.standins import upstream_own
from megatron.overlay import Fix, Patch
from megatron.overlay.registry import wraps_upstream

_BARE_PERCENT = re.compile(r"%(?!\(\w+\)[a-z]|%)")


def unexpandable_help(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The actions of ``parser`` whose help string argparse cannot expand.

    (``--help`` would raise on them.)
    """
    formatter = parser._get_formatter()
    bad = []
    for action in parser._actions:
        if not action.help or action.help is argparse.SUPPRESS:
            continue
        try:
            formatter._expand_help(action)
        except (ValueError, TypeError, KeyError):
            bad.append(action)
    return bad


def escape_help(parser: argparse.ArgumentParser) -> list[str]:
    """Double every bare ``%`` in the help strings argparse cannot expand.

    Returns:
        the first option string of each action changed.
    """
    changed = []
    for action in unexpandable_help(parser):
        action.help = _BARE_PERCENT.sub("%%", action.help)
        changed.append(action.option_strings[0] if action.option_strings else action.dest)
    return changed


def wrap_add_megatron_arguments(upstream: Callable) -> Callable:
    """Factory of the replacement of ``megatron.training.arguments.add_megatron_arguments``:
    upstream's, then every help string argparse cannot expand escaped (:func:`escape_help`)."""

    @wraps_upstream(upstream)
    def add_megatron_arguments(parser):
        """Upstream's, then every help string's bare ``%`` escaped."""
        parser = upstream(parser)
        escape_help(parser)
        return parser

    return add_megatron_arguments


class HelpTextFix(Fix):
    name = "help_text"
    title = "--help works: bare % in upstream help strings escaped"
    upstream_refs = (
        "megatron-core arguments.py --moe-paged-stash-buffer-size-factor-cuda help '10%)'",
    )
    package = "megatron-core"

    patches = (
        Patch(
            "megatron.training.arguments.add_megatron_arguments",
            wrap_add_megatron_arguments,
            "an unescaped % in a help string makes argparse raise ValueError on --help",
            params=("parser",),
        ),
    )

    def upstream_behaves(self) -> bool:
        """True if every help string of upstream's own parser expands (:func:`unexpandable_help`
        on ``add_megatron_arguments``, under no wrapper of this overlay)."""
        from megatron.training import arguments

        parser = upstream_own(arguments.add_megatron_arguments)(argparse.ArgumentParser())
        return not unexpandable_help(parser)


FIX = HelpTextFix()
