#!/usr/bin/env bash
# The normal-mode A/B on a 2-GPU machine (device kind nvidia-h200-x2), in one call: the copy-engine default against
# the zero-copy dispatch (--recv-slots 2) at 16/24/32/48/64 blocks and the SM-store combine push, then real OLMoE
# routing and K = 2 for the default and zero-copy at 48 blocks, and a trace of the zero-copy path. Every run is
# bench_gpu_normal_mode (median of 50 after warm-up, floors in the same run); the most important runs come first,
# so a run cut short by the device's time limit still returns them.
#
#   bench/gpu_normal_mode_ab.sh     # EPMOE_GPU_BUILD (default build/release) must hold bench/bench_gpu_normal_mode;
#                                   # <build>/carried-lib goes on LD_LIBRARY_PATH
# Writes one .txt and .json per run to $OUT (or ./gpu-results) and prints each run's table rows.
set -u -o pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
BUILD="${EPMOE_GPU_BUILD:-build/release}"
O="${OUT:-$ROOT/gpu-results}"
mkdir -p "$O"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export EPMOE_TIMEOUT_S="${EPMOE_TIMEOUT_S:-20}"
[ -d "$BUILD/carried-lib" ] && export LD_LIBRARY_PATH="$ROOT/$BUILD/carried-lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
NB="$BUILD/bench/bench_gpu_normal_mode"
[ -x "$NB" ] || { echo "no $NB (build the bench_gpu_normal_mode target)"; exit 1; }
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee "$O/device.txt"
run() {  # run TAG [ENV=VALUE ...] -- ARGS...: one benchmark run, its rows printed
  local tag="$1"
  shift
  local envs=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  env "${envs[@]}" timeout 90 "$NB" --runs 50 "$@" --json "$O/$tag.json" >"$O/$tag.txt" 2>&1
  echo "== $tag (exit $?)"
  grep -E '^peer copy|^\| (dispatch|combine)' "$O/$tag.txt"
}
run default -- 
run zero_copy_48 -- --recv-slots 2 --sms 48
run zero_copy_32 -- --recv-slots 2 --sms 32
run zero_copy_24 -- --recv-slots 2 --sms 24
run zero_copy_16 -- --recv-slots 2 --sms 16
run zero_copy_64 -- --recv-slots 2 --sms 64  # SM stores over NVLink may want more SMs than the copy engines
run sm_push_24 EPMOE_CUDA_IPC_COMBINE_PUSH=sm --
run sm_push_zero_copy_48 EPMOE_CUDA_IPC_COMBINE_PUSH=sm -- --recv-slots 2 --sms 48
run olmoe_zero_copy_48 -- --recv-slots 2 --sms 48 --routing tests/data/olmoe-routing
run k2_zero_copy_48 -- --recv-slots 2 --sms 48 --topk 2
run olmoe_default -- --routing tests/data/olmoe-routing
run k2_default -- --topk 2
run trace_zero_copy_48 EPMOE_CUDA_IPC_TRACE=1 -- --recv-slots 2 --sms 48
grep 'trace' "$O/trace_zero_copy_48.txt"
