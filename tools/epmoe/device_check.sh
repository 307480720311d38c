#!/usr/bin/env bash
# `epmoe run`, `epmoe tune`, `epmoe bench` and the CLI tests on a GPU machine, from a build made elsewhere.
#
#   tools/epmoe/device_check.sh pack [BUILD]    # here: BUILD (default build/h4-cli, a CUDA build holding
#                                               # tools/epmoe and tests/test_tools) -> BUILD/device (~15 MB:
#                                               # the two binaries and the shared libraries a GPU machine may lack)
#   tools/epmoe/device_check.sh run [DEVICE]    # there: DEVICE (default build/h4-cli/device); logs and JSON to
#                                               # $OUT (or ./gpu-results)
# Exit status of `run`: 0 when every step passed.
set -u -o pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"

if [ "${1:-}" = pack ]; then
  BUILD="${2:-build/h4-cli}"
  DEV="$BUILD/device"
  rm -rf "$DEV" && mkdir -p "$DEV/lib"
  cp "$BUILD/tools/epmoe" "$BUILD/tests/test_tools" "$DEV/"
  # What the H200 machines lack (the list of build/h-ipc/carried-lib); cuBLAS and NCCL are found there.
  for lib in libcudart.so.13 libfmt.so.9 libmpi.so.40 libmpi_cxx.so.40 libopen-pal.so.40 libopen-rte.so.40 \
    libhwloc.so.15 libevent_core-2.1.so.7 libevent_pthreads-2.1.so.7 libudev.so.1 libz.so.1; do
    path="$(ldd "$DEV/epmoe" | awk -v l="$lib" '$1 == l {print $3}')"
    [ -n "$path" ] && cp -L "$path" "$DEV/lib/"
  done
  du -sh "$DEV"
  exit 0
fi

DEV="${2:-build/h4-cli/device}"
RESULTS="${OUT:-$ROOT/gpu-results}"
mkdir -p "$RESULTS"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # no NVLink multicast here
export EPMOE_TIMEOUT_S="${EPMOE_TIMEOUT_S:-30}"
LIBS="$ROOT/$DEV/lib"
for d in /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/local/cuda/targets/x86_64-linux/lib; do
  [ -d "$d" ] && LIBS="$LIBS:$d"
done
CUBLAS="$(python3 -c 'import nvidia.cublas as m, os; print(os.path.join(list(m.__path__)[0], "lib"))' 2>/dev/null)"
[ -n "$CUBLAS" ] && LIBS="$LIBS:$CUBLAS"
if ! LD_LIBRARY_PATH="$LIBS" ldd "$DEV/epmoe" | grep -q 'libcublasLt.so.13 => /'; then
  found="$(timeout 20 find /usr /opt -name 'libcublasLt.so.13*' 2>/dev/null | head -1)"
  [ -n "$found" ] && LIBS="$LIBS:$(dirname "$found")"
fi
export LD_LIBRARY_PATH="$LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
EPMOE="$DEV/epmoe"

nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
ldd "$EPMOE" "$DEV/test_tools" | grep 'not found'
STATUS=0
step() { # step NAME LIMIT_S COMMAND...: output to $RESULTS/NAME.log, its tail printed
  local name="$1" limit="$2" t0=$SECONDS rc
  shift 2
  echo "== $name: $*"
  timeout --kill-after=5 "$limit" "$@" >"$RESULTS/$name.log" 2>&1
  rc=$?
  tail -n "${TAIL:-16}" "$RESULTS/$name.log"
  [ $rc -ne 0 ] && STATUS=1
  echo "   -> exit $rc in $((SECONDS - t0)) s"
}
step run_bf16 60 "$EPMOE" run --json "$RESULTS/run_bf16.json"
step run_fp8 60 "$EPMOE" run --dispatch-dtype fp8 --json "$RESULTS/run_fp8.json"
step run_replay 60 "$EPMOE" run --routing tests/data/olmoe-routing --domain coding --tokens 1024 --json "$RESULTS/run_replay.json"
TAIL=8 step test_tools 120 env EPMOE_CLI="$EPMOE" "$DEV/test_tools"
TAIL=14 step tune 90 "$EPMOE" tune --tokens 4096 --hidden 7168 --topk 8 --experts 256 --runs 20 -o "$RESULTS/tune.json"
CFG=()
[ -f "$RESULTS/tune.json" ] && CFG=(--config "$RESULTS/tune.json")
TAIL=50 step bench 200 "$EPMOE" bench "${CFG[@]}" --json "$RESULTS/bench.json"
exit $STATUS
