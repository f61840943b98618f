r"""Cost of restricted unpickling (``megatron/integrity/unpickle.py``): loads of real checkpoint
files with upstream's unrestricted unpickling and with the allowlist, interleaved (each round
runs every variant once, in turn), side by side in one table.

    python tools/bench_unpickling.py --local-file runs/quickstart/local/0/iter_0000016_0_local.pt \
        --persistent-dir runs/quickstart/ckpt/iter_0000020 [--rounds 30]

Rows: a local checkpoint file (NVRx's ``_load``: ``torch.load(weights_only=False)``, against the
restricted loader and, for reference, ``torch.load(weights_only=True)`` with the globals it needs
added through ``torch.serialization.safe_globals``), its header (the local tier's inventory: the
pickle without tensors), a persistent checkpoint's ``.metadata`` and a whole DCP load of it (every
tensor and byte object through ``torch.distributed.checkpoint.load``, upstream's reader and
planner against the restricted ``read_metadata``/``load_bytes``). Times are medians (ms) of the
rounds, with the fastest round in brackets, wall-clock and CPU time of this process (the second
is what to compare on a machine that other jobs load).
"""

from __future__ import annotations

import argparse
import io
import os
import pickle
import statistics
import sys
import time
import zipfile

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)


def _local_variants(path: str) -> dict:
    import importlib

    import torch

    from megatron.integrity import unpickle

    def weights_only():
        needed = [importlib.import_module(g.rsplit(".", 1)[0]) for g in _globals(path)]
        objs = [getattr(m, g.rsplit(".", 1)[1]) for m, g in zip(needed, _globals(path))]
        objs = [o for o in objs if callable(o)]  # dtypes are allowed already
        with torch.serialization.safe_globals(objs):
            return torch.load(path, weights_only=True)

    def header_unrestricted():
        with zipfile.ZipFile(path) as z:
            name = next(n for n in z.namelist() if n.endswith("data.pkl"))
            data = z.read(name)
        return unpickle._UnrestrictedNoTensor(io.BytesIO(data)).load()

    return {
        "local file: upstream (weights_only=False)": lambda: torch.load(path, weights_only=False),
        "local file: restricted (allowlist)": lambda: unpickle.torch_load(path),
        "local file: weights_only=True + safe_globals": weights_only,
        "local header: unrestricted": header_unrestricted,
        "local header: restricted": lambda: unpickle.load_without_tensors(path),
    }


def _globals(path: str) -> list:
    """The non-storage globals a torch.save file names (from its pickle, nothing executed)."""
    import pickletools

    with zipfile.ZipFile(path) as z:
        data = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    out, strings = set(), []
    for op, arg, _ in pickletools.genops(io.BytesIO(data)):
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE"):
            strings.append(arg)
        elif op.name == "GLOBAL":
            out.add(arg.replace(" ", "."))
        elif op.name == "STACK_GLOBAL":
            out.add(f"{strings[-2]}.{strings[-1]}")
    return sorted(g for g in out if not g.endswith("Storage"))


def _persistent_variants(ckpt: str) -> dict:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from megatron.integrity import dcp_metadata, unpickle
    from megatron.training_ext.persistent_tier import restricted

    md_path = os.path.join(ckpt, ".metadata")
    md = dcp_metadata.read_dcp_metadata(ckpt)

    def template():
        out = {}
        for k, m in md.state_dict_metadata.items():
            if isinstance(m, BytesStorageMetadata):
                out[k] = io.BytesIO()
            else:
                out[k] = torch.empty(tuple(m.size), dtype=m.properties.dtype)
        return out

    up_read, up_bytes = FileSystemReader.read_metadata, DefaultLoadPlanner.load_bytes
    ours_read = restricted._wrap_read_metadata(up_read)
    ours_bytes = restricted._wrap_load_bytes(up_bytes)

    def dcp_load(read, load_bytes):
        def run():
            FileSystemReader.read_metadata, DefaultLoadPlanner.load_bytes = read, load_bytes
            try:
                dcp.load(template(), storage_reader=FileSystemReader(ckpt), no_dist=True)
            finally:
                FileSystemReader.read_metadata, DefaultLoadPlanner.load_bytes = up_read, up_bytes

        return run

    def md_upstream():
        with open(md_path, "rb") as f:
            return pickle.load(f)

    def md_restricted():
        with open(md_path, "rb") as f:
            return unpickle.pickle_load(f, what=md_path)

    return {
        "persistent .metadata: upstream (pickle.load)": md_upstream,
        "persistent .metadata: restricted": md_restricted,
        "persistent DCP load: upstream": dcp_load(up_read, up_bytes),
        "persistent DCP load: restricted": dcp_load(ours_read, ours_bytes),
    }


def measure(variants: dict, rounds: int) -> dict:
    """Interleaved: each round runs every variant once, in turn (after one warm-up each).
    Returns name -> list of (wall seconds, CPU seconds of this process)."""
    for fn in variants.values():
        fn()
    times = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            times[name].append((time.perf_counter() - t0, time.process_time() - c0))
    return times


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--local-file", help="a local checkpoint file (iter_*_local.pt)")
    p.add_argument("--persistent-dir", help="a torch_dist iteration directory")
    p.add_argument("--rounds", type=int, default=30)
    a = p.parse_args(argv)
    if not a.local_file and not a.persistent_dir:
        p.error("give --local-file, --persistent-dir or both")
    import warnings

    import torch

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    variants = {}
    if a.local_file:
        variants.update(_local_variants(a.local_file))
    if a.persistent_dir:
        variants.update(_persistent_variants(a.persistent_dir))
    times = measure(variants, a.rounds)
    width = max(len(n) for n in times)
    print(f"rounds: {a.rounds}, interleaved; ms: median (fastest round)")
    print(f"{'load':<{width}}  {'wall':>18}  {'CPU of this process':>20}")
    for name, ts in times.items():
        wall, cpu = [t[0] * 1e3 for t in ts], [t[1] * 1e3 for t in ts]
        print(
            f"{name:<{width}}  {statistics.median(wall):9.2f} ({min(wall):6.2f})  "
            f"{statistics.median(cpu):11.2f} ({min(cpu):6.2f})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
