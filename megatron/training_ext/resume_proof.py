"""Resume proof: every save records a topology-independent digest of the training state taken from
memory before anything is serialized, and every load recomputes it from the state it rebuilt and
compares, before the first training step.

Byte checksums prove that a checkpoint's files hold what was written; they cannot see a writer that
wrote the wrong values (Megatron-LM PR 5077: the fully-reshardable distributed optimizer read the
state of every parameter after the first grad bucket at a shifted offset) or a load that puts
values in the wrong place. The digest covers every model tensor and, in model space (the
parameter's global coordinates, whatever the optimizer's flat layout), every optimizer state of it
(``fp32_param``, ``exp_avg``, ``exp_avg_sq``, ...), plus the scalar state (iteration, consumed
samples, scheduler, optimizer step) and the per-rank RNG states (compared when the layout is the
same). The element digest is :mod:`megatron.integrity.state_digest`; the record is
``state_digest.json`` in the iteration directory and the ``state_digest`` entry of the checkpoint's
common state (so local checkpoints carry it too). ``--resume-proof error|warn|off``.

Patch points (recorded by :data:`_PATCHER`): ``save_checkpoint``, ``generate_state_dict``,
``_load_base_checkpoint`` and ``load_checkpoint`` of ``megatron.training.checkpointing`` (and
``training``'s own bindings). Design notes: ``docs/resume-proof.md``.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import logging
import os
import pickle
import random
import re
import struct
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from megatron.integrity import state_digest as sd
from megatron.overlay import OverlayError, Patch, Patcher, alias_of, wraps_upstream
from megatron.training_ext.console import write_line

logger = logging.getLogger("megatron.training_ext.resume_proof")

__all__ = [
    "DIGEST_FNAME",
    "LOG_PREFIX",
    "ResumeProofError",
    "compare",
    "digest_of_save",
    "digest_training_state",
    "install",
    "read_digest",
    "uninstall",
]

LOG_PREFIX = "[resume-proof]"
DIGEST_FNAME = sd.DIGEST_FNAME
STATE_KEY = "state_digest"  # entry in the checkpoint's common state dict
FORMAT = sd.RECORD_FORMAT
read_digest = sd.read_digest
write_digest = sd.write_digest
_PATCHER = Patcher("resume_proof")
_ITER_DIR = re.compile(r"(iter_\d{7}|release)$")
_MASK = (1 << 64) - 1
#: How many differing tensor keys an error names.
SHOWN = 8


class DigestUnavailable(OverlayError, RuntimeError):
    """Some rank could not digest its state (raised on every rank, after the exchange)."""


class ResumeProofError(SystemExit, OverlayError):
    """The state a load rebuilt differs from the state that was saved (raised on every rank,
    before training; exit status 1 with the message)."""


# ---------------------------------------------------------------------------------------------
# Digest of the live training state
# ---------------------------------------------------------------------------------------------


@dataclass
class _Partial:
    """This rank's share of the digest: per tensor key, the partial sum and the tensor's meta."""

    sums: Dict[str, int] = field(default_factory=dict)
    meta: Dict[str, Tuple[Tuple[int, ...], str, str]] = field(default_factory=dict)
    skipped: List[str] = field(default_factory=list)

    def add(self, key: str, value: int, shape, dtype, kind: str) -> None:
        self.sums[key] = (self.sums.get(key, 0) + value) & _MASK
        meta = (tuple(int(s) for s in shape), str(dtype).replace("torch.", ""), kind)
        old = self.meta.setdefault(key, meta)
        if old != meta:
            raise RuntimeError(f"resume proof: tensor {key!r} described twice: {old} vs {meta}")


def _sharded_metadata(model: List[Any], args: Any) -> List[Any]:
    """The model's ShardedTensors / ShardedTensorFactories (upstream's own description of where
    each tensor sits in the global, topology-independent checkpoint space)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories
    from megatron.training import checkpointing

    metadata = checkpointing._build_sharded_state_dict_metadata(args)
    out = []
    for chunk in model:
        msd = chunk.sharded_state_dict(metadata=metadata)
        tensors, _ = extract_sharded_tensors_and_factories(msd)
        out.extend(nested_values(tensors))
    return out


def _by_param(shs: List[Any]) -> Dict[int, Any]:
    """id(model tensor) -> its sharded description, the main replica's where a tensor has two
    (tied embeddings)."""
    out: Dict[int, Any] = {}
    for sh in shs:
        if id(sh.data) not in out or _main(sh.replica_id):
            out[id(sh.data)] = sh
    return out


