#!/usr/bin/env bash
# System services the functional tests need beyond the Python environment: a single-node SLURM
# (Debian/Ubuntu packages `slurm-wlm` and `munge`), used by tests/functional_tests/test_slurm.py.
#
#   scripts/setup_test_services.sh        # installs what is missing (needs root or sudo + apt-get)
#   scripts/setup_test_services.sh --check  # only reports; exit 1 if something is missing
#
# Idempotent: with everything installed it only runs `command -v` (well under a second).
# Nothing is started or configured system-wide: the test harness
# (tests/helpers/slurm_harness.py) runs munged/slurmctld/slurmd itself, as its own child
# processes, with a private key, socket, config and scratch directories, on 127.0.0.1 only.
# Where the packages cannot be installed (no apt-get, no root, no network) this script says so and
# exits 0, and test_slurm.py skips with the reason; set SETUP_TEST_SERVICES_STRICT=1 to make that
# an error instead.
set -uo pipefail

need=()
command -v slurmctld >/dev/null 2>&1 && command -v slurmd >/dev/null 2>&1 \
  && command -v sbatch >/dev/null 2>&1 || need+=(slurm-wlm)
command -v munged >/dev/null 2>&1 || need+=(munge)

if [ ${#need[@]} -eq 0 ]; then
  echo "setup_test_services: slurm-wlm and munge present"
  exit 0
fi
if [ "${1:-}" = "--check" ]; then
  echo "setup_test_services: missing: ${need[*]}"
  exit 1
fi

fail() {
  echo "setup_test_services: cannot install ${need[*]}: $1 (test_slurm.py will be skipped)" >&2
  [ "${SETUP_TEST_SERVICES_STRICT:-0}" = "1" ] && exit 1
  exit 0
}

command -v apt-get >/dev/null 2>&1 || fail "apt-get not found (not a Debian/Ubuntu system)"
sudo=()
if [ "$(id -u)" != "0" ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then sudo=(sudo -n); else fail "not root and no passwordless sudo"; fi
fi
export DEBIAN_FRONTEND=noninteractive
echo "setup_test_services: installing ${need[*]}"
# The package lists may be missing or stale in a fresh container: update once, then install.
if ! "${sudo[@]}" apt-get install -y --no-install-recommends "${need[@]}" >/tmp/setup_test_services.log 2>&1; then
  "${sudo[@]}" apt-get update >>/tmp/setup_test_services.log 2>&1 || fail "apt-get update failed (see /tmp/setup_test_services.log)"
  "${sudo[@]}" apt-get install -y --no-install-recommends "${need[@]}" >>/tmp/setup_test_services.log 2>&1 \
    || fail "apt-get install failed (see /tmp/setup_test_services.log)"
fi
command -v slurmctld >/dev/null 2>&1 && command -v munged >/dev/null 2>&1 \
  || fail "packages installed but slurmctld/munged not on PATH"
echo "setup_test_services: ready ($(slurmctld -V 2>/dev/null), munge $(munged -V 2>/dev/null | head -1))"
