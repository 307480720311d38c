# Shared by scripts/gpu_check.sh and its parts (sourced, not run): the results folder, the log, timed steps
# with a time budget per part, the summary table, and the library path of a packed or local build.
#
# Variables the caller sets before sourcing: ROOT (the checkout), BUILD (the build folder, relative to ROOT or
# absolute), RESULTS (where logs and JSON go). Each part calls part_begin NAME BUDGET_S first; step cuts every
# limit to what is left of the part's budget, so one part stays within its bound.

# NVLink multicast stays off on shared machines: epmoe never uses it; this guards NCCL, torch and NVSHMEM.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1

LOG="$RESULTS/gpu_check.log"
STATUS=0
SUMMARY=()
PART=""
PART_END=0

note() { echo "$*" | tee -a "$LOG"; }

# part_begin NAME BUDGET_S: later steps share BUDGET_S seconds from now.
part_begin() {
  PART="$1"
  PART_END=$((SECONDS + $2))
  note ""
  note "#### part $PART (budget $2 s)"
}

# Seconds left of the part's budget (at least 1).
part_left() {
  local left=$((PART_END - SECONDS))
  [ "$left" -lt 1 ] && left=1
  echo "$left"
}

# record STEP VERDICT SECONDS: one row of the summary table.
record() {
  SUMMARY+=("| $PART | $1 | $2 | $3 s |")
}

# skip STEP WHY: a step that did not run (not a failure).
skip() {
  note "== $1: skipped ($2)"
  record "$1" "skipped: $2" 0
}

# fail STEP WHY: a step that could not run because something it needs failed.
fail() {
  note "== $1: FAILED ($2)"
  record "$1" "FAILED: $2" 0
  STATUS=1
}

# step NAME LIMIT_S COMMAND...: runs COMMAND with its output appended to the log, under min(LIMIT_S, what is
# left of the part's budget); records passed / skipped (exit 77) / FAILED / TIMED OUT.
step() {
  local name="$1" limit="$2"
  shift 2
  local left
  left="$(part_left)"
  [ "$limit" -gt "$left" ] && limit="$left"
  if [ "$limit" -le 5 ]; then
    skip "$name" "no time left in the part's budget"
    return 0
  fi
  note "== $name (limit ${limit} s): $*"
  local t0=$SECONDS rc verdict="passed"
  timeout --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1
  rc=$?
  if [ $rc -eq 77 ]; then
    verdict="skipped (exit 77)"
  elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    verdict="TIMED OUT after ${limit} s"
    STATUS=1
  elif [ $rc -ne 0 ]; then
    verdict="FAILED (exit $rc)"
    STATUS=1
  fi
  record "$name" "$verdict" $((SECONDS - t0))
  note "   -> $verdict in $((SECONDS - t0)) s"
  return 0
}

# The commit the binaries were built at: EPMOE_COMMIT, else <build>/COMMIT (written by `gpu_check.sh pack`),
# else git's HEAD of this checkout (with a note when the tree has local changes).
build_commit() {
  if [ -n "${EPMOE_COMMIT:-}" ]; then
    echo "$EPMOE_COMMIT"
  elif [ -f "$BUILD/COMMIT" ]; then
    cat "$BUILD/COMMIT"
  elif git -C "$ROOT" rev-parse --short HEAD >/dev/null 2>&1; then
    local c
    c="$(git -C "$ROOT" rev-parse --short HEAD)"
    git -C "$ROOT" diff --quiet HEAD 2>/dev/null || c="$c (with local changes)"
    echo "$c"
  else
    echo "unknown"
  fi
}

# Puts on LD_LIBRARY_PATH what the binaries may miss on a GPU machine: <build>/lib (shared libraries a pack
# brings), the CUDA toolkit's libraries, and cuBLAS from the nvidia-cublas wheel when the toolkit has none.
setup_library_path() {
  local libs=""
  [ -d "$BUILD/lib" ] && libs="$(cd "$BUILD/lib" && pwd)"
  local d
  for d in /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/local/cuda/targets/x86_64-linux/lib; do
    [ -d "$d" ] && libs="${libs:+$libs:}$d"
  done
  local cublas
  cublas="$(python3 -c 'import nvidia.cublas as m, os; print(os.path.join(list(m.__path__)[0], "lib"))' 2>/dev/null)"
  [ -n "$cublas" ] && [ -d "$cublas" ] && libs="${libs:+$libs:}$cublas"
  export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
}

# The `epmoe` binary of the build (tools/epmoe, or tools/epmoe/epmoe in older layouts).
cli_binary() {
  if [ -f "$BUILD/tools/epmoe" ] && [ -x "$BUILD/tools/epmoe" ]; then
    echo "$BUILD/tools/epmoe"
  elif [ -x "$BUILD/tools/epmoe/epmoe" ]; then
    echo "$BUILD/tools/epmoe/epmoe"
  fi
}

# ensure_built TARGET:PATH...: builds the targets whose binary (PATH, relative to the build) is missing. Without
# a configured build it configures one (the release preset for build/release); NO_BUILD=1 only reports.
# Returns non-zero when a binary is still missing.
ensure_built() {
  local missing=() spec
  for spec in "$@"; do
    [ -x "$BUILD/${spec#*:}" ] || missing+=("${spec%%:*}")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ "${NO_BUILD:-0}" = 1 ]; then
    note "missing in $BUILD: ${missing[*]} (--no-build given)"
    return 1
  fi
  note "== building ${missing[*]} in $BUILD (log in $RESULTS/build.log)"
  if [ ! -f "$BUILD/CMakeCache.txt" ]; then
    if [ "$BUILD" = build/release ]; then
      cmake --preset release >>"$RESULTS/build.log" 2>&1
    else
      cmake -S "$ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release >>"$RESULTS/build.log" 2>&1
    fi || {
      note "configure failed (the GPU machine may lack the C++ -dev packages: make a pack on a machine that has"
      note "them with 'scripts/gpu_check.sh pack' and carry it); the end of build.log:"
      tail -15 "$RESULTS/build.log" | tee -a "$LOG"
      return 1
    }
  fi
  cmake --build "$BUILD" -j "$(nproc)" --target "${missing[@]}" >>"$RESULTS/build.log" 2>&1 || {
    note "build failed; the end of build.log:"
    tail -25 "$RESULTS/build.log" | tee -a "$LOG"
    return 1
  }
}

# Lists binaries whose shared libraries are not found (a pack from another machine may miss one).
report_missing_libraries() {
  local b missing
  for b in "$@"; do
    [ -x "$b" ] || continue
    missing="$(ldd "$b" 2>/dev/null | grep 'not found')"
    [ -n "$missing" ] && note "MISSING shared libraries for $b: $missing"
  done
  return 0
}

# The number of GPUs nvidia-smi lists (0 without a driver).
gpu_count() {
  nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true
}
