"""What a local (non-persistent) checkpoint file belongs to: run identity, iteration, topology.

NVRx's local checkpoint files carry no identity: a file of another experiment, another parallel
layout or another save of the same iteration looks like any other and is loaded. The validated
local tier (:mod:`megatron.training_ext.local_tier`) stores the record defined here in every local
file (primary and replicas: it travels with the hollow state dict) and checks it before a file is
used; ``tools/verify_checkpoint.py`` reads it too. The rules are in ``docs/local-tier.md``.

The record (attribute :data:`IDENTITY_ATTR` of the saved ``TensorAwareStateDict``, builtin types
only; format ``megatron.local_tier.identity`` v1) is built by :func:`make_identity`: run id and its
source, the run settings it is derived from, topology, iteration, owner rank, save token, host.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
import uuid
from typing import Any, List, Mapping, Optional, Tuple

# the file names are defined in local_layout; re-exported here for existing callers
from megatron.integrity.local_layout import (
    LOCAL_FILE_RE,
    MARKER_NAME,
    QUARANTINE_DIR,
    parse_local_name,
)
from megatron.integrity.torch_save import load_without_tensors
from megatron.overlay.errors import OverlayError

__all__ = [
    "IDENTITY_ATTR",
    "IDENTITY_FORMAT",
    "LOCAL_FILE_RE",
    "MARKER_NAME",
    "QUARANTINE_DIR",
    "RUN_ID_FLAG",
    "RUN_SETTINGS",
    "RUN_TOKEN_FILE",
    "RunTokenError",
    "TOPOLOGY_SETTINGS",
    "get_identity",
    "identity_problems",
    "make_identity",
    "parse_local_name",
    "read_header",
    "recover_run_token",
    "repair_run_token",
    "run_identity",
    "run_token",
    "run_settings",
    "topology",
]

IDENTITY_ATTR = "_megatron_local_identity"
IDENTITY_FORMAT = "megatron.local_tier.identity"
IDENTITY_VERSION = 1
RUN_ID_FLAG = "--local-tier-run-id"

RUN_SETTINGS: Tuple[str, ...] = (
    # what the run learns from, and how it starts
    "seed",
    "data_path",
    "train_data_path",
    "valid_data_path",
    "test_data_path",
    "mock_data",
    "split",
    "tokenizer_type",
    "tokenizer_model",
    "vocab_size",
    # the model
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "group_query_attention",
    "kv_channels",
    "seq_length",
    "max_position_embeddings",
    "position_embedding_type",
    "normalization",
    "swiglu",
    "untie_embeddings_and_output_weights",
    "num_experts",
    "moe_ffn_hidden_size",
    "moe_router_topk",
    "multi_latent_attention",
    "q_lora_rank",
    "kv_lora_rank",
    "mtp_num_layers",
    "fp16",
    "bf16",
)
"""Arguments whose values make up the derived run identity, together with the run token kept in
``--save`` (:data:`RUN_TOKEN_FILE`). A requeued or ``ft_launcher``-restarted job has the same
command line and ``--save``, hence the same identity; an experiment that changes any of these
(another seed, other data, another model) or starts in a new or emptied ``--save`` is another
run. ``--load`` is left out (a run may be resumed with ``--load`` added), as are schedule and
logging settings."""

RUN_TOKEN_FILE = "local_tier_run_token.json"
"""File in ``--save`` holding the run token: created (never overwritten) by rank 0 at the first
start of a run that uses local checkpoints; a copied or moved ``--save`` keeps it."""

_PATH_SETTINGS = {
    "data_path",
    "train_data_path",
    "valid_data_path",
    "test_data_path",
    "tokenizer_model",
}

TOPOLOGY_SETTINGS: Tuple[str, ...] = (
    "world_size",
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "context_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
    "data_parallel_size",
    "use_distributed_optimizer",
    "num_distributed_optimizer_instances",
    "use_tp_pp_dp_mapping",
    "non_persistent_local_ckpt_algo",
)
"""Arguments that decide which state each rank holds: a local checkpoint is only usable under the
same values (local files are per-rank shards; they cannot be resharded)."""


def _canonical(name: str, value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        if name in _PATH_SETTINGS and isinstance(value, str):
            return os.path.realpath(value)
        return value
    if isinstance(value, (list, tuple)):  # data paths: [weight, prefix, weight, prefix] or [prefix]
        return [_canonical("" if _is_number(v) else name, v) for v in value]
    return str(value)


def _is_number(v: Any) -> bool:
    try:
        float(v)
        return True
    except (TypeError, ValueError):
        return False


def run_settings(args: Any) -> dict:
    """The :data:`RUN_SETTINGS` of ``args`` (missing ones as ``None``), paths made absolute."""
    return {n: _canonical(n, getattr(args, n, None)) for n in RUN_SETTINGS}


class RunTokenError(OverlayError, ValueError):
    """:data:`RUN_TOKEN_FILE` exists but cannot be read: a new token would silently make every
    local checkpoint of the run another run's. ``path``: the file."""

    def __init__(self, path: str, cause: BaseException):
        self.path = path
        super().__init__(
            f"{path} is unreadable ({type(cause).__name__}: {cause}); it identifies this run's "
            f"local checkpoints"
        )


