"""``--loss-log PATH``: exact per-iteration losses, for bitwise comparisons between runs.

Wraps upstream's ``megatron.training.training.training_log`` (called once per iteration by
``train()`` with the DP-reduced losses) and appends one JSON line per iteration (wrapped here)::

    {"iteration": 11, "skipped": 0, "launch": "1796418000-4242", "lm loss": "0x1.7d5e2ep+2",
     "lm loss (decimal)": 5.958, "grad norm": "0x1.3p+0", ...}

Floats are written with ``float.hex`` so that two runs can be compared bit for bit. ``launch``
(start time in seconds and pid of the logging process) tells the launches of one run apart, also
when a resume lost no iteration (``tools/plot_losses.py``).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from megatron.overlay import Patch, wraps_upstream
from megatron.overlay.component import Component


@dataclass
class LossLogState:
    """The loss log of one install.

    Attributes:
        path: the JSON-lines file the last rank appends to.
        launch: pid -> this launch's id (start time in seconds and pid; a forked rank gets its
            own).
    """

    path: str
    launch: dict[int, str] = field(default_factory=dict)

    def launch_id(self) -> str:
        pid = os.getpid()
        if pid not in self.launch:
            self.launch.clear()
            self.launch[pid] = f"{int(time.time())}-{pid}"
        return self.launch[pid]


def _as_float(value) -> float | None:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return float(value.detach().float().reshape(-1)[0].item())
    return float(value)


def wrap_training_log(upstream):
    """Factory of the replacement of ``megatron.training.training.training_log``: upstream's,
    after the last rank appends the iteration's losses and grad norm (``float.hex``) to the path
    given to :func:`install`."""

    @wraps_upstream(upstream)
    def training_log(
        loss_dict,
        total_loss_dict,
        learning_rate,
        iteration,
        loss_scale,
        report_memory_flag,
        skipped_iter,
        grad_norm,
        params_norm,
        *args,
        **kwargs,
    ):
        """Upstream's ``training_log``, after appending this iteration's losses to the log."""
        state = COMPONENT.state
        rank_ok = (
            not torch.distributed.is_initialized()
            or torch.distributed.get_rank() == torch.distributed.get_world_size() - 1
        )
        if state is not None and rank_ok and loss_dict:
            record: dict[str, object] = {
                "iteration": int(iteration),
                "skipped": int(skipped_iter),
                "launch": state.launch_id(),
            }
            for key, value in list(loss_dict.items()) + [("grad norm", grad_norm)]:
                v = _as_float(value)
                if v is not None:
                    record[key] = v.hex()
                    record[f"{key} (decimal)"] = v
            with open(state.path, "a") as f:
                f.write(json.dumps(record) + "\n")
        return upstream(
            loss_dict,
            total_loss_dict,
            learning_rate,
            iteration,
            loss_scale,
            report_memory_flag,
            skipped_iter,
            grad_norm,
            params_norm,
            *args,
            **kwargs,
        )

    return training_log


class LossLog(Component[LossLogState]):
    """``--loss-log PATH``: the last rank appends each iteration's losses to ``PATH``."""

    name = "loss_log"
    title = "--loss-log: exact (float.hex) per-iteration losses and grad norm, as JSON lines"
    patches = (
        Patch(
            "megatron.training.training.training_log",
            wrap_training_log,
            "--loss-log: each iteration's reduced losses and grad norm, exact (float.hex)",
            params=("loss_dict", "iteration", "skipped_iter", "grad_norm"),
        ),
    )

    def enabled(self, args) -> bool:
        return bool(getattr(args, "loss_log", None))

    def new_state(self, args) -> LossLogState:
        return LossLogState(path=args.loss_log)


#: The component (entry point ``loss_log``); a second install with another path redirects the log.
COMPONENT = LossLog()
PATCHES = LossLog.patches


def install(path: str) -> None:
    """Install the loss log appending to ``path`` (a JSON line per iteration; a second call with
    another path redirects the log)."""
    COMPONENT.install(SimpleNamespace(loss_log=path))


def uninstall() -> None:
    """Undo :func:`install` (tests)."""
    COMPONENT.uninstall()


def read(path: str) -> dict[int, dict[str, object]]:
    """Read a loss log: iteration -> record (the last record wins for repeated iterations)."""
    out: dict[int, dict[str, object]] = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                out[int(rec["iteration"])] = rec
    return out
