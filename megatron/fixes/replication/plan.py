"""How replica bytes are laid out and cut into messages (pure planning, no communication).

Every message is a flat ``uint8`` tensor of at most ``bucket_bytes`` (larger only for tensors sent
from their own memory, in chunks of up to :data:`DIRECT_CHUNK_BYTES`). A receiver keeps each
owner's replicas in flat per-dtype *segments* (:func:`segments`); the replica tensors are views of
them, so a message lands in place. :func:`plan_messages` cuts one owner's tensors into messages
that never span two segments; :func:`interleave` orders all owners' messages round-robin.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field
from typing import Any, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron.integrity.checksum import tensor as ck

DEFAULT_BUCKET_BYTES = {"cpu": 4 * 1024 * 1024, "cuda": 16 * 1024 * 1024}
"""Default staging bucket / largest message / largest receive segment (bytes) per communication
device type. Gloo over TCP moves 2-4 MiB messages fastest and a small staging bucket stays in
cache while it is packed; NCCL needs larger messages to reach its bandwidth."""
DEFAULT_DIRECT_MIN_FRACTION = 4
"""By default tensors of at least ``bucket_bytes // 4`` bytes are sent from their own memory
(no staging copy); smaller ones are packed."""
DIRECT_CHUNK_BYTES = 32 * 1024 * 1024
"""Largest message of a tensor sent from its own memory (never below ``bucket_bytes``; read when
``replicate`` starts). Smaller chunks made replicate slower than
upstream's one broadcast per tensor on gloo (docs/benchmarks.md). A receiver lands such a tensor
in a buffer of its own, so the message size costs no staging memory."""
DEFAULT_PIPELINE_DEPTH = 2
"""Staging buffers; up to twice as many messages are in flight at once. Staging memory is
``pipeline_depth * bucket_bytes``."""


@dataclass(frozen=True)
class TransportParams:
    """Message sizes of one strategy on one communication device (see :func:`transport_params`).

    Attributes:
        bucket: staging bucket, largest packed message and largest receive segment, bytes.
        direct_min: tensors of at least this many bytes are sent from their own memory.
        depth: staging buffers (``pipeline_depth``).
        direct_chunk: largest message of a tensor sent from its own memory, bytes.
    """

    bucket: int
    direct_min: int
    depth: int
    direct_chunk: int


def transport_params(strategy: Any, device: torch.device) -> TransportParams:
    """The message sizes of ``strategy`` on ``device``; also works on upstream instances
    (patched methods), which have none of the attributes and get the defaults."""
    bucket = getattr(strategy, "bucket_bytes", None)
    if bucket is None:
        bucket = DEFAULT_BUCKET_BYTES["cuda" if device.type == "cuda" else "cpu"]
    direct_min = getattr(strategy, "direct_min_bytes", None)
    if direct_min is None:
        direct_min = max(1, bucket // DEFAULT_DIRECT_MIN_FRACTION)
    depth = max(1, int(getattr(strategy, "pipeline_depth", DEFAULT_PIPELINE_DEPTH)))
    return TransportParams(int(bucket), int(min(direct_min, bucket)), depth, DIRECT_CHUNK_BYTES)


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
class Message:
    """One transfer of ``size`` bytes from owner ``src``.

    On the receiver it is the byte range ``[start, start + size)`` of the owner's receive segment
    ``group`` (see :func:`segments`); on the owner it is assembled from ``pieces``
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


def plan_messages(
    src: int,
    sizes: Sequence[int],
    bucket_bytes: int,
    direct_min: int,
    groups: Optional[Sequence[Sequence[int]]] = None,
    direct_chunk: Optional[int] = None,
) -> List[Message]:
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
    step = max(bucket_bytes, direct_chunk or bucket_bytes)
    out: List[Message] = []
    for g, members in enumerate(groups):
        pos = 0
        pending: Optional[Message] = None
        for i in members:
            n, off = sizes[i], pos
            pos += n
            if n == 0:
                continue
            if n >= direct_min:
                if pending is not None:
                    out.append(pending)
                    pending = None
                for c in range(0, n, step):
                    length = min(step, n - c)
                    out.append(Message(src, length, [(i, c, length, 0)], g, off + c))
                continue
            if pending is not None and off + n - pending.start > bucket_bytes:
                out.append(pending)
                pending = None
            if pending is None:
                pending = Message(src, 0, [], g, off)
            pending.pieces.append((i, 0, n, off - pending.start))
            pending.size = off + n - pending.start
        if pending is not None:
            out.append(pending)
    return out


def segments(
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


def segment_views(
    flat: torch.Tensor,
    members: Sequence[int],
    entries: Sequence[Mapping],
    offsets: Sequence[int],
    out: List[Optional[torch.Tensor]],
) -> None:
    """Put into ``out[i]``, for each tensor ``i`` of a segment, its view of the segment's flat
    buffer ``flat`` (of the segment's dtype), by the byte offsets of :func:`segments`."""
    for i in members:
        e = entries[i]
        first = offsets[i] // flat.element_size()
        out[i] = flat[first : first + math.prod(e["shape"])].view(e["shape"])


def interleave(per_src: Sequence[List[Message]]) -> List[Message]:
    """Round-robin over owners so transfers in both directions overlap."""
    queues = [collections.deque(m) for m in per_src]
    out: List[Message] = []
    while any(queues):
        for q in queues:
            if q:
                out.append(q.popleft())
    return out


class Staging:
    """``depth`` reusable uint8 buffers of ``bucket_bytes`` on ``device``, allocated lazily."""

    def __init__(self, depth: int, bucket_bytes: int, device: torch.device):
        self.bufs: List[Optional[torch.Tensor]] = [None] * depth
        self.bucket_bytes = bucket_bytes
        self.device = device

    def get(self, slot: int, size: int) -> torch.Tensor:
        buf = self.bufs[slot]
        if buf is None or buf.numel() < size:  # larger: a direct chunk that must be staged
            buf = self.bufs[slot] = torch.empty(
                max(self.bucket_bytes, size), dtype=torch.uint8, device=self.device
            )
        return buf[:size]


def byte_view(t: torch.Tensor) -> torch.Tensor:
    return ck.tensor_byte_view(t)
