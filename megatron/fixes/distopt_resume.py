"""Fix: distributed-optimizer resume without apex / Transformer Engine, and with fp32 parameters.

Two defects of megatron-core 0.19.2's ``DistributedOptimizer`` stop ``--use-distributed-optimizer``
runs from resuming when the inner optimizer is torch's Adam (no apex, no TE: every CPU run, and GPU
containers without them) or when parameters are fp32 (no ``--bf16``/``--fp16``); and a third
restarts Adam's bias correction after resume (one shared ``step`` tensor, overwritten by 0).

Design notes: ``docs/fixes/distopt_resume.md``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Callable

import torch

from megatron.fixes.standins import new_optimizer, replaced, upstream_own
from megatron.overlay import Fix, Patch
from megatron.overlay.registry import wraps_upstream

_D = "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer"


def wrap_state_dict(upstream: Callable) -> Callable:
    """Factory of the replacement of ``DistributedOptimizer.state_dict``: upstream's, except that
    without apex/TE a torch optimizer with no per-parameter state yet (the load template of a
    resume) reports step 0 instead of failing upstream's ``assert len(steps) == 1``."""
    from megatron.core.optimizer import distrib_optimizer as dopt

    @wraps_upstream(upstream)
    def state_dict(self):
        """Upstream's; a fresh torch optimizer reports step 0."""
        if dopt.HAVE_APEX_OR_TE or self.optimizer.state:
            return upstream(self)
        # A fresh torch optimizer (the load template on resume): no per-parameter state yet,
        # hence no step. Placeholders only: load_state_dict takes the checkpoint's step.
        inner = self.optimizer.state_dict()
        out = {"optimizer": {k: v for k, v in inner.items() if k != "state"}}
        for group in out["optimizer"]["param_groups"]:
            del group["params"]
            group["step"] = 0
        if self.grad_scaler:
            out["grad_scaler"] = self.grad_scaler.state_dict()
        return out

    return state_dict


def wrap_load_state_dict(upstream: Callable) -> Callable:
    """Factory of the replacement of ``DistributedOptimizer.load_state_dict``: upstream's, then
    (without apex/TE, on the load that carries ``param_state``) every parameter's ``step`` its own
    float32 0-dim tensor holding the checkpoint's step.

    The replacement raises ``RuntimeError`` when the checkpoint's param groups hold more than one
    step (they advance together)."""
    from megatron.core.optimizer import distrib_optimizer as dopt

    @wraps_upstream(upstream)
    def load_state_dict(self, state_dict):
        """Upstream's; then each parameter's step is the checkpoint's."""
        result = upstream(self, state_dict)
        if dopt.HAVE_APEX_OR_TE or "param_state" not in state_dict:
            return result  # apex/TE keep step per group; or the template pass before the load
        steps = {g.get("step") for g in state_dict["optimizer"]["param_groups"]} - {None}
        if len(steps) != 1:
            raise RuntimeError(
                f"distributed optimizer checkpoint holds param-group steps {steps}; "
                "expected exactly one (all groups advance together)"
            )
        step = float(steps.pop())
        for state in self.optimizer.state.values():
            if "step" in state:
                state["step"] = torch.tensor(step, dtype=torch.float32)
        return result

    return load_state_dict


def wrap_set_main_param_and_optimizer_states(upstream: Callable) -> Callable:
    """Factory of the replacement of ``DistributedOptimizer._set_main_param_and_optimizer_states``:
    upstream's under ``torch.no_grad()`` (with fp32 parameters the main parameters are views of
    leaf parameters that require grad, which an in-place ``copy_()`` with autograd on refuses)."""

    @wraps_upstream(upstream)
    def _set_main_param_and_optimizer_states(self, *args, **kwargs):
        """Upstream's, under ``torch.no_grad()``."""
        with torch.no_grad():
            return upstream(self, *args, **kwargs)

    return _set_main_param_and_optimizer_states


# --- the probe ----------------------------------------------------------------------------------


def _adam(n_params: int, stepped: bool) -> tuple[list[torch.nn.Parameter], torch.optim.Adam]:
    """torch Adam over ``n_params`` 2-element fp32 parameters; one step taken if ``stepped``
    (``torch.optim.Adam`` left as found: :func:`megatron.fixes.standins.new_optimizer`)."""
    params = [torch.nn.Parameter(torch.ones(2)) for _ in range(n_params)]
    adam = new_optimizer(torch.optim.Adam, params, lr=0.1)
    if stepped:
        for p in params:
            p.grad = torch.ones(2)
        adam.step()
    return params, adam


def upstream_state_dict_of_fresh_adam(fn: Callable | None = None) -> bool:
    """Whether upstream's ``DistributedOptimizer.state_dict`` (or ``fn``) gives a state dict for
    a torch Adam with no per-parameter state yet (the template a resume builds before loading),
    on the torch-Adam path (``HAVE_APEX_OR_TE`` False for the call).

    Returns:
        True if it returns one whose param groups carry a ``step``; False if it raises
        ``AssertionError`` (the defect: ``assert len(steps) == 1`` over an empty state).
    """
    from megatron.core.optimizer import distrib_optimizer as dopt

    fn = fn or upstream_own(dopt.DistributedOptimizer.state_dict)
    _, adam = _adam(1, stepped=False)
    stand_in = SimpleNamespace(optimizer=adam, grad_scaler=None)
    with replaced(dopt, HAVE_APEX_OR_TE=False):
        try:
            out = fn(stand_in)
        except AssertionError:
            return False
    groups = out.get("optimizer", {}).get("param_groups", [])
    return bool(groups) and all("step" in g for g in groups)


