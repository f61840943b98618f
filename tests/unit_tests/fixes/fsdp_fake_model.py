"""CPU stand-in for a Megatron-FSDP-wrapped GPT chunk with MLA attention and one MTP layer, plus the
distributed scenarios of ``test_fsdp_dtensor_dist.py`` (module level, so spawned ranks import them).

The stand-in reproduces what the ``fsdp_dtensor`` checkpoint code sees of a real model:
* module tree ``<adapter>.module (MegatronFSDP).module (GPTModel)`` with ``decoder.layers.0`` and
  ``mtp.layers.0.mtp_model_layer`` transformer layers (``mtp_layer_pattern = None``);
* fused attention (``linear_qkv_down_proj.weight`` + absorbed ``layer_norm_weight``, input
  layernorm absent) or unfused attention (``linear_q_down_proj`` / ``linear_kv_down_proj``,
  ``input_layernorm.weight``), with a ``config`` carrying the MLA ranks;
* every parameter a DTensor built by upstream ``make_fsdp_dtensor`` from this rank's rows of its
  TP-local weight, with ``megatron_fsdp_slice`` / ``megatron_fsdp_dist_index`` /
  tensor-parallel attributes as Megatron-FSDP sets them; the split into FSDP shards is chosen per
  parameter (uneven, with empty shards and shards straddling the q/kv boundary);
* optimizer state ``{'state': {name: {'exp_avg', 'exp_avg_sq', 'step'}}, 'param_to_group_meta'}``
  keyed by ``named_parameters()`` names, as
  ``DistributedOptimizer.sharded_param_state_fsdp_dtensor``.

Values are deterministic functions of the *checkpoint* (unfused, ``transformer_layer``) key, so a
fused rank can compute what it must hold after loading an unfused checkpoint, bit for bit.
"""

from __future__ import annotations

import os
import types
import zlib

import torch

H = 4  # hidden size
Q_LORA = 4  # q_lora_rank
KV_LORA = 4  # kv_lora_rank
POS = 2  # qk_pos_emb_head_dim
KV = KV_LORA + POS
LAYERS = ("decoder.layers.0", "mtp.layers.0")


def truth(name: str, shape, kind: str = "param", salt: str = "") -> torch.Tensor:
    """Deterministic float32 values for a checkpoint key."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}|{kind}|{salt}".encode()))
    return torch.randn(*shape, generator=g)


def disk_layer(layer: str) -> str:
    return "mtp.layers.0.transformer_layer" if layer.startswith("mtp") else layer


def live_layer(layer: str) -> str:
    return "mtp.layers.0.mtp_model_layer" if layer.startswith("mtp") else layer


class Box(torch.nn.Module):
    """Attribute container."""


def _child(root: torch.nn.Module, path: str) -> torch.nn.Module:
    node = root
    for part in path.split("."):
        if part.isdigit():
            while len(node) <= int(part):
                node.append(Box())
            node = node[int(part)]
        else:
            if not hasattr(node, part):
                setattr(node, part, torch.nn.ModuleList() if part == "layers" else Box())
            node = getattr(node, part)
    return node


def cuts_for(rows: int, dp: int, kind: str, boundary: int) -> list[int]:
    """FSDP shard row boundaries ``[0, c1, ..., rows]`` of one TP-local weight over ``dp`` ranks.

    ``exact``: a cut on the q/kv boundary; ``straddle``: one shard crosses it; ``empty_first``:
    rank 0 owns nothing; ``last_all``: the last rank owns everything; ``even``: near-even split.
    """
    if kind == "even":
        inner = [rows * i // dp for i in range(1, dp)]
    elif kind == "exact":
        inner = [boundary] + [boundary + (rows - boundary) * i // dp for i in range(1, dp - 1)]
    elif kind == "straddle":
        inner = [max(boundary - 1, 0)] + [min(boundary + 1 + i, rows) for i in range(dp - 2)]
    elif kind == "empty_first":
        inner = [0] + [min(boundary + i, rows) for i in range(dp - 2)]
    elif kind == "last_all":
        inner = [0] * (dp - 1)
    else:
        raise ValueError(kind)
    cuts = [0] + sorted(min(max(c, 0), rows) for c in inner[: dp - 1]) + [rows]
    assert len(cuts) == dp + 1
    return cuts


class Env:
    """Per-rank mesh and dist index: mesh (dp_shard, tp), TP fastest like Megatron's rank order."""

    def __init__(self, tp: int):
        from megatron.core.distributed.fsdp.src.megatron_fsdp.utils import FSDPDistributedIndex
        from torch.distributed.device_mesh import init_device_mesh

        world = torch.distributed.get_world_size()
        self.tp, self.dp = tp, world // tp
        self.mesh = init_device_mesh("cpu", (self.dp, tp), mesh_dim_names=("dp_shard", "tp"))
        self.dist_index = FSDPDistributedIndex(self.mesh, dp_shard_dim="dp_shard", tp_dim="tp")
        self.dp_rank = self.mesh.get_local_rank("dp_shard")
        self.tp_rank = self.mesh.get_local_rank("tp")


