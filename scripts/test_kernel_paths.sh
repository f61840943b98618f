#!/usr/bin/env bash
# Runs the tests once per CPU kernel path, to find comparisons whose tolerance holds on one
# machine's BLAS and ATen kernels only (docs/tests.md, "Kernel paths"):
#   scripts/test_kernel_paths.sh                      # the whole default lane, twice
#   scripts/test_kernel_paths.sh -k quantize          # arguments go to scripts/test.sh
#   KERNEL_PATHS="avx512 avx2 sse42" scripts/test_kernel_paths.sh tests/functional_tests/...
# Paths: avx512 (MKL's and ATen's AVX-512 kernels: the default on an AVX-512 host), avx2 (both at
# AVX2, as on an AVX2-only host), sse42 (MKL at SSE4.2, ATen's scalar kernels). MKL and ATen read
# MKL_ENABLE_INSTRUCTIONS and ATEN_CPU_CAPABILITY at start, and so do the ranks launched by the
# tests (they inherit the environment). A path above what the CPU has runs at the CPU's best.
set -uo pipefail
cd "$(dirname "$0")/.."
declare -A env_of=(
  [avx512]="MKL_ENABLE_INSTRUCTIONS=AVX512 ATEN_CPU_CAPABILITY=avx512"
  [avx2]="MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2"
  [sse42]="MKL_ENABLE_INSTRUCTIONS=SSE4_2 ATEN_CPU_CAPABILITY=default"
)
summary=()
rc=0
for path in ${KERNEL_PATHS:-avx512 avx2}; do
  [ -n "${env_of[$path]:-}" ] || { echo "test_kernel_paths: unknown path '$path' (avx512, avx2, sse42)" >&2; exit 2; }
  echo "=== kernel path $path: ${env_of[$path]}"
  start=$(date +%s)
  env ${env_of[$path]} scripts/test.sh "$@"
  code=$?
  [ "$code" = 0 ] || rc=1
  summary+=("$path (${env_of[$path]}): exit $code in $(( $(date +%s) - start )) s")
done
printf 'kernel paths: %s\n' "${summary[@]}"
exit "$rc"
