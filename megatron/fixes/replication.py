"""Fix: local checkpoint replication corrupts quantized weights (NVRx issue 349, Megatron-LM issue 5281).

The defect (NVRx issue 349)
---------------------------
With ``--non-persistent-ckpt-type local --replication`` Megatron's ``pretrain()`` builds
``CliqueReplicationStrategy.from_replication_params(J, F)`` (NVRx 0.7.0,
``checkpointing/local/replication/strategies.py``) and hands it to ``LocalCheckpointManager``.
``CliqueReplicationStrategy.replicate`` gives the raw ``ShardedTensor.data`` to
``GroupWrapper.all_gather_batch``, which allocates receive buffers with ``empty_like`` of a meta
placeholder and calls ``dist.broadcast`` on every tensor as it is. That is wrong for every tensor
the transport cannot carry as one dense block of memory in a dtype the backend supports:

* Transformer Engine quantized parameters (``--fp8-param-gather``: ``Float8Tensor``,
  ``MXFP8Tensor``, ...): ``empty_like`` makes a real, uninitialised quantized tensor and TE runs
  ``c10d::broadcast_`` (not a mutable-schema op) on a dequantized temporary, so the received values
  are thrown away and the replica file holds NaN/garbage; builds whose pickling drops the
  quantizer crash with ``AttributeError`` on ``make_empty`` instead.
* non-dense views (``x[:, ::2]``, ``x[1:, 1::3]``): sent as raw memory from ``data_ptr`` into a
  dense receive buffer -> silently wrong values (dense permuted views such as ``x.t()`` and
  contiguous offset views happen to survive); ``float8_*`` / ``uint16`` tensors on gloo:
  ``Invalid scalar type``.
* retrieval from a peer (``GroupWrapper.isend_state_dict`` / ``irecv_state_dict``) hardcodes
  ``.cuda()`` and ``'cuda'`` buffers: recovery cannot run over a CPU/gloo group.

What this fix does
------------------
:class:`FixedCliqueReplicationStrategy` subclasses the upstream class and overrides ``replicate``
and ``retrieve_execute``. ``install`` makes it the object the name
``nvidia_resiliency_ext.checkpointing.local.replication.strategies.CliqueReplicationStrategy``
resolves to (so ``pretrain()``'s in-function import, ``LazyCliqueReplicationStrategy`` and any
``CliqueReplicationStrategy.from_replication_params`` call made after ``apply()`` build it:
``from_replication_params`` uses ``cls(...)``), and also points the upstream class's own
``replicate`` / ``retrieve_execute`` at the fixed functions, so a strategy built from a name bound
before ``apply()`` is fixed too. Nothing else of upstream is touched.

``replicate`` (owner = the rank whose shard it is; receivers = the other ranks of its clique):

1. Before any collective, every tensor is checked by metadata. Tensors that cannot be stored
   faithfully (meta tensors, sparse layouts, PyTorch-native quantized tensors, tensor subclasses
   with their own ``__torch_dispatch__`` but no ``dequantize``) are refused with
   :class:`UnsupportedTensorError` naming the key. The first collective gathers every rank's
   errors, so the error is raised on *every* rank, before any data is sent or any file written.
2. One tensor at a time, the owner converts it to what will be stored: a quantized tensor
   (detected as ``type(t).dequantize is not torch.Tensor.dequantize``) is dequantized to its
   nominal dtype (``t.dtype``); a non-contiguous tensor is made contiguous; a tensor on another
   device than ``target_device`` is copied there. Plain contiguous tensors are used as they are
   (no copy). The converted tensor becomes the primary's data, so primary and replicas hold the
   same values. The hollow state dicts, with each tensor's key/dtype/shape/size, are gathered.
3. The transport never hands ``dist`` anything but flat ``uint8`` tensors: every dtype
   (``float8_*``, ``uint16``, ``bool``, complex, ...) travels as its bytes. Small tensors are
   coalesced by the owner into staging buckets of ``bucket_bytes``; large ones are broadcast
   straight from their own memory in chunks of at most ``bucket_bytes``. A receiver keeps each
   owner's replicas in flat per-dtype segments of at most ``bucket_bytes`` (the replica tensors
   are views of them; ``torch.save`` writes each segment once), so every message is received in
   place: no per-tensor allocation, no unpacking copy. Messages of all owners are interleaved
   round-robin and up to ``2 * pipeline_depth`` of them are in flight at once, so on a group of
   two both directions are used; the owner packs into ``pipeline_depth`` staging buffers, each
   refilled only once the message it carried has completed. Peak extra memory:
   ``pipeline_depth * bucket_bytes`` of staging on the communication device plus the tensor
   being converted; never a second copy of the model.
4. Checksums (:func:`megatron.integrity.checksums.tensor_checksum`; XXH3-64 on gloo, ``pmix64``
   computed on the GPU on NCCL, see :func:`checksum_algorithm`): the owner hashes
   each stored tensor right after posting the message that carries its last byte (a tensor
   packed into a staging bucket is hashed from its copy right after copying, while in cache; the
   primary file holds the source bytes, so a faulty copy would still fail the primary's load
   verification); a receiver hashes each tensor as soon as its last byte has arrived; both
   overlap with the messages in flight. A second collective exchanges the owners' and the
   receivers' checksums and every rank compares every (owner, receiver, tensor): on any
   mismatch every rank raises
   :class:`~megatron.integrity.checksums.ChecksumMismatchError` naming key, sender rank and
   receiver rank, before ``LocalCheckpointManager.save`` writes a file, so no file is written.
5. The owner's checksums are put into the checksum record of every returned (hollow, then
   filled) state dict, primary and replicas, so they are stored in every local checkpoint file;
   format in :mod:`megatron.integrity.checksums` (attribute ``_megatron_integrity`` of the
   pickled ``TensorAwareStateDict``).

``retrieve_execute`` (``LocalCheckpointManager.load()`` with replication):

1. Every state dict this rank loaded from disk is verified against its record; a group-wide
   collective makes a mismatch (e.g. a corrupted byte in a replica file) raise on every rank, so a
   corrupt file is never used. Files without a record (written without this fix) are loaded with a
   warning, as upstream would.
2. Peer transfers use point-to-point messages of flat ``uint8`` buffers on the device the group's
   backend supports (CPU for gloo, the current CUDA device for NCCL), not hardcoded CUDA.
3. The receiver verifies what it received against the sender's record; mismatches raise on every
   rank.

How ``upstream_behaves()`` decides (capability, not version)
-----------------------------------------------------------
It runs the *installed upstream* ``CliqueReplicationStrategy.replicate`` on a one-rank stand-in
group that records what upstream hands to ``all_gather_batch``, with a tiny state dict holding a
probe quantized tensor (a storage-less wrapper subclass with its own ``dequantize``) and a
non-contiguous view. Upstream behaves only if the transport receives plain, contiguous tensors
holding the dequantized / densified values. NVRx 0.7.0 hands over the quantized tensor itself, so
the fix installs. Any error in the probe (changed internals) counts as "does not behave", and
``Fix.apply`` then refuses versions other than the pinned one.

Not covered: load paths that bypass the replication strategy (``LocalCheckpointManager`` without
``repl_strategy``) are not verified, since such files are written without a record. A corrupt
file is refused, not repaired: when a rank's own primary fails verification the load raises even
if a peer holds a good replica (``retrieve_plan`` is upstream's and prefers the local copy).
On NCCL the checksums are ``pmix64`` computed on the GPU (:mod:`megatron.integrity.device_hash`):
receivers hash each replica where it landed, the owner hashes its primary before the host copy,
and the copies to ``target_device`` are issued ``non_blocking`` after hashing, as upstream's are;
only the 8-byte digests are read back, with one copy.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import math
import pickle
from dataclasses import dataclass, field
from typing import Any, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron.fixes.base import Fix, Patcher, PatchSpec
from megatron.integrity import checksums as ck
from megatron.integrity.checksums import ChecksumMismatchError

logger = logging.getLogger("megatron.fixes.replication")

_STRATEGIES = "nvidia_resiliency_ext.checkpointing.local.replication.strategies"

try:
    from nvidia_resiliency_ext.checkpointing.local.replication import strategies as _strategies

    _UpstreamClique = _strategies.CliqueReplicationStrategy
except ImportError:  # NVRx not installed: the fix reports NOT_APPLICABLE
    _strategies = None
    _UpstreamClique = None

# Upstream's own methods, captured before anything is patched (the capability probe runs them).
_UPSTREAM_REPLICATE = None if _UpstreamClique is None else _UpstreamClique.__dict__["replicate"]

DEFAULT_BUCKET_BYTES = {"cpu": 4 * 1024 * 1024, "cuda": 16 * 1024 * 1024}
"""Default staging bucket / largest message / largest receive segment (bytes) per communication
device type. Gloo over TCP moves 2-4 MiB messages fastest and a small staging bucket stays in
cache while it is packed; NCCL needs larger messages to reach its bandwidth."""
DEFAULT_DIRECT_MIN_FRACTION = 4
"""By default tensors of at least ``bucket_bytes // 4`` bytes are sent from their own memory
(no staging copy); smaller ones are packed."""
DIRECT_CHUNK_BYTES = 32 * 1024 * 1024
"""Largest message of a tensor sent from its own memory (never below ``bucket_bytes``; a strategy's
``direct_chunk_bytes`` overrides it). Measured on gloo with 32 MiB tensors: 4 MiB chunks made
replicate 20% slower than upstream's one broadcast per tensor even without checksums, 32 MiB chunks
matched it. A receiver lands such a tensor in a buffer of its own, so the message size costs no
staging memory."""
DEFAULT_PIPELINE_DEPTH = 2
"""Staging buffers; up to twice as many messages are in flight at once. Staging memory is
``pipeline_depth * bucket_bytes``."""

__all__ = [
    "ChecksumMismatchError",
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_DIRECT_MIN_FRACTION",
    "DEFAULT_PIPELINE_DEPTH",
    "FIX",
    "FixedCliqueReplicationStrategy",
    "ReplicationFix",
    "UnsupportedTensorError",
    "comm_device",
    "fixed_replicate",
    "fixed_retrieve_execute",
    "is_quantized",
    "prepare_tensor",
]


class UnsupportedTensorError(ValueError):
    """A tensor of a local checkpoint cannot be replicated faithfully.

    Raised on every rank of the replication group before any data is sent or any file written.
    The message names the key and the rank that holds it.
    """


# ---------------------------------------------------------------------------------------------
# Tensor classification and conversion
# ---------------------------------------------------------------------------------------------


def is_quantized(t: torch.Tensor) -> bool:
    """True for a quantized tensor subclass (Transformer Engine ``Float8Tensor``, ``MXFP8Tensor``,
    ...): its type defines its own ``dequantize``. Every tensor has ``Tensor.dequantize``, so
    ``hasattr`` is no test."""
    return type(t).dequantize is not torch.Tensor.dequantize


def _has_custom_dispatch(t: torch.Tensor) -> bool:
    return type(t).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__


def _describe(key: str) -> str:
    return f"'{key}'"


def check_tensor(key: str, t: Any) -> Optional[str]:
    """Metadata check of one checkpoint tensor (no data is read).

    Returns:
        ``None`` if :func:`prepare_tensor` can convert it faithfully, else the reason, naming
        ``key``.
    """
    if not isinstance(t, torch.Tensor):
        return f"tensor {_describe(key)} is a {type(t).__name__}, not a torch.Tensor"
    if t.device.type == "meta":
        return f"tensor {_describe(key)} is on the meta device (it holds no data)"
    if is_quantized(t):
        return None  # dequantized by prepare_tensor
    if _has_custom_dispatch(t):
        return (
            f"tensor {_describe(key)} is a {type(t).__module__}.{type(t).__qualname__}: a tensor "
            "subclass with its own __torch_dispatch__ but no dequantize(); its bytes cannot be "
            "carried faithfully"
        )
    if t.layout is not torch.strided:
        return f"tensor {_describe(key)} has layout {t.layout}; only dense (strided) tensors are supported"
    if t.is_quantized:
        return f"tensor {_describe(key)} is a PyTorch-native quantized tensor ({t.dtype}); not supported"
    return None


def prepare_tensor(
    key: str, t: torch.Tensor, device: Optional[torch.device] = None
) -> Tuple[torch.Tensor, bool]:
    """What a checkpoint stores for ``t``: a plain, C-contiguous tensor of ``t``'s nominal dtype
    and shape.

    Args:
        key: name used in error messages.
        t: a tensor that passed :func:`check_tensor`. A quantized tensor is dequantized
            (``t.dequantize()``, cast to ``t.dtype`` if the result has another dtype); a
            non-contiguous one is copied to a contiguous tensor; a plain contiguous tensor is
            returned as it is.
        device: if given and different from the tensor's device, the result is copied there.

    Returns:
        ``(tensor, converted)``; ``converted`` is True when the result is a new tensor.

    Raises:
        UnsupportedTensorError: ``check_tensor`` refuses it, or ``dequantize()`` did not return
            a plain tensor of ``t``'s shape.
    """
    reason = check_tensor(key, t)
    if reason is not None:
        raise UnsupportedTensorError(reason)
    converted = False
    if is_quantized(t):
        out = t.dequantize()
        if not isinstance(out, torch.Tensor) or is_quantized(out) or _has_custom_dispatch(out):
            raise UnsupportedTensorError(
                f"{type(t).__name__}.dequantize() of tensor {_describe(key)} returned "
                f"{type(out).__name__}, not a plain tensor"
            )
        if tuple(out.shape) != tuple(t.shape):
            raise UnsupportedTensorError(
                f"{type(t).__name__}.dequantize() of tensor {_describe(key)} has shape "
                f"{tuple(out.shape)}, expected {tuple(t.shape)}"
            )
        if out.dtype != t.dtype:
            out = out.to(t.dtype)
        converted = True
    else:
        out = t
    if not out.is_contiguous():
        out = out.contiguous()
        converted = True
    if device is not None and out.device != torch.device(device):
        out = out.to(device)
        converted = True
    if converted:
        out = out.detach()
    return out, converted


_DTYPES = {
    ck.dtype_name(d): d
    for d in vars(torch).values()
    if isinstance(d, torch.dtype)
}
_DTYPE_NAMES = {d: n for n, d in _DTYPES.items()}


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    return ck.dtype_name(dtype) if name is None else name


def _tensor_names(state_dict: Any, count: int) -> List[Tuple[str, Optional[Tuple[int, ...]]]]:
    """(key, global_offset) per tensor, in ``state_dict.tensors`` order (non-hollow)."""
    sharded = getattr(type(state_dict), "_sharded_tensors", None)
    if sharded is not None:
        names = [
            (str(sh.key), tuple(int(o) for o in sh.global_offset))
            for sh in state_dict._sharded_tensors
        ]
        if len(names) == count:
            return names
    return [(f"tensor[{i}]", None) for i in range(count)]


# ---------------------------------------------------------------------------------------------
# Transport: flat uint8 messages, coalesced and pipelined
# ---------------------------------------------------------------------------------------------


def comm_device(group_wrapper: Any) -> torch.device:
    """Device to communicate on for an NVRx ``GroupWrapper``, from its backend.

    NCCL (alone or in a mixed ``cpu:gloo,cuda:nccl`` backend, with CUDA available) -> the current
    CUDA device; a backend that supports the CPU (gloo, ...) -> CPU; otherwise the backend's first
    supported device.
    """
    backend = str(dist.get_backend(group_wrapper.group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if backend.startswith("cpu:") or ",cpu:" in backend:
        return torch.device("cpu")
    devices = dist.Backend.backend_capability.get(backend, ["cpu"])
    if "cpu" in devices:
        return torch.device("cpu")
    dev = torch.device(devices[0])
    if dev.type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return dev


@dataclass
class _Message:
    """One transfer of ``size`` bytes from owner ``src``.

    On the receiver it is the byte range ``[start, start + size)`` of the owner's receive segment
    ``group`` (see :func:`_segments`); on the owner it is assembled from ``pieces``
    ``(tensor, tensor_byte_offset, length, message_byte_offset)``. ``direct`` when it is one slice
    of one tensor (sent without a staging copy)."""

    src: int
    size: int
    pieces: List[Tuple[int, int, int, int]] = field(default_factory=list)
    group: int = 0
    start: int = 0

    @property
    def direct(self) -> bool:
        return len(self.pieces) == 1 and self.pieces[0][2] == self.size


def _plan_messages(
    src: int,
    sizes: Sequence[int],
    bucket_bytes: int,
    direct_min: int,
    groups: Optional[Sequence[Sequence[int]]] = None,
    direct_chunk: Optional[int] = None,
) -> List[_Message]:
    """Split one owner's tensors into messages of at most ``bucket_bytes``.

    Args:
        sizes: byte size of each tensor.
        groups: tensor indices per group; each group is laid out back to back (in the given
            order) in one flat buffer on the receiver. ``None``: one group of all tensors.
            A message never spans two groups.
        direct_min: tensors at least this large get messages of their own (chunks of at most
            ``direct_chunk``, default ``bucket_bytes``); smaller consecutive tensors of a group
            share a message.
    """
    if groups is None:
        groups = [range(len(sizes))]
    direct_min = min(direct_min, bucket_bytes)  # a packed message never exceeds the bucket
    out: List[_Message] = []
    for g, members in enumerate(groups):
        pos = 0
        pending: Optional[_Message] = None
        for i in members:
            n, off = sizes[i], pos
            pos += n
            if n == 0:
                continue
            if n >= direct_min:
                if pending is not None:
                    out.append(pending)
                    pending = None
                step = max(bucket_bytes, direct_chunk or bucket_bytes)
                for c in range(0, n, step):
                    length = min(step, n - c)
                    out.append(_Message(src, length, [(i, c, length, 0)], g, off + c))
                continue
            if pending is not None and off + n - pending.start > bucket_bytes:
                out.append(pending)
                pending = None
            if pending is None:
                pending = _Message(src, 0, [], g, off)
            pending.pieces.append((i, 0, n, off - pending.start))
            pending.size = off + n - pending.start
        if pending is not None:
            out.append(pending)
    return out


def _segments(
    entries: Sequence[Mapping], max_bytes: int
) -> Tuple[List[List[int]], List[str], List[int], List[int]]:
    """Lay one owner's tensors out in flat receive buffers ("segments").

    A segment holds consecutive tensors (in record order) of one dtype, at most ``max_bytes``
    together; a larger tensor gets a segment of its own. Segments stay below glibc's mmap
    threshold cap (32 MiB), so buffers freed after a save are reused instead of being faulted
    in again page by page, and ``torch.save`` writes each segment once (its tensors are views).

    Returns:
        (tensor indices per segment, dtype name per segment, byte offset of each tensor in its
        segment, total bytes per segment).
    """
    open_seg: dict = {}
    groups: List[List[int]] = []
    dtypes: List[str] = []
    totals: List[int] = []
    offsets = [0] * len(entries)

    def new_segment(dtype: str) -> int:
        groups.append([])
        dtypes.append(dtype)
        totals.append(0)
        return len(groups) - 1

    for i, e in enumerate(entries):
        n, dtype = e["nbytes"], e["dtype"]
        if n >= max_bytes:
            g = new_segment(dtype)
        else:
            g = open_seg.get(dtype)
            if g is None or totals[g] + n > max_bytes:
                g = open_seg[dtype] = new_segment(dtype)
        groups[g].append(i)
        offsets[i] = totals[g]
        totals[g] += n
    return groups, dtypes, offsets, totals


def _segment_views(flat: torch.Tensor, members: Sequence[int], entries: Sequence[Mapping],
                   offsets: Sequence[int], out: List[Optional[torch.Tensor]]) -> None:
    """Put into ``out[i]``, for each tensor ``i`` of a segment, its view of the segment's flat
    buffer ``flat`` (of the segment's dtype), by the byte offsets of :func:`_segments`."""
    for i in members:
        e = entries[i]
        first = offsets[i] // flat.element_size()
        out[i] = flat[first:first + math.prod(e["shape"])].view(e["shape"])


def _interleave(per_src: Sequence[List[_Message]]) -> List[_Message]:
    """Round-robin over owners so transfers in both directions overlap."""
    queues = [collections.deque(m) for m in per_src]
    out: List[_Message] = []
    while any(queues):
        for q in queues:
            if q:
                out.append(q.popleft())
    return out


def _broadcast(buf: torch.Tensor, src: int, group: Any):
    """The only call that moves replica bytes during ``replicate`` (tests wrap it to inject
    faults). Returns the async work handle."""
    return dist.broadcast(buf, src=src, group=group, async_op=True)


class _Staging:
    """``depth`` reusable uint8 buffers of ``bucket_bytes`` on ``device``, allocated lazily."""

    def __init__(self, depth: int, bucket_bytes: int, device: torch.device):
        self.bufs: List[Optional[torch.Tensor]] = [None] * depth
        self.bucket_bytes = bucket_bytes
        self.device = device

    def get(self, slot: int, size: int) -> torch.Tensor:
        buf = self.bufs[slot]
        if buf is None or buf.numel() < size:  # larger: a direct chunk that must be staged
            buf = self.bufs[slot] = torch.empty(max(self.bucket_bytes, size), dtype=torch.uint8,
                                                device=self.device)
        return buf[:size]


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    return ck.tensor_byte_view(t)


def _transport_params(self, device: torch.device) -> Tuple[int, int, int]:
    """(bucket_bytes, direct_min_bytes, pipeline_depth) of a strategy; also works on upstream
    instances (patched methods), which have none of these attributes."""
    bucket = getattr(self, "bucket_bytes", None)
    if bucket is None:
        bucket = DEFAULT_BUCKET_BYTES["cuda" if device.type == "cuda" else "cpu"]
    direct_min = getattr(self, "direct_min_bytes", None)
    if direct_min is None:
        direct_min = max(1, bucket // DEFAULT_DIRECT_MIN_FRACTION)
    depth = max(1, int(getattr(self, "pipeline_depth", DEFAULT_PIPELINE_DEPTH)))
    return int(bucket), int(min(direct_min, bucket)), depth


def _raise_everywhere(group_wrapper: Any, my_errors: List[str], exc_type, header: str) -> None:
    """Collective: gather every rank's error list; if any rank has errors, raise on all ranks."""
    gathered = group_wrapper.all_gather_object(list(my_errors))
    lines = [
        f"  rank {group_wrapper.get_global_rank(r)}: {e}"
        for r, errs in enumerate(gathered)
        for e in errs
    ]
    if lines:
        raise exc_type(header + "\n" + "\n".join(lines))


# ---------------------------------------------------------------------------------------------
# replicate
# ---------------------------------------------------------------------------------------------


def _cpu_checksum(ptr: int, nbytes: int) -> int:
    """:func:`megatron.integrity.checksums.tensor_checksum` of a plain contiguous CPU tensor,
    given its ``data_ptr()`` and byte size (no tensor ops: the per-tensor hot path)."""
    if nbytes == 0:
        return _EMPTY_CHECKSUM
    return ck.checksum_bytes(_host_bytes(ptr, nbytes))


def _host_bytes(ptr: int, nbytes: int):
    """The ``nbytes`` bytes of host memory at ``ptr`` as a buffer (no copy)."""
    return (ctypes.c_char * nbytes).from_address(ptr)


_EMPTY_CHECKSUM = ck.checksum_bytes(b"")
_INFLIGHT_FACTOR = 2
"""Messages in flight at most: ``_INFLIGHT_FACTOR * pipeline_depth`` (staged or not)."""
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def _stored_checksum(t: torch.Tensor) -> int:
    """Checksum of a prepared (plain, contiguous) tensor; tests may wrap it."""
    if t.is_cpu:
        return _cpu_checksum(t.data_ptr(), t.numel() * t.element_size())
    return ck.tensor_checksum(t)


def fixed_replicate(self, local_ckpt, id_):
    """Fixed ``CliqueReplicationStrategy.replicate`` (NVRx 0.7.0 ``replication/strategies.py``).

    Same contract as upstream: all ranks of ``self.local_group`` call it; ``local_ckpt`` is left
    hollow; returns ``(state_dicts, ids)`` with one entry per group rank (this rank's own primary
    included), each holding plain tensors on ``self.target_device`` and the checksum record.

    Args:
        local_ckpt: this rank's ``TensorAwareStateDict`` (e.g. ``MCoreTensorAwareStateDict``);
            its tensors may be quantized (dequantized here), non-contiguous (made contiguous) or
            of any dtype (sent as bytes).
        id_: this rank's checkpoint id.

    Raises:
        UnsupportedTensorError: on every rank, if any rank holds a tensor that cannot be stored
            faithfully (``local_ckpt`` is restored, nothing is sent).
        ChecksumMismatchError: on every rank, if any receiver got bytes that do not match the
            owner's checksum; the message names key, sender rank and receiver rank. Raised before
            ``LocalCheckpointManager.save`` writes any file.
    """
    return _replicate(self, local_ckpt, id_)


def checksum_algorithm(self, device: torch.device) -> str:
    """The checksum algorithm a strategy uses when communicating on ``device``: its
    ``checksum_algorithm`` attribute, or by default ``pmix64`` on CUDA (hashed on the GPU, no host
    copy) and ``xxh3_64`` elsewhere (the fastest CPU hash measured here)."""
    algorithm = getattr(self, "checksum_algorithm", None)
    if algorithm is None:
        algorithm = ck.device_hash.ALGORITHM if device.type == "cuda" else ck.ALGORITHM
    return algorithm


def _replicate(self, local_ckpt, id_):
    group = self.local_group
    target = None if self.target_device is None else torch.device(self.target_device)
    device = comm_device(group)
    bucket, direct_min, depth = _transport_params(self, device)
    algorithm = checksum_algorithm(self, device)
    # on_device: tensors are hashed where they are (pmix64; on NCCL the GPU), so the owner's host
    # copy and the replicas' move to ``target`` happen after hashing, asynchronously as upstream's
    on_device = algorithm != ck.ALGORITHM
    place = None if on_device else target
    me = group.my_group_rank
    my_global = group.get_global_rank(me)

    originals = list(local_ckpt.tensors)
    names = _tensor_names(local_ckpt, len(originals))

    # 1. owner: metadata check and conversion, one tensor at a time. Once a tensor is refused,
    #    the rest is only checked (nothing more is converted).
    errors: List[str] = []
    stored: List[torch.Tensor] = []
    send_src: List[torch.Tensor] = []
    entries: List[dict] = []
    dequantized: collections.Counter = collections.Counter()
    for i, ((key, offset), t) in enumerate(zip(names, originals)):
        if type(t) in _PLAIN_TYPES and t.is_contiguous() and (place is None or t.device == place):
            if t.device.type == "meta":  # the only refusal a plain dense tensor can hit
                errors.append(check_tensor(key, t))
                continue
            s = t  # the common case: stored and sent as it is
        else:
            reason = check_tensor(key, t)
            if reason is not None:
                errors.append(reason)
                continue
            if errors:
                continue
            try:
                s, _ = prepare_tensor(key, t, place)
                if is_quantized(t):
                    dequantized[f"{type(t).__name__} -> {_dtype_name(s.dtype)}"] += 1
            except Exception as e:  # noqa: BLE001 - reported on every rank below
                errors.append(f"tensor '{key}': {type(e).__name__}: {e}")
                continue
        if errors:
            continue
        entries.append({
            "index": i,
            "key": key,
            "global_offset": None if offset is None else list(offset),
            "dtype": _dtype_name(s.dtype),
            "shape": list(s.shape),
            "nbytes": s.numel() * s.element_size(),
            "checksum": None,  # filled in below, while the bytes are on the wire
        })
        stored.append(s)
        # A plain dense tensor already on the communication device is sent from its own memory
        # even when the stored copy went to another device (no copy back).
        if s is not t and type(t) in _PLAIN_TYPES and t.device == device and t.is_contiguous():
            send_src.append(t)
        else:
            send_src.append(s)

    # 2. first collective: hollow state dicts with the tensor metadata, errors, ids.
    local_ckpt.pop_tensors()
    ck.attach_record(local_ckpt, None if errors else ck.make_record(my_global, entries, algorithm))
    try:
        gathered = group.all_gather_object((local_ckpt, errors, id_))
    finally:
        ck.attach_record(local_ckpt, None)
    all_errors = [
        f"  rank {group.get_global_rank(r)}: {e}" for r, (_, errs, _) in enumerate(gathered) for e in errs
    ]
    if all_errors:
        local_ckpt.insert_tensors(originals)
        raise UnsupportedTensorError(
            "local checkpoint replication refused before sending any data or writing any file "
            f"(checkpoint id {id_}):\n" + "\n".join(all_errors)
        )
    hollows = [g[0] for g in gathered]
    ids = [g[2] for g in gathered]
    records = [ck.get_record(h) for h in hollows]
    world = len(hollows)

    # 3. transport. The owner checksums each of its tensors right after the message carrying its
    #    last byte is posted; a receiver checksums each tensor as soon as its last byte arrives.
    #    Both overlap with the messages in flight. A receiver holds each owner's replicas in flat
    #    per-dtype buffers of at most ``bucket`` bytes (the tensors are views of them), so
    #    messages land in place: no per-tensor allocation and no unpacking copy.
    recv_device = target if target is not None else device
    land_device = device if on_device else recv_device  # where received bytes land and are hashed
    recv_cpu = land_device.type == "cpu" and not on_device
    layouts = [_segments(rec["entries"], bucket) for rec in records]
    results: List[List[Optional[torch.Tensor]]] = [[None] * len(rec["entries"]) for rec in records]
    results[me] = stored
    ptrs: List[List[int]] = [[0] * len(rec["entries"]) for rec in records]
    flats: List[List[Optional[torch.Tensor]]] = [[None] * len(lay[0]) for lay in layouts]
    remaining = [[e["nbytes"] for e in rec["entries"]] for rec in records]
    sums: List[List[Optional[int]]] = [[None] * len(rec["entries"]) for rec in records]

    hash_tensor = ck.tensor_checksum_on_device if on_device else _stored_checksum

    def checksum_received(r: int, i: int) -> None:
        if recv_cpu:
            sums[r][i] = _cpu_checksum(ptrs[r][i], records[r]["entries"][i]["nbytes"])
        else:
            sums[r][i] = hash_tensor(results[r][i])

    for r in range(world):
        entries_r = records[r]["entries"]
        if r == me:
            for i, e in enumerate(entries_r):
                if e["nbytes"] == 0:
                    sums[r][i] = hash_tensor(stored[i])
            continue
        groups, dtypes, offsets, totals = layouts[r]
        for g, members in enumerate(groups):
            dtype = _DTYPES[dtypes[g]]
            flat = torch.empty(totals[g] // dtype.itemsize, dtype=dtype, device=land_device)
            flats[r][g] = flat.view(torch.uint8)
            _segment_views(flat, members, entries_r, offsets, results[r])
            base = flat.data_ptr()
            for i in members:
                ptrs[r][i] = base + offsets[i]
                if entries_r[i]["nbytes"] == 0:
                    checksum_received(r, i)

    per_src = [
        _plan_messages(r, [e["nbytes"] for e in rec["entries"]], bucket, direct_min, layouts[r][0],
                       getattr(self, "direct_chunk_bytes", None) or DIRECT_CHUNK_BYTES)
        for r, rec in enumerate(records)
    ]
    schedule = _interleave(per_src)
    staging = _Staging(depth, bucket, device)
    staging_cpu = device.type == "cpu"
    send_ptrs = [t.data_ptr() if t.is_cpu else 0 for t in send_src]
    send_views: dict = {}
    inflight: collections.deque = collections.deque()
    # A staging slot is reused only once the message that last used it has completed; messages
    # that need no staging (direct sends, in-place receives) only count against the in-flight cap.
    # So the owner packs its next bucket while its previous one is still on the wire.
    max_inflight = _INFLIGHT_FACTOR * depth
    slot_last = [-1] * depth  # sequence number of the last message staged in each slot
    count = {"posted": 0, "finished": 0, "staged": 0}

    def take_slot(size: int) -> torch.Tensor:
        slot = count["staged"] % depth
        count["staged"] += 1
        while count["finished"] <= slot_last[slot]:
            finish()
        slot_last[slot] = count["posted"]
        return staging.get(slot, size)

    def src_bytes(i: int) -> torch.Tensor:
        if i not in send_views:
            send_views[i] = _byte_view(send_src[i])
        return send_views[i]

    def finish() -> None:
        work, msg, buf, staged = inflight.popleft()
        work.wait()
        count["finished"] += 1
        if msg.src == me:
            return
        r = msg.src
        if staged:
            flats[r][msg.group][msg.start:msg.start + msg.size].copy_(buf)
        for i, toff, length, _ in msg.pieces:
            remaining[r][i] -= length
            if recv_cpu and length != records[r]["entries"][i]["nbytes"]:
                # one chunk of a tensor sent in several messages: hash it now, while the bytes
                # that just landed are in cache (chunks complete in order: FIFO per owner)
                hash_chunk(r, i, ptrs[r][i] + toff, length, remaining[r][i] == 0)
            elif remaining[r][i] == 0:
                checksum_received(r, i)

    entries_me = records[me]["entries"]
    streams: dict = {}  # (owner, tensor) -> xxh3 state of a tensor hashed chunk by chunk

    def hash_chunk(r: int, i: int, ptr: int, length: int, last: bool) -> None:
        """Add the next chunk (in order) of owner ``r``'s tensor ``i`` to its xxh3 state."""
        h = streams.get((r, i))
        if h is None:
            h = streams[(r, i)] = ck.streaming_checksum()
        h.update(_host_bytes(ptr, length))
        if last:
            sums[r][i] = streams.pop((r, i)).intdigest()
    stored_ptrs = [s.data_ptr() if s.is_cpu and not on_device else 0 for s in stored]
    for msg in schedule:
        while len(inflight) >= max_inflight:
            finish()
        if msg.src == me:
            i, toff, length, _ = msg.pieces[0]
            if msg.direct and send_src[i].device == device:
                buf, staged = src_bytes(i)[toff:toff + length], False
            else:
                buf, staged = take_slot(msg.size), True
                if staging_cpu and all(send_ptrs[p[0]] for p in msg.pieces):
                    base = buf.data_ptr()
                    for i, toff, length, moff in msg.pieces:
                        ctypes.memmove(base + moff, send_ptrs[i] + toff, length)
                        if length == entries_me[i]["nbytes"] and not on_device:
                            # the whole tensor was just copied: hash the copy while it is still
                            # in cache (one read of the source instead of two)
                            sums[me][i] = _cpu_checksum(base + moff, length)
                else:
                    for i, toff, length, moff in msg.pieces:
                        buf[moff:moff + length].copy_(src_bytes(i)[toff:toff + length])
        elif land_device == device:
            buf, staged = flats[msg.src][msg.group][msg.start:msg.start + msg.size], False
        else:
            buf, staged = take_slot(msg.size), True
        work = _broadcast(buf, group.get_global_rank(msg.src), group.group)
        inflight.append((work, msg, buf, staged))
        count["posted"] += 1
        if msg.src == me:  # owner checksums, overlapping the transfer just posted
            for i, toff, length, _ in msg.pieces:
                if sums[me][i] is None and stored_ptrs[i] and length != entries_me[i]["nbytes"]:
                    # a chunk of a tensor sent in several messages, hashed as it goes out
                    hash_chunk(me, i, stored_ptrs[i] + toff, length,
                               toff + length == entries_me[i]["nbytes"])
                elif toff + length == entries_me[i]["nbytes"] and sums[me][i] is None:
                    sums[me][i] = hash_tensor(stored[i])
                    if on_device and target is not None and stored[i].device != target:
                        stored[i] = stored[i].to(target, non_blocking=True)  # the primary's host copy
    while inflight:
        finish()
    if on_device:
        for i, s in enumerate(stored):  # tensors of 0 bytes
            if target is not None and s.device != target:
                stored[i] = s.to(target, non_blocking=True)
        if land_device != recv_device:  # replicas: hashed where they landed, then moved
            for r in range(world):
                if r == me:
                    continue
                groups, dtypes, offsets, _ = layouts[r]
                for g, members in enumerate(groups):
                    moved = flats[r][g].to(recv_device, non_blocking=True).view(_DTYPES[dtypes[g]])
                    _segment_views(moved, members, records[r]["entries"], offsets, results[r])
        # every digest read with one device-to-host copy of 8 bytes per tensor; queued on the
        # current stream after the host copies above, it also waits for them to complete
        flat_sums = ck.to_checksums([x for row in sums for x in row if x is not None])
        it = iter(flat_sums)
        sums = [[None if x is None else next(it) for x in row] for row in sums]
    del staging, send_views, flats

    # 4. second collective: every owner's checksums and every receiver's; all ranks compare all
    #    pairs, so a mismatch raises the same error on every rank before anything is written.
    all_sums = group.all_gather_object(sums)
    mismatches = []
    for recv in range(world):
        for owner in range(world):
            if owner == recv:
                continue
            for i, entry in enumerate(records[owner]["entries"]):
                want, got = all_sums[owner][owner][i], all_sums[recv][owner][i]
                if want != got:
                    mismatches.append(
                        f"  key '{entry['key']}' (tensor #{i}) sent by rank "
                        f"{group.get_global_rank(owner)}, received by rank "
                        f"{group.get_global_rank(recv)}: checksum mismatch "
                        f"(owner {want:#018x}, received {got:#018x})"
                    )
    if mismatches:
        local_ckpt.insert_tensors(originals)
        raise ChecksumMismatchError(
            "local checkpoint replication: replica bytes differ from the owner's checksums "
            f"(checkpoint id {id_}); nothing was written:\n" + "\n".join(mismatches)
        )

    for r in range(world):
        rec = records[r]
        for entry, checksum in zip(rec["entries"], all_sums[r][r]):
            entry["checksum"] = checksum
        ck.attach_record(hollows[r], rec)
        hollows[r].insert_tensors(results[r])
    logger.debug(
        "replicate %s: sent %d B in %d messages over %s",
        id_, sum(e["nbytes"] for e in records[me]["entries"]), len(per_src[me]), device,
    )
    if dequantized:
        logger.info(
            "local checkpoint %s (rank %d): primary and replicas store %d quantized tensors "
            "dequantized (%s)", id_, my_global, sum(dequantized.values()),
            ", ".join(f"{n} x {k}" for k, n in sorted(dequantized.items())),
        )
    return hollows, ids


# ---------------------------------------------------------------------------------------------
# retrieval
# ---------------------------------------------------------------------------------------------


def _verify_state_dict(sd: Any, what: str) -> List[str]:
    try:
        record = ck.get_record(sd)
    except ValueError as e:
        return [f"{what}: {e}"]
    if record is None:
        logger.warning(
            "%s has no checksum record (written without megatron.fixes.replication); "
            "loading it unverified", what,
        )
        return []
    tensors = list(sd.tensors)
    return [f"{what}: {m}" for m in ck.verify_record(record, tensors)]


def _p2p_plan(tensors: Sequence[torch.Tensor], bucket: int, direct_min: int) -> List[_Message]:
    return _plan_messages(0, [t.numel() * t.element_size() for t in tensors], bucket, direct_min)


def _send_state_dict(self, sd: Any, dst: int, device: torch.device) -> None:
    group = self.local_group
    bucket, direct_min, _ = _transport_params(self, device)
    tensors = sd.pop_tensors()
    try:
        prepared = [prepare_tensor(f"tensor[{i}]", t)[0] for i, t in enumerate(tensors)]
        group.send_object(sd, dst)
        staging = _Staging(1, bucket, device)
        views = [_byte_view(t) for t in prepared]
        for msg in _p2p_plan(prepared, bucket, direct_min):
            i, toff, length, _ = msg.pieces[0]
            if msg.direct and prepared[i].device == device:
                buf = views[i][toff:toff + length]
            else:
                buf = staging.get(0, msg.size)
                for i, toff, length, moff in msg.pieces:
                    buf[moff:moff + length].copy_(views[i][toff:toff + length])
            dist.send(buf, dst, group=group.group)
    finally:
        sd.insert_tensors(tensors)


def _recv_state_dict(self, src: int, device: torch.device) -> Any:
    group = self.local_group
    bucket, direct_min, _ = _transport_params(self, device)
    sd = group.recv_object(src)
    sd.init_tensors()
    tensors = list(sd.tensors)
    views = [_byte_view(t) for t in tensors]
    staging = _Staging(1, bucket, device)
    for msg in _p2p_plan(tensors, bucket, direct_min):
        i, toff, length, _ = msg.pieces[0]
        if msg.direct and tensors[i].device == device:
            dist.recv(views[i][toff:toff + length], src, group=group.group)
            continue
        buf = staging.get(0, msg.size)
        dist.recv(buf, src, group=group.group)
        for i, toff, length, moff in msg.pieces:
            views[i][toff:toff + length].copy_(buf[moff:moff + length])
    return sd


def fixed_retrieve_execute(self, exchange_plan, my_data):
    """Fixed ``CliqueReplicationStrategy.retrieve_execute`` (NVRx 0.7.0; upstream delegates to
    ``GroupWrapper.execute_plan``, whose ``isend_state_dict`` / ``irecv_state_dict`` hardcode
    CUDA).

    All ranks of ``self.local_group`` call it with the same plan, as upstream.

    Args:
        exchange_plan: ``ExchangePlan`` from ``retrieve_plan``.
        my_data: id -> state dict this rank loaded from disk (every id it must send).

    Returns:
        id -> state dict for the ids this rank receives (its own included).

    Raises:
        ChecksumMismatchError: on every rank, if a loaded file or a received state dict does not
            match its checksum record (message names the checkpoint id, key and ranks).
        AssertionError: data this rank must send is missing (as upstream).
    """
    return _retrieve_execute(self, exchange_plan, my_data)


def _retrieve_execute(self, exchange_plan, my_data):
    group = self.local_group
    me = group.my_global_rank
    device = comm_device(group)
    missing = exchange_plan.required_ids().difference(my_data.keys())
    assert not missing, f"Not all required data provided! Missing ids: {missing}"

    errors: List[str] = []
    for id_ in sorted(exchange_plan.required_ids(), key=str):
        sd = my_data[id_]
        errors += _verify_state_dict(sd, f"local checkpoint {id_} loaded on rank {me}")
        for i, t in enumerate(sd.tensors):
            reason = check_tensor(f"tensor[{i}]", t)
            if reason is not None:
                errors.append(f"local checkpoint {id_} on rank {me}: {reason}")
    _raise_everywhere(
        group, errors, ChecksumMismatchError,
        "local checkpoint load: a stored checkpoint does not match its checksums; it is not used:",
    )

    recv_buf = {}
    received_errors: List[str] = []
    for entry in exchange_plan.entries:
        if entry.sender == me == entry.receiver:
            recv_buf[entry.id_] = my_data[entry.id_]
        elif entry.sender == me:
            _send_state_dict(self, my_data[entry.id_], entry.receiver, device)
        elif entry.receiver == me:
            sd = _recv_state_dict(self, entry.sender, device)
            received_errors += _verify_state_dict(
                sd, f"local checkpoint {entry.id_} sent by rank {entry.sender}, received by rank {me}"
            )
            recv_buf[entry.id_] = sd
    _raise_everywhere(
        group, received_errors, ChecksumMismatchError,
        "local checkpoint load: a checkpoint received from a peer does not match its checksums:",
    )
    return recv_buf


# ---------------------------------------------------------------------------------------------
# The strategy class
# ---------------------------------------------------------------------------------------------

if _UpstreamClique is not None:

    class FixedCliqueReplicationStrategy(_UpstreamClique):
        """``CliqueReplicationStrategy`` whose replicas equal their primaries, with per-tensor
        checksums verified on save and on load, and peer retrieval over any backend.

        Built exactly like upstream (``from_replication_params(J, F)`` or ``cls(group,
        target_device)``). See the module docstring for the algorithm.

        Args:
            local_group: the clique (``torch.distributed.ProcessGroup`` or NVRx ``GroupWrapper``).
            target_device: where received replicas are placed (upstream default ``"cpu"``);
                ``None`` keeps them on the communication device.
            bucket_bytes: staging bucket size, largest message and largest receive segment,
                bytes; ``None`` (default): 4 MiB when communicating on the CPU (gloo),
                16 MiB on CUDA (NCCL).
            direct_min_bytes: tensors at least this large are sent without a staging copy;
                ``None`` (default): ``bucket_bytes // 4``. Capped at ``bucket_bytes``.
            pipeline_depth: staging buffers (default 2); up to ``2 * pipeline_depth`` messages
                are in flight; staging memory is ``pipeline_depth * bucket_bytes`` on the
                communication device.
            checksum_algorithm: ``"pmix64"`` (hashed on the device the bytes are on; replicas
                land on the communication device, are hashed there, then move to
                ``target_device``), ``"xxh3_64"`` (hashed on the CPU), or ``None`` (default):
                ``pmix64`` on NCCL, ``xxh3_64`` on gloo.

        Raises:
            ValueError: a size or depth is not positive, or the algorithm is unknown.
        """

        def __init__(
            self,
            local_group,
            target_device="cpu",
            *,
            bucket_bytes: Optional[int] = None,
            direct_min_bytes: Optional[int] = None,
            pipeline_depth: int = DEFAULT_PIPELINE_DEPTH,
            checksum_algorithm: Optional[str] = None,
        ):
            _UpstreamClique.__init__(self, local_group, target_device=target_device)
            if checksum_algorithm is not None and checksum_algorithm not in ck.ALGORITHMS:
                raise ValueError(f"checksum_algorithm must be one of {ck.ALGORITHMS} or None, "
                                 f"got {checksum_algorithm!r}")
            self.checksum_algorithm = checksum_algorithm
            for name, value in (("bucket_bytes", bucket_bytes), ("direct_min_bytes", direct_min_bytes),
                                ("pipeline_depth", pipeline_depth)):
                if value is not None and int(value) <= 0:
                    raise ValueError(f"{name} must be positive, got {value}")
            self.bucket_bytes = None if bucket_bytes is None else int(bucket_bytes)
            self.direct_min_bytes = None if direct_min_bytes is None else int(direct_min_bytes)
            self.pipeline_depth = int(pipeline_depth)

        replicate = fixed_replicate
        retrieve_execute = fixed_retrieve_execute

else:  # pragma: no cover - NVRx not installed
    FixedCliqueReplicationStrategy = None


# ---------------------------------------------------------------------------------------------
# Capability probe for upstream_behaves()
# ---------------------------------------------------------------------------------------------


class _ProbeQuantized(torch.Tensor):
    """Storage-less wrapper subclass with its own ``dequantize``: int8 payload * scale."""

    @staticmethod
    def __new__(cls, payload: torch.Tensor, scale: float):
        self = torch.Tensor._make_wrapper_subclass(cls, payload.shape, dtype=torch.float32)
        self._payload, self._scale = payload, scale
        return self

    def dequantize(self, *args, **kwargs):  # noqa: D401
        return self._payload.to(torch.float32) * self._scale

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def unwrap(x):
            return x.dequantize() if isinstance(x, _ProbeQuantized) else x

        args = torch.utils._pytree.tree_map(unwrap, args)
        kwargs = torch.utils._pytree.tree_map(unwrap, kwargs or {})
        return func(*args, **kwargs)


class _ProbeStateDict:
    """Minimal TensorAwareStateDict for the probe (duck-typed)."""

    def __init__(self, tensors):
        self._tensors = list(tensors)
        self._hollow = False

    @property
    def tensors(self):
        return iter(self._tensors)

    @property
    def is_hollow(self):
        return self._hollow

    def pop_tensors(self):
        out, self._tensors, self._hollow = self._tensors, [], True
        return out

    def insert_tensors(self, tensors):
        self._tensors, self._hollow = list(tensors), False

    def __getstate__(self):
        return {"_tensors": [], "_hollow": self._hollow}


class _RecordingGroup:
    """One-rank stand-in for ``GroupWrapper`` that records what reaches the transport."""

    world_size = 1
    my_group_rank = 0
    my_global_rank = 0
    ranks = [0]
    group = None
    backend = "gloo"

    def __init__(self):
        self.handed: List[torch.Tensor] = []

    def get_global_rank(self, group_rank=None):
        return 0

    def get_group_rank(self, global_rank=None):
        return 0

    def all_gather_object(self, obj):
        return [pickle.loads(pickle.dumps(obj))]

    def all_gather_batch(self, tensors, target_device=None):
        self.handed = list(tensors)
        return [[t for t in tensors]]


def _upstream_handles_unfaithful_tensors() -> bool:
    """Run upstream's ``replicate`` on the probe; True iff the transport got only plain, dense
    tensors with the right values."""
    if _UPSTREAM_REPLICATE is None:
        return False
    payload = torch.tensor([[1, -2, 3], [4, 5, -6]], dtype=torch.int8)
    quantized = _ProbeQuantized(payload, 0.5)
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    strided = base[:, ::2]
    expected = [quantized.dequantize(), strided.contiguous()]
    strategy = _UpstreamClique.__new__(_UpstreamClique)
    recorder = _RecordingGroup()
    strategy.local_group = recorder
    strategy.target_device = None
    try:
        _UPSTREAM_REPLICATE(strategy, _ProbeStateDict([quantized, strided]), "probe")
    except Exception as e:  # noqa: BLE001 - changed internals: treat as not behaving
        logger.debug("replication probe: upstream replicate raised %r", e)
        return False
    handed = recorder.handed
    if len(handed) != len(expected):
        return False
    for got, want in zip(handed, expected):
        if type(got) not in (torch.Tensor, torch.nn.Parameter) or not got.is_contiguous():
            return False
        if got.dtype != want.dtype or not torch.equal(got, want):
            return False
    return True


# ---------------------------------------------------------------------------------------------
# The fix
# ---------------------------------------------------------------------------------------------


class ReplicationFix(Fix):
    """Installs :class:`FixedCliqueReplicationStrategy` (see the module docstring)."""

    name = "replication"
    title = "Local checkpoint replication: faithful, checksummed replicas; recovery over any backend"
    upstream_refs = ("NVRx issue 349", "Megatron-LM issue 5281")
    package = "nvidia-resiliency-ext"
    supported = "==0.7.0"
    patches = (
        PatchSpec(
            target=f"{_STRATEGIES}.CliqueReplicationStrategy",
            replacement="megatron.fixes.replication.FixedCliqueReplicationStrategy",
            why="pretrain() and from_replication_params (cls(...)) build the fixed subclass: "
            "quantized tensors dequantized, every tensor sent as dense bytes, checksums verified",
        ),
        PatchSpec(
            target=f"{_STRATEGIES}.CliqueReplicationStrategy.replicate",
            replacement="megatron.fixes.replication.fixed_replicate",
            why="strategies built from the class bound before apply() stop writing NaN replicas "
            "of Transformer Engine quantized weights and non-dense views",
        ),
        PatchSpec(
            target=f"{_STRATEGIES}.CliqueReplicationStrategy.retrieve_execute",
            replacement="megatron.fixes.replication.fixed_retrieve_execute",
            why="peer recovery verifies checksums and runs over gloo/CPU as well as NCCL "
            "(upstream hardcodes .cuda())",
        ),
    )

    def upstream_behaves(self) -> bool:
        """True if the installed upstream ``replicate`` already hands the transport dequantized,
        dense tensors (probe described in the module docstring)."""
        return _upstream_handles_unfaithful_tensors()

    def install(self, patcher: Patcher) -> None:
        """Point the NVRx name and the upstream class's methods at the fixed implementation."""
        if _strategies is None:  # pragma: no cover - apply() reports NOT_APPLICABLE first
            raise RuntimeError("nvidia_resiliency_ext is not importable")
        patcher.replace(_UpstreamClique, "replicate", fixed_replicate)
        patcher.replace(_UpstreamClique, "retrieve_execute", fixed_retrieve_execute)
        patcher.replace(_strategies, "CliqueReplicationStrategy", FixedCliqueReplicationStrategy)


FIX = ReplicationFix()
