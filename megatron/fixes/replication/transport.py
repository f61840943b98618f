"""The replica transport of ``replicate``: pipelined broadcasts of flat ``uint8`` messages, with
every tensor checksummed as its bytes go out (owner) and land (receivers).

:class:`ReplicaExchange` owns one exchange's in-flight state: receive segments, staging buffers,
the queue of posted messages, per-tensor byte counters and the checksums computed so far.
:func:`_broadcast` is the only call that moves replica bytes (tests wrap it to inject faults);
:func:`_cpu_checksum` is the CPU hash of the hot path (tests and the benchmark wrap it).
"""

from __future__ import annotations

import collections
import ctypes
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron.fixes.replication.convert import DTYPES, Owned
from megatron.fixes.replication.plan import (
    Message,
    Staging,
    TransportParams,
    byte_view,
    interleave,
    plan_messages,
    segment_views,
    segments,
)
from megatron.integrity.checksum import device as device_checksum
from megatron.integrity.checksum import tensor as ck

_INFLIGHT_FACTOR = 2
"""Messages in flight at most: ``_INFLIGHT_FACTOR * pipeline_depth`` (staged or not)."""


def _broadcast(buf: torch.Tensor, src: int, group: Any):
    """The only call that moves replica bytes during ``replicate`` (tests wrap it to inject
    faults). Returns the async work handle."""
    return dist.broadcast(buf, src=src, group=group, async_op=True)


def _host_bytes(ptr: int, nbytes: int):
    """The ``nbytes`` bytes of host memory at ``ptr`` as a buffer (no copy)."""
    return (ctypes.c_char * nbytes).from_address(ptr)


_EMPTY_CHECKSUM = ck.checksum_bytes(b"")


def _cpu_checksum(ptr: int, nbytes: int) -> int:
    """:func:`megatron.integrity.checksum.tensor.tensor_checksum` of a plain contiguous CPU tensor,
    given its ``data_ptr()`` and byte size (no tensor ops: the per-tensor hot path)."""
    if nbytes == 0:
        return _EMPTY_CHECKSUM
    return ck.checksum_bytes(_host_bytes(ptr, nbytes))


def _stored_checksum(t: torch.Tensor) -> int:
    """Checksum of a prepared (plain, contiguous) tensor."""
    if t.is_cpu:
        return _cpu_checksum(t.data_ptr(), t.numel() * t.element_size())
    return ck.tensor_checksum(t)


def checksum_algorithm(strategy: Any, device: torch.device) -> str:
    """The checksum algorithm a strategy uses when communicating on ``device``: its
    ``checksum_algorithm`` attribute, or by default ``pmix64`` on CUDA (hashed on the GPU, no host
    copy) and ``xxh3_64`` elsewhere (the fastest CPU hash measured here)."""
    algorithm = getattr(strategy, "checksum_algorithm", None)
    if algorithm is None:
        algorithm = device_checksum.ALGORITHM if device.type == "cuda" else ck.ALGORITHM
    return algorithm


