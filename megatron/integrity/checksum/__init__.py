"""Checksums: hashes of bytes as they are stored or sent, so that a changed byte is found.

- :mod:`~megatron.integrity.checksum.tensor`: per-tensor checksums of local checkpoints (xxh3 on
  the CPU) and their record (``megatron.integrity.tensor_checksums``), carried with replicas and
  stored in every local file.
- :mod:`~megatron.integrity.checksum.device`: ``pmix64``, the same role computed where a tensor
  lives (GPU or CPU, bit-identical), for replication over NCCL.
- :mod:`~megatron.integrity.checksum.file`: block checksums of one file (``xxh3-64-blocks``), the
  unit of ``integrity.json``; :mod:`~megatron.integrity.checksum.written`: the same, taken from
  the bytes a save writes on their way to the file.

Not to be confused with the resume proof's *digest* (:mod:`megatron.integrity.digest`), a hash of
the training state's values by global index, whatever their layout in bytes. Neither package
imports the other; the mixing step both use is :mod:`megatron.integrity.mix64`. Submodules are
imported on use, so importing this package loads nothing else.
"""

__all__ = ["device", "file", "tensor", "written"]
