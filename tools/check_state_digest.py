r"""Recompute a checkpoint's state digest from its files and compare it with ``state_digest.json``.

    python tools/check_state_digest.py /lustre/ckpt/iter_0000010     # or the --save root

``pretrain_gpt.py`` writes ``state_digest.json`` at every save from the training state in memory
(before anything is serialized; ``docs/resume-proof.md``). This command reads the ``torch_dist``
checkpoint's tensors in one process, tensor by tensor (memory: the largest tensor), digests each as
a whole tensor (the digest does not depend on how the saving run was sharded) and compares: a
tensor whose bytes are intact (checksums pass) but whose values are not the state that was saved,
e.g. written by a defective writer, is named. Optimizer state saved in the default
``dp_reshardable`` format is in the saving run's flat buffer layout, not model space: those tensors
are reported as not checked (``--dist-ckpt-optim-fully-reshardable`` checkpoints are checked in
full). The scalar state (iteration, consumed samples, scheduler) is compared from ``common.pt``.

Exit status: 0 equal, 1 a tensor or scalar differs, 2 bad input (no checkpoint, no digest).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

TRACKER = "latest_checkpointed_iteration.txt"
_FP32 = "optimizer.state.fp32_param."


def _iteration_dir(path: str) -> str:
    if os.path.isfile(os.path.join(path, ".metadata")):
        return path
    tracker = os.path.join(path, TRACKER)
    if os.path.isfile(tracker):
        text = open(tracker).read().strip()
        name = "release" if text == "release" else f"iter_{int(text):07d}"
        return os.path.join(path, name)
    iters = sorted(n for n in os.listdir(path) if re.fullmatch(r"iter_\d{7}", n))
    if iters:
        return os.path.join(path, iters[-1])
    raise SystemExit(2)


def check(checkpoint_dir: str, progress: bool = True) -> dict:
    """Digests of a ``torch_dist`` checkpoint's tensors against its ``state_digest.json``.

    Returns:
        ``{"equal": [...], "differ": [...], "not_checked": [...], "missing": [...],
        "scalars_differ": [...], "seconds": float}`` (tensor keys; ``missing``: in the digest,
        not in the files).

    Raises:
        FileNotFoundError: no ``state_digest.json``.
        DcpMetadataError: ``.metadata`` is absent or unreadable (a ``ValueError``).
    """
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from megatron.integrity import unpickle
    from megatron.integrity.dcp_metadata import read_dcp_metadata, restricted_reader
    from megatron.integrity.digest import state as sd
    from megatron.integrity.digest.record import read_record

    t0 = time.perf_counter()
    record = read_record(checkpoint_dir)
    if record is None:
        raise FileNotFoundError(f"{checkpoint_dir}: no state_digest.json (saved without a digest)")
    meta = read_dcp_metadata(checkpoint_dir)
    stored = {
        k: m for k, m in meta.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)
    }
    out = {"equal": [], "differ": [], "not_checked": [], "missing": [], "scalars_differ": []}
    keys = sorted(record["tensors"])
    try:
        from tqdm import tqdm

        it = tqdm(keys, desc="digest", unit="tensor", disable=not progress)
    except ImportError:  # pragma: no cover
        it = keys
    for key in it:
        want = record["tensors"][key]
        m = stored.get(key)
        if m is None and key.startswith(_FP32):  # the fully-reshardable format's name for it
            key, want = "optimizer.state.param." + key[len(_FP32) :], want
            m = stored.get(key)
        if m is None:
            (out["not_checked"] if want["kind"] == "optimizer" else out["missing"]).append(key)
            continue
        t = torch.empty(tuple(m.size), dtype=m.properties.dtype)
        dcp.load({key: t}, storage_reader=restricted_reader(checkpoint_dir), no_dist=True)
        got = f"{sd.tensor_digest(t):016x}"
        (out["equal"] if got == want["digest"] else out["differ"]).append(key)
    common = os.path.join(checkpoint_dir, "common.pt")
    if os.path.isfile(common):
        state = unpickle.torch_load(common, map_location="cpu")
        saved = record.get("scalars", {})
        args = state.get("args")
        now = {
            "iteration": state.get("iteration"),
            "consumed_train_samples": getattr(args, "consumed_train_samples", None),
        }
        for name, value in now.items():
            if value is not None and name in saved and saved[name] != value:
                out["scalars_differ"].append(f"{name} ({saved[name]!r} digest, {value!r} files)")
    out["seconds"] = time.perf_counter() - t0
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("checkpoint", help="iteration directory, or the --save root (its latest)")
    p.add_argument("--json", metavar="PATH", help="write the result as JSON here")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--unrestricted-unpickling",
        action="store_true",
        help="unpickle without the allowlist (megatron/integrity/unpickle.py): the files may run "
        "code; only for checkpoints you wrote with code the allowlist does not know",
    )
    a = p.parse_args(argv)
    from megatron.integrity import unpickle

    unpickle.POLICY.unrestricted = a.unrestricted_unpickling
    if not os.path.isdir(a.checkpoint):
        print(f"check_state_digest: {a.checkpoint}: not a directory", file=sys.stderr)
        return 2
    try:
        d = _iteration_dir(a.checkpoint)
    except SystemExit:
        print(f"check_state_digest: {a.checkpoint}: no torch_dist checkpoint", file=sys.stderr)
        return 2
    try:
        r = check(d, progress=not a.no_progress)
    except (FileNotFoundError, ValueError, unpickle.UnsafeCheckpointError) as e:
        print(f"check_state_digest: {e}", file=sys.stderr)
        return 2
    n = len(r["equal"]) + len(r["differ"])
    print(f"{d}: {len(r['equal'])} of {n} tensors equal to the saved state digest "
          f"({r['seconds']:.1f} s)")  # fmt: skip
    if r["not_checked"]:
        print(f"  not checked: {len(r['not_checked'])} optimizer tensors not stored in model space "
              "(dp_reshardable format)")  # fmt: skip
    for key in r["differ"]:
        print(f"  DIFFERS: {key}")
    for key in r["missing"]:
        print(f"  MISSING from the files: {key}")
    for s in r["scalars_differ"]:
        print(f"  DIFFERS: {s}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=1)
    bad = r["differ"] or r["missing"] or r["scalars_differ"]
    print("RESULT: " + ("differs from the saved state" if bad else "equal to the saved state"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
