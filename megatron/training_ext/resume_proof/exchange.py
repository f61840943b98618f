"""The resume proof's exchange: every rank's share of the state digest, combined on every rank.

Each rank sums the elements it holds as the main replica; the digest of a tensor needs the sum over
ranks (modulo 2**64), and the proof also needs every rank's RNG digests and optimizer steps. The
first exchange of a process gathers every rank's share with ``all_gather_object`` and lays out a
vector with a slot per value (:class:`Slots`); later exchanges, while no rank's description
changes, are one ``all_reduce`` of that int64 vector (no pickling). A rank that could not digest
its state sets a flag in the vector, and only then are the failures' texts gathered, so that every
rank raises :class:`DigestUnavailable` together.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from megatron.overlay import OverlayError
from megatron.overlay.collective import all_gather_object
from megatron.training_ext.console import process_rank

__all__ = ["Combined", "DigestExchange", "DigestUnavailable", "Share", "Slots", "fingerprint"]

_MASK = (1 << 64) - 1
_M32 = (1 << 32) - 1

#: One rank's share: ``(sums, meta, skipped, rng, scalars, error)`` (see
#: :meth:`DigestExchange.exchange`).
Share = Tuple[Dict[str, int], Dict[str, Tuple], List[str], Dict[str, str], dict, Optional[str]]
#: The combined shares: ``(sums, meta, skipped, rngs, steps)`` (see
#: :meth:`DigestExchange.exchange`).
Combined = Tuple[Dict[str, List[int]], Dict[str, Tuple], List[str], List[Dict[str, str]], list]


class DigestUnavailable(OverlayError, RuntimeError):
    """Some rank could not digest its state (raised on every rank, after the exchange)."""


@dataclass
class Slots:
    """Where each rank's values sit in the exchange vector (the same on every rank): cached between
    digests of one process, because the set of tensors, their descriptions, the RNG streams and the
    number of optimizer steps do not change between saves of a run.

    Vector (int64, every value in ``[0, 2**32)``, so the sum over ranks never overflows): ``[0]``
    number of ranks that failed, ``[1]`` number of ranks whose description changed, then two
    halves (low, high 32 bits) per tensor key (summed over ranks), per RNG stream of each rank and
    per optimizer step value of each rank (one rank writes each of those, the others write 0)."""

    world: int
    fingerprints: List[str]  # per rank: its description's (:func:`fingerprint`)
    keys: List[str]
    meta: Dict[str, Tuple]
    skipped: List[str]
    rng_names: List[Tuple[str, ...]]  # per rank
    n_steps: List[int]  # per rank
    index: Dict[str, int] = field(default_factory=dict)  # key -> its low half's slot

    def __post_init__(self) -> None:
        self.index = {k: 2 + 2 * i for i, k in enumerate(self.keys)}
        self.rng_at, at = [], 2 + 2 * len(self.keys)
        for names in self.rng_names:
            self.rng_at.append(at)
            at += 2 * len(names)
        self.steps_at = []
        for n in self.n_steps:
            self.steps_at.append(at)
            at += 2 * n
        self.size = at


def fingerprint(mine: Share) -> str:
    """What the exchange's layout depends on in this rank's share (not the values): 32 hex
    digits."""
    sums, meta, skipped, rng, scalars, _error = mine
    desc = (
        sorted(meta.items()),
        sorted(sums),
        sorted(skipped),
        sorted(rng),
        len(scalars.get("optimizer_step", ())),
    )
    return hashlib.blake2b(repr(desc).encode(), digest_size=16).hexdigest()


def _put(vec: List[int], at: int, value: int) -> None:
    vec[at] = value & _M32
    vec[at + 1] = (value >> 32) & _M32


def _double_bits(step: float) -> int:
    return struct.unpack("<Q", struct.pack("<d", step))[0]


def _bits_double(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<Q", bits))[0]


def _exchange_device() -> torch.device:
    import torch.distributed as dist

    if "nccl" in str(dist.get_backend()).lower() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _combine(gathered: List[Tuple[Share, str]]) -> Combined:
    """The combined shares of every rank's ``(share, fingerprint)``.

    Raises:
        DigestUnavailable: a rank failed, or two ranks describe a tensor differently.
    """
    errors = [g[0][5] for g in gathered if g[0][5]]
    if errors:
        raise DigestUnavailable("; ".join(errors[:4]))
    sums: Dict[str, List[int]] = {}
    meta: Dict[str, Tuple] = {}
    skipped: set = set()
    for (rank_sums, rank_meta, rank_skipped, _, _, _), _fp in gathered:
        skipped.update(rank_skipped)
        for key, value in rank_sums.items():
            sums.setdefault(key, []).append(value)
            old = meta.setdefault(key, rank_meta[key])
            if old[:2] != rank_meta[key][:2]:
                raise DigestUnavailable(
                    f"resume proof: ranks disagree on tensor {key!r}: {old} vs {rank_meta[key]}"
                )
    steps = sorted({s for (g, _fp) in gathered for s in g[4]["optimizer_step"]})
    rngs = [g[3] for (g, _fp) in gathered]
    return sums, meta, sorted(skipped), rngs, steps


class DigestExchange:
    """Combines every rank's share of the state digest (collective over the world), keeping the
    layout of the cheap exchange (:class:`Slots`) between the digests it combines (the installed
    proof keeps one per install).

    Attributes:
        slots: the layout laid out by the last gathering exchange on every rank (``None`` before
            the first one, and without a process group).
    """

    def __init__(self, group: Any = None) -> None:
        self.slots: Optional[Slots] = None
        self.group = group  # None: the default group (world); else a gloo group of the world

    def gather_all(self, mine: Share) -> Combined:
        """Every rank's share by ``all_gather_object``, whatever :attr:`slots` holds (what the
        first exchange of a process does, and any exchange after a rank's description changed);
        lays out :attr:`slots` for the next :meth:`exchange`. Collective; arguments and result as
        :meth:`exchange`.

        Raises:
            DigestUnavailable: as :meth:`exchange`.
        """
        import torch.distributed as dist

        distributed = dist.is_initialized()
        gathered = all_gather_object(
            (mine, fingerprint(mine) if distributed else ""), group=self.group
        )
        combined = _combine(gathered)
        if distributed:
            self.slots = Slots(
                world=len(gathered),
                fingerprints=[fp for _g, fp in gathered],
                keys=sorted(combined[0]),
                meta=combined[1],
                skipped=combined[2],
                rng_names=[tuple(sorted(g[3])) for (g, _fp) in gathered],
                n_steps=[len(g[4]["optimizer_step"]) for (g, _fp) in gathered],
            )
        return combined

    def exchange(self, mine: Share) -> Combined:
        """Combine every rank's share of the digest (collective over the world).

        Args:
            mine: ``(sums, meta, skipped, rng, scalars, error)`` of this rank: per tensor key its
                partial sum (``[0, 2**64)``) and its ``(global shape, dtype, kind)``; the keys
                not digested; its RNG digests (stream -> 16 hex digits); ``scalars`` with
                ``optimizer_step`` (floats); ``error``: None, or the reason this rank could not
                digest its state.

        Returns:
            ``(sums, meta, skipped, rngs, steps)``: per tensor key the partial sums (to add modulo
            2**64) and the (shape, dtype, kind); the keys not digested; per rank its RNG digests;
            the optimizer step values of all ranks (sorted, distinct).

        Raises:
            DigestUnavailable: on every rank, when a rank failed (every failure's text, gathered
                only then) or two ranks describe a tensor differently.

        With :attr:`slots` of an earlier exchange and an unchanged description on every rank, this
        is one ``all_reduce`` of a small int64 vector; otherwise :meth:`gather_all`.
        """
        import torch.distributed as dist

        slots = self.slots
        if (
            not dist.is_initialized()
            or slots is None
            or slots.world != dist.get_world_size(self.group)
        ):
            return self.gather_all(mine)
        error = mine[5]
        device = torch.device("cpu") if self.group is not None else _exchange_device()
        t = torch.tensor(_vector(slots, mine), dtype=torch.int64, device=device)
        dist.all_reduce(t, group=self.group)
        total = t.tolist()
        if total[0]:  # every rank is here: gather the failures' texts
            errors = all_gather_object(error, group=self.group)
            raise DigestUnavailable("; ".join([e for e in errors if e][:4]))
        if total[1]:
            return self.gather_all(mine)
        return _unpack(slots, total)


def _vector(slots: Slots, mine: Share) -> List[int]:
    """This rank's exchange vector: its failure or changed description flag, or its values in
    their slots."""
    my_sums, _meta, _skipped, rng, scalars, error = mine
    rank = process_rank()
    vec = [0] * slots.size
    if error:
        vec[0] = 1
    elif fingerprint(mine) != slots.fingerprints[rank]:
        vec[1] = 1
    else:
        for key, value in my_sums.items():
            _put(vec, slots.index[key], value)
        at = slots.rng_at[rank]
        for i, name in enumerate(slots.rng_names[rank]):
            _put(vec, at + 2 * i, int(rng[name], 16))
        at = slots.steps_at[rank]
        for i, step in enumerate(scalars["optimizer_step"]):
            _put(vec, at + 2 * i, _double_bits(step))
    return vec


def _unpack(slots: Slots, total: List[int]) -> Combined:
    """The combined shares from the reduced vector."""

    def value(at: int) -> int:
        return (total[at] + (total[at + 1] << 32)) & _MASK

    sums = {key: [value(at)] for key, at in slots.index.items()}
    rngs = [
        {name: f"{value(at + 2 * i):016x}" for i, name in enumerate(names)}
        for names, at in zip(slots.rng_names, slots.rng_at)
    ]
    steps = set()
    for n, at in zip(slots.n_steps, slots.steps_at):
        for i in range(n):
            steps.add(_bits_double(value(at + 2 * i)))
    return sums, slots.meta, slots.skipped, rngs, sorted(steps)
