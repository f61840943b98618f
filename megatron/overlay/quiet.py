"""Known-harmless upstream warnings, hidden behind one line.

On the CPU path every rank prints upstream's "Transformer Engine and Apex are not installed"
(seven modules), "Apex is not installed", torch's deprecation and no-accelerator notices and a few
more: about 40 lines per 2-rank launch that say nothing a ``--cpu`` user can act on. Installed
before anything imports upstream (``pretrain_gpt.py --cpu``, ``python -m megatron.fixes``), this
module filters exactly those (by message, :data:`WARNINGS` and :data:`LOG_RECORDS`) and says so in
one line on rank 0. ``MEGATRON_SHOW_WARNINGS=1`` shows them all again. Warnings the fork itself
caused are fixed where they arise, not filtered here.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import warnings

__all__ = ["LOG_RECORDS", "SHOW_ENV", "WARNINGS", "hide_known_warnings"]

#: Environment variable that turns the filters off.
SHOW_ENV = "MEGATRON_SHOW_WARNINGS"

#: ``warnings`` messages (regular expressions matched at the start) hidden on the CPU path.
WARNINGS = (
    r"Transformer Engine and Apex are not installed",  # megatron-core: no TE/apex on CPU
    r"Apex is not installed",
    r"Only transformer-engine>=",  # megatron-core's TE spec provider, TE absent
    r"'pin_memory' argument is set as true but no accelerator is found",  # torch DataLoader
    r"`torch\.jit\.script` is deprecated",  # megatron-core's jit-scripted helpers
    r"`torch\.distributed\.all_gather_into_tensor` is deprecated",  # megatron-core's gather
    r"MimoModelConfig is experimental",  # imported by megatron-core, not used by GPT
)

#: ``logging`` records (logger name, message regular expression matched anywhere) hidden on the
#: CPU path.
LOG_RECORDS = (
    ("torch.utils.cpp_extension", r"No CUDA runtime is found"),
    ("megatron.core.dist_checkpointing.strategies.torch", r"MCore's async save is deprecated"),
    # upstream saves ``args`` in the common state; ``args.rank`` differs per rank by design
    (
        "megatron.core.dist_checkpointing.validation",
        r"common state dict differs .*Mismatched keys: "
        r"\[\(\('args',\), <class 'argparse\.Namespace'>, <class 'argparse\.Namespace'>\)\]$",
    ),
)

_installed = False


class _DropRecords(logging.Filter):
    def __init__(self, pattern: str):
        super().__init__()
        self._re = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            return not self._re.search(record.getMessage())
        except Exception:  # noqa: BLE001 - a record that cannot be formatted is shown
            return True


def hide_known_warnings(announce: bool = True) -> bool:
    """Hide :data:`WARNINGS` and :data:`LOG_RECORDS` in this process (idempotent) and, when
    ``announce`` and this is rank 0 (``RANK`` unset or ``0``), print one line saying so.

    Returns:
        False when ``MEGATRON_SHOW_WARNINGS=1`` keeps every warning, else True.
    """
    global _installed
    if os.environ.get(SHOW_ENV, "") not in ("", "0"):
        return False
    if _installed:
        return True
    _installed = True
    for message in WARNINGS:
        warnings.filterwarnings("ignore", message=message)
    for name, pattern in LOG_RECORDS:
        logging.getLogger(name).addFilter(_DropRecords(pattern))
    if announce and os.environ.get("RANK", "0") == "0":
        sys.stdout.write(
            "[warnings] upstream's known-harmless CPU-path warnings are hidden (no Transformer "
            f"Engine/apex, torch deprecations, no accelerator); {SHOW_ENV}=1 shows them\n"
        )
        sys.stdout.flush()
    return True
