"""The resume proof's state digest: a topology-independent hash of each tensor of the training
state, over its values by *global* index, so the same state saved under one parallel layout and
loaded under another gives the same digest.

- :mod:`~megatron.integrity.digest.state`: the digest (partial sums per block, their finish);
- :mod:`~megatron.integrity.digest.kernel`: its fused CPU loop (numba; imported only when numba is
  installed);
- :mod:`~megatron.integrity.digest.record`: ``state_digest.json``, the record a save writes.

Hashes of bytes as stored or sent are *checksums* (:mod:`megatron.integrity.checksum`); neither
package imports the other, and the mixing step both use is :mod:`megatron.integrity.mix64`.
Submodules are imported on use, so importing this package loads nothing else.
"""

#: ``kernel`` is left out: it needs numba, and :mod:`~megatron.integrity.digest.state` imports it
#: when numba is installed.
__all__ = ["record", "state"]
