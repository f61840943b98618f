"""``python -m megatron.fixes [--json] [--fixes-only]``: every fix's verdict on the installed
upstream (active, standing aside, refused, with the reason; a refusal does not stop the listing),
every component above the fixes as declared, and every upstream attribute this overlay replaces,
from the patch registry.

By default it installs what ``pretrain_gpt.py`` can install (the fixes; the CPU backend when no
CUDA device is present; the persistent tier, the validated local tier, the resume proof and the
loss log, as for ``--non-persistent-ckpt-type local --loss-log PATH``) and prints each fix, then
each component (when it is installed, after which others, whether it is installed now, and its
declared patches with the reason of each), then every replacement record with its owner and
reason; targets replaced more than once are flagged with their order. ``--json`` prints the
fixes' statuses, the components (name, title, installed_at, after, installed, patches) and one
object per replacement (target, replacement, owner, why, adds_attribute, depth).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from megatron.fixes import apply, fixes
from megatron.overlay import quiet
from megatron.overlay.component import INSTALLED_AT, Component, declared_components
from megatron.overlay.registry import REGISTRY

#: Entry-point group of what installs the components above the fixes (the CPU backend, the
#: training hooks) as ``pretrain_gpt.py`` would: each entry is a callable returning the names
#: installed. Declared in pyproject.toml, so this package imports nothing above it.
LISTING_GROUP = "megatron.overlay.listing"


def install_components() -> list[str]:
    """Install the components through the installers registered under :data:`LISTING_GROUP`
    (the CPU backend without a CUDA device, the persistent and local tiers, the resume proof, the
    loss log); returns the names installed.

    Raises:
        RuntimeError: no component is registered (the project is not installed: ``pip install
            -e .``, or ``scripts/setup.sh``), so the listing would silently miss them.
    """
    from importlib.metadata import entry_points

    found = sorted(entry_points(group=LISTING_GROUP), key=lambda ep: ep.name)
    if not found:
        raise RuntimeError(
            f"no {LISTING_GROUP} entry points: install the project (scripts/setup.sh, or "
            "pip install -e .) to list the CPU backend and the training hooks too, or pass "
            "--fixes-only"
        )
    installed: list[str] = []
    for ep in found:
        installed += ep.load()()
    return installed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megatron.fixes",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.add_argument(
        "--fixes-only",
        action="store_true",
        help="install and list the fixes only (no CPU backend, no training hooks, no components)",
    )
    opts = parser.parse_args(argv)
    quiet.hide_known_warnings(announce=False)  # the listing alone, not upstream's import notices
    logging.basicConfig(level=logging.WARNING)
    statuses = apply(strict=False)
    components: list[Component] = []
    if not opts.fixes_only:
        install_components()
        components = declared_components()
    if opts.json:
        print(json.dumps(_as_json(statuses, components), indent=1))
    else:
        _print_text(statuses, components)
    return 0


def _as_json(statuses: dict, components: list[Component]) -> dict:
    """The ``--json`` listing: ``fixes``, ``components`` and ``replacements``."""
    return {
        "fixes": [
            {
                "name": f.name,
                "title": f.title,
                "upstream": list(f.upstream_refs),
                "package": f.package,
                "supported": f.supported,
                "installed": f.installed_version(),
                "status": statuses[f.name].value,
                "reason": f.reason,
                "parts": [
                    {"name": p.name, "title": p.title, "status": p.status.value}
                    for p in getattr(f, "parts", ())
                ],
            }
            for f in fixes()
        ],
        "components": [c.describe() for c in components],
        "replacements": [r.as_dict() for r in REGISTRY.records()],
    }


def _print_text(statuses: dict, components: list[Component]) -> None:
    """The text listing: the fixes, the components, then every replacement record."""
    for fix in fixes():
        print(f"{fix.name}: {fix.title}")
        print(f"  upstream:  {', '.join(fix.upstream_refs)}")
        print(f"  proven on: {fix.package}{fix.supported} (installed: {fix.installed_version()})")
        print(
            f"  status:    {statuses[fix.name].value}" + (f" ({fix.reason})" if fix.reason else "")
        )
        for part in getattr(fix, "parts", ()):
            print(f"  - part {part.name}: {part.title} [{part.status.value}]")
        print()
    if components:
        print(f"{len(components)} components above the fixes (in install order, as declared):")
        for c in components:
            print(f"{c.name}: {c.title}")
            print(f"  installed at: {c.installed_at}: {INSTALLED_AT[c.installed_at]}")
            print(f"  after:        {', '.join(c.after) or '-'}")
            print(f"  now:          {'installed' if c.installed else 'not installed'}")
            print(f"  patches:      {len(c.patches)} declared")
            for spec in c.specs():
                print(f"  - {spec.target}: {spec.why}")
            print()
    records = REGISTRY.records()
    stacked = REGISTRY.stacked()
    print(f"{len(records)} replacements of upstream attributes (owner: target -> replacement):")
    for r in records:
        flags = [f"stacked {r.depth}/{len(stacked[r.target])}"] if r.target in stacked else []
        if r.adds_attribute:
            flags.append("adds the attribute")
        print(f"- [{r.owner}] {r.target}" + (f"  ({'; '.join(flags)})" if flags else ""))
        print(f"      with: {r.replacement}")
        print(f"       why: {r.why}")


if __name__ == "__main__":
    sys.exit(main())
