r"""Draw the loss curves of one or more runs on one figure, marking every resume and the
iterations it lost.

    python tools/plot_losses.py runs/quickstart/losses.jsonl -o runs/quickstart/losses.png
    python tools/plot_losses.py straight.jsonl resumed.jsonl runs/exp/tb --label straight \
        --label resumed --label tb -o compare.svg

Each input is a ``--loss-log`` file of ``pretrain_gpt.py`` (one JSON line per iteration, appended
by every launch of a run) or a ``--tensorboard-dir`` (one event file per launch). A launch that
starts at or before the previous launch's last iteration is a resume: it is drawn as its own
segment, a dashed line marks the iteration it resumed from, and the iterations trained again
(previous launch's last iteration minus the resumed one) are shaded and counted as lost. The
output format follows the file name (``.png``, ``.svg``, ``.pdf``); matplotlib, no display needed.

Exit status: 0 drawn, 2 bad input (no file, no series of that name).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from dataclasses import dataclass
from typing import List, Sequence, Tuple

#: The loss drawn by default: upstream's name of the language-model loss.
DEFAULT_KEY = "lm loss"


@dataclass
class Launch:
    """One launch of a run: its iterations and the values of the series, in order."""

    iterations: List[int]
    values: List[float]


@dataclass
class Resume:
    """A launch that started at ``resumed_from + 1`` after the previous one reached ``reached``:
    ``lost = reached - resumed_from`` iterations were trained again (0 when none)."""

    resumed_from: int
    reached: int

    @property
    def lost(self) -> int:
        return max(0, self.reached - self.resumed_from)


class InputError(ValueError):
    """An input that cannot be drawn (missing, unreadable, no such series)."""


def _split_launches(points: Sequence[Tuple[int, float, object]]) -> List[Launch]:
    """Points ``(iteration, value, launch id or None)`` in the order they were logged ->
    launches: a point whose launch id differs from the previous one's, or whose iteration is not
    above the previous one, begins a new launch."""
    out: List[Launch] = []
    last = None
    for it, v, launch in points:
        if last is None or it <= last[0] or launch != last[1]:
            out.append(Launch([], []))
        out[-1].iterations.append(it)
        out[-1].values.append(v)
        last = (it, launch)
    return out


def read_loss_log(path: str, key: str = DEFAULT_KEY) -> List[Launch]:
    """A ``--loss-log`` file -> its launches (iterations as logged, values as float; a launch
    per ``launch`` id, or, in logs without one, wherever the iteration does not increase).

    Raises:
        InputError: the file cannot be read, a line is not JSON, or no line has ``key``.
    """
    points = []
    try:
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise InputError(f"{path}:{n}: not a loss-log line ({e})") from None
                if key in rec and not rec.get("skipped"):
                    v = rec[key]
                    v = float.fromhex(v) if isinstance(v, str) else float(v)
                    points.append((int(rec["iteration"]), v, rec.get("launch")))
    except OSError as e:
        raise InputError(f"{path}: cannot be read ({e.strerror})") from None
    if not points:
        raise InputError(f"{path}: no iteration logs {key!r}")
    return _split_launches(points)


def read_tensorboard(path: str, key: str = DEFAULT_KEY) -> List[Launch]:
    """A TensorBoard log directory -> one launch per event file (in the order they were written).

    Raises:
        InputError: no event file, or none has the scalar ``key``.
    """
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted(glob.glob(os.path.join(path, "events.out.tfevents.*")), key=os.path.getmtime)
    if not files:
        raise InputError(f"{path}: no TensorBoard event file (events.out.tfevents.*)")
    points = []
    for f in files:
        acc = EventAccumulator(f, size_guidance={"scalars": 0})
        acc.Reload()
        if key in acc.Tags().get("scalars", []):
            points += [(int(e.step), float(e.value), f) for e in acc.Scalars(key)]
    if not points:
        raise InputError(f"{path}: no event file has the scalar {key!r}")
    return _split_launches(points)


def read_run(path: str, key: str = DEFAULT_KEY) -> List[Launch]:
    """A loss log (a file) or a TensorBoard directory -> its launches.

    Raises:
        InputError: see :func:`read_loss_log` and :func:`read_tensorboard`.
    """
    if os.path.isdir(path):
        return read_tensorboard(path, key)
    if not os.path.exists(path):
        raise InputError(
            f"{path}: no such file or directory (a --loss-log file or a --tensorboard-dir)"
        )
    return read_loss_log(path, key)


def resumes(launches: Sequence[Launch]) -> List[Resume]:
    """The resume between each pair of consecutive launches."""
    return [
        Resume(resumed_from=cur.iterations[0] - 1, reached=prev.iterations[-1])
        for prev, cur in zip(launches, launches[1:])
    ]


def describe(label: str, launches: Sequence[Launch]) -> str:
    """One line: launches, iterations, each resume and what it lost."""
    first, last = launches[0].iterations[0], launches[-1].iterations[-1]
    parts = [f"{label}: {len(launches)} launch(es), iterations {first}-{last}"]
    for r in resumes(launches):
        parts.append(f"resumed at {r.resumed_from} after {r.reached} ({r.lost} iterations lost)")
    return "; ".join(parts)


def plot(
    runs: Sequence[Tuple[str, List[Launch]]], out: str, key: str = DEFAULT_KEY, title: str = ""
) -> None:
    """Draw ``runs`` (label, launches) on one figure and write it to ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcParams["svg.hashsalt"] = "plot_losses"  # the same input gives the same SVG
    matplotlib.rcParams["svg.fonttype"] = "none"  # text as text: a small, readable SVG
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for n, (label, launches) in enumerate(runs):
        color = colors[n % len(colors)]
        for k, launch in enumerate(launches):
            style = "-" if k == 0 else "--"
            name = label if len(launches) == 1 else f"{label}, launch {k + 1}"
            ax.plot(launch.iterations, launch.values, style, color=color, marker=".", label=name)
        for r in resumes(launches):
            ax.axvline(r.resumed_from, color=color, linestyle=":", linewidth=1)
            if r.lost:
                ax.axvspan(r.resumed_from, r.reached, color=color, alpha=0.12)
            ax.annotate(
                f"resumed at {r.resumed_from}\n{r.lost} iterations lost",
                (r.resumed_from, 1.0),
                xycoords=("data", "axes fraction"),
                xytext=(4, -4),
                textcoords="offset points",
                va="top",
                fontsize=8,
                color=color,
            )
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("iteration")
    ax.set_ylabel(key)
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, metadata={"Date": None} if out.endswith(".svg") else None)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("inputs", nargs="+", help="--loss-log files or --tensorboard-dir directories")
    p.add_argument(
        "-o", "--output", default="losses.png", help="figure to write (.png, .svg, .pdf)"
    )
    p.add_argument("--label", action="append", default=[], help="legend name per input, in order")
    p.add_argument("--key", default=DEFAULT_KEY, help=f"series to draw (default {DEFAULT_KEY!r})")
    p.add_argument("--title", default="", help="figure title")
    a = p.parse_args(argv)
    if len(a.label) > len(a.inputs):
        p.error(f"{len(a.label)} --label for {len(a.inputs)} input(s)")
    labels = a.label + [os.path.basename(os.path.normpath(x)) for x in a.inputs[len(a.label) :]]
    try:
        runs = [(lab, read_run(x, a.key)) for lab, x in zip(labels, a.inputs)]
    except InputError as e:
        print(f"plot_losses.py: {e}", file=sys.stderr)
        return 2
    plot(runs, a.output, a.key, a.title)
    for lab, launches in runs:
        print(describe(lab, launches))
    print(f"wrote {a.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
