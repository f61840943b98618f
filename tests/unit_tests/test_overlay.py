"""megatron.overlay: patches as data, verdicts by behaviour, pins in one place, a clean layering."""

from __future__ import annotations

import ast
import re
import tomllib
import types
from pathlib import Path

import pytest

from megatron.overlay import (
    SKIP,
    Fix,
    FixGroup,
    FixStatus,
    Patch,
    Patcher,
    PatchRegistry,
    UnsupportedUpstreamError,
    alias_of,
    pins,
    resolve,
)

ROOT = Path(__file__).resolve().parents[2]

#: Layers, bottom first: a module may import only from its own layer or a lower one.
LAYERS = ("overlay", "integrity", "fixes", "cpu", "training_ext", "verify")


# -- patches as data ------------------------------------------------------------------------------
def test_resolve_walks_modules_then_attributes():
    owner, name = resolve("megatron.overlay.patch.Patch.check")
    assert owner is Patch and name == "check"
    import threading

    assert resolve("threading.Thread._bootstrap_inner") == (threading.Thread, "_bootstrap_inner")
    with pytest.raises(ImportError):
        resolve("no_such_module_xyz.attr")
    with pytest.raises(ValueError):
        resolve("nodots")


def _target(x, y=1):
    return x + y


def test_patch_check_names_what_changed():
    here = __name__
    assert Patch(f"{here}._target", lambda o: o, "why", params=("x", "y")).check() is None
    assert "no longer takes z" in Patch(f"{here}._target", lambda o: o, "w", params=("z",)).check()
    assert "does not exist" in Patch(f"{here}._nothing", lambda o: o, "why").check()
    assert Patch(f"{here}._nothing", lambda o: o, "why", adds=True).check() is None
    assert "cannot be resolved" in Patch("no_such_mod_xyz.f", lambda o: o, "why").check()


def test_patch_install_records_and_alias_reaches_the_same_object():
    mod_a = types.ModuleType("fake_a")
    mod_a.f = _target
    mod_b = types.ModuleType("fake_b")
    mod_b.f = _target  # `from fake_a import f`
    registry = PatchRegistry()
    patcher = Patcher("test", registry)

    def wrap(original):
        def f(x, y=1):
            return original(x, y) * 10

        f.__wrapped__ = original
        return f

    import sys

    sys.modules["fake_a"], sys.modules["fake_b"] = mod_a, mod_b
    try:
        Patch("fake_a.f", wrap, "times ten").install(patcher)
        Patch("fake_b.f", alias_of("fake_a.f"), "the alias").install(patcher)
        assert mod_a.f is mod_b.f and mod_a.f(1) == 20
        assert [r.target for r in registry.records()] == ["fake_a.f", "fake_b.f"]
        mod_b.f = _target.__call__  # no longer the alias
        assert alias_of("fake_a.f", only_if_same=True)(mod_b.f) is SKIP
        patcher.restore()
        assert mod_a.f is _target
    finally:
        del sys.modules["fake_a"], sys.modules["fake_b"]


# -- verdicts -------------------------------------------------------------------------------------
class _Probe(Fix):
    name = "probe_test"
    title = "a fake fix for the verdict table"
    upstream_refs = ("test",)
    package = "megatron-core"

    def __init__(self, behaves, proven=None, points_ok=True, raises=False):
        super().__init__()
        self._behaves, self._raises = behaves, raises
        if proven is not None:
            self.proven = proven
        target = f"{__name__}._target" if points_ok else f"{__name__}._gone"
        self.patches = (Patch(target, lambda o: o, "why", params=("x",)),)

    def upstream_behaves(self):
        if self._raises:
            raise AttributeError("upstream moved something")
        return self._behaves


@pytest.mark.parametrize(
    "behaves, proven, points_ok, raises, expected",
    [
        (True, None, True, False, FixStatus.STANDS_ASIDE),
        (True, "==0.1.0", False, False, FixStatus.STANDS_ASIDE),  # behaves: nothing to check
        (False, None, True, False, FixStatus.ACTIVE),
        (False, "==0.1.0", True, False, FixStatus.ACTIVE),  # defect shown, points as expected
        (False, "==0.1.0", False, False, FixStatus.REFUSED),  # defect shown, points changed
        (None, None, True, False, FixStatus.ACTIVE),  # cannot tell on a proven version: active
        (None, "==0.1.0", True, False, FixStatus.REFUSED),  # cannot tell, not proven: refuse
        (None, None, True, True, FixStatus.ACTIVE),  # a probe that raises cannot tell
        (None, "==0.1.0", True, True, FixStatus.REFUSED),
    ],
)
def test_verdict_table(behaves, proven, points_ok, raises, expected):
    fix = _Probe(behaves, proven, points_ok, raises)
    status, reason = fix.decide()
    assert status is expected, reason
    if expected is FixStatus.REFUSED:
        with pytest.raises(UnsupportedUpstreamError, match=r"probe_test.*megatron/overlay/pins"):
            fix.apply()
        assert fix.records() == []


def test_group_parts_decide_alone():
    class Group(FixGroup):
        name, title, upstream_refs, package = "g", "group", ("t",), "megatron-core"
        parts = (_Probe(True), _Probe(False))

    group = Group()
    assert [p.decide()[0] for p in group.parts] == [FixStatus.STANDS_ASIDE, FixStatus.ACTIVE]
    assert group.decide()[0] is FixStatus.ACTIVE


