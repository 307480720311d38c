# Parts `tests` and `ipc` of scripts/gpu_check.sh (sourced; see common.sh for step and part_begin).

# tests: every GPU test binary (test_gpu: router, layout, permute, quant, experts, MoE layer, cuda_ipc both modes)
# in full, then the cuda_ipc MPI tests: one process per GPU, or two processes sharing a lone GPU (the protocol,
# not the speed). EPMOE_GPU_TEST_FILTER (a --gtest_filter, e.g. '*LowLatency*') runs a subset of test_gpu, and
# EPMOE_GPU_TEST_QUICK=1 its small sizes: a change's own suites beside other parts in one call.
part_tests() {
  part_begin tests 570
  ensure_built test_gpu:tests/test_gpu test_mpi:tests/mpi/test_mpi || { fail build "binaries missing"; return; }
  local t tests=()
  mapfile -t tests < <(ls "$BUILD"/tests/test_gpu* 2>/dev/null)
  report_missing_libraries "${tests[@]}" "$BUILD/tests/mpi/test_mpi"
  for t in "${tests[@]}"; do
    step "$(basename "$t")${EPMOE_GPU_TEST_FILTER:+ ($EPMOE_GPU_TEST_FILTER)}" 420 "$t" \
      --gtest_filter="${EPMOE_GPU_TEST_FILTER:-*}" --gtest_output="xml:$RESULTS/$(basename "$t").xml"
  done
  local ngpu
  ngpu="$(gpu_count)"
  if ! command -v mpirun >/dev/null || [ ! -x "$BUILD/tests/mpi/test_mpi" ]; then
    skip "test_mpi cuda_ipc" "no mpirun or no tests/mpi/test_mpi"
  elif [ "${ngpu:-0}" -ge 2 ]; then
    step "test_mpi cuda_ipc, $ngpu processes" 180 env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
      mpirun -np "$ngpu" --oversubscribe "$BUILD/tests/mpi/test_mpi" --gtest_filter='MpiCudaIpc*'
  elif [ "${ngpu:-0}" -eq 1 ]; then
    step "test_mpi cuda_ipc, 2 processes sharing one GPU" 180 env OMPI_ALLOW_RUN_AS_ROOT=1 \
      OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 EPMOE_TEST_SHARE_GPU=1 mpirun -np 2 -x EPMOE_TEST_SHARE_GPU --oversubscribe \
      "$BUILD/tests/mpi/test_mpi" --gtest_filter='MpiCudaIpc*'
  else
    skip "test_mpi cuda_ipc" "no GPU"
  fi
}

# ipc: the quick check of the cuda_ipc backend on 2 or more GPUs: its tests (both modes), then bench_gpu_normal_mode
# (median of 50). EPMOE_TIMEOUT_S (default here 20 s) bounds every host and device wait, so a protocol bug costs
# seconds, not the 100 s default.
part_ipc() {
  part_begin ipc 570
  ensure_built test_gpu:tests/test_gpu bench_gpu_normal_mode:bench/bench_gpu_normal_mode ||
    { fail build "binaries missing"; return; }
  nvidia-smi topo -m 2>/dev/null | head -5 >>"$LOG"
  step "test_gpu cuda_ipc (GpuCudaIpc*)" 300 env EPMOE_TIMEOUT_S="${EPMOE_TIMEOUT_S:-20}" "$BUILD/tests/test_gpu" \
    --gtest_filter='GpuCudaIpc*' --gtest_output="xml:$RESULTS/test_gpu_cuda_ipc.xml"
  step bench_gpu_normal_mode 150 env EPMOE_TIMEOUT_S="${EPMOE_TIMEOUT_S:-20}" "$BUILD/bench/bench_gpu_normal_mode" \
    --runs 50 --json "$RESULTS/bench_gpu_normal_mode.json"
  BENCHES_RUN+=(bench_gpu_normal_mode)
}