def _blocks(sh: Any, param: torch.Tensor):
    """The ShardedTensors of ``sh`` (a factory is built) with their flat offset in ``param``.

    Yields:
        (ShardedTensor, offset of its data in ``param``'s flat view, or None when its data is not a
        contiguous piece of ``param``).
    """
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    parts = nested_values(sh.build()) if isinstance(sh, ShardedTensorFactory) else [sh]
    for part in parts:
        data = part.data
        off = None
        if data.is_contiguous() and data.untyped_storage().data_ptr() == (
            param.untyped_storage().data_ptr()
        ):
            off = (data.data_ptr() - param.data_ptr()) // param.element_size()
        yield part, off


def _place(part: Any) -> Tuple[Tuple[int, ...], Tuple[int, ...], Tuple[int, ...]]:
    """(local shape with prepended axes, global offset, global shape) of a ShardedTensor."""
    gshape = tuple(part.global_shape)
    lshape = (1,) * (len(gshape) - part.data.dim()) + tuple(part.data.shape)
    return lshape, tuple(part.global_offset), gshape


def _main(replica_id: Any, ignore_dp: bool = False) -> bool:
    """Whether this rank holds the main replica (``ignore_dp``: of its DP group's elements)."""
    ids = replica_id if isinstance(replica_id, tuple) else (replica_id,)
    if ignore_dp and len(ids) == 3:
        ids = ids[:2]
    return all(i == 0 for i in ids)


def _optimizers(optimizer: Any) -> List[Any]:
    if optimizer is None:
        return []
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _add_model(shs: List[Any], acc: _Partial) -> None:
    for sh in shs:
        if not _main(sh.replica_id):
            continue
        for part, _ in _blocks(sh, sh.data):
            _lshape, goff, gshape = _place(part)
            acc.add(
                part.key, sd.block_sum(part.data, goff, gshape), gshape, part.data.dtype, "model"
            )


def _state_tensors(states: Dict[str, Any]):
    """(name, tensor) of an optimizer's per-parameter state: the main parameter as
    ``fp32_param`` and every state tensor but the 0-d ``step`` (kept in the scalar state)."""
    for name, value in states.items():
        if name == "step" or not isinstance(value, torch.Tensor) or value.dim() == 0:
            continue
        yield ("fp32_param" if name == "param" else name), value.detach()


def _add_distributed_optimizer(opt: Any, part_map: Dict[int, Any], acc: _Partial) -> None:
    """The DP shard of each parameter's state this rank holds, placed in model space."""
    instance = getattr(opt, "distributed_optimizer_instance_id", 0)
    for param in opt.model_param_group_index_map:
        sh = part_map.get(id(param))
        if sh is None:
            acc.skipped.append(
                f"a parameter of shape {tuple(param.shape)} (not in the model's sharded state dict)"
            )
            continue
        if instance != 0 or not _main(sh.replica_id, ignore_dp=True):
            continue
        rng = opt._get_model_param_range_map(param)["param"]
        states = opt._get_main_param_and_optimizer_states(param)
        for state_name, value in _state_tensors(states):
            flat = value.reshape(-1)
            for part, off in _blocks(sh, param):
                key = f"optimizer.state.{state_name}.{part.key}"
                if off is None:
                    acc.skipped.append(key)
                    continue
                n = part.data.numel()
                lo, hi = max(rng.start, off), min(rng.end, off + n)
                lshape, goff, gshape = _place(part)
                if lo < hi:
                    v = sd.range_sum(
                        part.data,
                        lo - off,
                        hi - off,
                        lshape,
                        goff,
                        gshape,
                        values=flat[lo - rng.start : hi - rng.start],
                    )
                else:
                    v = 0
                acc.add(key, v, gshape, value.dtype, "optimizer")


def _main_params(opt: Any) -> Dict[int, torch.Tensor]:
    """id(model param) -> main (fp32) param of a non-distributed optimizer."""
    out = {}
    f16 = getattr(opt, "float16_groups", None)
    if f16 is not None:
        for g16, g32 in zip(f16, opt.fp32_from_float16_groups):
            for p16, p32 in zip(g16, g32):
                out[id(p16)] = p32
        for g in getattr(opt, "fp32_from_fp32_groups", []):
            for p in g:
                out[id(p)] = p
        return out
    for group in opt.optimizer.param_groups:
        for p in group["params"]:
            out[id(p)] = p
    return out