def _dtensor(env: Env, tp_local: torch.Tensor, column: bool, cuts: list[int]):
    """(DTensor of this rank's rows of ``tp_local``, fsdp slice)."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer import (
        make_fsdp_dtensor,
    )

    row = tp_local[0].numel() if tp_local.dim() > 1 else 1
    r0, r1 = cuts[env.dp_rank], cuts[env.dp_rank + 1]
    meta = torch.empty(tp_local.shape, device="meta")
    if column:
        meta.tensor_model_parallel, meta.partition_dim, meta.partition_stride = True, 0, 1
    dt = make_fsdp_dtensor(
        tp_local[r0:r1].clone(),
        meta,
        dist_index=env.dist_index,
        run_check=False,
        update_uneven_dtensor_chunk_meta=False,
    )
    return dt, slice(r0 * row, r1 * row)


class FakeModel:
    """The wrapped model, its state dicts, and the expected TP-local values of every parameter.

    Args:
        env: mesh of this rank.
        fused: fused MLA down projection (column parallel over TP) or unfused (duplicated over TP,
            like ``TELinear(parallel_mode='duplicated')``).
        fill: ``'truth'`` (values of the checkpoint to be written) or ``'init'`` (other values).
        shard: shard pattern of the fused weight (see :func:`cuts_for`); others use ``even`` or
            ``empty_first`` alternately.
        q_lora: q_lora_rank (a different value makes a shape mismatch).
    """

    def __init__(
        self,
        env: Env,
        fused: bool,
        fill: str = "truth",
        shard: str = "even",
        q_lora: int = Q_LORA,
        lr: float = 0.5,
        step: float = 7.0,
    ):
        self.env, self.fused, self.q_lora, self.shard = env, fused, q_lora, shard
        salt = "" if fill == "truth" else "init"
        self.gpt = Box()
        self.expected: dict[str, dict[str, torch.Tensor]] = {}  # live name -> kind -> TP-local
        self.params: dict[str, torch.nn.Parameter] = {}
        self.opt_state: dict[str, dict] = {}
        self.meta: dict[str, dict] = {}
        config = types.SimpleNamespace(
            q_lora_rank=q_lora,
            kv_lora_rank=KV_LORA,
            qk_pos_emb_head_dim=POS,
            num_moe_experts=None,
            gated_linear_unit=False,
        )
        tp, t = env.tp, env.tp_rank
        qt, kvt = q_lora // tp, KV // tp
        for i, layer in enumerate(LAYERS):
            live, disk = live_layer(layer), disk_layer(layer)
            attn = _child(self.gpt, f"{live}.self_attention")
            attn.config = config
            _child(self.gpt, f"{live}.input_layernorm")
            if layer.startswith("mtp"):
                _child(self.gpt, "mtp.layers.0").mtp_layer_pattern = None
            q_key = f"{disk}.self_attention.linear_q_down_proj.weight"
            kv_key = f"{disk}.self_attention.linear_kv_down_proj.weight"
            ln_key = f"{disk}.input_layernorm.weight"

            def logical(key, shape, kind, _salt=salt):
                return truth(key, shape, kind, _salt)

            if fused:

                def fused_local(kind, _q=q_key, _kv=kv_key):
                    q = logical(_q, (q_lora, H), kind)
                    kv = logical(_kv, (KV, H), kind)
                    return torch.cat([q[t * qt : (t + 1) * qt], kv[t * kvt : (t + 1) * kvt]])

                self._add(
                    f"{live}.self_attention.linear_qkv_down_proj.weight",
                    fused_local,
                    column=True,
                    cuts=cuts_for(qt + kvt, env.dp, shard, qt),
                )
                self._add(
                    f"{live}.self_attention.linear_qkv_down_proj.layer_norm_weight",
                    lambda kind, _k=ln_key: logical(_k, (H,), kind),
                    column=False,
                    cuts=cuts_for(H, env.dp, "empty_first", 1),
                )
            else:
                self._add(
                    f"{live}.self_attention.linear_q_down_proj.weight",
                    lambda kind, _k=q_key: logical(_k, (q_lora, H), kind),
                    column=False,
                    cuts=cuts_for(q_lora, env.dp, "even" if i else "last_all", 0),
                )
                self._add(
                    f"{live}.self_attention.linear_kv_down_proj.weight",
                    lambda kind, _k=kv_key: logical(_k, (KV, H), kind),
                    column=False,
                    cuts=cuts_for(KV, env.dp, "empty_first", 2),
                )
                self._add(
                    f"{live}.input_layernorm.weight",
                    lambda kind, _k=ln_key: logical(_k, (H,), kind),
                    column=False,
                    cuts=cuts_for(H, env.dp, "even", 0),
                )
            fc2 = f"{disk}.mlp.linear_fc2.weight"
            self._add(
                f"{live}.mlp.linear_fc2.weight",
                lambda kind, _k=fc2: logical(_k, (H, H), kind),
                column=False,
                cuts=cuts_for(H, env.dp, "straddle", 2),
            )
        self._add(
            "mtp.layers.0.enorm.weight",
            lambda kind: truth("mtp.layers.0.enorm.weight", (H,), kind, salt),
            column=False,
            cuts=cuts_for(H, env.dp, "last_all", 0),
        )
        inner = Box()
        inner.module = self.gpt
        self.wrapper = Box()
        self.wrapper.module = inner
        for name, p in self.wrapper.named_parameters():
            short = name[len("module.module.") :]
            self.params[name] = p
            self.opt_state[name] = {
                "exp_avg": self._opt[short]["exp_avg"],
                "exp_avg_sq": self._opt[short]["exp_avg_sq"],
                "step": torch.tensor(step),
            }
            self.meta[name] = {"lr": lr, "weight_decay": 0.1}

    def _add(self, live_name, make, column, cuts):
        env = self.env
        parent, _, leaf = live_name.rpartition(".")
        owner = _child(self.gpt, parent)
        self.expected[live_name] = {k: make(k) for k in ("param", "exp_avg", "exp_avg_sq")}
        dt, fsdp_slice = _dtensor(env, self.expected[live_name]["param"], column, cuts)
        p = torch.nn.Parameter(dt)
        p.megatron_fsdp_slice = fsdp_slice
        p.megatron_fsdp_dist_index = env.dist_index
        if column:
            p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, 0, 1
        owner.register_parameter(leaf, p)
        self._opt = getattr(self, "_opt", {})
        self._opt[live_name] = {
            k: _dtensor(env, self.expected[live_name][k], column, cuts)[0]
            for k in ("exp_avg", "exp_avg_sq")
        }
        self._cuts = getattr(self, "_cuts", {})
        self._cuts[live_name] = cuts

    # ---- state dicts -----------------------------------------------------------------------
    def model_state_dict(self) -> dict:
        return {name[len("module.") :]: p.detach() for name, p in self.params.items()}

    def optimizer_state_dict(self) -> dict:
        return {"state": self.opt_state, "param_to_group_meta": self.meta}

    def full_state_dict(self) -> dict:
        return {
            "model": self.model_state_dict(),
            "optimizer": self.optimizer_state_dict(),
            "iteration": 1,
            "checkpoint_version": 3.0,
        }


def mismatches(model: FakeModel, reference: FakeModel, optimizer: bool = True) -> list[str]:
    """Entries whose local values differ bitwise between two equally laid-out models (the loaded
    one and one built with the checkpoint's values)."""
    bad = []
    for name, p in model.params.items():
        if not torch.equal(p.to_local(), reference.params[name].to_local()):
            bad.append(name)
        if optimizer:
            for kind in ("exp_avg", "exp_avg_sq", "step"):
                got, want = model.opt_state[name][kind], reference.opt_state[name][kind]
                got = got.to_local() if hasattr(got, "to_local") else got
                want = want.to_local() if hasattr(want, "to_local") else want
                if not torch.equal(got, want):
                    bad.append(f"{name}:{kind}")
            if model.meta[name] != reference.meta[name]:
                bad.append(f"{name}:param_to_group_meta")
    return bad


def make_args(**overrides):
    args = types.SimpleNamespace(
        swiglu=False,
        num_experts=None,
        use_megatron_fsdp=True,
        strict_fsdp_dtensor_load=True,
        dist_ckpt_strictness="assume_ok_unexpected",
        finetune=False,
        non_persistent_ckpt_type=None,
        non_persistent_global_ckpt_dir=None,
        ckpt_step=1,
        exit_on_missing_checkpoint=False,
    )
    for k, v in overrides.items():
        setattr(args, k, v)
    return args


def save(model: FakeModel, root: str, args=None) -> None:
    """Save like ``save_checkpoint`` (fsdp_dtensor branch) into ``root/iter_0000001``."""
    import torch.distributed.checkpoint as dcp
    from megatron.training import checkpointing

    args = args or make_args()
    sd = checkpointing.preprocess_fsdp_dtensor_state_dict(
        args, model.full_state_dict(), model.wrapper
    )
    dcp.save(sd, checkpoint_id=os.path.join(root, "iter_0000001"))
    torch.distributed.barrier()


def load(model: FakeModel, root: str, args=None):
    """Load through upstream ``_load_base_checkpoint`` (fsdp_dtensor branch) with this rank's
    state dicts; returns its result."""
    from megatron.training import checkpointing

    args = args or make_args()
    sharded = {
        "model": model.model_state_dict(),
        "optimizer": model.optimizer_state_dict(),
        "_model": [model.wrapper],
    }
    return checkpointing._load_base_checkpoint(root, args, rank0=False, sharded_state_dict=sharded)


def metadata_keys(root: str) -> set[str]:
    from torch.distributed.checkpoint import FileSystemReader

    return set(
        FileSystemReader(os.path.join(root, "iter_0000001")).read_metadata().state_dict_metadata
    )
