"""The resume proof's comparison of two digest records: the one written at save and the one of
the state a load rebuilt, restricted to what the load restored (``--no-load-optim``,
``--no-load-rng``, ``--finetune``, ``--override-opt-param-scheduler``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List

__all__ = ["SCALAR_PARTS", "SHOWN", "Comparison", "compare", "grouped"]

#: How many differing tensor keys an error names.
SHOWN = 8

#: Scalar state -> the part of the load that restores it (see :func:`compare`'s ``restored``).
SCALAR_PARTS = {
    "iteration": "progress",
    "consumed_train_samples": "progress",
    "consumed_valid_samples": "progress",
    "skipped_train_samples": "progress",
    "opt_param_scheduler": "scheduler",
    "optimizer_step": "optimizer",
}


@dataclass
class Comparison:
    """What a load restored, compared with what was saved.

    Attributes:
        equal: how many tensors have equal digests.
        differ: the differing items: tensor keys (``"key (not loaded)"`` / ``"key (not in the
            checkpoint)"`` when one side lacks it), scalars with both values, RNG states.
        not_compared: what was left out, with the reason (not restored by the load, a changed
            shape or dtype, another parallel layout for the RNG states).
    """

    equal: int = 0
    differ: List[str] = field(default_factory=list)
    not_compared: List[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Nothing differs."""
        return not self.differ


def compare(saved: dict, now: dict, restored: Dict[str, bool]) -> Comparison:
    """Compare two digest records.

    Args:
        saved: the record written at save (``state_digest.json``).
        now: the record of the state rebuilt by the load.
        restored: which parts the load restored: ``optimizer``, ``rng``, ``scheduler``,
            ``progress`` (iteration and consumed samples); a part not restored is reported as not
            compared.

    Returns:
        :class:`Comparison`: counts and lists of keys (differing, not compared with the reason).
    """
    out = Comparison()
    s_t, n_t = saved.get("tensors", {}), now.get("tensors", {})
    for key in sorted(set(s_t) | set(n_t)):
        a, b = s_t.get(key), n_t.get(key)
        kind = (a or b)["kind"]
        if kind == "optimizer" and not restored.get("optimizer", True):
            continue
        if a is None or b is None:
            out.differ.append(f"{key} ({'not in the checkpoint' if a is None else 'not loaded'})")
            continue
        if a["shape"] != b["shape"] or a["dtype"] != b["dtype"]:
            out.not_compared.append(
                f"{key}: {a['dtype']}{a['shape']} saved, {b['dtype']}{b['shape']} now"
            )
            continue
        if a["digest"] == b["digest"]:
            out.equal += 1
        else:
            out.differ.append(key)
    if not restored.get("optimizer", True):
        out.not_compared.append("optimizer state (not loaded)")
    ss, ns = saved.get("scalars", {}), now.get("scalars", {})
    parts = SCALAR_PARTS
    for name, part in parts.items():
        if name not in ss or name not in ns:
            continue
        if not restored.get(part, True):
            out.not_compared.append(f"{name} (not loaded)")
        elif ss[name] != ns[name]:
            out.differ.append(f"{name} ({ss[name]!r} saved, {ns[name]!r} now)")
    if not restored.get("rng", True):
        out.not_compared.append("RNG states (not loaded)")
    elif saved.get("layout") != now.get("layout") or len(saved.get("rng", [])) != len(
        now.get("rng", [])
    ):
        out.not_compared.append("RNG states (another parallel layout)")
    else:
        bad = []
        for r, (a, b) in enumerate(zip(saved["rng"], now["rng"])):
            if a != b:
                streams = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
                bad.append(f"{r} ({', '.join(streams)})")
        if bad:
            out.differ.append(f"RNG state of rank(s) {'; '.join(bad[:SHOWN])}")
    return out


def grouped(keys: List[str]) -> str:
    """Differing keys (:attr:`Comparison.differ`) by kind, optimizer state first (a writer defect
    there also shows in the model tensors the load copies from it), the first few of each: one
    line, e.g. ``"2 optimizer state (a, b); 1 model (c)"``."""
    groups = {"optimizer state": [], "model": [], "scalar state": []}
    for k in keys:
        if k.startswith("optimizer.state."):
            groups["optimizer state"].append(k)
        elif k.split(" (")[0] in SCALAR_PARTS or k.startswith("RNG"):
            groups["scalar state"].append(k)
        else:
            groups["model"].append(k)
    out = []
    for name, ks in groups.items():
        if ks:
            more = f" and {len(ks) - SHOWN // 2} more" if len(ks) > SHOWN // 2 else ""
            out.append(f"{len(ks)} {name} ({', '.join(ks[: SHOWN // 2])}{more})")
    return "; ".join(out)
