# Parts `bench` and `ab` of scripts/gpu_check.sh (sourced). Every figure is the benchmark's own method (median of
# >= 50 runs after warm-up, L2 flushed, floors measured in the same run: docs/semantics.md section 12).

# bench: every bench_gpu_* binary of the build, JSON of each to the results.
part_bench() {
  part_begin bench 570
  local b name benches=()
  mapfile -t benches < <(find "$BUILD/bench" -maxdepth 1 -name 'bench_gpu_*' -type f -executable 2>/dev/null | sort)
  if [ ${#benches[@]} -eq 0 ]; then
    ensure_built bench_gpu_stages:bench/bench_gpu_stages bench_gpu_experts:bench/bench_gpu_experts \
      bench_gpu_moe_layer:bench/bench_gpu_moe_layer bench_gpu_normal_mode:bench/bench_gpu_normal_mode \
      bench_gpu_low_latency:bench/bench_gpu_low_latency bench_gpu_peer_store:bench/bench_gpu_peer_store ||
      { fail build "binaries missing"; return; }
    mapfile -t benches < <(find "$BUILD/bench" -maxdepth 1 -name 'bench_gpu_*' -type f -executable | sort)
  fi
  report_missing_libraries "${benches[@]}"
  for b in "${benches[@]}"; do
    name="$(basename "$b")"
    if "$b" --help 2>&1 | grep -q benchmark_filter; then
      step "$name" 120 "$b" --benchmark_out="$RESULTS/$name.json" --benchmark_out_format=json
    else
      step "$name" 120 "$b" --json "$RESULTS/$name.json"
    fi
    BENCHES_RUN+=("$name")
  done
}

# ab_run TAG ARGS...: one bench_gpu_normal_mode run of the A/B, its JSON as TAG.json; its table rows printed.
ab_run() {
  local tag="$1"
  shift
  step "normal mode: $tag" 90 "$AB_BENCH" --runs 50 "$@" --json "$RESULTS/ab_$tag.json"
  awk -v s="== normal mode: $tag " 'index($0, s) == 1 {p=1; next} p && /^   -> /{p=0} p && /^(peer copy|\| (dispatch|combine))/' \
    "$LOG"
}

# ab: the normal-mode A/B on 2 or more GPUs, in one call, every run bench_gpu_normal_mode (median of 50, floors in
# the same run): the copy-engine default against the zero-copy dispatch (--recv-slots 2) at 16..64 blocks and the
# SM-store path (--copy-engine 0: dispatch and combine by SM stores), then recorded OLMoE routing and K = 2 for the
# default and zero-copy at 48 blocks, and a traced zero-copy run. The most important runs come first, so a run cut
# short by the budget still has them.
part_ab() {
  part_begin ab 570
  ensure_built bench_gpu_normal_mode:bench/bench_gpu_normal_mode || { fail build "binaries missing"; return; }
  AB_BENCH="$BUILD/bench/bench_gpu_normal_mode"
  export EPMOE_TIMEOUT_S="${EPMOE_TIMEOUT_S:-20}"
  if [ "$(gpu_count)" -lt 2 ]; then
    note "ab: fewer than 2 GPUs: the runs measure one rank's fixed cost (no NVLink)"
  fi
  ab_run default
  ab_run zero_copy_48 --recv-slots 2 --sms 48
  ab_run zero_copy_32 --recv-slots 2 --sms 32
  ab_run zero_copy_24 --recv-slots 2 --sms 24
  ab_run zero_copy_16 --recv-slots 2 --sms 16
  ab_run zero_copy_64 --recv-slots 2 --sms 64  # SM stores over NVLink may want more SMs than the copy engines
  ab_run sm_stores_24 --copy-engine 0
  ab_run sm_stores_48 --copy-engine 0 --sms 48
  ab_run olmoe_zero_copy_48 --recv-slots 2 --sms 48 --routing "$ROOT/tests/data/olmoe-routing"
  ab_run k2_zero_copy_48 --recv-slots 2 --sms 48 --topk 2
  ab_run olmoe_default --routing "$ROOT/tests/data/olmoe-routing"
  ab_run k2_default --topk 2
  step "normal mode: traced zero_copy_48" 90 env EPMOE_CUDA_IPC_TRACE=1 "$AB_BENCH" --runs 50 --recv-slots 2 \
    --sms 48 --json "$RESULTS/ab_trace_zero_copy_48.json"
}

# llab: the low-latency A/B of two builds in one call (a change against the commit before it, both on this GPU):
# bench_gpu_low_latency of --base DIR and of --build, R = 1, L2 kept, 60 runs each, alternating base and new
# EPMOE_LLAB_ROUNDS times (default 3) at each T of EPMOE_LLAB_TOKENS (default 128,1), so a drift of the machine
# touches both alike; then one traced run of each per T (EPMOE_CUDA_IPC_TRACE=1: where the time goes, in
# llab_trace_{base,new}_T<T>.txt). llab.md: every run's median per op, base | new, new / base (bench/low_latency_ab.py).
part_llab() {
  part_begin llab 570
  local base_bin="${BASE_DIR:+$BASE_DIR/bench/bench_gpu_low_latency}"
  if [ -z "$base_bin" ] || [ ! -x "$base_bin" ]; then
    skip "low-latency A/B" "no --base DIR holding bench/bench_gpu_low_latency (the base commit's pack or build)"
    return
  fi
  ensure_built bench_gpu_low_latency:bench/bench_gpu_low_latency || { fail build "binaries missing"; return; }
  local tokens="${EPMOE_LLAB_TOKENS:-128,1}" rounds="${EPMOE_LLAB_ROUNDS:-3}" T i v base_json=() new_json=()
  local -A bin=([base]="$base_bin" [new]="$BUILD/bench/bench_gpu_low_latency")
  export EPMOE_TIMEOUT_S="${EPMOE_TIMEOUT_S:-20}"
  for T in ${tokens//,/ }; do
    for ((i = 0; i < rounds; ++i)); do
      for v in base new; do
        step "low latency $v T=$T run $i" 60 "${bin[$v]}" --ranks 1 --tokens "$T" --no-flush --runs 60 \
          --json "$RESULTS/llab_${v}_T${T}_$i.json"
        if [ -f "$RESULTS/llab_${v}_T${T}_$i.json" ]; then
          if [ "$v" = base ]; then base_json+=("$RESULTS/llab_${v}_T${T}_$i.json"); else new_json+=("$RESULTS/llab_${v}_T${T}_$i.json"); fi
        fi
      done
    done
  done
  for T in ${tokens//,/ }; do
    for v in base new; do
      step "low latency traced $v T=$T" 60 env EPMOE_CUDA_IPC_TRACE=1 bash -c '"$1" --ranks 1 --tokens "$2" --no-flush \
        --runs 40 >"$3" 2>&1' _ "${bin[$v]}" "$T" "$RESULTS/llab_trace_${v}_T$T.txt"
    done
  done
  if [ ${#base_json[@]} -gt 0 ] && [ ${#new_json[@]} -gt 0 ]; then
    local base_commit="base"
    [ -f "$BASE_DIR/COMMIT" ] && base_commit="$(head -1 "$BASE_DIR/COMMIT")"
    local traces=()
    for T in ${tokens//,/ }; do
      [ -s "$RESULTS/llab_trace_base_T$T.txt" ] && [ -s "$RESULTS/llab_trace_new_T$T.txt" ] &&
        traces+=(--traces "$T" "$RESULTS/llab_trace_base_T$T.txt" "$RESULTS/llab_trace_new_T$T.txt")
    done
    "${EPMOE_PYTHON:-python3}" "$ROOT/bench/low_latency_ab.py" --base "${base_json[@]}" --new "${new_json[@]}" \
      --labels "$base_commit" "$COMMIT" "${traces[@]}" >"$RESULTS/llab.md" 2>&1
    note "$(cat "$RESULTS/llab.md")"
  fi
}
