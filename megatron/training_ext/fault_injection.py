"""Deterministic, test-only fault injection for the training loop (functional tests of the local
checkpoint tier: ``tests/functional_tests/test_ft_restart.py``).

Nothing here is active unless one of these environment variables is set (``install_from_env`` is a
no-op otherwise); never set them in production.

``MEGATRON_TEST_FAULT="rank=R,iteration=K[,wipe_local=1][,corrupt=PATH][,once=PATH]"``
    When global rank ``R`` is about to run iteration ``K + 1`` (so iteration ``K`` and every
    checkpoint saved at ``K`` are complete), it

    * ``wipe_local=1``: deletes its own local checkpoint directory
      (``<--non-persistent-local-ckpt-dir>/<rank>``): the node's local storage is lost;
    * ``corrupt=PATH``: flips one byte in the middle of the largest tensor storage of the
      ``torch.save`` file ``PATH`` (a storage fault that only a content checksum can notice:
      ``torch.load`` does not check the zip CRC);
    * then leaves with ``os._exit(1)``, like a crashed process.

    ``once=PATH``: the fault fires only if ``PATH`` does not exist, and creates it (an in-job
    restart runs iteration ``K + 1`` again; without it the fault would fire on every restart).

``MEGATRON_TEST_NAN_AFTER_LOCAL_LOAD=K``
    In a process that resumed from the local checkpoint tier (:mod:`local_tier` validated it),
    every rank fills its model's first parameter with NaN just before iteration ``K`` runs: a
    local tier whose values pass every check but make training diverge.

Both wrap ``megatron.training.training.train_step`` (outside :mod:`local_tier`'s wrapper).
"""

from __future__ import annotations

import functools
import inspect
import os
import shutil
import struct
import sys
import zipfile
from pathlib import Path
from typing import Optional

from megatron.training_ext.console import write_line

ENV_FAULT = "MEGATRON_TEST_FAULT"
ENV_NAN = "MEGATRON_TEST_NAN_AFTER_LOCAL_LOAD"

_installed: dict = {}


def parse_fault(spec: str) -> dict:
    """Parse ``MEGATRON_TEST_FAULT``.

    Returns:
        dict with int ``rank``, ``iteration``, bool ``wipe_local``, optional str ``corrupt``,
        ``once``.

    Raises:
        ValueError: unknown key, missing ``rank``/``iteration``, or a non-integer value.
    """
    out: dict = {"wipe_local": False, "corrupt": None, "once": None}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, sep, value = part.partition("=")
        if not sep:
            raise ValueError(f"{ENV_FAULT}: '{part}' is not key=value")
        if key in ("rank", "iteration"):
            out[key] = int(value)
        elif key == "wipe_local":
            out[key] = value not in ("0", "", "false", "no")
        elif key in ("corrupt", "once"):
            out[key] = value
        else:
            raise ValueError(f"{ENV_FAULT}: unknown key '{key}' (rank, iteration, wipe_local, corrupt, once)")
    if "rank" not in out or "iteration" not in out:
        raise ValueError(f"{ENV_FAULT}: rank= and iteration= are required, got '{spec}'")
    return out


def flip_byte_in_largest_storage(path: str) -> int:
    """Flip one bit of the middle byte of the largest tensor storage in a ``torch.save`` zip file.

    Returns:
        The file offset of the flipped byte.

    Raises:
        ValueError: the file holds no tensor storage.
    """
    with zipfile.ZipFile(path) as z:
        storages = [i for i in z.infolist() if "/data/" in i.filename and i.file_size > 0]
    if not storages:
        raise ValueError(f"{path}: no tensor storage in this file")
    info = max(storages, key=lambda i: i.file_size)
    with open(path, "r+b") as f:
        f.seek(info.header_offset)
        header = f.read(30)
        name_len, extra_len = struct.unpack("<HH", header[26:30])
        pos = info.header_offset + 30 + name_len + extra_len + info.file_size // 2
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x10]))
    return pos


def _say(message: str) -> None:
    write_line(f"[fault-injection] {message}")


def install_from_env(args) -> None:
    """Wrap ``train_step`` if one of the variables is set; idempotent; no-op otherwise.

    Raises:
        ValueError: ``MEGATRON_TEST_FAULT`` or ``MEGATRON_TEST_NAN_AFTER_LOCAL_LOAD`` is malformed
            (every rank, before training).
    """
    fault_spec, nan_spec = os.environ.get(ENV_FAULT), os.environ.get(ENV_NAN)
    if not fault_spec and not nan_spec:
        return
    if _installed:
        return
    fault = parse_fault(fault_spec) if fault_spec else None
    nan_at: Optional[int] = int(nan_spec) if nan_spec else None
    local_root = getattr(args, "non_persistent_local_ckpt_dir", None)

    import torch
    import torch.distributed as dist

    import megatron.training.training as training
    from megatron.training_ext import local_tier

    upstream = training.train_step
    sig = inspect.signature(upstream)

    @functools.wraps(upstream)
    def train_step(*a, **kw):
        bound = sig.bind(*a, **kw).arguments
        iteration = bound.get("iteration")
        rank = dist.get_rank() if dist.is_initialized() else 0
        if fault is not None and iteration == fault["iteration"] and rank == fault["rank"]:
            once = fault["once"]
            if not (once and os.path.exists(once)):
                if once:
                    Path(once).touch()
                if fault["wipe_local"] and local_root:
                    shutil.rmtree(os.path.join(local_root, str(rank)), ignore_errors=True)
                    _say(f"rank {rank}: deleted its local checkpoint directory {local_root}/{rank}")
                if fault["corrupt"]:
                    pos = flip_byte_in_largest_storage(fault["corrupt"])
                    _say(f"rank {rank}: flipped a byte at offset {pos} of {fault['corrupt']}")
                _say(f"rank {rank}: crashing (os._exit(1)) before iteration {iteration + 1}")
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(1)
        if (nan_at is not None and iteration is not None and iteration + 1 == nan_at
                and local_tier.loaded_local_iteration() is not None):
            model = bound.get("model")
            with torch.no_grad():
                p = next(model[0].parameters())
                p.data.fill_(float("nan"))
            _say(f"rank {rank}: filled a parameter with NaN before iteration {nan_at} (resumed from "
                 f"local iteration {local_tier.loaded_local_iteration()})")
        return upstream(*a, **kw)

    training.train_step = train_step
    _installed.update(upstream=upstream)
