"""The components above the fixes (megatron.overlay.component): the training hooks install those
declared for that moment, in declared order, each by its own ``enabled(args)``; the disable
switch leaves a named component uninstalled with a warning and names what it knows when a name is
unknown; the CPU backend refuses to shadow a CUDA device before any patch; ``python -m
megatron.fixes --json`` lists every component from its declaration."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

import megatron.fixes as fixes
from megatron.overlay.component import DISABLE_ENV, INSTALLED_AT, Component, install_order


@dataclass
class _State:
    args: object = None


#: The names of the toy components whose state was created, in order.
calls: list[str] = []


def _component(name: str, when: str = "training", after: tuple = (), on: bool = True):
    """A component without patches that records its installs in ``calls``."""

    class Toy(Component[_State]):
        def enabled(self, args) -> bool:
            return on

        def new_state(self, args) -> _State:
            calls.append(name)
            return _State(args)

    Toy.name, Toy.title, Toy.installed_at, Toy.after = name, f"toy {name}", when, after
    return Toy()


def test_training_hooks_install_the_training_components_in_declared_order(monkeypatch):
    from megatron.training_ext import args as fork_args

    toys = [
        _component("zeta", after=("alpha",)),
        _component("alpha"),
        _component("off", on=False),
        _component("boot", when="startup"),
        _component("spec", when="model"),
    ]
    order = install_order(toys)
    monkeypatch.setattr(fork_args, "declared_components", lambda: order)
    calls.clear()
    args = SimpleNamespace()
    try:
        fork_args.install_training_hooks(args)
        assert calls == ["alpha", "zeta"]  # "off" disabled by its args, the others not training
        installed = {t.name for t in toys if t.installed}
        assert installed == {"alpha", "zeta"}
        assert next(t for t in toys if t.name == "zeta").state.args is args
        fork_args.install_training_hooks(args)  # a second start: fresh states, same objects
        assert calls == ["alpha", "zeta", "alpha", "zeta"]
    finally:
        for t in toys:
            t.uninstall()


def test_every_declared_component_says_when_it_is_installed():
    from megatron.cpu import runtime, specs
    from megatron.training_ext import loss_log, persistent_tier

    assert set(INSTALLED_AT) == {"startup", "training", "model"}
    assert runtime.COMPONENT.installed_at == "startup"
    assert specs.COMPONENT.installed_at == "model"
    assert persistent_tier.COMPONENT.installed_at == "training"
    assert loss_log.COMPONENT.installed_at == "training"
    assert (runtime.COMPONENT.name, specs.COMPONENT.name) == ("cpu", "cpu_mla")
    assert [p.target for p in runtime.COMPONENT.patches] == [
        p.target for p in runtime.declared_patches()
    ]
    assert [s.target for s in specs.COMPONENT.specs()] == [p.target for p in specs.PATCHES]


def test_a_component_named_in_the_disable_switch_stays_uninstalled_with_a_warning(
    monkeypatch, caplog
):
    from megatron.training_ext import persistent_tier

    tier = persistent_tier.PersistentTier()  # a fresh instance: nothing of the module's touched
    monkeypatch.setenv(DISABLE_ENV, "some_fix, persistent_tier")
    with caplog.at_level(logging.WARNING, logger="megatron.overlay"):
        assert tier.install(SimpleNamespace()) is None
        assert tier.install(SimpleNamespace()) is None
    assert not tier.installed and tier.records() == []
    warned = [r.getMessage() for r in caplog.records]
    assert warned == [
        f"component persistent_tier: disabled by ${DISABLE_ENV}: upstream's behaviour is back"
    ]


def test_an_unknown_name_in_the_disable_switch_lists_the_fixes_and_components(monkeypatch):
    from megatron.overlay.component import declared_names

    monkeypatch.setenv(DISABLE_ENV, "no_such_part")
    with pytest.raises(ValueError) as e:
        fixes.apply()
    message = str(e.value)
    assert "names unknown fixes or components ['no_such_part']" in message
    assert f"known: {sorted(f.name for f in fixes.fixes())}" in message
    assert f"components: {declared_names()}" in message
    assert {"cpu", "cpu_mla", "persistent_tier", "loss_log"} <= set(declared_names())


def test_cpu_backend_refuses_a_usable_cuda_device_before_any_patch(monkeypatch):
    import torch

    from megatron.cpu import runtime

    backend = runtime.CpuBackend()  # a fresh instance: the module's may be active here
    before = backend.records()  # the module's instance's, when an earlier test activated it
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="a CUDA device is available; the CPU backend would"):
        backend.install()
    assert not backend.installed and backend.records() == before


@pytest.mark.slow
def test_cli_json_lists_every_component_from_its_declaration(fixes_cli):
    import torch

    from megatron.overlay.component import declared_components

    out = fixes_cli["json"]  # python -m megatron.fixes --json (tests/unit_tests/conftest.py)
    assert out.returncode == 0, out.stderr[-3000:]
    listed = json.loads(out.stdout)["components"]
    declared = declared_components()
    assert [c["name"] for c in listed] == [c.name for c in declared]
    for entry, component in zip(listed, declared):
        assert set(entry) == {"name", "title", "installed_at", "after", "installed", "patches"}
        assert entry["title"] == component.title and entry["title"]
        assert entry["installed_at"] == component.installed_at in INSTALLED_AT
        assert entry["after"] == list(component.after)
        assert [p["target"] for p in entry["patches"]] == [p.target for p in component.patches]
        assert all(p["target"] and p["replacement"] and p["why"] for p in entry["patches"])
    state = {c["name"]: c["installed"] for c in listed}
    assert state["cpu"] is not torch.cuda.is_available()  # the listing adds --cpu without CUDA
    assert state["cpu_mla"] is False  # switched on by an MLA model config, not by flags
    assert state["persistent_tier"] is True and state["loss_log"] is True
    text = fixes_cli["text"].stdout
    assert f"{len(declared)} components above the fixes" in text
    assert "cpu_mla: " in text and "  installed at: model: " in text


def test_the_entry_points_declare_exactly_the_components_the_training_path_installs():
    """The listing and the disable switch find components through entry points (they live below
    training_ext); the training path installs megatron.training_ext.components' list. Both the
    installed metadata and pyproject.toml name the same components, by their COMPONENT."""
    import tomllib
    from importlib.metadata import entry_points
    from pathlib import Path

    from megatron.overlay.component import COMPONENTS_GROUP, declared_names
    from megatron.training_ext.components import COMPONENT_MODULES, declared_components

    names = sorted(c.name for c in declared_components())
    assert declared_names() == names
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    declared = pyproject["project"]["entry-points"][COMPONENTS_GROUP]
    assert sorted(declared) == names
    assert sorted(declared.values()) == sorted(f"{m}:COMPONENT" for m in COMPONENT_MODULES)
    for ep in entry_points(group=COMPONENTS_GROUP):
        assert ep.load() is next(c for c in declared_components() if c.name == ep.name)