def run_token(save_dir: Optional[str], create: bool) -> Optional[str]:
    """The run token kept in ``save_dir`` (:data:`RUN_TOKEN_FILE`), created when missing and
    ``create`` (exclusive create: an existing token is never replaced); ``None`` without
    ``save_dir``, when missing and not ``create``, or when it cannot be written (then the settings
    alone identify the run).

    Raises:
        RunTokenError: the file exists but is not a readable token (truncated, not JSON, no
            ``run_token``): :func:`recover_run_token` can restore it from the local files.
    """
    if not save_dir:
        return None
    path = os.path.join(save_dir, RUN_TOKEN_FILE)
    for _ in range(2):
        try:
            with open(path) as f:
                token = json.load(f)["run_token"]
            if not isinstance(token, str) or not token:
                raise ValueError(f"run_token is {token!r}")
            return token
        except FileNotFoundError:
            if not create:
                return None
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise RunTokenError(path, e) from None
        try:
            os.makedirs(save_dir, exist_ok=True)
            tmp = f"{path}.{os.getpid()}.tmp"
            _write_token(tmp, uuid.uuid4().hex)
            try:
                os.link(tmp, path)  # fails if another process created it first
            except FileExistsError:
                pass
            finally:
                os.unlink(tmp)
        except OSError:
            return None
    return None


def _write_token(path: str, token: str, **extra: Any) -> None:
    with open(path, "w") as f:
        json.dump(
            {
                "run_token": token,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "host": socket.gethostname(),
                **extra,
            },
            f,
        )
        f.flush()
        os.fsync(f.fileno())


def recover_run_token(local_dir: Optional[str]) -> Tuple[Optional[str], Optional[str]]:
    """The run token recorded in the newest local checkpoint file under ``local_dir`` (the
    ``run_settings`` of its identity record, read without its tensors), for a
    :data:`RUN_TOKEN_FILE` that became unreadable.

    Returns:
        ``(token, file)``, or ``(None, None)`` when no local file holds one.
    """
    if not local_dir or not os.path.isdir(local_dir):
        return None, None
    found = []
    for root, _dirs, names in os.walk(local_dir):
        for name in names:
            parsed = parse_local_name(name)
            if parsed is not None and not parsed[2]:
                found.append((parsed[0], os.path.join(root, name)))
    for _it, path in sorted(found, reverse=True):
        try:
            rec = get_identity(read_header(path))
        except Exception:  # noqa: BLE001 - an unreadable file: try the next one
            continue
        token = ((rec or {}).get("run_settings") or {}).get("run_token")
        if isinstance(token, str) and token:
            return token, path
    return None, None


def repair_run_token(save_dir: str, token: str, source: str) -> None:
    """Replace the unreadable :data:`RUN_TOKEN_FILE` of ``save_dir`` by ``token`` (recovered from
    ``source``), atomically (a temporary file renamed over it).

    Raises:
        OSError: the file cannot be written.
    """
    path = os.path.join(save_dir, RUN_TOKEN_FILE)
    tmp = f"{path}.{os.getpid()}.tmp"
    _write_token(tmp, token, recovered_from=source)
    os.replace(tmp, path)


def run_identity(
    args: Any, token: Optional[str] = None, settings: Optional[Mapping] = None
) -> Tuple[str, str, dict]:
    """``(run_id, source, settings)`` of the run configured by ``args`` (Megatron arguments) whose
    ``--save`` holds run token ``token`` (:func:`run_token`).

    ``run_id`` is ``args.local_tier_run_id`` when set (source ``"--local-tier-run-id"``), else the
    first 16 hex digits of SHA-256 over the canonical JSON of the run settings plus ``run_token``
    (source ``"derived"``). ``settings``: :func:`run_settings` taken earlier (upstream rewrites
    some arguments during training, e.g. ``num_query_groups``, so take them right after argument
    validation); default: taken now.
    """
    settings = dict(run_settings(args) if settings is None else settings)
    settings["run_token"] = token
    explicit = getattr(args, "local_tier_run_id", None)
    if explicit:
        return str(explicit), RUN_ID_FLAG, settings
    derived = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    return derived, "derived", settings


