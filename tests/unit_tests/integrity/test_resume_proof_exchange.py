"""The resume proof's exchange of partial sums: the cached one-``all_reduce`` path gives what the
``all_gather_object`` path gives (sums modulo 2**64, descriptions, RNG digests per rank, optimizer
steps), falls back to it when a rank's description changes, and a rank's failure makes every rank
raise with its text."""

from __future__ import annotations

import pytest

from tests.helpers.dist import run_distributed

_BIG = (1 << 64) - 5  # partial sums near 2**64: their sum wraps


def _share(rank: int, salt: int, extra_key: bool = False, error=None):
    sums = {"shared": (_BIG - rank * salt) % (1 << 64), f"only{rank}": 7 * salt + rank}
    meta = {k: ((4, 2), "float32", "model") for k in sums}
    if extra_key:
        sums["new"] = salt
        meta["new"] = ((3,), "float32", "optimizer")
    rng = {"torch": f"{(salt * 0x9E3779B97F4A7C15 + rank) % (1 << 64):016x}", "random": "00ff"}
    rng["random"] = f"{int(rng['random'], 16):016x}"
    scalars = {"optimizer_step": [float(salt) + 0.5 * rank]}
    return (sums, meta, [f"skipped{rank}"], rng, scalars, error)


def _body(rank, world):
    from megatron.training_ext import resume_proof as rp

    ex = rp.DigestExchange()

    def both(share):
        fast = ex.exchange(share)  # the cached path where slots exist
        slow = rp.DigestExchange().gather_all(share)
        fast = ({k: sum(v) % (1 << 64) for k, v in fast[0].items()},) + tuple(fast[1:])
        slow = ({k: sum(v) % (1 << 64) for k, v in slow[0].items()},) + tuple(slow[1:])
        return fast, slow

    first = ex.exchange(_share(rank, 3))
    assert ex.slots is not None and first[3][1]["torch"] == _share(1, 3)[3]["torch"]
    fast, slow = both(_share(rank, 5))
    assert fast == slow
    sums, meta, skipped, rngs, steps = fast
    assert sums["shared"] == (2 * _BIG - 5) % (1 << 64) and sums["only1"] == 36
    assert skipped == ["skipped0", "skipped1"] and steps == [5.0, 5.5]
    assert rngs == [_share(r, 5)[3] for r in range(world)]
    # rank 1's description changes: every rank takes the gathering path, then the new slots
    changed = _share(rank, 6, extra_key=rank == 1)
    fast, slow = both(changed)
    assert fast == slow and fast[0]["new"] == 6 and "new" in ex.slots.keys
    # the ranks' descriptions swap (a restart that renumbered them): gathered again, not misplaced
    fast, slow = both(_share(1 - rank, 8))
    assert fast == slow and fast[3] == [_share(1, 8)[3], _share(0, 8)[3]]
    # a rank fails: every rank raises, with its text
    with pytest.raises(rp.DigestUnavailable, match="rank 1: TypeError: no byte view"):
        ex.exchange(
            _share(
                rank,
                7,
                extra_key=rank == 1,
                error="rank 1: TypeError: no byte view" if rank else None,
            )
        )


def test_cached_exchange_equals_gathering():
    run_distributed(_body, 2)
