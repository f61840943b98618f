"""``replicate`` of the fixed strategy: convert, exchange metadata, transport, compare checksums.

The four steps (docs/fixes/replication.md has the design): every rank converts its own tensors
(:func:`~.convert.prepare_owned`); one ``all_gather_object`` carries the hollow state dicts,
their checksum records and every rank's refusals; :class:`~.transport.ReplicaExchange` moves the
bytes; a second ``all_gather_object`` carries every rank's checksums, and every rank compares every
(owner, receiver, tensor), so any failure raises on every rank before a file is written.
"""

from __future__ import annotations

import logging
from typing import Any, List, Sequence, Tuple

import torch

from megatron.fixes.replication.convert import Owned, UnsupportedTensorError, prepare_owned
from megatron.fixes.replication.plan import comm_device, transport_params
from megatron.fixes.replication.transport import ReplicaExchange, checksum_algorithm
from megatron.integrity.checksum import tensor as ck
from megatron.integrity.checksum.tensor import ChecksumMismatchError
from megatron.overlay.collective import RankFailures

logger = logging.getLogger("megatron.fixes.replication")


class GroupChecksumMismatchError(ChecksumMismatchError, RankFailures):
    """:class:`~megatron.integrity.checksum.tensor.ChecksumMismatchError` raised on every rank of a
    replication group; ``failures``: global rank (the receiver, or the rank whose file failed) ->
    its messages."""

    def __init__(self, message: str, failures: dict | None = None) -> None:
        ChecksumMismatchError.__init__(self, message)
        self.failures = dict(failures or {})


def fixed_replicate(self, local_ckpt, id_):
    """Fixed ``CliqueReplicationStrategy.replicate`` (NVRx 0.7.0, NVRx issue 349).

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
    group = self.local_group
    target = None if self.target_device is None else torch.device(self.target_device)
    device = comm_device(group)
    algorithm = checksum_algorithm(self, device)
    # other than xxh3 (pmix64; on NCCL the GPU), tensors are hashed where they are: the owner's
    # host copy is made after hashing, by the transport, asynchronously as upstream's
    place = target if algorithm == ck.ALGORITHM else None
    originals = list(local_ckpt.tensors)
    owned = prepare_owned(local_ckpt, originals, place, device)

    hollows, ids = _exchange_metadata(group, local_ckpt, originals, owned, algorithm, id_)
    records = [ck.get_record(h) for h in hollows]
    exchange = ReplicaExchange(
        group, device, transport_params(self, device), algorithm, target, owned, records
    )
    results, sums = exchange.run()

    all_sums = group.all_gather_object(sums)
    _raise_on_mismatch(group, records, all_sums, id_, lambda: local_ckpt.insert_tensors(originals))
    for r, (hollow, rec) in enumerate(zip(hollows, records)):
        for entry, checksum in zip(rec["entries"], all_sums[r][r]):
            entry["checksum"] = checksum
        ck.attach_record(hollow, rec)
        hollow.insert_tensors(results[r])
    _log(id_, group, owned, records[group.my_group_rank], exchange.messages_sent, device)
    return hollows, ids


def _exchange_metadata(
    group: Any, local_ckpt: Any, originals: List[Any], owned: Owned, algorithm: str, id_: Any
) -> Tuple[List[Any], List[Any]]:
    """Collective: every rank's hollow state dict (with its record, checksums still ``None``) and
    id; raises :class:`UnsupportedTensorError` on every rank if any rank refused a tensor."""
    my_global = group.get_global_rank(group.my_group_rank)
    local_ckpt.pop_tensors()
    record = None if owned.errors else ck.make_record(my_global, owned.entries, algorithm)
    ck.attach_record(local_ckpt, record)
    try:
        gathered = group.all_gather_object((local_ckpt, owned.errors, id_))
    finally:
        ck.attach_record(local_ckpt, None)
    failures = {
        group.get_global_rank(r): list(errs) for r, (_, errs, _) in enumerate(gathered) if errs
    }
    if failures:
        local_ckpt.insert_tensors(originals)
        raise UnsupportedTensorError.from_failures(
            "local checkpoint replication refused before sending any data or writing any file "
            f"(checkpoint id {id_}):",
            failures,
        )
    return [g[0] for g in gathered], [g[2] for g in gathered]


def _raise_on_mismatch(
    group: Any, records: Sequence[dict], all_sums: Sequence, id_: Any, restore
) -> None:
    """Compare every owner's checksums with every receiver's (the same on every rank); on any
    mismatch call ``restore`` and raise :class:`GroupChecksumMismatchError`."""
    world = len(records)
    failures: dict = {}
    lines = []
    for recv in range(world):
        for owner in range(world):
            if owner == recv:
                continue
            for i, entry in enumerate(records[owner]["entries"]):
                want, got = all_sums[owner][owner][i], all_sums[recv][owner][i]
                if want == got:
                    continue
                receiver = group.get_global_rank(recv)
                msg = (
                    f"key '{entry['key']}' (tensor #{i}) sent by rank "
                    f"{group.get_global_rank(owner)}, received by rank {receiver}: checksum "
                    f"mismatch (owner {want:#018x}, received {got:#018x})"
                )
                failures.setdefault(receiver, []).append(msg)
                lines.append("  " + msg)
    if lines:
        restore()
        raise GroupChecksumMismatchError(
            "local checkpoint replication: replica bytes differ from the owner's checksums "
            f"(checkpoint id {id_}); nothing was written:\n" + "\n".join(lines),
            failures,
        )


def _log(
    id_: Any, group: Any, owned: Owned, my_record: dict, messages: int, device: torch.device
) -> None:
    logger.debug(
        "replicate %s: sent %d B in %d messages over %s",
        id_,
        sum(e["nbytes"] for e in my_record["entries"]),
        messages,
        device,
    )
    if owned.dequantized:
        logger.info(
            "local checkpoint %s (rank %d): primary and replicas store %d quantized tensors "
            "dequantized (%s)",
            id_,
            group.get_global_rank(group.my_group_rank),
            sum(owned.dequantized.values()),
            ", ".join(f"{n} x {k}" for k, n in sorted(owned.dequantized.items())),
        )
