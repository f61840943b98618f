#!/usr/bin/env bash
# Single-GPU checks (< 8 minutes on one GPU): the entrypoint's resume tests on CUDA, plus the unit
# tests, with the GPU visible. Needs the environment of scripts/setup.sh, or an NGC container with
# the fork installed (README, "GPUs").
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" MEGATRON_TEST_DEVICE=cuda
"$py" -c 'import torch; assert torch.cuda.is_available(), "gpu_check: no CUDA device visible"'
exec "$py" -m pytest tests/functional_tests/test_gpu.py -m gpu -p no:cacheprovider -q "$@"
