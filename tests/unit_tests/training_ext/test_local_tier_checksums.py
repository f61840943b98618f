"""The local tier's load verification (``local_tier.verify_state_dict``) reads both checksum
record versions: xxh3_64 (version 1, every file written before device checksums) and pmix64
(version 2, written by replication over NCCL), and names a flipped byte in either."""

from __future__ import annotations

import pytest
import torch

from megatron.integrity.checksum import tensor as ck
from megatron.training_ext import local_tier


class _SD:
    def __init__(self, tensors):
        self._tensors = tensors

    @property
    def tensors(self):
        return iter(self._tensors)


@pytest.mark.parametrize("algorithm", ["xxh3_64", "pmix64"])
def test_load_verification_reads_both_record_versions(algorithm):
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(64, 8, generator=g), torch.randn(5, generator=g).to(torch.bfloat16)]
    sd = _SD(tensors)
    ck.attach_record(
        sd,
        ck.make_record(
            0,
            [
                ck.make_entry(i, f"tensor[{i}]", t, algorithm=algorithm)
                for i, t in enumerate(tensors)
            ],
            algorithm,
        ),
    )
    errors, summary = local_tier.verify_state_dict(sd, "own primary", check_checksums=True)
    assert (errors, summary) == ([], "2 checksums")
    tensors[0].view(-1).view(torch.uint8)[100] ^= 0x01
    errors, _ = local_tier.verify_state_dict(sd, "own primary", check_checksums=True)
    assert len(errors) == 1 and "ChecksumMismatchError: own primary: 'tensor[0]'" in errors[0], (
        errors
    )
