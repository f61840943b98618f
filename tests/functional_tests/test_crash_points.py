"""Crash points: a ``SIGKILL`` of the whole launch right before any file-system operation of a save
leaves a run that resumes right (:mod:`tests.helpers.crash_points`; ``docs/crash-points.md``).

Default lane: a fixed sample (:data:`SAMPLE`): for the local tier's replicated save and the
persistent ``torch_dist`` save, one recorded launch each (its operations and the reference losses)
and every ``N``-th crash point of it, cross-rank points included (one rank past its rename, the
other held before its own). Each point is two launches: the killed one and the restart, whose
resumed iteration, resume proof and losses (bitwise, against the recorded launch) are checked.

The full sweep (every point of every save kind, about 40 min on 2 cores) is marker ``sweep``,
outside the default lane:

    scripts/test.sh -m sweep tests/functional_tests/test_crash_points.py
    python -m tests.helpers.crash_points        # the same, as a table
"""

from __future__ import annotations

import pytest

from tests.helpers import crash_points as cp

#: save kind -> N: every N-th point of its recorded operations (the first included) and the last
#: cross-rank point.
SAMPLE = {"local": 20, "torch_dist": 17}
#: Save kinds whose full sweep fails at points that known defects make fail (rows of the issue
#: fixed on other branches, or found by the sweep and not fixed yet): strict=False until fixed.
KNOWN = {
    name: pytest.mark.xfail(
        strict=False,
        reason="; ".join(
            f"{'row ' + row if row.isdigit() else row}: {why}" for row, why in kind.known
        ),
    )
    for name, kind in cp.KINDS.items()
    if kind.known
}


def _assert_all_right(kind: cp.SaveKind, outcomes: list[cp.Outcome]) -> None:
    bad = [f"{o.point.label}: {o.what}" for o in outcomes if not o.ok]
    assert not bad, f"{kind.name}: {len(bad)} of {len(outcomes)} restarts wrong:\n" + "\n".join(bad)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SAMPLE))
def test_crash_point_sample(tmp_path, name):
    """A fixed sample of ``name``'s crash points: every restart resumes at the older checkpoint
    or the one being written, with the proof passing and the losses bitwise."""
    kind = cp.KINDS[name]
    rec, outcomes = cp.sweep(kind, tmp_path, every=SAMPLE[name], report=lambda s: None)
    assert len(outcomes) >= 2 and any(len(o.point.targets) > 1 for o in outcomes)
    _assert_all_right(kind, outcomes)


@pytest.mark.slow
@pytest.mark.sweep
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=KNOWN[n]) if n in KNOWN else n for n in cp.KINDS]
)
def test_crash_point_sweep(tmp_path, name):
    """Every crash point of ``name``'s save (module docstring)."""
    kind = cp.KINDS[name]
    rec, outcomes = cp.sweep(kind, tmp_path, report=print)
    assert len(outcomes) == len(cp.points(rec))
    _assert_all_right(kind, outcomes)