def _add_plain_optimizer(opt: Any, part_map: Dict[int, Any], acc: _Partial) -> None:
    mains = _main_params(opt)
    for pid, sh in part_map.items():
        main = mains.get(pid)
        if main is None or not _main(sh.replica_id):
            continue
        states = {"param": main}
        states.update(opt.optimizer.state.get(main, {}))
        for state_name, value in _state_tensors(states):
            for part, off in _blocks(sh, sh.data):
                key = f"optimizer.state.{state_name}.{part.key}"
                if off is None:
                    acc.skipped.append(key)
                    continue
                lshape, goff, gshape = _place(part)
                n = part.data.numel()
                v = sd.range_sum(
                    part.data,
                    0,
                    n,
                    lshape,
                    goff,
                    gshape,
                    values=value.reshape(-1)[off : off + n],
                )
                acc.add(key, v, gshape, value.dtype, "optimizer")


def _add_dtensors(state: Any, prefix: str, acc: _Partial) -> None:
    """Digest every tensor of a Megatron-FSDP state dict (``fsdp_dtensor``): DTensors by their
    local chunk (uneven chunks placed by Megatron-FSDP's own chunk metadata; collective over each
    DTensor's mesh), plain tensors on rank 0."""
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(state, dict):
        for k in sorted(state, key=str):
            _add_dtensors(state[k], f"{prefix}.{k}" if prefix else str(k), acc)
        return
    if isinstance(state, DTensor):
        from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
            gather_and_compute_chunk_metadata,
        )

        chunk = gather_and_compute_chunk_metadata(state)
        local = state.to_local()
        coord = state.device_mesh.get_coordinate() or []
        replica = any(isinstance(p, Replicate) and c != 0 for p, c in zip(state.placements, coord))
        gshape = tuple(state.shape)
        value = 0 if replica or local.numel() == 0 else sd.block_sum(local, chunk.offsets, gshape)
        kind = "optimizer" if prefix.startswith("optimizer") else "model"
        acc.add(prefix, value, gshape, local.dtype, kind)
        return
    if isinstance(state, torch.Tensor) and state.dim() > 0:
        value = sd.block_sum(state) if _rank() == 0 else 0
        kind = "optimizer" if prefix.startswith("optimizer") else "model"
        acc.add(prefix, value, state.shape, state.dtype, kind)


def _add_fsdp(model: List[Any], optimizer: Any, args: Any, acc: _Partial) -> None:
    from megatron.training import checkpointing

    state = checkpointing.generate_state_dict(
        args, model, optimizer, None, None, optim_sd_kwargs={"metadata": {}}
    )
    for key in ("model", "optimizer"):
        if key in state:
            _add_dtensors(state[key], key, acc)


def _optimizer_steps(optimizer: Any) -> List[float]:
    """The optimizer steps the next update uses: the per-parameter ``step`` (torch Adam), else the
    param groups' (apex/TE fused Adam). A torch optimizer keeps the ``step`` a load put into its
    param groups without advancing it (megatron-core stores the per-parameter step there at
    save); it is not training state and is not digested."""
    steps = set()
    for opt in _optimizers(optimizer):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        own = set()
        for state in inner.state.values():
            s = state.get("step") if isinstance(state, dict) else None
            if s is not None:
                own.add(float(s))
        if not own:
            own = {float(g["step"]) for g in inner.param_groups if "step" in g}
        steps |= own
    return sorted(steps)


