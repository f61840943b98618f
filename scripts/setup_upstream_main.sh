#!/usr/bin/env bash
# The compatibility lane's environment: .venv-upstream-main, which is ./.venv with megatron-core
# replaced by the build of upstream main in ../shared/upstream/ (see its README).
#
#   scripts/setup_upstream_main.sh                  # creates or refreshes .venv-upstream-main
#   UPSTREAM_WHEEL=/path/megatron_core-...whl scripts/setup_upstream_main.sh
#
# Layered, not copied: a fresh venv whose site-packages come first and hold only upstream main's
# megatron-core; a .pth line adds .venv's site-packages (every other pin, and this project's
# editable install) after it. Seconds instead of a second full install; .venv is never modified
# (pip runs with --ignore-installed, so it does not uninstall 0.19.2 from .venv).
# Exits 3 (after a message) when the wheel is not there: scripts/test.sh then skips the lane.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
BASE=${BASE_VENV:-$here/.venv}
VENV=${VENV:-$here/.venv-upstream-main}
wheel=${UPSTREAM_WHEEL:-$(ls "$here"/../shared/upstream/megatron_core-*.whl 2>/dev/null | head -1 || true)}
if [ -z "$wheel" ] || [ ! -f "$wheel" ]; then
  echo "setup_upstream_main: no megatron-core wheel of upstream main (../shared/upstream/ or \$UPSTREAM_WHEEL)" >&2
  exit 3
fi
stamp=$( { sha256sum "$wheel" | cut -d' ' -f1; echo "$BASE"; } | sha256sum | cut -d' ' -f1)
if [ -x "$VENV/bin/python" ] && [ "$(cat "$VENV/.megatron-setup-stamp" 2>/dev/null)" = "$stamp" ]; then
  echo "setup_upstream_main: $VENV is up to date"
  exit 0
fi
rm -rf "$VENV"
"$BASE/bin/python" -c 'import sys; print(sys.base_prefix)' >/dev/null
py=$("$BASE/bin/python" -c 'import sys, os; print(os.path.join(sys.base_prefix, "bin", "python3"))')
"$py" -m venv "$VENV"
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
base_site=$("$BASE/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "import site; site.addsitedir('$base_site')" > "$site/_megatron_base_venv.pth"
"$VENV/bin/python" -m pip --disable-pip-version-check -q install --no-deps --ignore-installed "$wheel"
# console scripts of the base (ruff, torchrun, ft_launcher) run with this interpreter
for tool in torchrun ft_launcher; do
  if [ -x "$BASE/bin/$tool" ]; then
    sed "1s|.*|#!$VENV/bin/python|" "$BASE/bin/$tool" > "$VENV/bin/$tool" && chmod +x "$VENV/bin/$tool"
  fi
done
echo "$stamp" > "$VENV/.megatron-setup-stamp"
echo "setup_upstream_main: ready: $VENV ($("$VENV/bin/python" -c 'import importlib.metadata as m; print(", ".join(f"{p} {m.version(p)}" for p in ("torch", "megatron-core", "nvidia-resiliency-ext", "nvidia-modelopt")))' 2>/dev/null))"
