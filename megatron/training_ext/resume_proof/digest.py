"""The resume proof's digest of the live training state: a topology-independent record of every
model tensor, every optimizer state in model space, the scalar state and the per-rank RNG states.

Each rank walks the blocks it holds as the main replica (upstream's own ShardedTensors of the
model; for the distributed optimizer, the DP range of each parameter it owns, placed at the
parameter's global coordinates), sums them with :mod:`megatron.integrity.digest.state` into a
:class:`PartialDigest`, and :class:`~megatron.training_ext.resume_proof.exchange.DigestExchange`
combines the ranks' shares. The digest never goes through the checkpoint writer's layout code, so
a writer defect shows as a mismatch at load.
"""

from __future__ import annotations

import contextlib
import hashlib
import pickle
import random
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from megatron.integrity.digest import record as digest_record
from megatron.integrity.digest import state as sd
from megatron.training_ext.console import process_rank
from megatron.training_ext.resume_proof.exchange import DigestExchange, Share

__all__ = [
    "FORMAT",
    "DeferredDigest",
    "PartialDigest",
    "ShardRegion",
    "deferred_training_state",
    "digest_training_state",
    "no_torch_function",
    "regions_of",
    "shard_regions",
    "shard_sources",
    "storage_range",
]

FORMAT = digest_record.RECORD_FORMAT
_MASK = (1 << 64) - 1


@dataclass
class PartialDigest:
    """This rank's share of the digest: per tensor key, the partial sum and the tensor's meta.

    Attributes:
        sums: key -> sum of the terms of the elements this rank holds (``[0, 2**64)``).
        meta: key -> (global shape, dtype name without ``torch.``, ``"model"`` or
            ``"optimizer"``).
        skipped: what could not be digested (keys, or a description), reported as not digested.
        all_replicas: also record the blocks of replicas other than the main one (a
            :class:`DeferredDigest` whose sums the saving rank evaluates); ``False``: only the
            main replica's blocks are digested.
    """

    sums: Dict[str, int] = field(default_factory=dict)
    meta: Dict[str, Tuple[Tuple[int, ...], str, str]] = field(default_factory=dict)
    skipped: List[str] = field(default_factory=list)
    all_replicas: bool = False

    def add(self, key: str, value: int, shape, dtype, kind: str) -> None:
        """Add ``value`` (a block's sum) to ``key``'s partial sum, modulo 2**64.

        Raises:
            RuntimeError: ``key`` was added before with another shape, dtype or kind.
        """
        self.sums[key] = (self.sums.get(key, 0) + value) & _MASK
        meta = (tuple(int(s) for s in shape), str(dtype).replace("torch.", ""), kind)
        old = self.meta.setdefault(key, meta)
        if old != meta:
            raise RuntimeError(f"resume proof: tensor {key!r} described twice: {old} vs {meta}")

    def block_sum(
        self, data: torch.Tensor, goff, gshape, main: bool = True, replicated: bool = False
    ) -> Any:
        """:func:`megatron.integrity.digest.state.block_sum` of a block (a deferred digest
        records it instead; ``main``: the block is the main replica's; ``replicated``: every
        replica of the block records it, as ``all_replicas`` does for the model and a
        non-distributed optimizer, not the distributed optimizer's per-rank ranges)."""
        return sd.block_sum(data, goff, gshape)

    def range_sum(
        self,
        data: torch.Tensor,
        lo: int,
        hi: int,
        lshape,
        goff,
        gshape,
        values,
        main: bool = True,
        replicated: bool = False,
    ) -> Any:
        """:func:`megatron.integrity.digest.state.range_sum` of a range (a deferred digest records
        it instead; ``main``, ``replicated`` as :meth:`block_sum`)."""
        return sd.range_sum(data, lo, hi, lshape, goff, gshape, values=values)


@dataclass
class _Sum:
    """A recorded block or range sum: ``fn(*args, values=values)`` with the tensors replaceable
    (by their snapshot). ``main``: the block is the main replica's; ``replicated``: every replica
    of it recorded it (see :meth:`PartialDigest.block_sum`). :meth:`read` is the tensor
    whose elements it sums (``values`` when given: ``range_sum`` reads only its shape from
    ``data`` then)."""

    fn: Any
    data: torch.Tensor
    args: tuple
    values: Optional[torch.Tensor] = None
    main: bool = True
    replicated: bool = False

    def read(self) -> torch.Tensor:
        """The tensor whose elements the sum reads."""
        return self.data if self.values is None else self.values

    def rebind(self, t: torch.Tensor) -> None:
        """Read ``t`` (a copy of :meth:`read`) instead."""
        if self.values is None:
            self.data = t
        else:
            self.values = t

    def __call__(self) -> int:
        if self.fn is sd.block_sum:
            return sd.block_sum(self.data, *self.args)
        return sd.range_sum(self.data, *self.args, values=self.values)


