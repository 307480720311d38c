#!/usr/bin/env bash
# The one GPU entry point: tests, command line, Python package, benchmarks, sanitizer runs and the anchors
# (DeepEP) on a GPU machine, in parts picked by arguments; each part is bounded to 570 s on a 1-GPU machine, so
# a job with a 10-minute limit can run any one part (a step that would outlast the bound is cut short or skipped,
# and the summary says so).
#
#   scripts/gpu_check.sh [PART...] [--build DIR] [--out DIR] [--anchors DEEPEP_SRC] [--deps DIR] [--base DIR]
#                        [--no-build]
#   scripts/gpu_check.sh pack [PART...] [--build DIR] [--to DIR]   # on a build machine: binaries + libraries
#   scripts/gpu_check.sh deps [--to DIR]                           # on a build machine: C++ libraries for `python`
#
# Parts (default: tests cli python bench sanitizer):
#   tests      test_gpu in full (every GPU suite), then the cuda_ipc MPI tests (one process per GPU, or two
#              processes sharing a lone GPU)                                          scripts/gpu/tests.sh
#   cli        `epmoe run` (bf16, fp8, replayed routing, low-latency), test_tools, `epmoe tune`, `epmoe bench`
#                                                                                     scripts/gpu/cli.sh
#   python     the Python package built there with CUDA, offline, and its whole suite  scripts/gpu/python.sh
#   bench      every bench_gpu_* benchmark                                            scripts/gpu/bench.sh
#   sanitizer  compute-sanitizer memcheck, synccheck and racecheck over test_gpu's suites, quick sizes
#                                                                                     scripts/gpu/sanitizer.sh
#   anchors    DeepEP from --anchors DIR built in a temporary folder; both libraries through
#              bench/low_latency_vs_deepep.py and DeepEP's test_low_latency.py --num-processes 1 over each
#              (EPMOE_ANCHOR_SWEEP=1: and the shape sweep); skipped with a note without DIR
#                                                                                     scripts/gpu/anchors.sh
#   deepep     DeepEP's own test_intranode.py and test_low_latency.py from --anchors DIR, unchanged, against
#              epmoe's Python Buffer (a one-line deep_ep.py), --num-processes 1; skipped without DIR
#                                                                                     scripts/gpu/deepep.sh
#   ipc        the cuda_ipc tests and bench_gpu_normal_mode (the quick check on 2 or more GPUs)
#   ab         the normal-mode A/B: copy engine, zero-copy at 16..64 blocks, SM stores, OLMoE routing, K = 2
#   llab       the low-latency A/B of two builds: bench_gpu_low_latency of --base DIR (the commit before a change,
#              a pack or build folder) and of --build, alternating, at T = 128 and 1, then a traced run of each;
#              llab.md: every run's medians, new / base, the traced points moved   scripts/gpu/bench.sh
#   all        tests cli python bench sanitizer anchors (more than one call's time)
#
# Binaries: --build DIR (default build/release). What a part needs and DIR lacks is built there (configuring
# DIR first; the C++ -dev packages must be installed) unless --no-build. GPU machines lack those packages: on a
# machine that has them (scripts/setup.sh release, with nvcc), `scripts/gpu_check.sh pack` copies the GPU
# binaries, stripped, with the shared libraries the GPU machine lacks (DIR/lib) into build/release-pack (carry it;
# then --build build/release-pack), and `scripts/gpu_check.sh deps` the C++ libraries the Python build needs into
# build/deps (carry it for the python part).
#
# Results: logs, JSON and summary.md to --out DIR (default ./gpu-results); the summary table
# (part, step, result, time) is printed last. Exit status: 0 when every step passed or skipped.
set -u -o pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

