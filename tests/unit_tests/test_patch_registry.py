"""megatron.overlay.registry: every replacement of an upstream attribute is recorded (target,
replacement, owner, why, adds-attribute, stacking), undone by owner, and listed by
``python -m megatron.fixes --json``; the entrypoint's setup makes no replacement outside it."""

from __future__ import annotations

import json
import textwrap
import types

import pytest

from megatron.overlay.registry import Patcher, PatchRegistry, wraps_upstream
from tests.helpers.dist import run_python


def test_records_stack_and_restore_by_owner():
    reg = PatchRegistry()
    mod = types.ModuleType("upstream_mod")
    mod.fn = lambda: "upstream"

    def first():
        return "first"

    def second():
        return "second"

    a, b = Patcher("a", reg), Patcher("b", reg)
    assert a.replace(mod, "fn", first, "why a") is not None
    b.replace(mod, "fn", second, "why b")
    b.replace(mod, "new_attr", second, "adds one")
    recs = reg.records()
    assert [(r.target, r.owner, r.depth, r.adds_attribute) for r in recs] == [
        ("upstream_mod.fn", "a", 1, False),
        ("upstream_mod.fn", "b", 2, False),
        ("upstream_mod.new_attr", "b", 1, True),
    ]
    assert recs[0].replacement.endswith("first") and recs[0].why == "why a"
    assert list(reg.stacked()) == ["upstream_mod.fn"]
    assert reg.is_recorded(mod, "fn") and mod.fn() == "second"
    b.restore()
    assert mod.fn() == "first" and not hasattr(mod, "new_attr")
    assert [r.owner for r in reg.records()] == ["a"]
    a.restore()
    assert mod.fn() == "upstream" and reg.records() == []


def test_a_classmethod_is_recorded_and_restored_as_a_classmethod():
    """Attribute access makes a new bound method each time: the record compares the class's own
    ``classmethod`` object, and the restore puts it back (not a method bound to the base)."""

    class Base:
        @classmethod
        def make(cls):
            return cls

    class Sub(Base):
        pass

    reg = PatchRegistry()
    upstream = Base.make
    p = Patcher("o", reg)
    p.replace(Base, "make", classmethod(lambda cls: ("patched", upstream.__func__(cls))), "why")
    assert reg.is_recorded(Base, "make") and Sub.make() == ("patched", Sub)
    p.restore()
    assert isinstance(vars(Base)["make"], classmethod) and Sub.make() is Sub


def test_owner_and_why_are_required():
    reg = PatchRegistry()
    mod = types.ModuleType("m")
    mod.x = 1
    with pytest.raises(ValueError, match="owner and why are required"):
        reg.replace(mod, "x", 2, owner="o", why="")
    assert mod.x == 1 and reg.records() == []


def test_wraps_upstream_keeps_the_wrapper_name():
    def upstream(x):
        """upstream doc"""
        return x

    @wraps_upstream(upstream)
    def wrapper(x):
        """fork doc"""
        return upstream(x) + 1

    assert wrapper.__name__ == "wrapper" and wrapper.__doc__ == "fork doc"
    assert wrapper.__wrapped__ is upstream


#: Walks every loaded upstream module (and the classes defined in it) before and after the
#: entrypoint's setup: a changed callable, or one of ours found in an upstream namespace, must be
#: in the registry. Runs in a process where nothing was applied yet (``run_python``: forked from the
#: test forkserver, which imports torch and upstream and applies nothing; the walk also covers
#: what that process has loaded).
_SETUP_SCRIPT = textwrap.dedent(
    r"""
    import importlib, inspect, json, os, sys, types
    OURS = ("megatron.fixes", "megatron.cpu", "megatron.integrity", "megatron.training_ext")
    for name in ("megatron.core", "megatron.training", "megatron.training.training",
                 "megatron.training.checkpointing", "megatron.training.arguments",
                 "megatron.core.dist_checkpointing.serialization",
                 "nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager",
                 "nvidia_resiliency_ext.checkpointing.local.replication.strategies",
                 "torch.cuda", "torch.cuda.random", "torch.cuda.nvtx"):
        importlib.import_module(name)

    SKIP = OURS + ("tests", "__main__", "__mp_main__")

    def upstream_modules():
        return [m for n, m in list(sys.modules.items())
                if isinstance(m, types.ModuleType) and not n.startswith(SKIP)]

    def namespaces():
        for m in upstream_modules():
            yield m
            for v in list(vars(m).values()):
                if inspect.isclass(v) and getattr(v, "__module__", None) == m.__name__:
                    yield v

    def callables(ns):
        try:
            items = list(vars(ns).items())
        except TypeError:
            return {}
        return {k: v for k, v in items if not k.startswith("__")
                and (callable(v) or isinstance(v, (staticmethod, classmethod)))}

    before = {id(ns): (ns, callables(ns)) for ns in namespaces()}
    import megatron.fixes
    megatron.fixes.apply()
    from megatron.fixes.__main__ import install_components
    install_components()
    from megatron.overlay.registry import REGISTRY

    def ours(v):
        v = getattr(v, "__func__", v)
        return str(getattr(v, "__module__", "") or "").startswith(OURS)

    unrecorded = set()
    for ns in namespaces():
        now = callables(ns)
        existed = id(ns) in before
        old = before.get(id(ns), (ns, {}))[1]
        for k, v in now.items():
            # replaced; or added to an upstream class (modules gain attributes lazily)
            changed = existed and (old[k] is not v if k in old else inspect.isclass(ns))
            if (changed or ours(v)) and not REGISTRY.is_recorded(ns, k):
                owner = getattr(ns, "__name__", repr(ns))
                mod = getattr(ns, "__module__", "")
                unrecorded.add(f"{mod + '.' if inspect.isclass(ns) else ''}{owner}.{k}")
    print("RESULT", json.dumps({"unrecorded": sorted(unrecorded),
                                "records": len(REGISTRY.records())}))
"""
)


@pytest.mark.slow
def test_entrypoint_setup_replaces_nothing_outside_the_registry():
    out = run_python(_SETUP_SCRIPT, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line[len("RESULT ") :])
    assert result["unrecorded"] == [], result["unrecorded"]
    assert result["records"] >= 84


@pytest.mark.slow
def test_cli_json_lists_every_replacement(fixes_cli):
    out = fixes_cli["json"]  # python -m megatron.fixes --json (tests/unit_tests/conftest.py)
    assert out.returncode == 0, out.stderr[-3000:]
    data = json.loads(out.stdout)
    recs = data["replacements"]
    assert len(recs) >= 84
    for r in recs:
        assert r["target"] and r["replacement"] and r["owner"] and r["why"], r
        assert not r["why"].startswith("part of fix "), r  # a specific reason at each replace
    owners = {r["owner"] for r in recs}
    fix_owners = {f["name"] for f in data["fixes"]} | {
        p["name"] for f in data["fixes"] for p in f["parts"]
    }
    hooks = {"cpu", "persistent_tier", "resume_proof", "local_tier", "loss_log"}
    assert hooks <= owners
    assert all(f["status"] == "active" for f in data["fixes"]), data["fixes"]
    assert owners - hooks <= fix_owners
