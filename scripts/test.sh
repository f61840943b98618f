#!/usr/bin/env bash
# The project's test command (README "Tests"; .ci/run calls exactly this).
#   scripts/test.sh                 # set up .venv if needed, then unit + functional tests (CPU)
#   scripts/test.sh -k replication  # extra arguments go to pytest
# GPU tests run when a CUDA device is present (MEGATRON_TEST_DEVICE=cuda for the functional lane);
# cluster-only tests (Transformer Engine, >= 2 GPUs) are skipped here.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/setup_test_services.sh || true   # single-node SLURM for test_slurm.py (skipped if it cannot install)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec .venv/bin/python -m pytest tests -m "not cluster" -p no:cacheprovider "$@"
