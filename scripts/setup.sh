#!/usr/bin/env bash
# Creates (or refreshes) the project's virtual environment with the pinned upstream stack.
#
#   scripts/setup.sh            # runtime + test dependencies into ./.venv
#   VENV=/path scripts/setup.sh # another location
#   PYTHON=/usr/bin/python3.12 scripts/setup.sh
#
# Idempotent: a second run with everything in place returns in well under a second (a stamp of
# pyproject.toml and the NVRx pin in $VENV/.megatron-setup-stamp; edit either and pip runs again).
# On a cluster, inside an NGC PyTorch container, do NOT run this script: see README
# ("Container image": docker/Dockerfile), which keeps the container's torch, TE and apex.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
VENV=${VENV:-$here/.venv}
NVRX_VERSION=0.7.0

find_python() {
  if [ -n "${PYTHON:-}" ]; then echo "$PYTHON"; return; fi
  for c in python3.12 "$HOME/.pyenv/versions/3.12"*/bin/python3.12 /usr/bin/python3.12 /usr/local/bin/python3.12; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; assert sys.version_info[:2]==(3,12)' 2>/dev/null; then
      command -v "$c"; return
    fi
  done
  echo "setup: Python 3.12 not found (megatron-core >= 0.17 needs it); set PYTHON=/path/to/python3.12" >&2
  exit 1
}

# Nothing to do when the environment was set up from exactly this pyproject.toml (and NVRx pin) and
# the project is still installed: compare a stamp instead of re-running pip (~30 s).
stamp_file=$VENV/.megatron-setup-stamp
stamp=$( { cat "$here/pyproject.toml"; echo "nvrx=$NVRX_VERSION"; } | sha256sum | cut -d' ' -f1)
if [ -x "$VENV/bin/python" ] && [ "$(cat "$stamp_file" 2>/dev/null)" = "$stamp" ] \
   && "$VENV/bin/python" -c "import importlib.metadata as m; m.version('megatron-lm-fixed'); assert m.version('nvidia-resiliency-ext')=='$NVRX_VERSION'" 2>/dev/null; then
  echo "setup: $VENV is up to date (pyproject.toml and the NVRx pin unchanged since its setup)"
  exit 0
fi
rm -f "$stamp_file"

if [ ! -x "$VENV/bin/python" ]; then
  py=$(find_python)
  echo "setup: creating $VENV with $py"
  "$py" -m venv "$VENV"
fi
pip=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${pip[@]}" install --upgrade "pip>=24" wheel

# NVRx 0.5.0-0.7.0 are published only as manylinux_2_39 wheels, but the one compiled module
# needs only glibc 2.32; pip refuses the tag on older glibc (Debian 12 has 2.36), so download
# the wheel for the 2.39 platform and retag it for manylinux_2_28 before installing.
nvrx=()
if ! "$VENV/bin/python" -c "import importlib.metadata as m; assert m.version('nvidia-resiliency-ext')=='$NVRX_VERSION'" 2>/dev/null; then
  tmp=$(mktemp -d)
  "${pip[@]}" download --no-deps --only-binary=:all: --python-version 3.12 \
      --platform manylinux_2_39_x86_64 -d "$tmp" "nvidia-resiliency-ext==$NVRX_VERSION"
  whl=$(ls "$tmp"/nvidia_resiliency_ext-*.whl)
  if ! "$VENV/bin/python" -c 'import sys; from packaging.tags import sys_tags; sys.exit(0 if any(t.platform=="manylinux_2_39_x86_64" for t in sys_tags()) else 1)' 2>/dev/null; then
    "$VENV/bin/python" -m wheel tags --remove --platform-tag manylinux_2_28_x86_64 "$whl" >/dev/null
    whl=$(ls "$tmp"/nvidia_resiliency_ext-*manylinux_2_28*.whl)
  fi
  nvrx=("$whl")
fi

# The project and its pins (pyproject.toml, one resolver run); [test] adds pytest.
"${pip[@]}" install -e "$here[test]" ${nvrx[@]+"${nvrx[@]}"}
[ -n "${tmp:-}" ] && rm -rf "$tmp"
echo "$stamp" > "$stamp_file"
echo "setup: ready: $VENV ($("$VENV/bin/python" -c 'import importlib.metadata as m; print(", ".join(f"{p} {m.version(p)}" for p in ("torch", "megatron-core", "nvidia-resiliency-ext", "nvidia-modelopt")))'))"