def _rng_digest() -> Dict[str, str]:
    """Digests (8 bytes, hex) of this process's RNG streams as upstream's ``get_rng_state`` saves
    them: Python, NumPy, torch CPU, CUDA, and each stream of the model-parallel tracker."""
    import numpy as np

    def h(data: bytes) -> str:
        return hashlib.blake2b(data, digest_size=8).hexdigest()

    kind, keys, pos, has_gauss, cached = np.random.get_state()
    out = {
        "random": h(pickle.dumps(random.getstate(), protocol=4)),
        "numpy": h(pickle.dumps((kind, keys.tobytes(), pos, has_gauss, cached), protocol=4)),
        "torch": h(torch.get_rng_state().numpy().tobytes()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = h(torch.cuda.get_rng_state().cpu().numpy().tobytes())
    try:
        from megatron.core import tensor_parallel

        states = tensor_parallel.get_cuda_rng_tracker().get_states()
        for name in sorted(states):
            out[name] = h(torch.as_tensor(states[name]).cpu().numpy().tobytes())
    except Exception:  # noqa: BLE001 - no tracker in this setup: the other states still count
        pass
    return out


def _layout(args: Any) -> Dict[str, int]:
    import torch.distributed as dist

    return {
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "tp": int(getattr(args, "tensor_model_parallel_size", 1) or 1),
        "pp": int(getattr(args, "pipeline_model_parallel_size", 1) or 1),
        "cp": int(getattr(args, "context_parallel_size", 1) or 1),
        "ep": int(getattr(args, "expert_model_parallel_size", 1) or 1),
        "etp": int(getattr(args, "expert_tensor_parallel_size", None) or 0),
        "vpp": int(getattr(args, "virtual_pipeline_model_parallel_size", None) or 0),
    }


def _scheduler_state(sched: Any) -> Optional[dict]:
    if sched is None:
        return None
    return {k: v for k, v in sched.state_dict().items() if isinstance(v, (int, float, bool, str))}


def _no_torch_function():
    """A context in which torch functions skip the active torch function modes (the CPU backend's
    CUDA-to-CPU mode costs ~50 us per tensor method call; the digest only reads tensors and
    makes temporaries, which need no mapping). A no-op context where torch has no such switch."""
    import contextlib

    switch = getattr(torch._C, "DisableTorchFunction", None)
    return switch() if switch is not None else contextlib.nullcontext()


_M32 = (1 << 32) - 1


@dataclass
class _Slots:
    """Where each rank's values sit in the exchange vector (the same on every rank): cached between
    digests of one process, because the set of tensors, their descriptions, the RNG streams and the
    number of optimizer steps do not change between saves of a run.

    Vector (int64, every value in ``[0, 2**32)``, so the sum over ranks never overflows): ``[0]``
    number of ranks that failed, ``[1]`` number of ranks whose description changed, then two
    halves (low, high 32 bits) per tensor key (summed over ranks), per RNG stream of each rank and
    per optimizer step value of each rank (one rank writes each of those, the others write 0)."""

    world: int
    fingerprints: List[str]  # per rank: its description's (:func:`_fingerprint`)
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


_SLOTS: Optional[_Slots] = None


def _fingerprint(mine: tuple) -> str:
    """What the exchange's layout depends on in this rank's share (not the values)."""
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


def _exchange_device() -> torch.device:
    import torch.distributed as dist

    if "nccl" in str(dist.get_backend()).lower() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _gather_all(mine: tuple):
    """Every rank's share by ``all_gather_object`` (the first digest of a process, and whenever
    a rank's description changed): ``(sums, meta, skipped, rngs, steps)`` and the new slots."""
    import torch.distributed as dist

    global _SLOTS
    if dist.is_initialized():
        gathered: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (mine, _fingerprint(mine)))
    else:
        gathered = [(mine, "")]
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
    if dist.is_initialized():
        _SLOTS = _Slots(
            world=len(gathered),
            fingerprints=[fp for _g, fp in gathered],
            keys=sorted(sums),
            meta=meta,
            skipped=sorted(skipped),
            rng_names=[tuple(sorted(g[3])) for (g, _fp) in gathered],
            n_steps=[len(g[4]["optimizer_step"]) for (g, _fp) in gathered],
        )
    return sums, meta, sorted(skipped), rngs, steps


def _exchange(mine: tuple):
    """Combine every rank's share of the digest (collective over the world).

    Args:
        mine: ``(sums, meta, skipped, rng, scalars, error)`` of this rank (``error``: None, or
            the reason this rank could not digest its state).

    Returns:
        ``(sums, meta, skipped, rngs, steps)``: per tensor key the partial sums (to add modulo
        2**64) and the (shape, dtype, kind); the keys not digested; per rank its RNG digests; the
        optimizer step values of all ranks.

    Raises:
        DigestUnavailable: on every rank, when a rank failed (every failure's text, gathered only
            then) or two ranks describe a tensor differently.

    With the slots of an earlier digest of this process (:class:`_Slots`) and an unchanged
    description on every rank, this is one ``all_reduce`` of a small int64 vector (no pickling);
    otherwise one ``all_gather_object`` of every rank's share, which also (re)builds the slots.
    """
    import torch.distributed as dist

    slots = _SLOTS
    if not dist.is_initialized() or slots is None or slots.world != dist.get_world_size():
        return _gather_all(mine)
    my_sums, _meta, _skipped, rng, scalars, error = mine
    rank = _rank()
    vec = [0] * slots.size
    if error:
        vec[0] = 1
    elif _fingerprint(mine) != slots.fingerprints[rank]:
        vec[1] = 1
    else:
        for key, value in my_sums.items():
            _put(vec, slots.index[key], value)
        at = slots.rng_at[rank]
        for i, name in enumerate(slots.rng_names[rank]):
            _put(vec, at + 2 * i, int(rng[name], 16))
        at = slots.steps_at[rank]
        for i, step in enumerate(scalars["optimizer_step"]):
            _put(vec, at + 2 * i, struct.unpack("<Q", struct.pack("<d", step))[0])
    t = torch.tensor(vec, dtype=torch.int64, device=_exchange_device())
    dist.all_reduce(t)
    total = t.tolist()
    if total[0]:  # every rank is here: gather the failures' texts
        errors: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        raise DigestUnavailable("; ".join([e for e in errors if e][:4]))
    if total[1]:
        return _gather_all(mine)

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
            steps.add(struct.unpack("<d", struct.pack("<Q", value(at + 2 * i)))[0])
    return sums, slots.meta, slots.skipped, rngs, sorted(steps)


def digest_training_state(
    model: List[Any], optimizer: Any, opt_param_scheduler: Any, args: Any, iteration: int
) -> dict:
    """The state digest of the live training state (collective over the world: every rank calls).

    Args:
        model: the model chunks as ``pretrain`` holds them (DDP-wrapped modules).
        optimizer: megatron-core's optimizer (distributed, mixed precision, fp32 or chained), or
            None.
        opt_param_scheduler: upstream's ``OptimizerParamScheduler`` or None.
        args: the run's arguments (parallel sizes, checkpoint format, consumed samples).
        iteration: the iteration the state belongs to.

    Returns:
        The JSON-able record (the same on every rank): ``tensors`` (key -> ``digest`` as 16 hex
        digits, global ``shape``, ``dtype``, ``kind``), ``scalars``, ``rng`` (per-rank digests and
        the layout they belong to), ``layout``, ``seconds``.

    Raises:
        DigestUnavailable: on every rank, when some rank could not digest its part (its reason
            named) or two ranks describe a tensor differently. The local work holds no
            collective except under ``fsdp_dtensor`` (Megatron-FSDP's chunk metadata).
    """
    from megatron.core.utils import unwrap_model

    t0 = time.perf_counter()
    error = None
    acc = _Partial()
    rng: Dict[str, str] = {}
    scalars: dict = {}
    try:  # local work only: a failure is exchanged below, so no rank is left in a collective
        rng = _rng_digest()  # first: nothing below may draw from a stream before it is recorded
        acc = _Partial()
        model = unwrap_model(model)  # as upstream's save_checkpoint / load_checkpoint do
        with torch.no_grad():
            if getattr(args, "ckpt_format", None) == "fsdp_dtensor":
                _add_fsdp(model, optimizer, args, acc)
            else:
                shs = _sharded_metadata(model, args)
                part_map = _by_param(shs)
                with _no_torch_function():  # reads only: ~5x fewer microseconds per tensor
                    _add_model(shs, acc)
                    for opt in _optimizers(optimizer):
                        if hasattr(opt, "model_param_group_index_map"):
                            _add_distributed_optimizer(opt, part_map, acc)
                        elif hasattr(opt, "optimizer"):
                            _add_plain_optimizer(opt, part_map, acc)
        scalars = {
            "iteration": int(iteration),
            "consumed_train_samples": int(getattr(args, "consumed_train_samples", 0) or 0),
            "consumed_valid_samples": int(getattr(args, "consumed_valid_samples", 0) or 0),
            "skipped_train_samples": int(getattr(args, "skipped_train_samples", 0) or 0),
            "opt_param_scheduler": _scheduler_state(opt_param_scheduler),
            "optimizer_step": _optimizer_steps(optimizer),
        }
    except Exception as e:  # noqa: BLE001 - e.g. a tensor type the digest cannot read
        error = f"rank {_rank()}: {type(e).__name__}: {e}"
    mine = (acc.sums, acc.meta, acc.skipped, rng, scalars, error)
    sums, meta, skipped, rngs, steps = _exchange(mine)
    tensors = {}
    for key in sorted(sums):
        shape, dtype, kind = meta[key]
        numel = 1
        for s in shape:
            numel *= s
        tensors[key] = {
            "digest": f"{sd.finish(sums[key], numel):016x}",
            "shape": list(shape),
            "dtype": dtype,
            "kind": kind,
        }
    scalars["optimizer_step"] = steps
    return {
        "format": FORMAT,
        "version": sd.VERSION,
        "algorithm": sd.ALGORITHM,
        "iteration": int(iteration),
        "layout": _layout(args),
        "ckpt_format": getattr(args, "ckpt_format", None),
        "scalars": scalars,
        "rng": rngs,
        "tensors": tensors,
        "not_digested": sorted(skipped),
        "seconds": round(time.perf_counter() - t0, 3),
    }


# ---------------------------------------------------------------------------------------------
# Comparison
# ---------------------------------------------------------------------------------------------


#: Scalar state -> the part of the load that restores it (see :func:`compare`'s ``restored``).
_SCALAR_PARTS = {
    "iteration": "progress",
    "consumed_train_samples": "progress",
    "consumed_valid_samples": "progress",
    "skipped_train_samples": "progress",
    "opt_param_scheduler": "scheduler",
    "optimizer_step": "optimizer",
}
_SCALARS = set(_SCALAR_PARTS)


@dataclass
class Comparison:
    """What a load restored, compared with what was saved."""

    equal: int = 0
    differ: List[str] = field(default_factory=list)
    not_compared: List[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
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
    parts = _SCALAR_PARTS
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


# ---------------------------------------------------------------------------------------------
# Hooks
# ---------------------------------------------------------------------------------------------


@dataclass
class _State:
    mode: str = "error"
    pending: Optional[dict] = None  # the digest of the save in progress
    written: bool = False
    loaded: Optional[Tuple[Optional[dict], Any, Any]] = None  # (record, checkpoint_name, type)


_STATE: Optional[_State] = None


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _say(line: str) -> None:
    if _rank() == 0:
        write_line(f"{LOG_PREFIX} {line}")


def write_pending(checkpoint_dir: Any) -> None:
    """Write the digest of the save in progress into ``checkpoint_dir`` (rank 0). The persistent
    tier's ``dist_checkpointing.save`` calls it before its manifest, so the manifest covers it."""
    st = _STATE
    if st is None or st.pending is None or st.written:
        return
    if not _ITER_DIR.search(str(checkpoint_dir).rstrip("/")):
        return  # e.g. modelopt_state/ inside the iteration directory
    if _rank() == 0:
        write_digest(checkpoint_dir, st.pending)
    st.written = True


@contextlib.contextmanager
def digest_of_save(record: Optional[dict]):
    """Within the block, the ``dist_checkpointing.save`` of an iteration directory writes
    ``record`` as its ``state_digest.json`` (before its manifest), as :func:`write_pending` does
    for a save of the live state. The local tier uses it when it writes a local checkpoint as a
    persistent one: the record is the one taken at the local save. A no-op without ``record`` or
    when the proof is off."""
    st = _STATE
    if st is None or record is None:
        yield
        return
    saved = (st.pending, st.written)
    st.pending, st.written = record, False
    try:
        yield
    finally:
        st.pending, st.written = saved


def _wrap_save_checkpoint(orig):
    sig = inspect.signature(orig)

    @wraps_upstream(orig)
    def save_checkpoint(*a, **kw):
        """Upstream's; first digests the live training state (resume_proof)."""
        from megatron.training import checkpointing

        st = _STATE
        if st is None or st.mode == "off":
            return orig(*a, **kw)
        ba = sig.bind(*a, **kw)
        ba.apply_defaults()
        args = checkpointing.get_args()
        try:
            st.pending = digest_training_state(
                ba.arguments["model"],
                ba.arguments["optimizer"],
                ba.arguments["opt_param_scheduler"],
                args,
                ba.arguments["iteration"],
            )
        except (
            DigestUnavailable
        ) as e:  # the save goes ahead, without a digest (its load: not proven)
            st.pending = None
            _say(f"iteration {ba.arguments['iteration']}: no state digest for this save ({e})")
        st.written = False
        try:
            result = orig(*a, **kw)
            local = ba.arguments.get("non_persistent_ckpt") and (
                getattr(args, "non_persistent_ckpt_type", None) == "local"
            )
            if not st.written and not local and args.save:
                save_dir = args.save
                if ba.arguments.get("non_persistent_ckpt"):
                    save_dir = args.non_persistent_global_ckpt_dir or os.path.join(
                        args.save, "non_persistent"
                    )
                name = checkpointing.get_checkpoint_name(
                    save_dir, ba.arguments["iteration"], release=False, return_base_dir=True
                )
                if os.path.isdir(name):
                    write_pending(name)
            return result
        finally:
            st.pending = None

    return save_checkpoint


def _wrap_generate_state_dict(orig):
    @wraps_upstream(orig)
    def generate_state_dict(*a, **kw):
        """Upstream's; a save's state dict carries the state digest in its common state
        (megatron.training_ext.resume_proof)."""
        state_dict = orig(*a, **kw)
        st = _STATE
        if st is not None and st.pending is not None and isinstance(state_dict, dict):
            # without this rank's ``seconds``: the common state must be equal on every rank
            # (upstream's validation warns when it is not)
            state_dict[STATE_KEY] = json.dumps(
                {k: v for k, v in st.pending.items() if k != "seconds"}
            )
        return state_dict

    return generate_state_dict


def _wrap_load_base_checkpoint(orig):
    @wraps_upstream(orig)
    def _load_base_checkpoint(*a, **kw):
        """Upstream's; remembers the digest of what it loaded (resume_proof)."""
        result = orig(*a, **kw)
        st = _STATE
        if st is not None and isinstance(result, tuple) and len(result) == 4:
            state_dict, name, _release, ckpt_type = result
            if state_dict is not None:
                record = state_dict.get(STATE_KEY) if isinstance(state_dict, dict) else None
                if isinstance(record, (str, bytes)):
                    record = json.loads(record)
                st.loaded = (record, name, ckpt_type)
        return result

    return _load_base_checkpoint


def _tier(ckpt_type: Any, name: Any, args: Any) -> str:
    t = getattr(ckpt_type, "name", str(ckpt_type)).lower()
    if t == "local":
        return "local tier"
    fmt = getattr(args, "ckpt_format", "torch_dist")
    if "non_persistent" in str(name):
        return f"global non-persistent {fmt}"
    return f"persistent {fmt}"


def _restored(args: Any) -> Dict[str, bool]:
    finetune = bool(getattr(args, "finetune", False))
    return {
        "optimizer": not (finetune or getattr(args, "no_load_optim", False)),
        "rng": not (finetune or getattr(args, "no_load_rng", False)),
        # upstream restores the scheduler together with the optimizer (not with --no-load-optim)
        "scheduler": not (
            finetune
            or getattr(args, "no_load_optim", False)
            or getattr(args, "override_opt_param_scheduler", False)
        ),
        "progress": not finetune,
    }


def _grouped(keys: List[str]) -> str:
    """Differing keys by kind, optimizer state first (a writer defect there also shows in the
    model tensors the load copies from it), the first few of each."""
    groups = {"optimizer state": [], "model": [], "scalar state": []}
    for k in keys:
        if k.startswith("optimizer.state."):
            groups["optimizer state"].append(k)
        elif k.split(" (")[0] in _SCALARS or k.startswith("RNG"):
            groups["scalar state"].append(k)
        else:
            groups["model"].append(k)
    out = []
    for name, ks in groups.items():
        if ks:
            more = f" and {len(ks) - SHOWN // 2} more" if len(ks) > SHOWN // 2 else ""
            out.append(f"{len(ks)} {name} ({', '.join(ks[: SHOWN // 2])}{more})")
    return "; ".join(out)


def _wrap_load_checkpoint(orig):
    sig = inspect.signature(orig)

    @wraps_upstream(orig)
    def load_checkpoint(*a, **kw):
        """Upstream's (with this fork's fallbacks); then the loaded state is proven equal to the
        saved one (megatron.training_ext.resume_proof)."""
        from megatron.training import checkpointing

        st = _STATE
        if st is None or st.mode == "off":
            return orig(*a, **kw)
        st.loaded = None
        result = orig(*a, **kw)
        ba = sig.bind(*a, **kw)
        ba.apply_defaults()
        if st.loaded is None or ba.arguments.get("skip_load_to_model_and_opt"):
            return result
        record, name, ckpt_type = st.loaded
        st.loaded = None
        args = checkpointing.get_args()
        iteration = result[0] if isinstance(result, tuple) else getattr(args, "iteration", 0)
        tier = _tier(ckpt_type, name, args)
        shown_name = (
            getattr(args, "non_persistent_local_ckpt_dir", None) if tier == "local tier" else name
        )
        where = f"{tier} {shown_name}"
        if record is None and name is not None and os.path.isdir(str(name)):
            try:
                record = read_digest(name)
            except ValueError as e:
                _say(f"iteration {iteration} ({where}): {e}; not proven")
                record = None
        if record is None:
            _say(
                f"iteration {iteration} ({where}): saved without a state digest (upstream "
                "Megatron-LM, or an older version of this fork): not proven"
            )
            return result
        t0 = time.perf_counter()
        try:
            now = digest_training_state(
                ba.arguments["ddp_model"],
                ba.arguments["optimizer"],
                ba.arguments["opt_param_scheduler"],
                args,
                record.get("iteration", iteration)
                if getattr(args, "finetune", False)
                else iteration,
            )
        except DigestUnavailable as e:
            _say(
                f"iteration {iteration} ({where}): the loaded state could not be digested ({e}): "
                "not proven"
            )
            return result
        cmp = compare(record, now, _restored(args))
        seconds = time.perf_counter() - t0
        skipped = f"; not compared: {'; '.join(cmp.not_compared)}" if cmp.not_compared else ""
        if cmp.ok:
            _say(
                f"iteration {iteration}: {cmp.equal} tensors and the scalar state equal to the "
                f"saved state ({where}, {seconds:.1f} s){skipped}"
            )
            return result
        shown = _grouped(cmp.differ)
        message = (
            f"{LOG_PREFIX} iteration {iteration}: the state loaded from {where} differs from the "
            f"state that was saved: {len(cmp.differ)} of {cmp.equal + len(cmp.differ)} items "
            f"differ: {shown}{skipped}. The checkpoint's writer or this load put wrong values in "
            f"the training state; resuming would train on them. Load another checkpoint "
            f"(--ckpt-step), or pass --resume-proof warn to continue anyway"
        )
        if st.mode == "warn":
            if _rank() == 0:
                write_line(f"WARNING: {message}")
            return result
        raise ResumeProofError(message)

    return load_checkpoint


_CKPT = "megatron.training.checkpointing"
_WHY_SAVE = "every save records a topology-independent digest of the live training state"
_WHY_LOAD = "every load is proven equal to the saved state before training"

#: What :func:`install` replaces, in order.
PATCHES = (
    Patch(f"{_CKPT}.save_checkpoint", _wrap_save_checkpoint, _WHY_SAVE),
    Patch(
        "megatron.training.training.save_checkpoint",
        alias_of(f"{_CKPT}.save_checkpoint", only_if_same=True),
        _WHY_SAVE + " (train()'s binding)",
    ),
    Patch(
        f"{_CKPT}.generate_state_dict",
        _wrap_generate_state_dict,
        "the digest travels in the checkpoint's common state (local checkpoints too)",
    ),
    Patch(
        f"{_CKPT}._load_base_checkpoint",
        _wrap_load_base_checkpoint,
        "remembers the digest and the tier of what a load read",
    ),
    Patch(f"{_CKPT}.load_checkpoint", _wrap_load_checkpoint, _WHY_LOAD),
    Patch(
        "megatron.training.training.load_checkpoint",
        alias_of(f"{_CKPT}.load_checkpoint", only_if_same=True, otherwise=_wrap_load_checkpoint),
        _WHY_LOAD + " (train()'s binding)",
    ),
)


def install(args: Any) -> None:
    """Install the digest at save and the proof at load for ``args.resume_proof`` (``error``:
    a differing load stops every rank; ``warn``; ``off``: nothing is installed). Idempotent."""
    global _STATE
    mode = getattr(args, "resume_proof", "error") or "error"
    if _STATE is not None:
        _STATE.mode = mode
        return
    if mode == "off":
        return
    _STATE = _State(mode=mode)
    for patch in PATCHES:
        patch.install(_PATCHER)


def uninstall() -> None:
    """Undo :func:`install` (tests)."""
    global _STATE, _SLOTS
    _PATCHER.restore()
    _STATE = None
    _SLOTS = None
