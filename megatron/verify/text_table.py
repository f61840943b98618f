"""Plain-text tables and byte counts for the verifier's and the benchmarks' console output
(:mod:`megatron.verify.report`, ``tools/bench_verify.py``): no colour, no terminal width
detection, so that logs of batch jobs read the same as a terminal.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Sequence

__all__ = ["format_table", "human_bytes"]


def format_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], max_width: int = 70) -> str:
    """A plain-text table (left-aligned text, right-aligned numbers); cells longer than
    ``max_width`` are shortened in the middle."""

    def cell(v: Any) -> str:
        s = "-" if v is None else str(v)
        if len(s) > max_width:
            half = (max_width - 3) // 2
            s = s[:half] + "..." + s[-half:]
        return s

    rows = [[cell(v) for v in r] for r in rows]
    raw = [list(r) for r in rows]
    widths = [len(h) for h in headers]
    for r in raw:
        for i, c in enumerate(r):
            widths[i] = max(widths[i], len(c))

    def is_num(s: str) -> bool:
        return bool(re.fullmatch(r"[-+]?[\d,.]+( ?[kMGT]?i?B)?|[-+]?[\d.]+e[-+]?\d+", s))

    def line(r: Sequence[str]) -> str:
        return "  ".join(
            c.rjust(w) if is_num(c) else c.ljust(w) for c, w in zip(r, widths)
        ).rstrip()

    out = [line(list(headers)), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in raw]
    return "\n".join(out)


def human_bytes(n: float) -> str:
    """``1536 -> '1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)