@dataclass
class ShardRegion:
    """The bytes of one shard (a contiguous ``ShardedTensor``) of a save's state dict, as the
    rank holds it before upstream's fully parallel distribution drops the shards other ranks of
    the data-parallel group save.

    Attributes:
        sharded: the ``ShardedTensor`` (its ``data`` becomes ``None`` when another rank saves it).
        storage: ``(device, storage data_ptr)`` of its data.
        lo, hi: its data's byte addresses ``[lo, hi)``.
        main: the main replica apart from the data-parallel index (``replica_id`` zero but for
            its DP entry).
    """

    sharded: Any
    storage: tuple
    lo: int
    hi: int
    main: bool


def storage_range(t: Any) -> Optional[tuple]:
    """``((device, storage data_ptr), lo, hi)``, the byte addresses ``[lo, hi)`` of a plain
    contiguous tensor, else ``None``."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) or not t.is_contiguous():
        return None
    try:
        key = (t.device, t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return None
    return key, t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


def shard_sources(sharded_state_dict: Any) -> List[Tuple[Any, Any]]:
    """``(ShardedTensor, its data)`` of every ``ShardedTensor`` of a sharded state dict, in its
    order: what :func:`regions_of` reads, kept before upstream's distribution drops the data of
    the shards other ranks save (``data = None``)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return [
        (sh, sh.data) for sh in nested_values(sharded_state_dict) if isinstance(sh, ShardedTensor)
    ]


def regions_of(sources: List[Tuple[Any, Any]]) -> List[ShardRegion]:
    """The :class:`ShardRegion` of every contiguous ``ShardedTensor`` with data among
    ``sources`` (:func:`shard_sources`), in order; only those with megatron-core's
    ``(PP, TP, DP)`` replica id (any other, and factories, are left out: the blocks inside them go
    to their main replica)."""
    out = []
    with no_torch_function():  # reads only: the CPU backend's mode costs ~2 us per call
        for sh, data in sources:
            where = storage_range(data)
            ids = sh.replica_id
            if where is None or not (isinstance(ids, tuple) and len(ids) == 3):
                continue
            main = ids[0] == 0 and ids[1] == 0
            out.append(ShardRegion(sh, where[0], where[1], where[2], main))
    return out


def shard_regions(sharded_state_dict: Any) -> List[ShardRegion]:
    """:func:`regions_of` the :func:`shard_sources` of a sharded state dict."""
    return regions_of(shard_sources(sharded_state_dict))