class ReplicaExchange:
    """Sends this rank's stored tensors to the other ranks of the clique and receives theirs.

    Every rank of ``group`` builds one with the same ``records`` and calls :meth:`run` once.
    Messages of all owners are interleaved round-robin; up to ``2 * depth`` are in flight; the
    owner packs small tensors into ``depth`` staging buffers, each refilled only once the message
    it carried has completed. A receiver lands each owner's replicas in flat per-dtype segments
    (the replica tensors are views of them), hashing each tensor once its last byte has arrived.

    Args:
        group: NVRx ``GroupWrapper`` of the clique.
        device: the communication device (:func:`~.plan.comm_device`).
        params: message sizes (:func:`~.plan.transport_params`).
        algorithm: checksum algorithm; other than ``xxh3_64``, tensors are hashed where they are
            (``pmix64`` on the GPU) and copied to ``target`` after hashing, ``non_blocking``.
        target: device of the returned tensors (``None``: the communication device).
        owned: this rank's tensors (:func:`~.convert.prepare_owned`); ``owned.stored`` is updated
            in place when a primary is copied to ``target`` after hashing.
        records: every rank's checksum record (from the metadata exchange), in group rank order.
    """

    def __init__(
        self,
        group: Any,
        device: torch.device,
        params: TransportParams,
        algorithm: str,
        target: Optional[torch.device],
        owned: Owned,
        records: Sequence[dict],
    ) -> None:
        self.group = group
        self.me = group.my_group_rank
        self.device = device
        self.params = params
        self.target = target
        self.on_device = algorithm != ck.ALGORITHM
        self.recv_device = target if target is not None else device
        # where received bytes land and are hashed
        self.land_device = device if self.on_device else self.recv_device
        self.recv_cpu = self.land_device.type == "cpu" and not self.on_device
        self.hash_tensor = ck.tensor_checksum_on_device if self.on_device else _stored_checksum

        self.entries = [rec["entries"] for rec in records]
        self.layouts = [segments(e, params.bucket) for e in self.entries]
        self.results: List[List[Optional[torch.Tensor]]] = [[None] * len(e) for e in self.entries]
        self.stored = owned.stored
        self.results[self.me] = self.stored
        self.ptrs = [[0] * len(e) for e in self.entries]
        self.flats: List[List[Optional[torch.Tensor]]] = [
            [None] * len(lay[0]) for lay in self.layouts
        ]
        self.remaining = [[e["nbytes"] for e in entries] for entries in self.entries]
        self.sums: List[List[Any]] = [[None] * len(e) for e in self.entries]
        self.streams: Dict[Tuple[int, int], Any] = {}  # xxh3 states of tensors hashed by chunk

        self.send_src = owned.send_src
        self.send_ptrs = [t.data_ptr() if t.is_cpu else 0 for t in self.send_src]
        self.send_views: Dict[int, torch.Tensor] = {}
        self.stored_ptrs = [
            s.data_ptr() if s.is_cpu and not self.on_device else 0 for s in self.stored
        ]
        self.staging: Optional[Staging] = Staging(params.depth, params.bucket, device)
        self.staging_cpu = device.type == "cpu"
        self.per_src = [
            plan_messages(
                r,
                [e["nbytes"] for e in entries],
                params.bucket,
                params.direct_min,
                self.layouts[r][0],
                params.direct_chunk,
            )
            for r, entries in enumerate(self.entries)
        ]
        # A staging slot is reused only once the message that last used it has completed;
        # messages that need no staging (direct sends, in-place receives) only count against the
        # in-flight cap. So the owner packs its next bucket while its previous one is on the wire.
        self.inflight: collections.deque = collections.deque()
        self.max_inflight = _INFLIGHT_FACTOR * params.depth
        self.slot_last = [-1] * params.depth  # sequence number of the last message in each slot
        self.posted = self.finished = self.staged = 0

    @property
    def messages_sent(self) -> int:
        return len(self.per_src[self.me])

    def run(self) -> Tuple[List[List[Optional[torch.Tensor]]], List[List[Any]]]:
        """Move every owner's tensors to every other rank, checksumming on both sides.

        Returns:
            ``(results, sums)``: per group rank, its tensors as this rank holds them (this rank's
            own: the stored primaries) and the checksums this rank computed of them (ints).
        """
        self._allocate_segments()
        for msg in interleave(self.per_src):
            while len(self.inflight) >= self.max_inflight:
                self._finish()
            self._post(msg)
        while self.inflight:
            self._finish()
        if self.on_device:
            self._place_and_read_checksums()
        self.staging = None
        self.send_views.clear()
        self.flats = []
        return self.results, self.sums

    # ------------------------------------------------------------------------- receiving side

    def _allocate_segments(self) -> None:
        """Receive segments of every other owner; tensors of 0 bytes are hashed at once."""
        for r, entries in enumerate(self.entries):
            if r == self.me:
                for i, e in enumerate(entries):
                    if e["nbytes"] == 0:
                        self.sums[r][i] = self.hash_tensor(self.stored[i])
                continue
            groups, dtypes, offsets, totals = self.layouts[r]
            for g, members in enumerate(groups):
                dtype = DTYPES[dtypes[g]]
                flat = torch.empty(
                    totals[g] // dtype.itemsize, dtype=dtype, device=self.land_device
                )
                self.flats[r][g] = flat.view(torch.uint8)
                segment_views(flat, members, entries, offsets, self.results[r])
                base = flat.data_ptr()
                for i in members:
                    self.ptrs[r][i] = base + offsets[i]
                    if entries[i]["nbytes"] == 0:
                        self._checksum_received(r, i)

    def _checksum_received(self, r: int, i: int) -> None:
        if self.recv_cpu:
            self.sums[r][i] = _cpu_checksum(self.ptrs[r][i], self.entries[r][i]["nbytes"])
        else:
            self.sums[r][i] = self.hash_tensor(self.results[r][i])

    def _hash_chunk(self, r: int, i: int, ptr: int, length: int, last: bool) -> None:
        """Add the next chunk (in order) of owner ``r``'s tensor ``i`` to its xxh3 state."""
        h = self.streams.get((r, i))
        if h is None:
            h = self.streams[(r, i)] = ck.streaming_checksum()
        h.update(_host_bytes(ptr, length))
        if last:
            self.sums[r][i] = self.streams.pop((r, i)).intdigest()

    def _landed(self, msg: Message, buf: torch.Tensor, staged: bool) -> None:
        """A message from another owner completed: unstage it, hash the tensors it finished."""
        r = msg.src
        if staged:
            self.flats[r][msg.group][msg.start : msg.start + msg.size].copy_(buf)
        remaining, entries = self.remaining[r], self.entries[r]
        for i, toff, length, _ in msg.pieces:
            remaining[i] -= length
            if self.recv_cpu and length != entries[i]["nbytes"]:
                # one chunk of a tensor sent in several messages: hash it now, while the bytes
                # that just landed are in cache (chunks complete in order: FIFO per owner)
                self._hash_chunk(r, i, self.ptrs[r][i] + toff, length, remaining[i] == 0)
            elif remaining[i] == 0:
                self._checksum_received(r, i)

    # --------------------------------------------------------------------------- sending side

    def _src_bytes(self, i: int) -> torch.Tensor:
        view = self.send_views.get(i)
        if view is None:
            view = self.send_views[i] = byte_view(self.send_src[i])
        return view

    def _take_slot(self, size: int) -> torch.Tensor:
        """The next staging buffer, once the message that last used it has completed."""
        slot = self.staged % self.params.depth
        self.staged += 1
        while self.finished <= self.slot_last[slot]:
            self._finish()
        self.slot_last[slot] = self.posted
        return self.staging.get(slot, size)

    def _outgoing(self, msg: Message) -> Tuple[torch.Tensor, bool]:
        """(buffer to broadcast, staged) for a message of this rank."""
        i, toff, length, _ = msg.pieces[0]
        if msg.direct and self.send_src[i].device == self.device:
            return self._src_bytes(i)[toff : toff + length], False
        buf = self._take_slot(msg.size)
        if self.staging_cpu and all(self.send_ptrs[p[0]] for p in msg.pieces):
            self._pack_host(msg, buf)
        else:
            for i, toff, length, moff in msg.pieces:
                buf[moff : moff + length].copy_(self._src_bytes(i)[toff : toff + length])
        return buf, True

    def _pack_host(self, msg: Message, buf: torch.Tensor) -> None:
        """``memmove`` the pieces into a host staging buffer; a tensor copied whole is hashed
        from the copy while it is in cache (one read of the source instead of two)."""
        base = buf.data_ptr()
        entries, sums = self.entries[self.me], self.sums[self.me]
        for i, toff, length, moff in msg.pieces:
            ctypes.memmove(base + moff, self.send_ptrs[i] + toff, length)
            if length == entries[i]["nbytes"] and not self.on_device:
                sums[i] = _cpu_checksum(base + moff, length)

    def _hash_sent(self, msg: Message) -> None:
        """Owner checksums of the tensors whose last byte ``msg`` carries (or, for tensors sent
        in several messages, of its chunk), overlapping the transfer just posted."""
        entries, sums, stored = self.entries[self.me], self.sums[self.me], self.stored
        for i, toff, length, _ in msg.pieces:
            nbytes = entries[i]["nbytes"]
            if sums[i] is None and self.stored_ptrs[i] and length != nbytes:
                self._hash_chunk(
                    self.me, i, self.stored_ptrs[i] + toff, length, toff + length == nbytes
                )
            elif toff + length == nbytes and sums[i] is None:
                sums[i] = self.hash_tensor(stored[i])
                if self.on_device and self.target is not None and stored[i].device != self.target:
                    stored[i] = stored[i].to(self.target, non_blocking=True)  # the host copy

    # --------------------------------------------------------------------------- the pipeline

    def _post(self, msg: Message) -> None:
        if msg.src == self.me:
            buf, staged = self._outgoing(msg)
        elif self.land_device == self.device:
            buf, staged = self.flats[msg.src][msg.group][msg.start : msg.start + msg.size], False
        else:
            buf, staged = self._take_slot(msg.size), True
        work = _broadcast(buf, self.group.get_global_rank(msg.src), self.group.group)
        self.inflight.append((work, msg, buf, staged))
        self.posted += 1
        if msg.src == self.me:
            self._hash_sent(msg)

    def _finish(self) -> None:
        """Wait for the oldest message in flight."""
        work, msg, buf, staged = self.inflight.popleft()
        work.wait()
        self.finished += 1
        if msg.src != self.me:
            self._landed(msg, buf, staged)

    def _place_and_read_checksums(self) -> None:
        """Tensors hashed where they are (``pmix64``): copy the remaining primaries and every
        replica to ``target`` (``non_blocking``), then read all checksums with one device-to-host
        copy; queued on the current stream after the copies, it also waits for them."""
        target = self.target
        for i, s in enumerate(self.stored):  # tensors of 0 bytes
            if target is not None and s.device != target:
                self.stored[i] = s.to(target, non_blocking=True)
        if self.land_device != self.recv_device:  # replicas: hashed where they landed, moved
            for r, entries in enumerate(self.entries):
                if r == self.me:
                    continue
                groups, dtypes, offsets, _ = self.layouts[r]
                for g, members in enumerate(groups):
                    moved = self.flats[r][g].to(self.recv_device, non_blocking=True)
                    segment_views(
                        moved.view(DTYPES[dtypes[g]]), members, entries, offsets, self.results[r]
                    )
        checksums = iter(ck.to_checksums([x for row in self.sums for x in row if x is not None]))
        self.sums = [[None if x is None else next(checksums) for x in row] for row in self.sums]
