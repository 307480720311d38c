#!/usr/bin/env bash
# Every GPU test and benchmark in one go, for the GPU machine (run from anywhere; works in the repo root).
#
#   scripts/gpu_check.sh            # uses $EPMOE_GPU_BUILD (default build/h-gpu) if it holds test_gpu,
#                                   # else configures and builds build/release (needs the -dev packages)
#
# 1. builds what is missing; checks the binaries find their shared libraries (a build made on another
#    machine may bring the ones the GPU machine lacks in <build>/carried-lib, added to LD_LIBRARY_PATH);
# 2. runs every test binary CTest labels `gpu` (test_gpu and the later GPU suites), in full; the cuda_ipc MPI tests
#    (one process per GPU, or two sharing one); the `epmoe` command-line tests (test_tools), whose run tests take
#    the GPUs there; the Python package's suite (python/tests/gpu/run_gpu_tests.sh: built for this machine's
#    python3, with its GPU tests);
# 3. runs every bench_gpu_* binary (median of >= 50 runs, L2 flushed, next to a d2d copy);
# 4. runs the stage suites of test_gpu (router, layout, permute, quant) once more under compute-sanitizer:
#    memcheck (small sizes) and racecheck (the kernels that use shared memory);
# 5. writes the log, the benchmark JSON and a markdown summary (device, date, commit, figures) to $OUT
#    (or ./gpu-results), and prints a short table last.
# EPMOE_GPU_CHECK_PARTS (default "tests python bench sanitizer") picks the steps, so one device call's time limit can
# be kept by splitting the run (the summary lists what ran).
# Exit status: 0 when every step passed.
set -u -o pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
BUILD="${EPMOE_GPU_BUILD:-build/h-gpu}"
RESULTS="${OUT:-$ROOT/gpu-results}"
mkdir -p "$RESULTS"
LOG="$RESULTS/gpu_check.log"
: >"$LOG"
STATUS=0
SUMMARY=()
PARTS="${EPMOE_GPU_CHECK_PARTS:-tests python bench sanitizer}"
want() { case " $PARTS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
note() { echo "$*" | tee -a "$LOG"; }
step() { # step NAME TIMEOUT_S COMMAND...: runs, logs, records pass/fail
  local name="$1" limit="$2"
  shift 2
  note "== $name: $*"
  local t0=$SECONDS rc
  timeout --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1
  rc=$?
  local verdict="passed"
  if [ $rc -eq 77 ]; then
    verdict="skipped (77)"
  elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    verdict="TIMED OUT after ${limit}s"
    STATUS=1
  elif [ $rc -ne 0 ]; then
    verdict="FAILED (exit $rc)"
    STATUS=1
  fi
  SUMMARY+=("| $name | $verdict | $((SECONDS - t0)) s |")
  note "   -> $verdict in $((SECONDS - t0)) s"
}

# The commit: EPMOE_COMMIT when given (the binaries' commit: a copied checkout's .git may be stale), else git's.
if [ -n "${EPMOE_COMMIT:-}" ]; then
  COMMIT="$EPMOE_COMMIT"
else
  COMMIT="$(git rev-parse HEAD 2>/dev/null)" || COMMIT="unknown"
  if git rev-parse HEAD >/dev/null 2>&1 && ! git diff --quiet HEAD 2>/dev/null; then
    COMMIT="$COMMIT (with local changes)"
  fi
fi
note "epmoe gpu_check: $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $COMMIT"
DEVICE="$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)"
note "device: ${DEVICE:-none found}"

# 1. Build (or reuse the carried build).
if [ ! -x "$BUILD/tests/test_gpu" ]; then
  note "== no $BUILD/tests/test_gpu: building build/release"
  BUILD=build/release
  cmake --preset release >>"$LOG" 2>&1 && cmake --build "$BUILD" -j "$(nproc)" >>"$LOG" 2>&1 \
    || { note "build failed (see $LOG)"; tail -30 "$LOG"; exit 1; }
fi
if [ -d "$BUILD/carried-lib" ]; then
  export LD_LIBRARY_PATH="$ROOT/$BUILD/carried-lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi

# Binaries: every test labelled gpu (from CTest's own listing; paths re-rooted to this checkout), and every
# bench_gpu_* executable.
BUILT_AT="$(sed -n 's/^CMAKE_CACHEFILE_DIR:INTERNAL=//p' "$BUILD/CMakeCache.txt" 2>/dev/null)"
mapfile -t TESTS < <(ctest --test-dir "$BUILD" -L '^gpu$' --show-only=json-v1 2>/dev/null | python3 -c '
import json, os, sys
built_at, build = sys.argv[1], sys.argv[2]
seen = []
for t in json.load(sys.stdin).get("tests", []):
    cmd = t.get("command") or []
    if not cmd: continue
    exe = cmd[0]
    if built_at and exe.startswith(built_at + "/"): exe = os.path.join(build, exe[len(built_at) + 1:])
    if exe not in seen: seen.append(exe)
print("\n".join(seen))' "$BUILT_AT" "$BUILD" 2>/dev/null)
if [ ${#TESTS[@]} -eq 0 ] || [ -z "${TESTS[0]}" ]; then
  mapfile -t TESTS < <(ls "$BUILD"/tests/test_gpu* 2>/dev/null)
fi
mapfile -t BENCHES < <(find "$BUILD/bench" -maxdepth 1 -name 'bench_gpu_*' -type f -executable 2>/dev/null | sort)
note "gpu tests: ${TESTS[*]:-none}"
note "gpu benchmarks: ${BENCHES[*]:-none}"
for b in "${TESTS[@]}" "${BENCHES[@]}"; do
  missing="$(ldd "$b" 2>/dev/null | grep 'not found')"
  [ -n "$missing" ] && note "MISSING shared libraries for $b: $missing"
done

# 2. Tests, full sizes.
want tests || TESTS=()
for t in "${TESTS[@]}"; do
  step "$(basename "$t")" 240 "$t" --gtest_output="xml:$RESULTS/$(basename "$t").xml"
done

# 2b. One process per GPU (cuda_ipc over CUDA IPC handles, bootstrap through MPI), when the host has >= 2 GPUs.
NGPU="$(nvidia-smi -L 2>/dev/null | wc -l)"
if want tests && [ "${NGPU:-0}" -ge 2 ] && command -v mpirun >/dev/null && [ -x "$BUILD/tests/mpi/test_mpi" ]; then
  step "test_mpi cuda_ipc, $NGPU processes" 180 env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
    mpirun -np "$NGPU" --oversubscribe "$BUILD/tests/mpi/test_mpi" --gtest_filter='MpiCudaIpc*'
elif want tests && [ "${NGPU:-0}" -eq 1 ] && command -v mpirun >/dev/null && [ -x "$BUILD/tests/mpi/test_mpi" ]; then
  # One GPU: two processes share it (time-sliced): the protocol, not the speed.
  step "test_mpi cuda_ipc, 2 processes sharing one GPU" 180 env OMPI_ALLOW_RUN_AS_ROOT=1 \
    OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 EPMOE_TEST_SHARE_GPU=1 mpirun -np 2 -x EPMOE_TEST_SHARE_GPU --oversubscribe \
    "$BUILD/tests/mpi/test_mpi" --gtest_filter='MpiCudaIpc*'
fi

# 2c. The command line on this machine's GPUs (the tests run the binary as a process).
if want tests && [ -x "$BUILD/tests/test_tools" ] && [ -x "$BUILD/tools/epmoe/epmoe" ]; then
  step "test_tools (epmoe command line)" 300 env EPMOE_CLI="$ROOT/$BUILD/tools/epmoe/epmoe" "$BUILD/tests/test_tools" \
    --gtest_output="xml:$RESULTS/test_tools.xml"
fi

# 2d. The Python package, built here (its extension must match this machine's python3), and its whole suite.
if want python; then
  step "python suite (python/tests, GPU tests included)" 560 env OUT="$RESULTS/python" \
    python/tests/gpu/run_gpu_tests.sh
fi

# 3. Benchmarks.
want bench || BENCHES=()
for b in "${BENCHES[@]}"; do
  name="$(basename "$b")"
  if "$b" --help 2>&1 | grep -q benchmark_filter; then
    step "$name" 120 "$b" --benchmark_out="$RESULTS/$name.json" --benchmark_out_format=json
  else
    step "$name" 120 "$b" --json "$RESULTS/$name.json"
  fi
done

# 4. compute-sanitizer on test_gpu, small sizes.
SANITIZER="$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)"
if ! want sanitizer; then
  :
elif [ -n "$SANITIZER" ] && [ -x "$BUILD/tests/test_gpu" ]; then
  export EPMOE_GPU_TEST_QUICK=1
  step "memcheck test_gpu (quick sizes)" 150 "$SANITIZER" --tool memcheck --error-exitcode 99 \
    "$BUILD/tests/test_gpu" --gtest_filter='GpuRouter.*:GpuDispatchLayout.*:GpuPermute.*:GpuQuant.*-GpuQuant.E4m3*'
  RACE_FILTER='GpuRouter.KernelWrites*:GpuRouter.RunsOn*:GpuDispatchLayout.ManyRanks*:GpuDispatchLayout.OutOfRange*'
  RACE_FILTER+=':GpuPermute.OutOfRange*:GpuPermute.Fp8*'
  RACE_FILTER+=':GpuMoELayer*:GpuWeightAndReduce*'  # the MoE layer's shared-memory kernels (src/moe/*.cu)
  # The layer's low-latency tests spin on their peers' flags in the cuda_ipc kernels (covered by the memcheck steps).
  RACE_FILTER+='-GpuMoELayerLowLatency.*'
  # Hazards inside cuBLAS's own GEMM kernels (nvjet*, called by the MoE layer's experts) do not count: their
  # warp-specialised pipelines synchronise through mbarriers, which racecheck does not model. (Leaving them out
  # with --kernel-name-exclude made the sanitizer fail their launches, so they run instrumented and their
  # reports are filtered.) The step fails on a failed test or on any hazard reported in another kernel.
  racecheck_ours() {
    "$SANITIZER" --tool racecheck "$BUILD/tests/test_gpu" --gtest_filter="$RACE_FILTER" >"$RESULTS/racecheck.log" 2>&1
    local rc=$?
    cat "$RESULTS/racecheck.log"
    local ours
    ours="$(grep -E 'Race reported|Error: .*hazard' "$RESULTS/racecheck.log" | grep -v nvjet)"
    echo "racecheck: test exit $rc; hazards outside cuBLAS: $(printf '%s' "$ours" | grep -c .)"
    [ $rc -eq 0 ] && [ -z "$ours" ]
  }
  export -f racecheck_ours
  export SANITIZER BUILD RESULTS RACE_FILTER
  step "racecheck shared-memory kernels" 150 bash -c racecheck_ours
  step "memcheck experts fp8 + MoE layer (quick sizes)" 300 "$SANITIZER" --tool memcheck --error-exitcode 99 \
    "$BUILD/tests/test_gpu" --gtest_filter='GpuExpertsFp8*:GpuMoELayer*:GpuWeightAndReduce*'
  if [ "${NGPU:-0}" -ge 2 ]; then
    step "memcheck cuda_ipc (quick sizes)" 240 "$SANITIZER" --tool memcheck --error-exitcode 99 \
      "$BUILD/tests/test_gpu" --gtest_filter='GpuCudaIpcNormal.*-*Timeout*:*AcrossSizes*'
  fi
  # The low-latency suite runs with one rank per GPU, so also on one GPU (R = 1).
  step "memcheck cuda_ipc low-latency (quick sizes)" 150 "$SANITIZER" --tool memcheck --error-exitcode 99 \
    "$BUILD/tests/test_gpu" --gtest_filter='GpuCudaIpcLowLatency.*-*Timeout*'
  unset EPMOE_GPU_TEST_QUICK
else
  note "compute-sanitizer not found: sanitizer runs skipped"
  SUMMARY+=("| compute-sanitizer | not available | - |")
fi

# 5. Summary.
{
  echo "# epmoe GPU stages: $(date -u +%Y-%m-%d)"
  echo
  echo "- device: ${DEVICE:-unknown}"
  echo "- date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "- commit: $COMMIT"
  echo "- build: $BUILD"
  echo
  echo "| step | result | time |"
  echo "| --- | --- | --- |"
  printf '%s\n' "${SUMMARY[@]}"
  echo
  grep -h '^\[  \(PASSED\|FAILED\)  \]\|tests ran\.' "$LOG" | sed 's/^/    /'
  echo
  for b in "${BENCHES[@]}"; do
    name="$(basename "$b")"
    echo "## $name"
    echo
    # Its first line and its markdown table, from its own part of the log.
    awk -v step="== $name:" 'index($0, step) == 1 {p=1; next} p && /^   -> /{p=0} p && /^\|/{print} p && /^bench_gpu/{print "    " $0}' "$LOG"
    echo
  done
} >"$RESULTS/summary.md"
echo
cat "$RESULTS/summary.md"
exit $STATUS