def topology(args: Any) -> dict:
    """The :data:`TOPOLOGY_SETTINGS` of ``args`` (missing ones as ``None``; ``world_size`` from
    the environment when ``args`` has none)."""
    out = {n: _canonical(n, getattr(args, n, None)) for n in TOPOLOGY_SETTINGS}
    if out["world_size"] is None and os.environ.get("WORLD_SIZE", "").isdigit():
        out["world_size"] = int(os.environ["WORLD_SIZE"])
    return out


def make_identity(
    run_id: str,
    source: str,
    settings: Mapping,
    topo: Mapping,
    iteration: int,
    owner_rank: int,
    save_token: str,
    host: str,
) -> dict:
    """The record stored in every local file of one shard (see the module docstring)."""
    return {
        "format": IDENTITY_FORMAT,
        "version": IDENTITY_VERSION,
        "run_id": str(run_id),
        "run_id_source": source,
        "run_settings": dict(settings),
        "topology": dict(topo),
        "iteration": int(iteration),
        "owner_rank": int(owner_rank),
        "save_token": str(save_token),
        "host": str(host),
    }


def get_identity(state_dict: Any) -> Optional[dict]:
    """The identity record of a loaded local checkpoint, ``None`` if it has none.

    Raises:
        ValueError: the attribute exists but is not a record of a known format/version.
    """
    rec = getattr(state_dict, IDENTITY_ATTR, None)
    if rec is None:
        return None
    if not isinstance(rec, dict) or rec.get("format") != IDENTITY_FORMAT:
        raise ValueError(f"unknown identity record {type(rec).__name__}")
    if rec.get("version") != IDENTITY_VERSION:
        raise ValueError(
            f"identity record version {rec.get('version')} (this code reads {IDENTITY_VERSION})"
        )
    return rec


def _differences(stored: Mapping, current: Mapping, limit: int = 4) -> str:
    diffs = [
        f"{k} {stored.get(k)!r} (checkpoint) vs {current.get(k)!r} (this run)"
        for k in sorted(set(stored) | set(current))
        if stored.get(k) != current.get(k)
    ]
    more = f" (+{len(diffs) - limit} more)" if len(diffs) > limit else ""
    return ", ".join(diffs[:limit]) + more


def identity_problems(
    rec: Optional[Mapping],
    run_id: str,
    settings: Mapping,
    topo: Mapping,
    iteration: int,
    owner_rank: int,
) -> List[str]:
    """Why a file whose record is ``rec`` is not a shard of this run, topology, iteration and
    owner; ``[]`` when it is. Each problem is one sentence naming the settings that differ."""
    if rec is None:
        return [
            "written without a run identity (by upstream NVRx or an older version of this "
            "fork): cannot tell which run it belongs to"
        ]
    out = []
    if rec.get("run_id") != run_id:
        what = _differences(rec.get("run_settings") or {}, settings)
        out.append(
            f"written by another run (run id {rec.get('run_id')} vs {run_id} here"
            + (f": {what}" if what else f"; {rec.get('run_id_source')} vs this run's id")
            + f"; {RUN_ID_FLAG} sets the id explicitly)"
        )
    if dict(rec.get("topology") or {}) != dict(topo):
        out.append(
            f"written under another topology: {_differences(rec.get('topology') or {}, topo)}"
        )
    if rec.get("iteration") != iteration or rec.get("owner_rank") != owner_rank:
        out.append(
            f"holds rank {rec.get('owner_rank')}'s shard of iteration {rec.get('iteration')}, "
            f"its name says rank {owner_rank}, iteration {iteration}"
        )
    return out


def read_header(path: str | os.PathLike) -> Any:
    """The object a local checkpoint file holds, with every tensor replaced by ``None``: reads
    only the archive's directory and its pickle (no tensor data), so its records
    (:data:`IDENTITY_ATTR`, the checksum record, ...) cost a few milliseconds whatever the size.

    Raises:
        OSError, zipfile.BadZipFile, pickle.UnpicklingError, ...: the file is missing, truncated
            or not a ``torch.save`` zip archive (callers treat any exception as unreadable).
    """
    return load_without_tensors(path)