@dataclass
class DeferredDigest(PartialDigest):
    """A :class:`PartialDigest` whose sums are recorded, not computed: the tensors they read
    (:meth:`tensors`) can be replaced by a snapshot of them (:meth:`bind`) and summed later, off
    the training loop (:meth:`evaluate`). The share's other parts (RNG digests, scalars) are
    taken when it is made."""

    recorded: List[Tuple[str, _Sum]] = field(default_factory=list)
    iteration: int = 0
    share: Optional[tuple] = None  # (rng, scalars, error) of :func:`deferred_training_state`
    args: Any = None
    shards: Optional[List[ShardRegion]] = None  # of the save's state dict (the save sets them)
    #: :func:`shard_sources` of the save's state dict, made :attr:`shards` by :meth:`record`
    shard_sources: Optional[List[Tuple[Any, Any]]] = None
    #: ``(model, optimizer)`` whose blocks :meth:`record` records (a lazy deferred digest)
    sources: Optional[tuple] = None
    #: copies of upstream's model ShardedTensors / factories of the save
    #: (:meth:`capture_model`); ``None``: :meth:`record` asks the model for them
    model_shs: Optional[List[Any]] = None

    def capture_model(self, state_dict: Dict[str, Any]) -> None:
        """Keep shallow copies of the model ShardedTensors and factories of upstream's save state
        dict (``generate_state_dict``'s, before upstream's distribution drops the data of the
        shards other ranks save), so that :meth:`record` need not ask the model again: the same
        call with the same metadata gave them (``torch_dist`` only; else nothing is kept)."""
        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

        if self.sources is None or getattr(self.args, "ckpt_format", None) != "torch_dist":
            return
        chunks = len(self.sources[0])
        keys = ["model"] if chunks == 1 else [f"model{i}" for i in range(chunks)]
        if not all(isinstance(state_dict.get(k), dict) for k in keys):
            return
        kinds = (ShardedTensor, ShardedTensorFactory)
        self.model_shs = [
            _shallow_copy(v)
            for k in keys
            for v in nested_values(state_dict[k])
            if isinstance(v, kinds)
        ]

    def record(self) -> None:
        """Record the sums of this rank's blocks (a lazy deferred digest, once; a no-op
        otherwise). Reads the model's and optimizer's structure, no tensor values: it may run
        in another thread while the training loop's forward and backward run (not while an
        optimizer step changes the optimizer's state). A failure is kept as this rank's error
        (exchanged by :func:`finish_deferred`), not raised. Also makes :attr:`shards` of
        :attr:`shard_sources`."""
        if self.shard_sources is not None:
            self.shards, self.shard_sources = regions_of(self.shard_sources), None
        if self.sources is None:
            return
        (model, optimizer), self.sources = self.sources, None
        try:
            _add_tensors(model, optimizer, self.args, self, shs=self.model_shs)
        except Exception as e:  # noqa: BLE001 - e.g. a tensor type the digest cannot read
            rng, scalars, error = self.share
            self.share = (rng, scalars, error or _rank_error(e))
        finally:
            self.model_shs = None

    def block_sum(self, data, goff, gshape, main: bool = True, replicated: bool = False) -> Any:
        return _Sum(sd.block_sum, data, (goff, gshape), main=main, replicated=replicated)

    def range_sum(
        self, data, lo, hi, lshape, goff, gshape, values, main=True, replicated=False
    ) -> Any:
        args = (lo, hi, lshape, goff, gshape)
        return _Sum(sd.range_sum, data, args, values, main=main, replicated=replicated)

    def add(self, key: str, value: Any, shape, dtype, kind: str) -> None:
        if isinstance(value, _Sum):
            self.recorded.append((key, value))
            value = 0
        super().add(key, value, shape, dtype, kind)

    def tensors(self) -> List[torch.Tensor]:
        """The tensors the recorded sums read, in order (one per sum: ``values`` if given, else
        ``data``); records them first (:meth:`record`)."""
        self.record()
        return [s.read() for _, s in self.recorded]

    def bind(self, tensors: List[torch.Tensor]) -> None:
        """Replace the recorded tensors by ``tensors`` (same order and shapes as
        :meth:`tensors`: their snapshot)."""
        for (_, s), t in zip(self.recorded, tensors, strict=True):
            s.rebind(t)

    def keep(self, which: List[bool]) -> None:
        """Keep only the recorded sums whose entry of ``which`` (one per sum, in order) is true
        (the others are evaluated on another rank, or by none: a replica's)."""
        self.recorded = [r for r, k in zip(self.recorded, which, strict=True) if k]

    def evaluate(self) -> None:
        """Compute the recorded sums into :attr:`sums` (releases the tensors)."""
        with torch.no_grad(), no_torch_function():
            for key, s in self.recorded:
                self.sums[key] = (self.sums.get(key, 0) + s()) & _MASK
        self.recorded = []


def _rank_error(e: Exception) -> str:
    """This rank's failure as the digest's exchange carries it."""
    return f"rank {process_rank()}: {type(e).__name__}: {e}"


def _shallow_copy(obj: Any) -> Any:
    """A shallow copy of a dataclass instance (its ``__dict__``; ``copy.copy`` costs ~5x)."""
    out = object.__new__(type(obj))
    out.__dict__.update(obj.__dict__)
    return out


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


def _add_model(shs: List[Any], acc: PartialDigest) -> None:
    for sh in shs:
        main = _main(sh.replica_id)
        if not (main or acc.all_replicas):
            continue
        for part, _ in _blocks(sh, sh.data):
            _lshape, goff, gshape = _place(part)
            v = acc.block_sum(part.data, goff, gshape, main=main, replicated=acc.all_replicas)
            acc.add(part.key, v, gshape, part.data.dtype, "model")


def _state_tensors(states: Dict[str, Any]):
    """(name, tensor) of an optimizer's per-parameter state: the main parameter as
    ``fp32_param`` and every state tensor but the 0-d ``step`` (kept in the scalar state)."""
    for name, value in states.items():
        if name == "step" or not isinstance(value, torch.Tensor) or value.dim() == 0:
            continue
        yield ("fp32_param" if name == "param" else name), value.detach()