usage() { sed -n '2,/^set -u/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }

BUILD=build/release
RESULTS="$ROOT/gpu-results"
ANCHORS_DIR=""
BASE_DIR=""
DEPS_PREFIX=""
NO_BUILD=0
PACK_TO=""
PARTS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --build) BUILD="$2"; shift 2 ;;
    --out) RESULTS="$2"; shift 2 ;;
    --anchors) ANCHORS_DIR="$2"; shift 2 ;;
    --deps) DEPS_PREFIX="$2"; shift 2 ;;
    --base) BASE_DIR="$2"; shift 2 ;;
    --to) PACK_TO="$2"; shift 2 ;;
    --no-build) NO_BUILD=1; shift ;;
    -h | --help) usage; exit 0 ;;
    all) PARTS+=(tests cli python bench sanitizer anchors); shift ;;
    tests | cli | python | bench | sanitizer | anchors | deepep | ipc | ab | llab | pack | deps) PARTS+=("$1"); shift ;;
    *) echo "gpu_check.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
[ ${#PARTS[@]} -eq 0 ] && PARTS=(tests cli python bench sanitizer)
export NO_BUILD

# On a build machine: pack or deps, nothing else.
if [ "${PARTS[0]}" = pack ]; then
  source "$ROOT/scripts/gpu/pack.sh"
  run_pack "${PACK_TO:-$ROOT/build/release-pack}" "${PARTS[@]:1}"
  exit $?
fi
if [ "${PARTS[0]}" = deps ]; then
  exec "$ROOT/scripts/gpu/make_deps_prefix.sh" "${PACK_TO:-$ROOT/build/deps}"
fi

mkdir -p "$RESULTS"
RESULTS="$(cd "$RESULTS" && pwd)"
source "$ROOT/scripts/gpu/common.sh"
: >"$LOG"
for f in tests cli python bench sanitizer anchors deepep; do source "$ROOT/scripts/gpu/$f.sh"; done
DEEPEP_LINES=""
BENCHES_RUN=()
ANCHOR_LINES=""

COMMIT="$(build_commit)"
DEVICE="$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)"
note "epmoe gpu_check: $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $COMMIT, build $BUILD, parts ${PARTS[*]}"
note "device: ${DEVICE:-none found} ($(gpu_count) GPUs)"
setup_library_path

for p in "${PARTS[@]}"; do
  case "$p" in
    pack | deps) note "'$p' runs alone, on a build machine: skipped here" ;;
    *) "part_$p" ;;
  esac
done

# The summary: what ran, the test totals, each benchmark's table, the anchors' timing lines.
{
  echo "# epmoe gpu_check: $(date -u +%Y-%m-%d)"
  echo
  echo "- device: ${DEVICE:-unknown} ($(gpu_count) GPUs)"
  echo "- date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "- commit: $COMMIT"
  echo "- build: $BUILD"
  echo "- parts: ${PARTS[*]}"
  echo
  grep -h '^\[  \(PASSED\|FAILED\)  \]\|tests ran\.\| passed\| failed' "$LOG" | grep -v '^== ' | sed 's/^/    /' |
    head -40
  for name in "${BENCHES_RUN[@]}"; do
    echo
    echo "## $name"
    echo
    awk -v s="== $name " 'index($0, s) == 1 {p=1; next} p && /^   -> /{p=0} p && /^\|/{print} p && /^bench_gpu/{print "    " $0}' \
      "$LOG"
  done
  if [ -n "$ANCHOR_LINES" ]; then
    echo
    echo "## DeepEP test_low_latency.py (one GPU)"
    echo
    printf '%s\n' "$ANCHOR_LINES" | sed 's/^/    /'
  fi
  if [ -f "$RESULTS/llab.md" ]; then
    echo
    echo "## Low-latency A/B (llab)"
    echo
    cat "$RESULTS/llab.md"
  fi
  if [ -n "$DEEPEP_LINES" ]; then
    echo
    echo "## DeepEP's tests against epmoe (one GPU; the tail of each log)"
    echo
    printf '%s' "$DEEPEP_LINES"
  fi
  echo
  echo "| part | step | result | time |"
  echo "| --- | --- | --- | --- |"
  printf '%s\n' "${SUMMARY[@]}"
} >"$RESULTS/summary.md"
echo
cat "$RESULTS/summary.md"
exit $STATUS
