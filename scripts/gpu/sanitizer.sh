# Part `sanitizer` of scripts/gpu_check.sh (sourced): test_gpu's suites again under compute-sanitizer, at the
# tests' quick sizes (EPMOE_GPU_TEST_QUICK=1): memcheck of the stage kernels, racecheck of the kernels that use
# shared memory, memcheck of the fp8 experts and the MoE layer, memcheck of cuda_ipc (both modes), and synccheck and
# racecheck of the cuda_ipc low-latency kernels.

# racecheck over RACE_FILTER, failing on a failed test or on a hazard outside cuBLAS. cuBLAS's own GEMM kernels
# (nvjet*, called by the MoE layer's experts) synchronise through mbarriers, which racecheck does not model; leaving
# them out with --kernel-name-exclude made the sanitizer fail their launches, so they run instrumented and their
# reports are filtered.
racecheck_ours() {
  "$SANITIZER" --tool racecheck "$BUILD/tests/test_gpu" --gtest_filter="$RACE_FILTER" >"$RESULTS/racecheck.log" 2>&1
  local rc=$?
  cat "$RESULTS/racecheck.log"
  local ours
  ours="$(grep -E 'Race reported|Error: .*hazard' "$RESULTS/racecheck.log" | grep -v nvjet)"
  echo "racecheck: test exit $rc; hazards outside cuBLAS: $(printf '%s' "$ours" | grep -c .)"
  [ $rc -eq 0 ] && [ -z "$ours" ]
}

part_sanitizer() {
  part_begin sanitizer 570
  SANITIZER="$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)"
  if [ -z "$SANITIZER" ]; then
    skip compute-sanitizer "not found on this machine"
    return
  fi
  ensure_built test_gpu:tests/test_gpu || { fail build "binaries missing"; return; }
  export EPMOE_GPU_TEST_QUICK=1
  step "memcheck stage kernels" 120 "$SANITIZER" --tool memcheck --error-exitcode 99 "$BUILD/tests/test_gpu" \
    --gtest_filter='GpuRouter.*:GpuDispatchLayout.*:GpuPermute.*:GpuQuant.*-GpuQuant.E4m3*'
  RACE_FILTER='GpuRouter.KernelWrites*:GpuRouter.RunsOn*:GpuDispatchLayout.ManyRanks*:GpuDispatchLayout.OutOfRange*'
  RACE_FILTER+=':GpuPermute.OutOfRange*:GpuPermute.Fp8*'
  RACE_FILTER+=':GpuMoELayer*:GpuWeightAndReduce*'  # the MoE layer's shared-memory kernels (src/moe/*.cu)
  # The layer's low-latency tests spin on their peers' flags in the cuda_ipc kernels (memcheck covers them).
  RACE_FILTER+='-GpuMoELayerLowLatency.*'
  export -f racecheck_ours
  export SANITIZER BUILD RESULTS RACE_FILTER
  step "racecheck shared-memory kernels" 150 bash -c racecheck_ours
  step "memcheck experts fp8 + MoE layer" 200 "$SANITIZER" --tool memcheck --error-exitcode 99 \
    "$BUILD/tests/test_gpu" --gtest_filter='GpuExpertsFp8*:GpuMoELayer*:GpuWeightAndReduce*'
  if [ "$(gpu_count)" -ge 2 ]; then
    step "memcheck cuda_ipc normal mode" 200 "$SANITIZER" --tool memcheck --error-exitcode 99 \
      "$BUILD/tests/test_gpu" --gtest_filter='GpuCudaIpcNormal.*-*Timeout*:*AcrossSizes*'
  else
    skip "memcheck cuda_ipc normal mode" "needs 2 GPUs"
  fi
  # The low-latency suite runs one rank per GPU, so also on one GPU (R = 1). Its kernels share shared-memory
  # tables across warps and keep every barrier uniform (a timeout returns the whole block): synccheck and
  # racecheck check both.
  local tool
  for tool in memcheck synccheck racecheck; do
    step "$tool cuda_ipc low-latency" 200 "$SANITIZER" --tool "$tool" --error-exitcode 99 \
      "$BUILD/tests/test_gpu" --gtest_filter='GpuCudaIpcLowLatency.*-*Timeout*'
  done
  unset EPMOE_GPU_TEST_QUICK
}
