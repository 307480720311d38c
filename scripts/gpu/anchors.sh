# Part `anchors` of scripts/gpu_check.sh (sourced): the systems epmoe is measured against, built and run on the
# same GPU machine in the same call, so their figures and epmoe's share the hardware (ratios, not absolutes).
#
#   scripts/gpu_check.sh anchors --anchors DIR
#
# DIR: DeepEP's source folder (the one holding setup.py and tests/; DeepEP V1 at commit 567632d is what epmoe's
# Python Buffer follows), or a folder holding it as src/. Without DIR, or when it does not exist, the part is
# skipped with a note. It travels to the GPU machine only inside the checkout: copy it into an ignored folder of
# the tree and name that folder in the call's carry list.
#
# The source is copied to a temporary folder and built there with `python3 setup.py build_ext --inplace`
# (TORCH_CUDA_ARCH_LIST 9.0, NVSHMEM from the nvidia-nvshmem wheel; CUDA 13's CCCL headers and, when the machine has
# no rdma-core headers, DIR/../fallback_include added to CPATH), then its tests/test_low_latency.py runs with
# --num-processes 1 (one GPU; DeepEP's intranode kernels need 2, 4 or 8 ranks) at DeepEP's decode shapes, over
# DeepEP and then over epmoe (after bench/low_latency_vs_deepep.py for both).
# A deep_ep_cpp*.so beside setup.py in DIR (a build for that machine's Python and torch) is used as it is:
# EPMOE_ANCHOR_KEEP=FOLDER copies a fresh build into FOLDER for that (~80 s less in each later call).
# Logs: deepep_build.log, deepep_low_latency.log, deepep_low_latency_over_epmoe.log; the timing lines are copied into
# the summary. ll_host_profile_{deepep,epmoe}.txt: where each library's host time of an eager pair goes.
# EPMOE_ANCHOR_SWEEP=1 adds bench/low_latency_vs_deepep.py --sweep over both libraries (bf16 dispatch; K = 1, 2, 4;
# H = 2048, 2880, 4096; T = 1, 32, 128, or EPMOE_ANCHOR_SWEEP_TOKENS): ll_sweep_compare.md.
part_anchors() {
  part_begin anchors 570
  local dir="${ANCHORS_DIR:-}"
  if [ -z "$dir" ]; then
    skip "DeepEP low-latency test" "no --anchors DIR given (DeepEP's source folder)"
    return
  fi
  [ -f "$dir/setup.py" ] || { [ -f "$dir/src/setup.py" ] && dir="$dir/src"; }
  if [ ! -f "$dir/setup.py" ]; then
    skip "DeepEP low-latency test" "$dir holds no DeepEP source (no setup.py)"
    return
  fi
  dir="$(cd "$dir" && pwd)"
  local py="${EPMOE_PYTHON:-python3}" work
  # DeepEP's decode shapes; its test runs over epmoe with the same arguments (anchors_low_latency_side_by_side).
  ANCHOR_TEST_ARGS="--num-processes 1 --num-tokens 128 --hidden 7168 --num-topk 8 --num-experts 256"
  work="$(mktemp -d /tmp/epmoe-deepep.XXXXXX)"
  cp -a "$dir/." "$work/"
  local cuda_home="${CUDA_HOME:-/usr/local/cuda}"
  [ -x "$cuda_home/bin/nvcc" ] || cuda_home="$(dirname "$(dirname "$(command -v nvcc 2>/dev/null || echo /x/x)")")"
  export CUDA_HOME="$cuda_home" PATH="$cuda_home/bin:$PATH"
  export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" MAX_JOBS="${MAX_JOBS:-$(nproc)}" DISABLE_SM90_FEATURES=0
  # CUDA 13 keeps cuda/std (needed by NVSHMEM's headers, compiled by g++) under include/cccl.
  [ -d "$cuda_home/include/cccl" ] && export CPATH="$cuda_home/include/cccl${CPATH:+:$CPATH}"
  if [ ! -f /usr/include/infiniband/mlx5dv.h ] && [ -d "$dir/../fallback_include" ]; then
    export CPATH="${CPATH:+$CPATH:}$(cd "$dir/../fallback_include" && pwd)"
  fi
  # setup.py links -lcuda: the toolkit's stub when the linker finds no libcuda.so.
  if ! echo 'int main(){return 0;}' | g++ -x c++ - -o "$work/lcuda_probe" -lcuda >/dev/null 2>&1 &&
     [ -e "$cuda_home/lib64/stubs/libcuda.so" ]; then
    export LIBRARY_PATH="$cuda_home/lib64/stubs${LIBRARY_PATH:+:$LIBRARY_PATH}"
  fi
  local nvshmem
  nvshmem="$("$py" -c 'import importlib.util as u; print(u.find_spec("nvidia.nvshmem").submodule_search_locations[0])' \
    2>/dev/null)"
  [ -n "$nvshmem" ] && export LD_LIBRARY_PATH="$nvshmem/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  note "DeepEP source $dir, built in $work; NVSHMEM ${nvshmem:-not found (setup.py then drops the low-latency kernels)}"
  local t0=$SECONDS
  if ls "$work"/deep_ep_cpp*.so >/dev/null 2>&1; then
    # DIR holds a build of this source already (a deep_ep_cpp*.so from EPMOE_ANCHOR_KEEP, for this Python and torch)
    note "DeepEP: the build in $dir is used ($(cd "$work" && ls deep_ep_cpp*.so)), not rebuilt"
  else
    step "DeepEP build (setup.py build_ext --inplace)" 420 bash -c 'cd "$1" && shift && "$@" >"$0" 2>&1' \
      "$RESULTS/deepep_build.log" "$work" "$py" setup.py build_ext --inplace
    if [ -n "${EPMOE_ANCHOR_KEEP:-}" ] && ls "$work"/deep_ep_cpp*.so >/dev/null 2>&1; then
      mkdir -p "$EPMOE_ANCHOR_KEEP" && cp "$work"/deep_ep_cpp*.so "$EPMOE_ANCHOR_KEEP/" &&
        note "DeepEP's build kept in $EPMOE_ANCHOR_KEEP (put it beside setup.py in DIR to skip the build next time)"
    fi
  fi
  if ! ls "$work"/deep_ep_cpp*.so >/dev/null 2>&1; then
    note "DeepEP did not build (after $((SECONDS - t0)) s); the end of deepep_build.log:"
    grep -E 'error|FAILED' "$RESULTS/deepep_build.log" | head -10 | tee -a "$LOG"
    return
  fi
  # tests/utils.py reads WORLD_SIZE / RANK as the node count / node rank: keep them unset.
  step "DeepEP test_low_latency.py --num-processes 1" 150 env -u WORLD_SIZE -u RANK -u LOCAL_RANK \
    MASTER_ADDR=127.0.0.1 MASTER_PORT=$((29500 + RANDOM % 2000)) PYTHONPATH="$work${PYTHONPATH:+:$PYTHONPATH}" \
    bash -c 'cd "$1/tests" && shift && "$@" >"$0" 2>&1' "$RESULTS/deepep_low_latency.log" "$work" \
    "$py" test_low_latency.py $ANCHOR_TEST_ARGS
  ANCHOR_LINES="$(grep -E '\[rank [0-9]+\] (Dispatch|Combine)' "$RESULTS/deepep_low_latency.log" 2>/dev/null)"
  [ -n "$ANCHOR_LINES" ] && note "$ANCHOR_LINES"
  anchors_low_latency_side_by_side "$work"
}

