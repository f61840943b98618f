"""Every component of this fork, named in one place, as ``megatron.fixes.FIX_MODULES`` names the
fixes: the training path installs them from this list, never from installed package metadata, so
a checkout run from ``PYTHONPATH`` (or a container whose installed copy is older than the mounted
checkout) installs exactly the components of the code it runs.

The same components are declared as entry points (``pyproject.toml``,
``megatron.overlay.components``) for ``python -m megatron.fixes`` and the disable switch, which
live below this package; ``tests/unit_tests/test_components.py`` keeps the two lists equal.
"""

from __future__ import annotations

import importlib

from megatron.overlay.component import Component, install_order

__all__ = ["COMPONENT_MODULES", "declared_components"]

#: The module of each component (each defines ``COMPONENT``).
COMPONENT_MODULES = (
    "megatron.cpu.runtime",
    "megatron.cpu.specs",
    "megatron.training_ext.persistent_tier",
    "megatron.training_ext.resume_proof",
    "megatron.training_ext.local_tier",
    "megatron.training_ext.loss_log",
)


def declared_components() -> list[Component]:
    """Every component of :data:`COMPONENT_MODULES` (importing the modules), in install order:
    each after those it names in ``after``, else by name.

    Raises:
        TypeError: a module's ``COMPONENT`` is not a :class:`Component`.
        ValueError: ``after`` names an unknown component, or a cycle, or an ``installed_at``
            is unknown.
    """
    found = []
    for name in COMPONENT_MODULES:
        obj = importlib.import_module(name).COMPONENT
        if not isinstance(obj, Component):
            raise TypeError(f"{name}.COMPONENT is not a Component: {obj!r}")
        found.append(obj)
    return install_order(found)
