#!/usr/bin/env bash
# Single-GPU checks (< 8 minutes on one GPU): the entrypoint's resume tests on CUDA, the GPU unit
# tests (pmix64 on CUDA equal to the CPU value for every dtype; replication hashing on the GPU
# without host copies for checksums), then the CUDA replication benchmark (hash throughput vs a
# device-to-device copy; replicate over a one-rank NCCL group). Needs the environment of
# scripts/setup.sh, or an NGC container with the fork installed (README, "GPUs").
#   scripts/gpu_check.sh            # tests, then the benchmark
#   scripts/gpu_check.sh -k resume  # extra arguments go to pytest; BENCH=0 skips the benchmark
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" MEGATRON_TEST_DEVICE=cuda
"$py" -c 'import torch; assert torch.cuda.is_available(), "gpu_check: no CUDA device visible"'
"$py" -m pytest tests/functional_tests/test_gpu.py tests/unit_tests/integrity/test_checksum_device.py \
  tests/unit_tests/fixes/test_replication_cuda.py -m gpu -p no:cacheprovider -q "$@"
if [ "${BENCH:-1}" != 0 ]; then
  "$py" tools/bench_replication.py --device cuda --size-mb 256 --reps 5 --hash-sizes 1,16,256,1024
fi
