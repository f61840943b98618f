"""Setup mistakes about the training data, refused in the first seconds with a message that says
what to give instead of failing late or obscurely.

* No ``--data-path`` (nor per-split paths nor ``--mock-data``): upstream fails on every rank with
  ``AttributeError: 'NoneType' object has no attribute 'startswith'`` while building the dataset.
* An indexed dataset holding token ids >= the model's vocabulary (``--padded-vocab-size``, from
  ``--vocab-size`` or the tokenizer): upstream trains until a batch holds such an id, then fails
  with an ``IndexError`` in the embedding. :func:`check_token_ids` scans the ``.bin`` files, split
  over all ranks (``numpy`` max over a memory map), before the datasets are built.
"""

from __future__ import annotations

import logging
import os
import struct
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

logger = logging.getLogger("megatron.training_ext.data_checks")

__all__ = ["check_data_args", "check_token_ids", "data_prefixes", "max_token_id"]

SCAN_BYTES_PER_RANK = 4 << 30
"""Bytes of token data one rank reads in full; beyond that, evenly spaced windows of that total are
scanned (the log line says which fraction)."""

_WINDOW = 1 << 20
_CHECKED: Dict[Tuple[Tuple[str, ...], int], Dict[str, int]] = {}


def clear_cache() -> None:
    """Forget the token-id checks done in this process (a new attempt of in-process restart checks
    its data afresh, as a new process would)."""
    _CHECKED.clear()


def check_data_args(args: Any) -> None:
    """Refuse a training run without data.

    Raises:
        SystemExit: no ``--data-path``, ``--data-args-path``, ``--train-data-path`` /
            ``--valid-data-path`` / ``--test-data-path``, ``--per-split-data-args-path`` and no
            ``--mock-data``; raised on every rank before any model is built.
    """
    if getattr(args, "mock_data", False):
        return
    names = (
        "data_path",
        "data_args_path",
        "train_data_path",
        "valid_data_path",
        "test_data_path",
        "per_split_data_args_path",
    )
    if any(getattr(args, n, None) for n in names):
        return
    raise SystemExit(
        "pretrain_gpt.py: no training data: give --data-path PREFIX [PREFIX ...] (an "
        "indexed dataset, <PREFIX>.bin and <PREFIX>.idx, made by tools/preprocess_data.py), "
        "or --train-data-path/--valid-data-path/--test-data-path, or --mock-data for "
        "synthetic data"
    )


def data_prefixes(blend, blend_per_split) -> List[str]:
    """The distinct dataset prefixes of upstream's ``get_blend_and_blend_per_split`` result."""
    out: List[str] = []
    for b in ([blend] if blend else []) + list(blend_per_split or []):
        if b:
            for p in b[0]:
                if p not in out:
                    out.append(p)
    return out


def _token_dtype(prefix: str) -> np.dtype:
    from megatron.core.datasets.indexed_dataset import _INDEX_HEADER, DType

    idx = prefix + ".idx"
    try:
        with open(idx, "rb") as f:
            head = f.read(18)
    except OSError as e:
        raise SystemExit(f"pretrain_gpt.py: cannot read the indexed dataset {idx}: {e}") from e
    if head[:9] != _INDEX_HEADER or len(head) < 18:
        raise SystemExit(
            f"pretrain_gpt.py: {idx} is not a megatron-core indexed dataset index "
            "(make it with tools/preprocess_data.py)"
        )
    return np.dtype(DType.dtype_from_code(struct.unpack("<B", head[17:18])[0]))


def max_token_id(
    prefix: str, part: int = 0, parts: int = 1, budget_bytes: int = SCAN_BYTES_PER_RANK
) -> Tuple[int, float]:
    """Largest token id in slice ``part`` of ``parts`` of ``<prefix>.bin``.

    Returns:
        (max id, or -1 for an empty slice; fraction of the slice's bytes read: 1.0, or less when
        the slice is larger than ``budget_bytes`` and evenly spaced windows were scanned).

    Raises:
        SystemExit: the files are missing or unreadable.
    """
    dtype = _token_dtype(prefix)
    path = prefix + ".bin"
    try:
        n = os.path.getsize(path) // dtype.itemsize
    except OSError as e:
        raise SystemExit(f"pretrain_gpt.py: cannot read the indexed dataset {path}: {e}") from e
    lo, hi = n * part // parts, n * (part + 1) // parts
    if hi <= lo:
        return -1, 1.0
    data = np.memmap(path, dtype=dtype, mode="r")
    span = hi - lo
    budget = max(budget_bytes // dtype.itemsize, 1)
    if span <= budget:
        step = 1 << 24
        return int(max(int(data[i : min(i + step, hi)].max()) for i in range(lo, hi, step))), 1.0
    win = max(min(_WINDOW // dtype.itemsize, budget), 1)
    count = max(budget // win, 1)
    starts = np.linspace(lo, hi - win, count).astype(np.int64)
    return int(max(int(data[s : s + win].max()) for s in starts)), count * win / span


def check_token_ids(prefixes: Sequence[str], vocab_size: int, group=None) -> Dict[str, int]:
    """Refuse datasets whose token ids do not fit the model's vocabulary. Collective when
    ``torch.distributed`` is initialised: rank ``r`` scans slice ``r`` of every ``.bin``, one
    ``all_gather_object`` combines the maxima.

    Args:
        prefixes: indexed dataset prefixes (``<prefix>.bin`` / ``.idx``).
        vocab_size: rows of the embedding (upstream's ``args.padded_vocab_size``).

    Returns:
        prefix -> largest token id.

    Raises:
        SystemExit: on every rank, naming each dataset whose largest id is >= ``vocab_size`` and
            what to change.
    """
    import torch.distributed as dist

    key = (tuple(prefixes), int(vocab_size))
    if key in _CHECKED:  # the provider runs once per virtual pipeline stage
        return dict(_CHECKED[key])
    ready = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if ready else (0, 1)
    mine = {p: max_token_id(p, rank, world) for p in prefixes}
    if world > 1:
        gathered: List[Optional[dict]] = [None] * world
        dist.all_gather_object(gathered, mine, group=group)
    else:
        gathered = [mine]
    maxima = {p: max(g[p][0] for g in gathered) for p in prefixes}
    coverage = min((sum(g[p][1] for g in gathered) / world for p in prefixes), default=1.0)
    bad = {p: m for p, m in maxima.items() if m >= vocab_size}
    if rank == 0:
        logger.info(
            "data_checks: largest token id %s (vocabulary %d, %.0f%% of the data scanned)",
            max(maxima.values(), default=-1),
            vocab_size,
            100 * coverage,
        )
    if bad:
        listed = "; ".join(f"{p} holds token id {m}" for p, m in bad.items())
        raise SystemExit(
            f"pretrain_gpt.py: the training data does not fit the model's vocabulary of "
            f"{vocab_size} token ids (0-{vocab_size - 1}, --vocab-size or the tokenizer's size, "
            f"padded by "
            f"--make-vocab-size-divisible-by): {listed}. Use the tokenizer the data was made with "
            f"(--tokenizer-type and its files), or a --vocab-size of at least "
            f"{max(bad.values()) + 1}."
        )
    _CHECKED[key] = maxima
    return maxima
