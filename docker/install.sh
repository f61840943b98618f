#!/usr/bin/env bash
# The container recipe's install step: this fork and its pinned upstream stack into an environment
# that already holds torch (an NGC PyTorch image: torch, Transformer Engine, apex), without
# replacing anything the environment has. docker/Dockerfile runs it; so does
# tests/functional_tests/test_container_recipe.py, in a clean environment standing in for the image.
#
#   docker/install.sh [REPO]      REPO: this repository (default: the one this script is in)
#   PYTHON=/path/to/python docker/install.sh     the environment's interpreter (default: python)
#
# Every package comes from docker/requirements.txt and is installed with `pip install --no-deps`
# (pip never resolves, so it never upgrades or replaces torch, TE or apex); the fork itself too.
# Then it checks, and fails with the reason otherwise:
#   * torch is the one the environment had (same version, same location);
#   * the installed torch satisfies the torch requirement of every package installed here
#     (nvidia-modelopt 0.47.0: torch>=2.8; a torch 2.8.0a0 pre-release does not), and every
#     requirement the pinned stack declares holds where the package is installed (e.g. pulp<4.0);
#     the same for the listed packages' own requirements is reported as a warning;
#   * megatron.fixes.apply() succeeds, and `ft_launcher --help` starts.
# Requirements that are declared but not installed are listed (not an error):
# docker/requirements.txt installs only what the code imports on the paths this fork uses.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "${1:-$here/..}" && pwd)
py=${PYTHON:-python}
pip=("$py" -m pip --disable-pip-version-check)
reqs=$here/requirements.txt

"$py" -c 'import sys; assert sys.version_info[:2] == (3, 12), f"install: Python 3.12 needed (megatron-core >= 0.17), this environment has {sys.version.split()[0]}"'
torch_before=$("$py" -c 'import torch; print(torch.__version__, torch.__file__)') \
  || { echo "install: this environment has no importable torch; the recipe keeps the image's torch and installs none" >&2; exit 1; }
echo "install: keeping torch $torch_before"

# NVRx 0.7.0 is published only for manylinux_2_39 (glibc 2.39: NGC images on Ubuntu 24.04 have it).
# Its one compiled module needs glibc 2.32 only, so on an older glibc the wheel is downloaded for
# the 2.39 platform and retagged manylinux_2_28 (the `wheel` tool runs from the download directory,
# it is not installed).
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
nvrx=$(sed -n 's/^\(nvidia-resiliency-ext==[^ #]*\).*/\1/p' "$reqs")
grep -v '^nvidia-resiliency-ext==' "$reqs" > "$tmp/requirements.txt"
if "$py" -c 'import sys; from packaging.tags import sys_tags; sys.exit(0 if any(t.platform == "manylinux_2_39_x86_64" for t in sys_tags()) else 1)' 2>/dev/null \
   || [ "$(uname -m)" != x86_64 ]; then
  echo "$nvrx" >> "$tmp/requirements.txt"
else
  "${pip[@]}" download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --platform manylinux_2_39_x86_64 -d "$tmp/nvrx" "$nvrx"
  "${pip[@]}" download -q --no-deps --only-binary=:all: -d "$tmp/tools" wheel
  PYTHONPATH=$(ls "$tmp"/tools/wheel-*.whl) "$py" -m wheel tags --remove \
      --platform-tag manylinux_2_28_x86_64 "$tmp"/nvrx/nvidia_resiliency_ext-*.whl >/dev/null
  ls "$tmp"/nvrx/nvidia_resiliency_ext-*manylinux_2_28*.whl >> "$tmp/requirements.txt"
  echo "install: glibc < 2.39: NVRx wheel retagged manylinux_2_28"
fi

"${pip[@]}" install -q --no-deps -r "$tmp/requirements.txt"
"${pip[@]}" install -q --no-deps "$repo"

"$py" - "$torch_before" "$reqs" <<'PY'
import importlib.metadata as md
import re
import sys

import torch
from packaging.requirements import Requirement
from packaging.version import Version

before, reqs = sys.argv[1], sys.argv[2]
now = f"{torch.__version__} {torch.__file__}"
if now != before:
    sys.exit(f"install: torch changed: {before} -> {now}")
listed = [re.split(r"[=<>!~ ;#\[]", line.strip(), maxsplit=1)[0]
          for line in open(reqs) if line.strip() and not line.lstrip().startswith("#")]
stack = ["megatron-core", "nvidia-resiliency-ext", "nvidia-modelopt", "megatron-fsdp", "megatron-lm-fixed"]
torch_version = Version(torch.__version__)
errors, warnings, missing = [], [], []
for name in stack + [n for n in listed if n not in stack]:
    for spec in md.requires(name) or []:
        req = Requirement(spec)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # an optional extra
        try:
            have = Version(md.version(req.name))
        except md.PackageNotFoundError:
            missing.append(f"{req.name} (for {name})")
            continue
        if not req.specifier.contains(have, prereleases=True):
            what = f"{name} needs {req.name}{req.specifier}, installed: {have}"
            # the pinned stack's own requirements must hold; deeper ones are reported
            (errors if name in stack or req.name == "torch" else warnings).append(what)
for w in warnings:
    print(f"install: warning: {w}")
if missing:
    print("install: declared but not installed (not imported on this fork's paths): "
          + ", ".join(sorted(set(missing))))
if errors:
    sys.exit("install: " + "; ".join(errors) + ". For torch: use a base image with a newer torch "
             "(BASE_IMAGE in docker/Dockerfile); otherwise adjust docker/requirements.txt.")
print(f"install: torch {torch.__version__} satisfies every installed package's torch requirement")
PY
"$py" -c 'import megatron.fixes as f; s = f.apply(); print("install: fixes:", ", ".join(f"{k} {v.name.lower()}" for k, v in s.items()))' 2>/dev/null
ft=$(dirname "$(command -v "$py")")/ft_launcher
[ -x "$ft" ] || ft=ft_launcher
"$ft" --help >/dev/null
echo "install: ready (torch $torch_before kept; $(cd "$tmp" && "$py" -c 'import importlib.metadata as m; print(", ".join(f"{p} {m.version(p)}" for p in ("megatron-core", "nvidia-resiliency-ext", "nvidia-modelopt", "megatron-fsdp", "megatron-lm-fixed")))'))"