def _add_distributed_optimizer(opt: Any, part_map: Dict[int, Any], acc: PartialDigest) -> None:
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
                    v = acc.range_sum(
                        part.data,
                        lo - off,
                        hi - off,
                        lshape,
                        goff,
                        gshape,
                        flat[lo - rng.start : hi - rng.start],
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


def _add_plain_optimizer(opt: Any, part_map: Dict[int, Any], acc: PartialDigest) -> None:
    mains = _main_params(opt)
    for pid, sh in part_map.items():
        main = mains.get(pid)
        is_main = _main(sh.replica_id)
        if main is None or not (is_main or acc.all_replicas):
            continue
        states = {"param": main}
        states.update(opt.optimizer.state.get(main, {}))
        parts = [  # the same blocks for every state of the parameter
            (part, off, None if off is None else _place(part)) for part, off in _blocks(sh, sh.data)
        ]
        for state_name, value in _state_tensors(states):
            flat_value = value.reshape(-1)
            for part, off, place in parts:
                key = f"optimizer.state.{state_name}.{part.key}"
                if off is None:
                    acc.skipped.append(key)
                    continue
                lshape, goff, gshape = place
                n = part.data.numel()
                flat = flat_value[off : off + n]
                v = acc.range_sum(
                    part.data, 0, n, lshape, goff, gshape, flat, main=is_main, replicated=True
                )
                acc.add(key, v, gshape, value.dtype, "optimizer")


def _add_dtensors(state: Any, prefix: str, acc: PartialDigest) -> None:
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
        value = sd.block_sum(state) if process_rank() == 0 else 0
        kind = "optimizer" if prefix.startswith("optimizer") else "model"
        acc.add(prefix, value, state.shape, state.dtype, kind)


def _add_fsdp(model: List[Any], optimizer: Any, args: Any, acc: PartialDigest) -> None:
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
    with no_torch_function():  # reads only: the CPU backend's mode costs ~2 us per call
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


def no_torch_function():
    """A context in which torch functions skip the active torch function modes (the CPU backend's
    CUDA-to-CPU mode costs ~50 us per tensor method call; the digest only reads tensors and
    makes temporaries, which need no mapping). A no-op context where torch has no such switch."""
    switch = getattr(torch._C, "DisableTorchFunction", None)
    return switch() if switch is not None else contextlib.nullcontext()


def _add_tensors(
    model: List[Any], optimizer: Any, args: Any, acc: PartialDigest, shs: Optional[List[Any]] = None
) -> None:
    """Add this rank's blocks of the model and optimizer state to ``acc`` (local work, except
    Megatron-FSDP's chunk metadata under ``fsdp_dtensor``). ``shs``: the model's ShardedTensors
    and factories when the caller has them (upstream's save state dict), else they are built."""
    with torch.no_grad():
        if getattr(args, "ckpt_format", None) == "fsdp_dtensor":
            _add_fsdp(model, optimizer, args, acc)
            return
        if shs is None:
            shs = _sharded_metadata(model, args)
        part_map = _by_param(shs)
        with no_torch_function():  # reads only: ~5x fewer microseconds per tensor
            _add_model(shs, acc)
            for opt in _optimizers(optimizer):
                if hasattr(opt, "model_param_group_index_map"):
                    _add_distributed_optimizer(opt, part_map, acc)
                elif hasattr(opt, "optimizer"):
                    _add_plain_optimizer(opt, part_map, acc)


def _local_share(
    model: List[Any],
    optimizer: Any,
    opt_param_scheduler: Any,
    args: Any,
    iteration: int,
    acc: Optional[PartialDigest] = None,
    lazy: bool = False,
) -> Share:
    """This rank's share of the digest (see :meth:`DigestExchange.exchange`); a failure is carried
    in it as text, so that no rank is left alone in the exchange's collective. ``acc``: where the
    sums go (a :class:`DeferredDigest` records them; ``lazy``: later, :meth:`DeferredDigest.record`
    records them)."""
    from megatron.core.utils import unwrap_model

    error = None
    acc = PartialDigest() if acc is None else acc
    rng: Dict[str, str] = {}
    scalars: dict = {}
    try:  # local work only: a failure is exchanged, so no rank is left in a collective
        rng = _rng_digest()  # first: nothing below may draw from a stream before it is recorded
        model = unwrap_model(model)  # as upstream's save_checkpoint / load_checkpoint do
        if lazy:
            acc.sources = (model, optimizer)
        else:
            _add_tensors(model, optimizer, args, acc)
        scalars = {
            "iteration": int(iteration),
            "consumed_train_samples": int(getattr(args, "consumed_train_samples", 0) or 0),
            "consumed_valid_samples": int(getattr(args, "consumed_valid_samples", 0) or 0),
            "skipped_train_samples": int(getattr(args, "skipped_train_samples", 0) or 0),
            "opt_param_scheduler": _scheduler_state(opt_param_scheduler),
            "optimizer_step": _optimizer_steps(optimizer),
        }
    except Exception as e:  # noqa: BLE001 - e.g. a tensor type the digest cannot read
        error = _rank_error(e)
    return (acc.sums, acc.meta, acc.skipped, rng, scalars, error)


def digest_training_state(
    model: List[Any],
    optimizer: Any,
    opt_param_scheduler: Any,
    args: Any,
    iteration: int,
    exchange: Optional[DigestExchange] = None,
) -> dict:
    """The state digest of the live training state (collective over the world: every rank calls).

    Args:
        model: the model chunks as ``pretrain`` holds them (DDP-wrapped modules).
        optimizer: megatron-core's optimizer (distributed, mixed precision, fp32 or chained), or
            None.
        opt_param_scheduler: upstream's ``OptimizerParamScheduler`` or None.
        args: the run's arguments (parallel sizes, checkpoint format, consumed samples).
        iteration: the iteration the state belongs to.
        exchange: combines the ranks' shares (the installed proof passes its own, which keeps the
            cheap exchange's layout between digests); None: a new one (a gathering exchange).

    Returns:
        The JSON-able record (the same on every rank): ``tensors`` (key -> ``digest`` as 16 hex
        digits, global ``shape``, ``dtype``, ``kind``), ``scalars``, ``rng`` (per-rank digests and
        the layout they belong to), ``layout``, ``seconds``.

    Raises:
        DigestUnavailable: on every rank, when some rank could not digest its part (its reason
            named) or two ranks describe a tensor differently. The local work holds no
            collective except under ``fsdp_dtensor`` (Megatron-FSDP's chunk metadata).
    """
    t0 = time.perf_counter()
    mine = _local_share(model, optimizer, opt_param_scheduler, args, iteration)
    return _record(mine, exchange or DigestExchange(), args, iteration, t0)


def deferred_training_state(
    model: List[Any],
    optimizer: Any,
    opt_param_scheduler: Any,
    args: Any,
    iteration: int,
    all_replicas: bool = False,
    lazy: bool = False,
) -> Optional[DeferredDigest]:
    """This rank's share of the state digest with its sums recorded, not computed (no
    collective): the RNG digests and scalars are taken now; the tensors the sums read are
    :meth:`DeferredDigest.tensors`, to snapshot and :meth:`~DeferredDigest.bind`; then
    :func:`finish_deferred` (collective). ``None`` under ``fsdp_dtensor`` (its digest needs
    collectives of the training loop: digest synchronously).

    ``all_replicas``: the blocks of every replica this rank holds are recorded, each marked
    main or not (``_Sum.main``); the caller must then :meth:`~DeferredDigest.keep` exactly one
    replica's sum of every block over all ranks (the local tier keeps the saving rank's), or
    only the main ones.

    ``lazy``: the blocks are recorded later, by :meth:`DeferredDigest.record` (the first of
    :meth:`~DeferredDigest.tensors` and :func:`finish_deferred` calls it), from the model
    ShardedTensors of the save's state dict when :meth:`~DeferredDigest.capture_model` kept
    them: the training loop then pays only for the RNG digests and the scalars."""
    if getattr(args, "ckpt_format", None) == "fsdp_dtensor":
        return None
    acc = DeferredDigest(all_replicas=all_replicas)
    acc.args = args
    mine = _local_share(model, optimizer, opt_param_scheduler, args, iteration, acc=acc, lazy=lazy)
    acc.share = (mine[3], mine[4], mine[5])
    acc.iteration = int(iteration)
    return acc


def finish_deferred(deferred: DeferredDigest, exchange: DigestExchange) -> dict:
    """The state digest record of a :class:`DeferredDigest` (collective over ``exchange``'s
    group: every rank calls, in the same order); as :func:`digest_training_state`.

    Raises:
        DigestUnavailable: as :func:`digest_training_state`.
    """
    t0 = time.perf_counter()
    deferred.record()
    error = deferred.share[2]
    if error is None:
        try:
            deferred.evaluate()
        except Exception as e:  # noqa: BLE001 - exchanged, so no rank is left alone
            error = _rank_error(e)
    rng, scalars, _ = deferred.share
    mine = (deferred.sums, deferred.meta, deferred.skipped, rng, scalars, error)
    return _record(mine, exchange, deferred.args, deferred.iteration, t0)


def _record(mine: Share, exchange: DigestExchange, args: Any, iteration: int, t0: float) -> dict:
    """Combine the ranks' shares (collective) into the record."""
    scalars = mine[4]
    sums, meta, skipped, rngs, steps = exchange.exchange(mine)
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
