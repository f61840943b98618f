"""The fixed strategy class: NVRx ``CliqueReplicationStrategy`` with the fixed ``replicate`` and
``retrieve_execute``, and the transport's knobs.

``UpstreamClique`` / ``UPSTREAM_REPLICATE`` are NVRx's class and its own ``replicate``,
captured at import, before anything is patched (the capability probe runs them);
``FixedCliqueReplicationStrategy`` is ``None`` when NVRx is not installed.
"""

from __future__ import annotations

from typing import Optional

from megatron.fixes.replication.plan import DEFAULT_PIPELINE_DEPTH
from megatron.fixes.replication.replicate import fixed_replicate
from megatron.fixes.replication.retrieve import fixed_retrieve_execute
from megatron.integrity.checksum import tensor as ck

try:
    from nvidia_resiliency_ext.checkpointing.local.replication import strategies as _strategies

    UpstreamClique = _strategies.CliqueReplicationStrategy
except ImportError:  # NVRx not installed: the fix reports NOT_APPLICABLE
    _strategies = None
    UpstreamClique = None

UPSTREAM_REPLICATE = None if UpstreamClique is None else UpstreamClique.__dict__["replicate"]


def _validated_knobs(bucket_bytes, direct_min_bytes, pipeline_depth, checksum_algorithm):
    if checksum_algorithm is not None and checksum_algorithm not in ck.ALGORITHMS:
        raise ValueError(
            f"checksum_algorithm must be one of {ck.ALGORITHMS} or None, got {checksum_algorithm!r}"
        )
    for name, value in (
        ("bucket_bytes", bucket_bytes),
        ("direct_min_bytes", direct_min_bytes),
        ("pipeline_depth", pipeline_depth),
    ):
        if value is not None and int(value) <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    return (
        None if bucket_bytes is None else int(bucket_bytes),
        None if direct_min_bytes is None else int(direct_min_bytes),
        int(pipeline_depth),
    )


if UpstreamClique is not None:

    class FixedCliqueReplicationStrategy(UpstreamClique):
        """``CliqueReplicationStrategy`` whose replicas equal their primaries, with per-tensor
        checksums verified on save and on load, and peer retrieval over any backend.

        Built exactly like upstream (``from_replication_params(J, F)`` or ``cls(group,
        target_device)``). See docs/fixes/replication.md for the algorithm.

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
            UpstreamClique.__init__(self, local_group, target_device=target_device)
            self.bucket_bytes, self.direct_min_bytes, self.pipeline_depth = _validated_knobs(
                bucket_bytes, direct_min_bytes, pipeline_depth, checksum_algorithm
            )
            self.checksum_algorithm = checksum_algorithm

        replicate = fixed_replicate
        retrieve_execute = fixed_retrieve_execute

else:  # pragma: no cover - NVRx not installed
    FixedCliqueReplicationStrategy = None
