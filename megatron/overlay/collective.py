"""All ranks agree on errors, then all raise: the one collective every check here uses.

A check that finds a problem on some ranks must not let the others walk into the next collective
alone (they would hang). :func:`agree_on_failures` gathers every rank's messages in one
``all_gather_object``; :func:`raise_if_any_failed` raises the same :class:`RankFailures` subclass
on every rank when any rank failed, carrying ``failures`` per rank, the way PyTorch DCP's
``CheckpointException`` does.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

from megatron.overlay.errors import OverlayError

#: Messages kept per rank in an exception's text (all are counted).
MAX_PER_RANK = 20


class RankFailures(OverlayError):
    """Base of every error raised on all ranks because some rank failed a check.

    Attributes:
        failures: global rank -> that rank's messages (only ranks that failed).
    """

    def __init__(self, message: str, failures: dict[int, list[str]] | None = None) -> None:
        super().__init__(message)
        self.failures: dict[int, list[str]] = dict(failures or {})

    @classmethod
    def from_failures(
        cls,
        header: str,
        failures: dict[int, list[str]],
        limit: int = MAX_PER_RANK,
        prefix: str = "  ",
    ) -> "RankFailures":
        """An instance whose message is ``header`` then one line per message, ``rank R: msg``
        (at most ``limit`` per rank, then a count of the rest)."""
        return cls(header + "\n" + "\n".join(failure_lines(failures, limit, prefix)), failures)


def failure_lines(
    failures: dict[int, list[str]], limit: int = MAX_PER_RANK, prefix: str = ""
) -> list[str]:
    """``[f"{prefix}rank R: msg", ...]`` in rank order, at most ``limit`` per rank."""
    lines = []
    for rank in sorted(failures):
        msgs = failures[rank]
        lines.extend(f"{prefix}rank {rank}: {m}" for m in msgs[:limit])
        if len(msgs) > limit:
            lines.append(f"{prefix}rank {rank}: ... and {len(msgs) - limit} more")
    return lines


def summarize(gathered: list, limit: int = 3, width: int = 300) -> str:
    """``[[messages of rank 0], [messages of rank 1], ...]`` -> one line: each distinct message
    once (shortened to ``width`` characters), with the ranks that reported it; at most ``limit``
    messages, then a count of the rest."""
    by_text: dict[str, list[int]] = {}
    for r, msgs in enumerate(gathered):
        for m in msgs or []:
            by_text.setdefault(str(m), []).append(r)
    items = list(by_text.items())
    shown = "; ".join(
        f"rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))}: {shorten(t, width)}"
        for t, rs in items[:limit]
    )
    more = f" (+{len(items) - limit} more)" if len(items) > limit else ""
    return shown + more


def shorten(text: str, limit: int = 300) -> str:
    """``text`` on one line (whitespace runs collapsed), at most ``limit`` characters."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def all_gather_object(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's ``obj`` (``[obj]`` without an initialised process group).

    Args:
        group: a ``torch.distributed`` process group, or an object with ``all_gather_object``
            (NVRx's ``GroupWrapper``), or None for the default group.
    """
    if group is not None and hasattr(group, "all_gather_object"):
        return list(group.all_gather_object(obj))
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _global_ranks(group: Any, n: int) -> Sequence[int]:
    if group is not None and hasattr(group, "get_global_rank"):
        return [group.get_global_rank(r) for r in range(n)]
    if group is None or n == 1:
        return list(range(n))
    import torch.distributed as dist

    return [dist.get_global_rank(group, r) for r in range(n)]


def agree_on_failures(my_failures: Iterable[str], group: Any = None) -> dict[int, list[str]]:
    """Collective: global rank -> messages, for every rank of ``group`` that has any.

    Every rank of ``group`` must call it (one ``all_gather_object``); every rank gets the same
    dict.
    """
    gathered = all_gather_object(list(my_failures), group)
    ranks = _global_ranks(group, len(gathered))
    return {ranks[i]: list(msgs) for i, msgs in enumerate(gathered) if msgs}


def raise_if_any_failed(
    my_failures: Iterable[str],
    header: str,
    exc_type: type[RankFailures] = RankFailures,
    group: Any = None,
    limit: int = MAX_PER_RANK,
) -> None:
    """Collective: raise ``exc_type`` on every rank of ``group`` if any rank has failures.

    Raises:
        RankFailures: (``exc_type``) with ``header`` and each rank's messages, on every rank.
    """
    failures = agree_on_failures(my_failures, group)
    if failures:
        raise exc_type.from_failures(header, failures, limit)
