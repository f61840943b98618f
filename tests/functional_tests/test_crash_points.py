"""Crash points: a ``SIGKILL`` of the whole launch right before any file-system operation of a save
leaves a run that resumes right (:mod:`tests.helpers.crash_points`; ``docs/crash-points.md``).

Default lane: a fixed sample (:data:`SAMPLE`): for the local tier's replicated save and the
persistent ``torch_dist`` save, one recorded launch each (its operations and the reference losses)
and two crash points of it, one of them cross-rank (one rank past its rename, the other held
before its own). Each point is two launches: the killed one and the restart, whose
resumed iteration, resume proof and losses (bitwise, against the recorded launch) are checked.

The full sweep (every point of every save kind, about 40 min on 2 cores) is marker ``sweep``,
outside the default lane:

    scripts/test.sh -m sweep tests/functional_tests/test_crash_points.py
    python -m tests.helpers.crash_points        # the same, as a table
"""

from __future__ import annotations

import pytest

from tests.helpers import crash_points as cp

#: save kind -> the points of the sample (a part of each label): for the local tier, a kill before
#: rank 0's first file and one with rank 1 past its last rename and rank 0 held before its own; for
#: ``torch_dist``, a kill before megatron-core's ``metadata.json`` is written (an empty file after
#: DCP's ``.metadata``: the persistent tier took it for complete) and one with rank 1 past the
#: rename of its write record and rank 0 held before its own.
SAMPLE = {
    "local": (
        "before 0/main/open/local/0/iter_0000004_0_local.dirty.pt#1",
        "rank 1 past 1/main/rename/local/1/iter_0000004_1_local.dirty.pt",
    ),
    "torch_dist": (
        "before 0/main/write/ckpt/iter_0000004/metadata.json#1",
        "rank 1 past 1/main/rename/ckpt/iter_0000004/__1_0.distcp",
    ),
}
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
    rec, outcomes = cp.sweep(kind, tmp_path, report=lambda s: None, match=SAMPLE[name])
    assert len(outcomes) == 2 and len(outcomes[1].point.targets) == 2, [o.point for o in outcomes]
    _assert_all_right(kind, outcomes)
    if name == "torch_dist":  # the interrupted save is not taken for complete
        assert outcomes[0].resumed == kind.older, outcomes[0]


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
