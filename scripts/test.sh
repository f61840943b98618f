#!/usr/bin/env bash
# The project's test command (README "Tests"; .ci/run calls exactly this).
#   scripts/test.sh                 # set up .venv if needed, then unit + functional tests (CPU)
#   scripts/test.sh --quick         # fast lane: unit tests + one pretrain_gpt.py smoke run (< 3 min)
#   scripts/test.sh -k replication  # extra arguments go to pytest (test paths replace tests/)
#   scripts/test.sh -m sweep tests/functional_tests/test_crash_points.py   # the full crash-point
#                                   # sweep (marker sweep, in no lane by default; ~40 min)
# Integration tests (marker integration: the container install step in a fresh venv, a local SLURM
# cluster) run only with MEGATRON_INTEGRATION_TESTS=1; CI leaves them out for time. With them, the
# lane first runs scripts/setup_test_services.sh, which installs the Debian packages slurm-wlm and
# munge with apt-get (as root; nothing is started or configured system-wide) for
# tests/functional_tests/test_slurm.py. MEGATRON_SKIP_TEST_SERVICES=1 skips that step (test_slurm.py
# then skips unless SLURM is already installed); --quick never runs it.
# Both lanes run `ruff check` and `ruff format --check` first (pyproject.toml [tool.ruff]).
# The default lane then runs the compatibility lane: the unit tests and the functional tests
# marked `compat` again on megatron-core built from upstream main (scripts/setup_upstream_main.sh,
# from ../shared/upstream/); skipped, with a line saying so, when that wheel is absent.
# MEGATRON_SKIP_COMPAT=1 leaves it out; scripts/test.sh --compat runs only it.
# GPU tests run when a CUDA device is present (MEGATRON_TEST_DEVICE=cuda for the functional lane);
# cluster-only tests (Transformer Engine, >= 2 GPUs) are skipped here.
set -euo pipefail
cd "$(dirname "$0")/.."
quick=0
compat_only=0
if [ "${1:-}" = "--quick" ]; then quick=1; shift; fi
if [ "${1:-}" = "--compat" ]; then compat_only=1; shift; fi
# test paths given (scripts/test.sh tests/unit_tests/integrity): run those instead of tests/
where=tests
for a in "$@"; do
  case "$a" in -*) ;; *) if [ -e "${a%%::*}" ]; then where=; fi ;; esac
done
scripts/setup.sh
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# style first (seconds): ruff lint and format check, configured in pyproject.toml
.venv/bin/ruff check .
.venv/bin/ruff format --check .
if [ "$quick" = 1 ]; then
  # unit tests that launch nothing, plus the README's "Using it" CPU command (one 2-rank launch)
  exec .venv/bin/python -m pytest tests/unit_tests tests/functional_tests/test_readme_commands.py \
    -m "not cluster and (not slow or quick)" -p no:cacheprovider "$@"
fi
# MEGATRON_TEST_WORKERS=N: N pytest-xdist workers, one test file per worker at a time (module
# fixtures stay in one process), for machines with cores to spare; default 0 (serial): on the
# 2-core machine two workers took 15:11 once and 19:38 once for a default lane of 16:23 serial
# (docs/tests.md).
workers=(-n "${MEGATRON_TEST_WORKERS:-0}" --dist loadfile)
compat_lane() {
  # the same tests on upstream main: unit tests that launch nothing, and functional tests marked
  # compat (tests an upstream defect breaks there are strict xfails: marker upstream_defect)
  local rc=0
  scripts/setup_upstream_main.sh || rc=$?
  if [ "$rc" = 3 ]; then
    echo "compatibility lane: SKIPPED (no megatron-core wheel of upstream main in ../shared/upstream/)"
    return 0
  fi
  [ "$rc" = 0 ] || return "$rc"
  echo "compatibility lane: $(.venv-upstream-main/bin/python -c 'import importlib.metadata as m; print("megatron-core", m.version("megatron-core"))' 2>/dev/null) (upstream main)"
  .venv-upstream-main/bin/python -m pytest tests/unit_tests tests/functional_tests \
    -m "not cluster and not integration and not sweep and ((not slow) or compat)" -p no:cacheprovider \
    "${workers[@]}" "$@"
}
if [ "$compat_only" = 1 ]; then
  compat_lane "$@"
  exit $?
fi
if [ "${MEGATRON_INTEGRATION_TESTS:-0}" != 1 ]; then
  # default (CI): without the integration tests (container install step, local SLURM cluster)
  rc=0
  .venv/bin/python -m pytest $where -m "not cluster and not integration and not sweep" -p no:cacheprovider \
    "${workers[@]}" "$@" || rc=$?
  if [ "$rc" = 0 ] && [ -n "$where" ] && [ "${MEGATRON_SKIP_COMPAT:-0}" != 1 ]; then
    compat_lane "$@" || rc=$?
  fi
  exit "$rc"
fi
if [ "${MEGATRON_SKIP_TEST_SERVICES:-0}" != 1 ]; then
  scripts/setup_test_services.sh || true   # single-node SLURM for test_slurm.py (skipped if it cannot install)
fi
exec .venv/bin/python -m pytest $where -m "not cluster and not sweep" -p no:cacheprovider "$@"
