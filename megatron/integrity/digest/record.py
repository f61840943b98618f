"""The resume proof's record: ``state_digest.json`` in a checkpoint's iteration directory, the
state digests (:mod:`megatron.integrity.digest.state`) of every tensor of the training state as
``pretrain_gpt.py`` saved it (written by :mod:`megatron.training_ext.resume_proof`, read at load,
by the verifier and by ``tools/check_state_digest.py``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

__all__ = ["DIGEST_FNAME", "RECORD_FORMAT", "read_record", "write_record"]

#: The record ``pretrain_gpt.py`` writes at every save (``megatron.training_ext.resume_proof``).
DIGEST_FNAME = "state_digest.json"
RECORD_FORMAT = "megatron-lm-fixed state digest"


def read_record(checkpoint_dir: Any) -> Optional[dict]:
    """``state_digest.json`` of a checkpoint directory, or None when it has none.

    Raises:
        ValueError: the file exists but is not a state digest record.
    """
    path = Path(str(checkpoint_dir)) / DIGEST_FNAME
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: unreadable state digest ({e})") from e
    if not isinstance(record, dict) or record.get("format") != RECORD_FORMAT:
        raise ValueError(f"{path}: not a state digest record")
    return record


def write_record(checkpoint_dir: Any, record: dict) -> Path:
    """Write ``record`` to ``checkpoint_dir/state_digest.json`` atomically (temporary + rename)."""
    path = Path(str(checkpoint_dir)) / DIGEST_FNAME
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=1, sort_keys=False) + "\n")
    os.replace(tmp, path)
    return path