# -- pins in one place ----------------------------------------------------------------------------
def test_pyproject_installs_the_releases_of_pins():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pinned = {}
    for d in deps:
        m = re.match(r"^([A-Za-z0-9_.-]+)==([0-9.]+)$", d.split(";")[0].strip())
        if m:
            pinned[m.group(1)] = m.group(2)
    for package, release in pins.RELEASES.items():
        assert pinned.get(package) == release, (package, pinned.get(package), release)
        assert pins.PROVEN[package][0].version == release


def test_no_version_specifier_outside_pins():
    """Fixes carry no version strings of their own: a ``==x.y.z`` literal in product code outside
    megatron/overlay/pins.py is a second source of pins."""
    offenders = []
    for path in (ROOT / "megatron").rglob("*.py"):
        if path.name == "pins.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if re.fullmatch(r"\s*[=<>~!]=\s*\d+\.\d+(\.\d+)?\s*", node.value):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, offenders


def test_no_probe_reads_upstream_source():
    """Probes decide by behaviour: no module of megatron/fixes calls inspect.getsource."""
    offenders = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "megatron" / "fixes").rglob("*.py")
        if "getsource" in p.read_text()
    ]
    assert not offenders, offenders


# -- layering -------------------------------------------------------------------------------------
def _imports(type_checking: bool = False):
    """(importing module, imported module, line) for every import of our packages, function-level
    imports included; ``if TYPE_CHECKING:`` blocks only when ``type_checking`` (they never run, but
    a type-only import still ties the two modules together)."""
    out = []
    for path in (ROOT / "megatron").rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        module = ".".join(parts)
        tree = ast.parse(path.read_text())
        typing_only = {
            id(n)
            for block in ast.walk(tree)
            if isinstance(block, ast.If) and getattr(block.test, "id", "") == "TYPE_CHECKING"
            for stmt in block.body
            for n in ast.walk(stmt)
        }
        for node in ast.walk(tree):
            if id(node) in typing_only and not type_checking:
                continue
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                if name.startswith("megatron.") and name.split(".")[1] in LAYERS:
                    out.append((module, name, node.lineno))
    return out


def test_no_import_goes_up_the_layers():
    up = [
        f"{src}:{line} imports {dst}"
        for src, dst, line in _imports()
        if LAYERS.index(dst.split(".")[1]) > LAYERS.index(src.split(".")[1])
    ]
    assert not up, up


def test_no_import_circle_between_packages():
    """No package-level circle: if a subpackage (``megatron.fixes.replication``) imports another
    (``megatron.fixes.modelopt_moe``), the second does not import the first; type-only imports
    (``if TYPE_CHECKING:``) count."""

    def package(mod):
        parts = mod.split(".")
        return ".".join(parts[:3]) if len(parts) > 2 else mod

    imports = _imports(type_checking=True)
    known = {package(src) for src, _, _ in imports}
    edges: dict[str, set[str]] = {}
    for src, dst, _ in imports:
        a = package(src)
        b = package(dst) if package(dst) in known else ".".join(dst.split(".")[:2])
        if a != b and not a.startswith(b + ".") and not b.startswith(a + "."):
            edges.setdefault(a, set()).add(b)
    circles = sorted(f"{a} <-> {b}" for a in edges for b in edges[a] if a in edges.get(b, ()))
    assert not circles, circles


def test_no_private_name_is_imported_across_our_modules():
    """Our packages use each other through public names (``__all__``, no leading underscore):
    no ``from megatron.<ours>... import _name`` (upstream's and torch's are not ours)."""
    found = []
    for path in (ROOT / "megatron").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.ImportFrom)
                and node.module
                and node.module.startswith("megatron.")
                and node.module.split(".")[1] in LAYERS
            ):
                found += [
                    f"{path.relative_to(ROOT)}:{node.lineno} imports {node.module}.{a.name}"
                    for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")
                ]
    assert not found, found


# -- one exception root ---------------------------------------------------------------------------
def _exception_classes():
    """(module, class name) of every public exception class defined in megatron/."""
    import importlib

    out = []
    for path in sorted((ROOT / "megatron").rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                bases = [ast.unparse(b) for b in node.bases]
                if any(b.endswith(("Error", "Exception", "Failures", "Exit")) for b in bases) or (
                    node.name.endswith(("Error", "Failures", "Unavailable"))
                ):
                    rel = path.relative_to(ROOT).with_suffix("")
                    parts = [p for p in rel.parts if p != "__init__"]
                    out.append((".".join(parts), node.name))
    classes = []
    for module, name in out:
        obj = getattr(importlib.import_module(module), name)
        if isinstance(obj, type) and issubclass(obj, BaseException):
            classes.append((module, obj))
    return classes


def test_every_exception_derives_from_the_root_and_is_documented():
    from megatron.overlay import OverlayError

    classes = _exception_classes()
    assert len(classes) >= 10
    rootless = [f"{m}.{c.__name__}" for m, c in classes if not issubclass(c, OverlayError)]
    assert not rootless, rootless
    doc = (ROOT / "docs" / "errors.md").read_text()
    missing = [f"{m}.{c.__name__}" for m, c in classes if f"`{c.__name__}`" not in doc]
    assert not missing, f"docs/errors.md does not list {missing}"
