# Part `deepep` of scripts/gpu_check.sh (sourced): DeepEP V1's own tests, unchanged, against epmoe's Python Buffer.
#
#   scripts/gpu_check.sh deepep --anchors DIR
#
# DIR: as for the anchors part (DeepEP's source folder holding tests/, or a folder holding it as src/; DeepEP V1 at
# commit 567632d). Without DIR, or without DIR's tests, the part is skipped with a note. Nothing of DeepEP is built:
# the package epmoe is (build_python_package of scripts/gpu/python.sh, the same steps as the python part, reusing
# its build folder), and a temporary folder first on PYTHONPATH holds a one-line deep_ep.py re-exporting epmoe's
# Buffer, Config, EventOverlap and topk_idx_t. Then, from a copy of DIR/tests (their utils.py beside them), each
# with its own time limit and --num-processes 1 (one GPU):
#   test_intranode.py (DeepEP's defaults: T = 4096, H = 7168, K = 8, E = 256) and test_low_latency.py (T = 128,
#   H = 7168, K = 8, E = 288); then, while the part's 570 s last, test_low_latency.py at T = 1 / 32, H = 2048 / 4096
#   and K = 1 / 4.
# Each run's pass/fail is a step of the summary, and the tail of its log (deepep_<name>.log) is copied into it.
part_deepep() {
  part_begin deepep 570
  local dir="${ANCHORS_DIR:-}"
  if [ -z "$dir" ]; then
    skip "DeepEP tests against epmoe" "no --anchors DIR given (DeepEP's source folder)"
    return
  fi
  [ -d "$dir/tests" ] || { [ -d "$dir/src/tests" ] && dir="$dir/src"; }
  if [ ! -f "$dir/tests/test_intranode.py" ] || [ ! -f "$dir/tests/test_low_latency.py" ]; then
    skip "DeepEP tests against epmoe" "$dir holds no DeepEP tests (tests/test_intranode.py, tests/test_low_latency.py)"
    return
  fi
  dir="$(cd "$dir" && pwd)"
  local py="${EPMOE_PYTHON:-python3}"
  local target="${EPMOE_PY_TARGET:-/tmp/epmoe-py}"
  local deps="${DEPS_PREFIX:-${EPMOE_DEPS_PREFIX:-$ROOT/build/deps}}"
  export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
  build_python_package "$py" "$target" "$deps" || return 0

  local work
  work="$(mktemp -d /tmp/epmoe-deepep-tests.XXXXXX)"
  mkdir -p "$work/shim" "$work/tests"
  echo 'from epmoe import Buffer, Config, EventOverlap, topk_idx_t  # noqa: F401' >"$work/shim/deep_ep.py"
  cp -a "$dir/tests/." "$work/tests/"
  note "DeepEP tests from $dir/tests (copied to $work/tests); deep_ep = epmoe via $work/shim/deep_ep.py"
  DEEPEP_LINES=""
  deepep_run intranode 240 test_intranode.py
  deepep_run low_latency 150 test_low_latency.py
  deepep_run low_latency_t1_h2048_k1 45 test_low_latency.py --num-tokens 1 --hidden 2048 --num-topk 1
  deepep_run low_latency_t32_h4096_k4 45 test_low_latency.py --num-tokens 32 --hidden 4096 --num-topk 4
  deepep_run low_latency_t32_h2048_k4 45 test_low_latency.py --num-tokens 32 --hidden 2048 --num-topk 4
}

# One DeepEP test file run as a step: deepep_run NAME LIMIT FILE [ARGS...]; its log is $RESULTS/deepep_NAME.log.
deepep_run() {
  local name="$1" limit="$2"
  shift 2
  local log="$RESULTS/deepep_$name.log"
  # tests/utils.py reads WORLD_SIZE / RANK as the node count / node rank: keep them unset.
  step "DeepEP $* --num-processes 1 (epmoe)" "$limit" env -u WORLD_SIZE -u RANK -u LOCAL_RANK \
    MASTER_ADDR=127.0.0.1 MASTER_PORT=$((29500 + RANDOM % 2000)) \
    PYTHONPATH="$work/shim:$target${PYTHONPATH:+:$PYTHONPATH}" \
    bash -c 'cd "$1" && shift && "$@" >"$0" 2>&1' "$log" "$work/tests" "$py" "$@" --num-processes 1
  [ -f "$log" ] || return 0
  DEEPEP_LINES+="### $name: ${SUMMARY[-1]}"$'\n'"$(tail -n 15 "$log" | cut -c1-200 | sed 's/^/    /')"$'\n\n'
}