def upstream_load_gives_each_param_its_step(fn: Callable | None = None) -> bool:
    """Whether upstream's ``DistributedOptimizer.load_state_dict`` (or ``fn``), loading a state
    dict whose param groups hold step 5 into a torch Adam over 2 parameters with state (torch-Adam
    path: ``HAVE_APEX_OR_TE`` False for the call), leaves each parameter its own ``step`` tensor.

    Returns:
        True if both steps are 5 and distinct tensors; False if one tensor is shared (the defect:
        torch Adam advances it once per parameter, and the template load's 0 overwrites every
        parameter's step at once).
    """
    from megatron.core.optimizer import distrib_optimizer as dopt

    fn = fn or upstream_own(dopt.DistributedOptimizer.load_state_dict)
    params, adam = _adam(2, stepped=True)
    groups = adam.state_dict()["param_groups"]
    saved = {
        "optimizer": {
            "param_groups": [
                {k: v for k, v in g.items() if k != "params"} | {"step": 5} for g in groups
            ]
        }
    }
    stand_in = SimpleNamespace(
        optimizer=adam,
        grad_scaler=None,
        ddp_config=SimpleNamespace(use_megatron_fsdp=False),
        config=SimpleNamespace(fp16=False),
        gbuf_ranges=[],
    )
    with replaced(dopt, HAVE_APEX_OR_TE=False):
        fn(stand_in, saved)
    steps = [adam.state[p]["step"] for p in params]
    return steps[0] is not steps[1] and all(float(s) == 5.0 for s in steps)


def upstream_dp_reshardable_load_copies_fp32(
    fn: Callable | None = None, setter: Callable | None = None
) -> bool:
    """Whether upstream's ``DistributedOptimizer.load_parameter_state_from_dp_reshardable`` (or
    ``fn``), with autograd on, copies a checkpoint's values into an fp32 main parameter that is a
    view of a leaf model parameter requiring grad (what the distributed optimizer holds without
    ``--bf16``/``--fp16``). The stand-in's copy is upstream's own
    ``_set_main_param_and_optimizer_states`` (or ``setter``); one bucket of one 4-element
    parameter.

    Returns:
        True if the parameter holds the checkpoint's values; False if the in-place copy raises
        ``RuntimeError`` (the defect: no ``torch.no_grad()`` around it).
    """
    from megatron.core.optimizer import distrib_optimizer as dopt

    D = dopt.DistributedOptimizer
    fn = fn or upstream_own(D.load_parameter_state_from_dp_reshardable)
    setter = setter or upstream_own(D._set_main_param_and_optimizer_states)
    model_param = torch.nn.Parameter(torch.zeros(4))
    main = model_param.view(-1)[0:4]  # as the fp32 shard of an fp32 parameter
    stand_in = SimpleNamespace(
        gbuf_ranges=[{torch.float32: [{"param_map": {model_param: {}}}]}],
        model_param_group_index_map={model_param: (0, 0)},
        config=SimpleNamespace(use_precision_aware_optimizer_no_fp8_or_ds_fp8=False),
        optimizer=SimpleNamespace(param_groups=[{"params": [main]}], state={main: {}}),
    )
    stand_in._set_main_param_and_optimizer_states = lambda *a, **k: setter(stand_in, *a, **k)
    checkpoint = {0: {torch.float32: [[{"param": torch.full((4,), 3.0), "padding": False}]]}}
    with torch.enable_grad():
        try:
            fn(stand_in, checkpoint)
        except RuntimeError:
            return False
    return torch.equal(model_param.detach(), torch.full((4,), 3.0))


class DistOptResumeFix(Fix):
    name = "distopt_resume"
    title = "distributed-optimizer resume without apex/TE and with fp32 params"
    upstream_refs = ("megatron-core DistributedOptimizer.state_dict (non-apex step assertion)",)
    package = "megatron-core"

    patches = (
        Patch(
            f"{_D}.state_dict",
            wrap_state_dict,
            "resume without apex/TE asserts on the empty state of a fresh torch Adam",
        ),
        Patch(
            f"{_D}.load_state_dict",
            wrap_load_state_dict,
            "one shared step tensor, later overwritten by the template's 0, restarts "
            "Adam's bias correction after resume",
            params=("state_dict",),
        ),
        Patch(
            f"{_D}._set_main_param_and_optimizer_states",
            wrap_set_main_param_and_optimizer_states,
            "fp32 resume copy_()s into views of leaf parameters with autograd on",
        ),
    )

    def upstream_behaves(self) -> bool:
        """Upstream's own three methods on stand-ins (no process group, CPU tensors): behaves
        only if each does (:func:`upstream_state_dict_of_fresh_adam`,
        :func:`upstream_load_gives_each_param_its_step`,
        :func:`upstream_dp_reshardable_load_copies_fp32`)."""
        return (
            upstream_state_dict_of_fresh_adam()
            and upstream_load_gives_each_param_its_step()
            and upstream_dp_reshardable_load_copies_fp32()
        )


FIX = DistOptResumeFix()
