"""``retrieve_execute`` of the fixed strategy: verified local checkpoints, peer transfers over any
backend.

Upstream (NVRx 0.7.0) delegates to ``GroupWrapper.execute_plan``, whose ``isend_state_dict`` /
``irecv_state_dict`` hardcode ``.cuda()`` and load whatever bytes they find. Here every state
dict loaded from disk is verified against its checksum record first, peer transfers are
point-to-point flat ``uint8`` messages on the device the group's backend supports, and what a
rank received is verified again; any failure raises on every rank of the group.
"""

from __future__ import annotations

import logging
from typing import Any, List, Sequence

import torch
import torch.distributed as dist

from megatron.fixes.replication.convert import check_tensor, prepare_tensor
from megatron.fixes.replication.plan import (
    Message,
    Staging,
    byte_view,
    comm_device,
    plan_messages,
    transport_params,
)
from megatron.fixes.replication.replicate import GroupChecksumMismatchError
from megatron.integrity.checksum import tensor as ck
from megatron.overlay.collective import raise_if_any_failed

logger = logging.getLogger("megatron.fixes.replication")


def _verify_state_dict(sd: Any, what: str) -> List[str]:
    try:
        record = ck.get_record(sd)
    except ValueError as e:
        return [f"{what}: {e}"]
    if record is None:
        logger.warning(
            "%s has no checksum record (written without megatron.fixes.replication); "
            "loading it unverified",
            what,
        )
        return []
    tensors = list(sd.tensors)
    return [f"{what}: {m}" for m in ck.verify_record(record, tensors)]


def _p2p_plan(tensors: Sequence[torch.Tensor], bucket: int, direct_min: int) -> List[Message]:
    return plan_messages(0, [t.numel() * t.element_size() for t in tensors], bucket, direct_min)


def _send_state_dict(self, sd: Any, dst: int, device: torch.device) -> None:
    group = self.local_group
    params = transport_params(self, device)
    tensors = sd.pop_tensors()
    try:
        prepared = [prepare_tensor(f"tensor[{i}]", t)[0] for i, t in enumerate(tensors)]
        group.send_object(sd, dst)
        staging = Staging(1, params.bucket, device)
        views = [byte_view(t) for t in prepared]
        for msg in _p2p_plan(prepared, params.bucket, params.direct_min):
            i, toff, length, _ = msg.pieces[0]
            if msg.direct and prepared[i].device == device:
                buf = views[i][toff : toff + length]
            else:
                buf = staging.get(0, msg.size)
                for i, toff, length, moff in msg.pieces:
                    buf[moff : moff + length].copy_(views[i][toff : toff + length])
            dist.send(buf, dst, group=group.group)
    finally:
        sd.insert_tensors(tensors)


def _recv_state_dict(self, src: int, device: torch.device) -> Any:
    group = self.local_group
    params = transport_params(self, device)
    sd = group.recv_object(src)
    sd.init_tensors()
    tensors = list(sd.tensors)
    views = [byte_view(t) for t in tensors]
    staging = Staging(1, params.bucket, device)
    for msg in _p2p_plan(tensors, params.bucket, params.direct_min):
        i, toff, length, _ = msg.pieces[0]
        if msg.direct and tensors[i].device == device:
            dist.recv(views[i][toff : toff + length], src, group=group.group)
            continue
        buf = staging.get(0, msg.size)
        dist.recv(buf, src, group=group.group)
        for i, toff, length, moff in msg.pieces:
            views[i][toff : toff + length].copy_(buf[moff : moff + length])
    return sd


def _verify_loaded(exchange_plan: Any, my_data: dict, me: int) -> List[str]:
    """Checksum and metadata failures of the state dicts this rank loaded and must use or send."""
    errors: List[str] = []
    for id_ in sorted(exchange_plan.required_ids(), key=str):
        sd = my_data[id_]
        errors += _verify_state_dict(sd, f"local checkpoint {id_} loaded on rank {me}")
        for i, t in enumerate(sd.tensors):
            reason = check_tensor(f"tensor[{i}]", t)
            if reason is not None:
                errors.append(f"local checkpoint {id_} on rank {me}: {reason}")
    return errors


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
    group = self.local_group
    me = group.my_global_rank
    device = comm_device(group)
    missing = exchange_plan.required_ids().difference(my_data.keys())
    assert not missing, f"Not all required data provided! Missing ids: {missing}"

    raise_if_any_failed(
        _verify_loaded(exchange_plan, my_data, me),
        "local checkpoint load: a stored checkpoint does not match its checksums; it is not used:",
        GroupChecksumMismatchError,
        group,
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
                sd,
                f"local checkpoint {entry.id_} sent by rank {entry.sender}, received by rank {me}",
            )
            recv_buf[entry.id_] = sd
    raise_if_any_failed(
        received_errors,
        "local checkpoint load: a checkpoint received from a peer does not match its checksums:",
        GroupChecksumMismatchError,
        group,
    )
    return recv_buf
