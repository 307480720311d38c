#!/usr/bin/env bash
# cuda_ipc normal mode on a 2-GPU machine (device kind nvidia-h200-x2), from a build carried there:
# the GPU tests of tests/gpu/cuda_ipc_normal_test.cpp, then bench_gpu_normal_mode.
#
#   bench/gpu_normal_mode.sh            # EPMOE_GPU_BUILD (default build/h-ipc) must hold tests/test_gpu and
#                                       # bench/bench_gpu_normal_mode; <build>/carried-lib goes on LD_LIBRARY_PATH
# Writes logs and the benchmark JSON to $OUT (or ./gpu-results). EPMOE_TIMEOUT_S (default here 20 s) bounds
# every host and device wait, so a protocol bug costs seconds, not the 100 s default.
set -u -o pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
BUILD="${EPMOE_GPU_BUILD:-build/h-ipc}"
RESULTS="${OUT:-$ROOT/gpu-results}"
mkdir -p "$RESULTS"
# NVLink multicast stays off on shared machines (KINDS.md); epmoe never uses it, this guards the libraries.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export EPMOE_TIMEOUT_S="${EPMOE_TIMEOUT_S:-20}"
LIBS="$ROOT/$BUILD/carried-lib"
for d in /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/local/cuda/targets/x86_64-linux/lib; do
  [ -d "$d" ] && LIBS="$LIBS:$d"
done
# cuBLAS (linked by the experts stage) is too large to carry: take the machine's.
CUBLAS="$(python3 -c 'import nvidia.cublas as m, os; print(os.path.join(list(m.__path__)[0], "lib"))' 2>/dev/null)"
[ -n "$CUBLAS" ] && LIBS="$LIBS:$CUBLAS"
if ! LD_LIBRARY_PATH="$LIBS" ldd "$BUILD/tests/test_gpu" | grep -q 'libcublasLt.so.13 => /'; then
  found="$(timeout 20 find /usr /opt -name 'libcublasLt.so.13*' 2>/dev/null | head -1)"
  [ -n "$found" ] && LIBS="$LIBS:$(dirname "$found")"
fi
export LD_LIBRARY_PATH="$LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
nvidia-smi topo -m 2>/dev/null | head -5
ldd "$BUILD/tests/test_gpu" "$BUILD/bench/bench_gpu_normal_mode" | grep 'not found'
STATUS=0
timeout --kill-after=5 "${EPMOE_IPC_TEST_LIMIT:-170}" "$BUILD/tests/test_gpu" --gtest_filter='GpuCudaIpc*' \
  >"$RESULTS/test_cuda_ipc.log" 2>&1 || STATUS=1
grep -E '^\[ +(OK|FAILED|PASSED|SKIPPED) +\]|Failure|Expected|Which is|seed|rank [0-9]|what\(\)' "$RESULTS/test_cuda_ipc.log" |
  head -60
tail -3 "$RESULTS/test_cuda_ipc.log"
timeout --kill-after=5 "${EPMOE_IPC_BENCH_LIMIT:-90}" "$BUILD/bench/bench_gpu_normal_mode" --runs 50 \
  --json "$RESULTS/bench_gpu_normal_mode.json" >"$RESULTS/bench_gpu_normal_mode.log" 2>&1 || STATUS=1
tail -12 "$RESULTS/bench_gpu_normal_mode.log"
exit $STATUS
