"""How the verifier divides files among the ranks of its group: biggest first to the least
loaded rank that can see the file, the files of one owner together where possible (so the
persistent regions they share are read once and then served by the page cache)."""

from __future__ import annotations

from typing import Dict, List, Set, Tuple

__all__ = ["assign", "local_units"]


def assign(units: List[Tuple[str, int, Set[int]]], world: int) -> Dict[int, List[str]]:
    """Greedy: biggest unit first to the least loaded rank that can see it (ties: lowest rank).

    Args:
        units: ``(unit id, bytes, ranks that can process it)``.

    Returns:
        rank -> unit ids (in assignment order).
    """
    load = [0] * world
    out: Dict[int, List[str]] = {r: [] for r in range(world)}
    for uid, size, ranks in sorted(units, key=lambda u: (-u[1], u[0])):
        cands = sorted(ranks) or [0]
        r = min(cands, key=lambda x: (load[x], x))
        load[r] += size
        out[r].append(uid)
    return out


def local_units(visible: List[List[Tuple[str, int, int]]], world: int) -> Dict[int, List[str]]:
    """Assign local files (``rel``) to ranks. ``visible[r]`` lists ``(rel, owner, size)`` rank
    ``r`` sees. Files of one owner form one unit when there are at least ``world`` owners and a
    rank sees all of them; otherwise single files are the units."""
    seen: Dict[str, Tuple[int, int, Set[int]]] = {}
    for r, files in enumerate(visible):
        for rel, owner, size in files:
            seen.setdefault(rel, (owner, size, set()))[2].add(r)
    groups: Dict[int, List[str]] = {}
    for rel, (owner, _s, _r) in seen.items():
        groups.setdefault(owner, []).append(rel)
    units = []
    if len(groups) >= world:
        for _owner, rels in groups.items():
            common = set.intersection(*(seen[x][2] for x in rels))
            if common:
                units.append(("\n".join(sorted(rels)), sum(seen[x][1] for x in rels), common))
            else:
                units += [(x, seen[x][1], seen[x][2]) for x in rels]
    else:
        units = [(x, s, rs) for x, (_o, s, rs) in seen.items()]
    assigned = assign(units, world)
    return {r: [rel for uid in uids for rel in uid.split("\n")] for r, uids in assigned.items()}