# Both libraries through bench/low_latency_vs_deepep.py, one after the other in this call (the same GPU, the same
# inputs and method): DeepEP from its build folder, epmoe from the package an earlier part of the same call
# installed (python or deepep: EPMOE_PY_TARGET, default /tmp/epmoe-py), else built here as those parts build it.
anchors_low_latency_side_by_side() {
  local work="$1" py="${EPMOE_PYTHON:-python3}" target="${EPMOE_PY_TARGET:-/tmp/epmoe-py}"
  local tokens="${EPMOE_ANCHOR_TOKENS:-1,128}" bench="$ROOT/bench/low_latency_vs_deepep.py"
  step "side by side: DeepEP through bench/low_latency_vs_deepep.py" 90 env -u WORLD_SIZE -u RANK \
    PYTHONPATH="$work" "$py" "$bench" --lib deepep --tokens "$tokens" --json "$RESULTS/ll_deepep.json" \
    --host-profile "$RESULTS/ll_host_profile_deepep.txt"
  if [ ! -f "$target/epmoe/__init__.py" ]; then
    export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
    build_python_package "$py" "$target" "${DEPS_PREFIX:-${EPMOE_DEPS_PREFIX:-$ROOT/build/deps}}" || return 0
  fi
  step "side by side: epmoe through bench/low_latency_vs_deepep.py" 90 env -u WORLD_SIZE -u RANK \
    PYTHONPATH="$target" "$py" "$bench" --lib epmoe --tokens "$tokens" --json "$RESULTS/ll_epmoe.json" \
    --host-profile "$RESULTS/ll_host_profile_epmoe.txt"
  # DeepEP's test over epmoe (the one-line deep_ep module), the same arguments as over DeepEP above: its hook halves
  # (send / recv kernel times) and event-timed pair beside DeepEP's, like for like.
  local shim="$work/epmoe_shim"
  mkdir -p "$shim"
  echo 'from epmoe import Buffer, Config, EventOverlap, topk_idx_t  # noqa: F401' >"$shim/deep_ep.py"
  step "DeepEP test_low_latency.py over epmoe, the same arguments" 150 env -u WORLD_SIZE -u RANK -u LOCAL_RANK \
    MASTER_ADDR=127.0.0.1 MASTER_PORT=$((29500 + RANDOM % 2000)) PYTHONPATH="$shim:$target" \
    bash -c 'cd "$1/tests" && shift && "$@" >"$0" 2>&1' "$RESULTS/deepep_low_latency_over_epmoe.log" "$work" \
    "$py" test_low_latency.py $ANCHOR_TEST_ARGS
  local over
  over="$(grep -E '\[rank [0-9]+\] (Dispatch|Combine)' "$RESULTS/deepep_low_latency_over_epmoe.log" 2>/dev/null)"
  if [ -n "$over" ]; then
    ANCHOR_LINES="${ANCHOR_LINES:+$ANCHOR_LINES
}DeepEP's test over epmoe:
$over"
    note "DeepEP's test over epmoe:
$over"
  fi
  if [ -f "$RESULTS/ll_deepep.json" ] && [ -f "$RESULTS/ll_epmoe.json" ]; then
    "$py" "$bench" --compare "$RESULTS/ll_epmoe.json" "$RESULTS/ll_deepep.json" >"$RESULTS/ll_compare.md" 2>&1
    ANCHOR_LINES="${ANCHOR_LINES:+$ANCHOR_LINES
}$(cat "$RESULTS/ll_compare.md")"
    note "$(cat "$RESULTS/ll_compare.md")"
  fi
  [ "${EPMOE_ANCHOR_SWEEP:-0}" = 1 ] && anchors_low_latency_sweep "$work" "$target"
}

# The sweep of shapes around DeepEP's decode default (bench/low_latency_vs_deepep.py SWEEP), both
# libraries in this call; a shape DeepEP does not compile is a row with its error.
anchors_low_latency_sweep() {
  local work="$1" target="$2" py="${EPMOE_PYTHON:-python3}" bench="$ROOT/bench/low_latency_vs_deepep.py"
  local tokens="${EPMOE_ANCHOR_SWEEP_TOKENS:-1,32,128}" lib path
  for lib in deepep epmoe; do
    path="$work"
    [ "$lib" = epmoe ] && path="$target"
    step "sweep: $lib through bench/low_latency_vs_deepep.py --sweep" 300 env -u WORLD_SIZE -u RANK \
      PYTHONPATH="$path" "$py" "$bench" --lib "$lib" --sweep --tokens "$tokens" --json "$RESULTS/ll_sweep_$lib.json"
  done
  if [ -f "$RESULTS/ll_sweep_deepep.json" ] && [ -f "$RESULTS/ll_sweep_epmoe.json" ]; then
    "$py" "$bench" --compare "$RESULTS/ll_sweep_epmoe.json" "$RESULTS/ll_sweep_deepep.json" \
      >"$RESULTS/ll_sweep_compare.md" 2>&1
    note "sweep, epmoe / DeepEP: $RESULTS/ll_sweep_compare.md"
  fi
}
