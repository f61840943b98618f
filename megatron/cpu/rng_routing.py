"""Which torch callables draw random numbers: the ops the CPU backend routes to the "CUDA"
generator (:mod:`megatron.cpu.runtime`). Enumerated from torch's operator registry (aten ops
tagged ``nondeterministic_seeded``), so an op added by a later torch is covered without a change."""

from __future__ import annotations

import functools
import types
from typing import Any

import torch

#: Namespaces whose attribute of an aten op's name is that op's Python binding.
BINDING_NAMESPACES = (
    torch,
    torch.Tensor,
    torch.nn.functional,
    torch._C._nn,
    torch.special,
    torch.nn.init,
)
#: Modules whose pure-Python functions may call seeded ops inside (then the torch function mode sees
#: only the outer call: ``nn.init.normal_`` runs ``Tensor.normal_`` with the mode off).
_WRAPPER_MODULES = (torch.nn.functional, torch.nn.init)


def seeded_aten_ops() -> frozenset[str]:
    """Names of the aten operators that draw random numbers (tag ``nondeterministic_seeded``), from
    torch's operator registry, e.g. ``normal_``, ``dropout``, ``multinomial``, ``_standard_gamma``,
    ``scaled_dot_product_attention``; enumerated programmatically, so an op added by a later torch
    is covered without a change here."""
    names = set()
    for schema in torch._C._jit_get_all_schemas():
        if not schema.name.startswith("aten::"):
            continue
        name = schema.name[len("aten::") :]
        if name in names:
            continue
        packet = getattr(torch.ops.aten, name, None)
        if packet is None:
            continue
        for overload in packet.overloads():
            if torch.Tag.nondeterministic_seeded in getattr(packet, overload).tags:
                names.add(name)
                break
    return frozenset(names)


def _calls_seeded(code: types.CodeType, module: Any, seeded: frozenset[str], seen: set) -> bool:
    if code in seen:
        return False
    seen.add(code)
    if seeded.intersection(code.co_names):
        return True
    nested = [c for c in code.co_consts if isinstance(c, types.CodeType)]
    for name in code.co_names:  # module-level helpers, e.g. nn.init.normal_ -> _no_grad_normal_
        helper = vars(module).get(name)
        if isinstance(helper, types.FunctionType) and helper.__module__ == module.__name__:
            nested.append(helper.__code__)
    return any(_calls_seeded(c, module, seeded, seen) for c in nested)


@functools.lru_cache(maxsize=1)
def random_callables() -> frozenset:
    """Every Python callable of torch that draws random numbers without an explicit generator
    argument being required: the bindings of :func:`seeded_aten_ops` in ``torch``, ``Tensor``,
    ``torch.nn.functional``, ``torch._C._nn``, ``torch.special``, ``torch.nn.init``, plus the
    pure-Python functions of ``torch.nn.functional`` and ``torch.nn.init`` whose code (or a helper
    of the same module) calls one of them by name (``F.dropout``, ``F.gumbel_softmax``,
    ``nn.init.kaiming_uniform_``, ...). ``torch.distributions`` needs no entry: its samplers call
    ``torch.rand``/``_standard_gamma``/... at the top level, where the mode sees them."""
    seeded = seeded_aten_ops()
    out = set()
    for ns in BINDING_NAMESPACES:
        for name in seeded:
            f = getattr(ns, name, None)
            if callable(f):
                out.add(f)

    def draws(f: types.FunctionType, module: Any) -> bool:
        if _calls_seeded(f.__code__, module, seeded, set()):
            return True
        # boolean_dispatch wrappers (F.fractional_max_pool2d) hold their targets in a closure
        cells = [c.cell_contents for c in (f.__closure__ or ()) if c.cell_contents is not f]
        return any(
            g in out or isinstance(g, types.FunctionType) and draws(g, module)
            for g in cells
            if callable(g)
        )

    for module in _WRAPPER_MODULES:
        for f in list(vars(module).values()):
            if (
                isinstance(f, types.FunctionType)
                and f.__module__ == module.__name__
                and draws(f, module)
            ):
                out.add(f)
    return frozenset(out)
