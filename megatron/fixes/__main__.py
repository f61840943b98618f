"""``python -m megatron.fixes``: apply the fixes and print what each one is and does."""

import logging
import sys

from megatron.fixes import apply, fixes


def main() -> int:
    logging.basicConfig(level=logging.WARNING)
    statuses = apply()
    for fix in fixes():
        print(f"{fix.name}: {fix.title}")
        print(f"  upstream:  {', '.join(fix.upstream_refs)}")
        print(f"  targets:   {fix.package}{fix.supported} (installed: {fix.installed_version()})")
        print(f"  status:    {statuses[fix.name].value}" + (f" ({fix.reason})" if fix.reason else ""))
        for p in fix.patches:
            print(f"  replaces:  {p.target}")
            print(f"       with: {p.replacement}")
            print(f"        why: {p.why}")
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
