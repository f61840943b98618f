"""Fix: distributed-optimizer resume without apex / Transformer Engine, and with fp32 parameters.

Two defects of megatron-core 0.19.2's ``DistributedOptimizer`` stop ``--use-distributed-optimizer``
runs from resuming when the inner optimizer is torch's Adam (no apex, no TE: every CPU run, and GPU
containers without them) or when parameters are fp32 (no ``--bf16``/``--fp16``); and a third
restarts Adam's bias correction after resume (one shared ``step`` tensor, overwritten by 0).

Design notes: ``docs/fixes/distopt_resume.md``.
"""

from __future__ import annotations

import inspect

import torch

from megatron.overlay import Fix, Patcher
from megatron.overlay.registry import wraps_upstream


class DistOptResumeFix(Fix):
    name = "distopt_resume"
    title = "distributed-optimizer resume without apex/TE and with fp32 params"
    upstream_refs = ("megatron-core DistributedOptimizer.state_dict (non-apex step assertion)",)
    package = "megatron-core"

    def upstream_behaves(self) -> bool:
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer as D

        step_assert = "assert len(steps) == 1" in inspect.getsource(D.state_dict)
        shared_step = 's["step"] = step\n' in inspect.getsource(D.load_state_dict)
        loader = inspect.getsource(D.load_parameter_state_from_dp_reshardable)
        copy_fn = inspect.getsource(D._set_main_param_and_optimizer_states)
        no_grad_copy = "no_grad" in copy_fn or "@torch.no_grad()" in loader.split("def ")[0]
        return not step_assert and not shared_step and no_grad_copy

    def install(self, patcher: Patcher) -> None:
        from megatron.core.optimizer import distrib_optimizer as dopt

        D = dopt.DistributedOptimizer
        upstream_state_dict = D.state_dict

        @wraps_upstream(upstream_state_dict)
        def state_dict(self):
            """Upstream's; a fresh torch optimizer reports step 0."""
            if dopt.HAVE_APEX_OR_TE or self.optimizer.state:
                return upstream_state_dict(self)
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

        patcher.replace(
            D,
            "state_dict",
            state_dict,
            "resume without apex/TE asserts on the empty state of a fresh torch Adam",
        )
        upstream_load = D.load_state_dict

        @wraps_upstream(upstream_load)
        def load_state_dict(self, state_dict):
            """Upstream's; then each parameter's step is the checkpoint's."""
            result = upstream_load(self, state_dict)
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

        patcher.replace(
            D,
            "load_state_dict",
            load_state_dict,
            "one shared step tensor, later overwritten by the template's 0, restarts "
            "Adam's bias correction after resume",
        )
        upstream_set = D._set_main_param_and_optimizer_states

        @wraps_upstream(upstream_set)
        def _set_main_param_and_optimizer_states(self, *args, **kwargs):
            """Upstream's, under ``torch.no_grad()``."""
            with torch.no_grad():
                return upstream_set(self, *args, **kwargs)

        patcher.replace(
            D,
            "_set_main_param_and_optimizer_states",
            _set_main_param_and_optimizer_states,
            "fp32 resume copy_()s into views of leaf parameters with autograd on",
        )


FIX = DistOptResumeFix()
