"""The Component contract (megatron/overlay/component.py) on a stand-in upstream module: what the
base owns for every component (declared patches checked and installed, idempotent install, a fresh
state per install in the same object, the disable switch, the declared order)."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field

import pytest

from megatron.overlay import Patch, UnsupportedUpstreamError, wraps_upstream
from megatron.overlay.component import DISABLE_ENV, Component, install_order
from megatron.overlay.registry import REGISTRY

UPSTREAM = "fake_upstream_for_components"


def _upstream_step(iteration, loss):
    return ("upstream", iteration, loss)


@pytest.fixture
def upstream(monkeypatch):
    mod = types.ModuleType(UPSTREAM)
    mod.step = _upstream_step
    monkeypatch.setitem(sys.modules, UPSTREAM, mod)
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    return mod


@dataclass
class Counting:
    mode: str
    seen: list = field(default_factory=list)


def _wrap_step(orig):
    @wraps_upstream(orig)
    def step(iteration, loss):
        st = COUNTER.state
        if st is not None:
            st.seen.append(iteration)
        return ("wrapped", *orig(iteration, loss))

    return step


class Counter(Component[Counting]):
    name = "counter"
    title = "counts the iterations upstream's step sees"
    patches = (Patch(f"{UPSTREAM}.step", _wrap_step, "count", params=("iteration",)),)

    def enabled(self, args) -> bool:
        return args.mode != "off"

    def new_state(self, args) -> Counting:
        return Counting(mode=args.mode)


COUNTER = Counter()


@pytest.fixture
def counter(upstream):
    yield COUNTER
    COUNTER.uninstall()


def test_install_is_idempotent_and_a_reinstall_starts_from_a_fresh_state_in_the_same_object(
    counter, upstream
):
    first = counter.install(types.SimpleNamespace(mode="a"))
    assert upstream.step(3, 1.0) == ("wrapped", "upstream", 3, 1.0)
    assert first.seen == [3] and counter.installed
    again = counter.install(types.SimpleNamespace(mode="b"))
    assert again is first and (first.mode, first.seen) == ("b", [])  # nothing carried over
    assert upstream.step(4, 1.0) == ("wrapped", "upstream", 4, 1.0)  # wrapped once, not twice
    assert [r.target for r in REGISTRY.records("counter")] == [f"{UPSTREAM}.step"]
    counter.uninstall()
    assert upstream.step is _upstream_step and counter.state is None
    assert REGISTRY.records("counter") == []


def test_a_reinstall_that_switches_the_component_off_uninstalls_it(counter, upstream):
    counter.install(types.SimpleNamespace(mode="a"))
    assert counter.install(types.SimpleNamespace(mode="off")) is None
    assert upstream.step is _upstream_step and not counter.installed


def test_a_changed_patch_point_is_an_unsupported_upstream_and_installs_nothing(counter, upstream):
    def step(it, loss):  # the parameter the wrapper relies on was renamed upstream
        return it

    upstream.step = step
    with pytest.raises(
        UnsupportedUpstreamError, match=r"counter: .*step no longer takes iteration"
    ):
        counter.install(types.SimpleNamespace(mode="a"))
    assert upstream.step is step and not counter.installed


def test_the_disable_switch_leaves_the_component_out(counter, upstream, monkeypatch, caplog):
    monkeypatch.setenv(DISABLE_ENV, "counter")
    assert counter.install(types.SimpleNamespace(mode="a")) is None
    assert upstream.step is _upstream_step and not counter.installed
    assert "disabled by $MEGATRON_FIXES_DISABLE" in caplog.text


def test_a_failing_start_hook_undoes_the_patches(upstream):
    class Failing(Counter):
        name = "failing"

        def started(self, state):
            raise RuntimeError("no device")

    c = Failing()
    with pytest.raises(RuntimeError, match="no device"):
        c.install(types.SimpleNamespace(mode="a"))
    assert upstream.step is _upstream_step and not c.installed


def test_install_order_follows_after_and_refuses_unknown_names_and_cycles():
    def comp(name, after=()):
        return type(name, (Component,), {"name": name, "title": name, "after": after})()

    a, b, c = comp("a", ("c",)), comp("b"), comp("c", ("b",))
    assert [x.name for x in install_order([a, b, c])] == ["b", "c", "a"]
    with pytest.raises(ValueError, match="unknown"):
        install_order([comp("x", ("nope",))])
    with pytest.raises(ValueError, match="cycle"):
        install_order([comp("p", ("q",)), comp("q", ("p",))])
    typo = comp("t")
    typo.installed_at = "trainig"
    with pytest.raises(ValueError, match="installed_at 'trainig' is not one of"):
        install_order([typo])


def test_the_disable_switch_set_after_an_install_uninstalls_it(counter, upstream, monkeypatch):
    counter.install(types.SimpleNamespace(mode="a"))
    monkeypatch.setenv(DISABLE_ENV, "counter")
    assert counter.install(types.SimpleNamespace(mode="a")) is None
    assert upstream.step is _upstream_step and not counter.installed


@dataclass(slots=True, frozen=True)
class Slotted:
    mode: str


class SlottedCounter(Counter):
    name = "slotted"

    def new_state(self, args) -> Slotted:  # type: ignore[override]
        return Slotted(mode=args.mode)


def test_a_reinstall_refreshes_a_slotted_frozen_state_in_the_same_object(upstream):
    c = SlottedCounter()
    try:
        first = c.install(types.SimpleNamespace(mode="a"))
        again = c.install(types.SimpleNamespace(mode="b"))
        assert again is first and first.mode == "b"
    finally:
        c.uninstall()
