"""Checks of the checkpoint directories in the first seconds of a start, on every rank, before any
process group or model exists: a ``--load`` that names an iteration directory, and a ``--save`` or
local checkpoint directory that cannot be written or has no room for one checkpoint, and an
unreadable run token of the local tier.

Upstream finds the first at once but silently (it trains from random weights, exit 0) and the
second only at the first save, after the training time is spent (``OSError: [Errno 30] Read-only
file system``, ``NotADirectoryError``, ``[Errno 28] No space left on device``). Rules:
``docs/persistent-tier.md`` ("What a start checks").
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import tempfile
from typing import Any, List, Optional, Tuple

__all__ = [
    "check_directories",
    "check_load_dir",
    "check_local_ownership",
    "check_run_token",
    "estimate_checkpoint_bytes",
]

_ITER = re.compile(r"iter_(\d{7})$")


def check_load_dir(args: Any) -> None:
    """Refuse a ``--load`` that names an iteration directory (``ck/iter_0000010``) instead of its
    checkpoint root: upstream finds no tracker in it and starts from random weights.

    Raises:
        SystemExit: naming the root and ``--ckpt-step`` to pass instead.
    """
    load = getattr(args, "load", None)
    if not load or not os.path.isdir(load):
        return
    name = os.path.basename(os.path.normpath(load))
    m = _ITER.match(name)
    if not m or os.path.isfile(os.path.join(load, "latest_checkpointed_iteration.txt")):
        return
    if not any(os.path.isfile(os.path.join(load, f)) for f in (".metadata", "metadata.json")):
        return
    root = os.path.dirname(os.path.normpath(load)) or "."
    raise SystemExit(
        f"pretrain_gpt.py: --load {load} is an iteration directory, not a checkpoint directory: "
        f"upstream would find no checkpoint in it and train from random weights. Pass --load "
        f"{root} --ckpt-step {int(m.group(1))} to resume from it"
    )


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def estimate_checkpoint_bytes(args: Any) -> Tuple[int, int]:
    """A lower bound of the size of one checkpoint of this run, from the model's shape.

    Counts the weights of attention (Q/K/V/O with ``--num-query-groups``), MLP (dense, or
    ``--num-experts`` experts of ``--moe-ffn-hidden-size``; gated with ``--swiglu``) and the
    embedding/output layer of ``--vocab-size`` (biases, norms and padding are left out), at 2 bytes
    per weight for ``--bf16``/``--fp16`` (4 otherwise), plus the Adam state in fp32 (12 bytes per
    weight with a 16-bit model: main weight and two moments; 8 with an fp32 model).

    Returns:
        ``(persistent, local_per_rank)`` in bytes: the whole ``torch_dist`` checkpoint in
        ``--save``, and one rank's local checkpoint (its model shard of ``TP x PP``, its optimizer
        shard of the world with ``--use-distributed-optimizer``), before replication.
    """
    h = int(getattr(args, "hidden_size", 0) or 0)
    layers = int(getattr(args, "num_layers", 0) or 0)
    heads = int(getattr(args, "num_attention_heads", 0) or 0) or 1
    groups = (
        int(getattr(args, "num_query_groups", 0) or 0)
        if getattr(args, "group_query_attention", False)
        else heads
    ) or heads
    ffn = int(getattr(args, "ffn_hidden_size", 0) or 0)
    gate = 3 if getattr(args, "swiglu", False) else 2
    experts = int(getattr(args, "num_experts", 0) or 0)
    mlp = experts * gate * h * int(getattr(args, "moe_ffn_hidden_size", 0) or ffn) if experts else 0
    mlp = mlp or gate * h * ffn
    attn = 2 * h * h + 2 * h * (h * groups // heads)
    vocab = int(getattr(args, "padded_vocab_size", 0) or getattr(args, "vocab_size", 0) or 0)
    untied = getattr(args, "untie_embeddings_and_output_weights", False)
    weights = layers * (attn + mlp) + vocab * h * (2 if untied else 1)
    half = getattr(args, "bf16", False) or getattr(args, "fp16", False)
    model_bytes, optim_bytes = (2, 12) if half else (4, 8)
    model_parallel = int(getattr(args, "tensor_model_parallel_size", 1) or 1) * int(
        getattr(args, "pipeline_model_parallel_size", 1) or 1
    )
    world = int(getattr(args, "world_size", 0) or os.environ.get("WORLD_SIZE", 1))
    optim_shard = world if getattr(args, "use_distributed_optimizer", False) else model_parallel
    local = weights * model_bytes // model_parallel + weights * optim_bytes // max(optim_shard, 1)
    return weights * (model_bytes + optim_bytes), local


def _existing_ancestor(path: str) -> Tuple[Optional[str], Optional[str]]:
    """``(the nearest existing ancestor of path (or path), a component that is a file)``."""
    p = os.path.abspath(path)
    while not os.path.exists(p):
        parent = os.path.dirname(p)
        if parent == p:
            return None, None
        p = parent
    return p, (None if os.path.isdir(p) else p)


def _write_problem(flag: str, path: str, need: int) -> Optional[str]:
    """Why ``path`` (a directory a save writes into) cannot take a checkpoint, or ``None``."""
    base, file_in_way = _existing_ancestor(path)
    if file_in_way is not None:
        what = "is a file" if file_in_way == os.path.abspath(path) else f"is under a file, {base}"
        return f"{flag} {path} {what}, not a directory"
    if base is None:
        return f"{flag} {path}: no existing parent directory"
    try:  # what a save does: create files (an access() check can be wrong on network mounts)
        if base == os.path.abspath(path):
            fd, probe = tempfile.mkstemp(prefix=".write-check-", dir=base)
            os.close(fd)
            os.unlink(probe)
        elif not os.access(base, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), base)
    except OSError as e:
        where = "" if base == os.path.abspath(path) else f" (it would be created in {base})"
        return f"{flag} {path} cannot be written{where}: {e.strerror or e}"
    free = shutil.disk_usage(base).free
    if need and free < need:
        return (
            f"{flag} {path} has {_gb(free)} free, but one checkpoint of this model needs about "
            f"{_gb(need)} (estimated from its weights and the Adam state; a lower bound)"
        )
    return None


def _local_need(args: Any, per_rank: int) -> int:
    """Bytes one node's local checkpoint directory takes: the ranks of the node, each its own shard
    and the replicas it holds for others (``--replication-factor`` copies of each in all)."""
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", 1) or 1)
    copies = 1
    if getattr(args, "replication", False):
        copies = int(getattr(args, "replication_factor", 1) or 1)
    return per_rank * ranks_here * copies


def check_directories(args: Any) -> None:
    """Refuse a start whose ``--save`` or local checkpoint directory (``--non-persistent-local-
    ckpt-dir`` with ``--non-persistent-ckpt-type local``) is a file, under a file, not writable,
    or smaller than one checkpoint (:func:`estimate_checkpoint_bytes`). Creates nothing: a
    directory that does not exist yet is judged by its nearest existing parent.

    Raises:
        SystemExit: naming each directory and what is wrong; raised on every rank (each checks its
            own view of the file system), before any process group exists.
    """
    persistent, local_per_rank = estimate_checkpoint_bytes(args)
    wanted: List[Tuple[str, str, int]] = []
    if getattr(args, "save", None):
        wanted.append(("--save", args.save, persistent))
    local_dir = getattr(args, "non_persistent_local_ckpt_dir", None)
    if local_dir and getattr(args, "non_persistent_ckpt_type", None) == "local":
        wanted.append(
            ("--non-persistent-local-ckpt-dir", local_dir, _local_need(args, local_per_rank))
        )
    problems = [p for flag, path, need in wanted if (p := _write_problem(flag, path, need))]
    if problems:
        raise SystemExit(
            "pretrain_gpt.py: "
            + "; ".join(problems)
            + ". Checked before training so that no iteration is spent before a save that "
            "cannot be written: choose a writable directory with room"
        )


def check_local_ownership(args: Any) -> None:
    """With local checkpoints: refuse a local checkpoint directory (the root, this host's rank
    directories, the files in them) that is writable by other users (group or others write bit,
    no sticky bit) or owned by another user than this process's: whoever can write there can
    replace what this job loads. ``--accept-shared-local-ckpt-dir`` accepts it. A directory that
    does not exist yet is created by the job itself and passes.

    Raises:
        SystemExit: one line naming the first such path, its owner and mode, and the fixes
            (``chmod``, another ``--non-persistent-local-ckpt-dir``, the flag); on every rank,
            before any process group exists.
    """
    local_dir = getattr(args, "non_persistent_local_ckpt_dir", None)
    if (
        not local_dir
        or getattr(args, "non_persistent_ckpt_type", None) != "local"
        or getattr(args, "accept_shared_local_ckpt_dir", False)
        or not os.path.isdir(local_dir)
    ):
        return
    problem = _ownership_problem(local_dir)
    if problem is None:
        return
    path, why = problem
    raise SystemExit(
        f"pretrain_gpt.py: local checkpoint path {path} is {why}: another user could replace "
        f"what this job loads. Fix: chmod go-w {path} (and own it), or choose another "
        f"--non-persistent-local-ckpt-dir; --accept-shared-local-ckpt-dir starts anyway"
    )


def _ownership_problem(root: str) -> Optional[Tuple[str, str]]:
    """``(path, why)`` of the first path under ``root`` (two levels: rank directories and their
    files) that another user could write, else ``None``."""
    import stat

    uid = os.geteuid() if hasattr(os, "geteuid") else None
    paths = [root]
    for sub in sorted(os.listdir(root)):
        p = os.path.join(root, sub)
        paths.append(p)
        if os.path.isdir(p) and not os.path.islink(p):
            paths += [os.path.join(p, f) for f in sorted(os.listdir(p))]
    for p in paths:
        try:
            st = os.lstat(p)
        except OSError:
            continue
        mode = stat.S_IMODE(st.st_mode)
        if uid is not None and st.st_uid != uid:
            return p, f"owned by uid {st.st_uid}, not this job's user (uid {uid})"
        if mode & 0o022 and not (stat.S_ISDIR(st.st_mode) and mode & stat.S_ISVTX):
            who = "others" if mode & 0o002 else "its group"
            return p, f"writable by {who} (mode {mode:o})"
    return None


def check_run_token(args: Any) -> Optional[str]:
    """With local checkpoints: the run token in ``--save`` (``local_tier_run_token.json``) must be
    readable, or the run's identity would silently change and every local checkpoint would count
    as another run's. An unreadable one is restored from the newest local file's identity record
    (rank 0 rewrites it; every rank reads its own local directory), with one line.

    Returns:
        The line saying what was restored (rank 0), else ``None``.

    Raises:
        SystemExit: the token is unreadable and no local file of this rank records it, naming the
            file and what to do; raised before any process group exists.
    """
    from megatron.integrity import local_identity

    save = getattr(args, "save", None)
    if not save or getattr(args, "non_persistent_ckpt_type", None) != "local":
        return None
    try:
        local_identity.run_token(save, create=False)
        return None
    except local_identity.RunTokenError as e:
        broken = e
    token, source = local_identity.recover_run_token(
        getattr(args, "non_persistent_local_ckpt_dir", None)
    )
    if token is None:
        raise SystemExit(
            f"pretrain_gpt.py: {broken}, and no local checkpoint file of this rank records the "
            f"token. Restore the file from a copy; or delete it to give the run a new identity "
            f"(its local checkpoints then count as another run's and the persistent tier is used)"
        )
    if int(os.environ.get("RANK", "0")) != 0:
        return None
    local_identity.repair_run_token(save, token, source)
    return (
        f"[local-tier] {broken}: restored run token {token[:8]}... from {source} (the identity "
        f"record of the newest local checkpoint)"
    )
