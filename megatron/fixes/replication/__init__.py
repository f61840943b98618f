"""Fix: local checkpoint replication corrupts quantized weights (NVRx #349, Megatron-LM #5281).

With ``--non-persistent-ckpt-type local --replication``, NVRx 0.7.0
``CliqueReplicationStrategy.replicate`` broadcasts raw tensors into ``empty_like`` buffers:
replicas of Transformer Engine quantized weights (``--fp8-param-gather``) are NaN, non-dense views
arrive wrong, ``float8_*`` / ``uint16`` fail on gloo; peer recovery hardcodes ``.cuda()``.

:class:`FixedCliqueReplicationStrategy` dequantizes and densifies every tensor, sends flat bytes,
checksums every replica (xxh3 on gloo, ``pmix64`` on the GPU over NCCL) and verifies them before
any file is written and again on load; failures raise :class:`UnsupportedTensorError` or
:class:`GroupChecksumMismatchError` (a ``ChecksumMismatchError``) on every rank of the group.
Modules: ``convert``, ``plan``, ``transport`` (:class:`ReplicaExchange`; ``_broadcast`` and
``_cpu_checksum`` are its fault and timing hooks), ``replicate``, ``retrieve``, ``strategy``,
``probe``. Design: ``docs/fixes/replication.md``.
"""

from __future__ import annotations

from megatron.fixes.replication import probe
from megatron.fixes.replication.convert import (
    UnsupportedTensorError,
    check_tensor,
    prepare_tensor,
)
from megatron.fixes.replication.plan import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_DIRECT_MIN_FRACTION,
    DEFAULT_PIPELINE_DEPTH,
    DIRECT_CHUNK_BYTES,
    comm_device,
)
from megatron.fixes.replication.plan import interleave as interleave  # re-exported for tests
from megatron.fixes.replication.plan import plan_messages as plan_messages
from megatron.fixes.replication.plan import segments as segments
from megatron.fixes.replication.replicate import GroupChecksumMismatchError, fixed_replicate
from megatron.fixes.replication.retrieve import fixed_retrieve_execute
from megatron.fixes.replication.strategy import (
    UPSTREAM_REPLICATE,
    FixedCliqueReplicationStrategy,
    UpstreamClique,
)
from megatron.fixes.replication.transport import ReplicaExchange, checksum_algorithm
from megatron.integrity.checksum.tensor import ChecksumMismatchError
from megatron.integrity.tensors import is_quantized
from megatron.overlay import Fix, Patch, value

__all__ = [
    "ChecksumMismatchError",
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_DIRECT_MIN_FRACTION",
    "DEFAULT_PIPELINE_DEPTH",
    "DIRECT_CHUNK_BYTES",
    "FIX",
    "FixedCliqueReplicationStrategy",
    "GroupChecksumMismatchError",
    "ReplicaExchange",
    "ReplicationFix",
    "UnsupportedTensorError",
    "check_tensor",
    "checksum_algorithm",
    "comm_device",
    "fixed_replicate",
    "fixed_retrieve_execute",
    "is_quantized",
    "prepare_tensor",
]


_STRATEGIES = "nvidia_resiliency_ext.checkpointing.local.replication.strategies"
_CLIQUE = f"{_STRATEGIES}.CliqueReplicationStrategy"


class ReplicationFix(Fix):
    """Installs :class:`FixedCliqueReplicationStrategy` in place of NVRx's class and its methods
    (the methods first: they are patched on upstream's class, reached by its NVRx name)."""

    name = "replication"
    title = (
        "Local checkpoint replication: faithful, checksummed replicas; recovery over any backend"
    )
    upstream_refs = ("NVRx issue 349", "Megatron-LM issue 5281")
    package = "nvidia-resiliency-ext"
    patches = (
        Patch(
            f"{_CLIQUE}.replicate",
            value(fixed_replicate),
            "a strategy built from the class bound before apply() stops writing NaN replicas of "
            "Transformer Engine quantized weights and wrong replicas of non-dense views",
            params=("local_ckpt", "id_"),
        ),
        Patch(
            f"{_CLIQUE}.retrieve_execute",
            value(fixed_retrieve_execute),
            "peer recovery verifies checksums and runs over gloo/CPU as well as NCCL (upstream "
            "hardcodes .cuda() in GroupWrapper.isend_state_dict / irecv_state_dict)",
        ),
        Patch(
            _CLIQUE,
            value(FixedCliqueReplicationStrategy),
            "pretrain() and from_replication_params (cls(...)) build the fixed subclass, whose "
            "replicas are dequantized, dense and checksum-verified instead of NaN for quantized "
            "weights",
        ),
    )

    def upstream_behaves(self) -> bool:
        """True if upstream's own ``replicate`` (captured at import, before any patch) already
        hands the transport dequantized, dense tensors; False if it hands over the quantized or
        non-dense tensors themselves, or fails on them (:mod:`.probe`)."""
        return probe.upstream_handles_unfaithful_tensors(UpstreamClique, UPSTREAM_REPLICATE)


FIX = ReplicationFix()
