# Part `cli` of scripts/gpu_check.sh (sourced): the `epmoe` command line on this machine's GPUs. `epmoe run`
# (bf16, fp8 dispatch, replayed OLMoE routing, low-latency mode), the CLI's own tests (test_tools, which run the
# binary as a process), `epmoe tune`, then `epmoe bench` with the tuned config. JSON of each to the results.
part_cli() {
  part_begin cli 570
  ensure_built epmoe_cli:tools/epmoe test_tools:tests/test_tools || { fail build "binaries missing"; return; }
  local epmoe
  epmoe="$(cli_binary)"
  report_missing_libraries "$epmoe" "$BUILD/tests/test_tools"
  export EPMOE_TIMEOUT_S="${EPMOE_TIMEOUT_S:-30}"
  step "epmoe run (bf16)" 60 "$epmoe" run --json "$RESULTS/run_bf16.json"
  step "epmoe run --dispatch-dtype fp8" 60 "$epmoe" run --dispatch-dtype fp8 --json "$RESULTS/run_fp8.json"
  step "epmoe run --routing (OLMoE, coding)" 60 "$epmoe" run --routing "$ROOT/tests/data/olmoe-routing" \
    --domain coding --tokens 1024 --json "$RESULTS/run_replay.json"
  step "epmoe run --mode low-latency --dispatch-dtype fp8" 60 "$epmoe" run --mode low-latency --dispatch-dtype fp8 \
    --json "$RESULTS/run_low_latency.json"
  step "test_tools (epmoe command line)" 150 env EPMOE_CLI="$(cd "$(dirname "$epmoe")" && pwd)/$(basename "$epmoe")" \
    "$BUILD/tests/test_tools" --gtest_output="xml:$RESULTS/test_tools.xml"
  step "epmoe tune" 90 "$epmoe" tune --tokens 4096 --hidden 7168 --topk 8 --experts 256 --runs 20 \
    -o "$RESULTS/tune.json"
  local cfg=()
  [ -f "$RESULTS/tune.json" ] && cfg=(--config "$RESULTS/tune.json")
  step "epmoe bench" 200 "$epmoe" bench "${cfg[@]}" --json "$RESULTS/cli_bench.json"
}
