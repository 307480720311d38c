# `scripts/gpu_check.sh pack`, sourced: on a machine that builds epmoe (the -dev packages installed), copies the
# GPU binaries of a CUDA build and the shared libraries a GPU machine lacks into one small folder that travels
# to the GPU machine, where `scripts/gpu_check.sh PART --build <that folder>` runs them.
#
#   scripts/gpu_check.sh pack [PART...] [--build build/release] [--to build/release-pack]
#
# PARTs pick the binaries (default: every part's): tests and sanitizer test_gpu and test_mpi; cli epmoe and
# test_tools; bench every bench_gpu_*; ipc test_gpu and bench_gpu_normal_mode; ab bench_gpu_normal_mode; llab
# bench_gpu_low_latency (pack the base commit's too, into another folder, for --base). The
# layout mirrors the build (tests/, tests/mpi/, tools/, bench/) so gpu_check.sh finds them the same way; the
# binaries are stripped; lib/ holds the libraries; COMMIT names the commit they were built at. The build must
# exist (scripts/setup.sh release, with nvcc present).

# Libraries the GPU machines lack (found by ldd there); cuBLAS, NCCL and OpenBLAS are found on them.
# EPMOE_PACK_LIBS adds more names (space-separated sonames).
PACK_LIBS=(libcudart.so.13 libfmt.so.9 libmpi.so.40 libmpi_cxx.so.40 libopen-pal.so.40 libopen-rte.so.40
           libhwloc.so.15 libevent_core-2.1.so.7 libevent_pthreads-2.1.so.7 libudev.so.1 libz.so.1)

pack_binaries_of() {  # pack_binaries_of PART: binaries (relative to the build) the part runs
  case "$1" in
    tests | sanitizer) echo tests/test_gpu tests/mpi/test_mpi ;;
    cli) echo tools/epmoe tests/test_tools ;;
    bench) (cd "$BUILD" && ls bench/bench_gpu_* 2>/dev/null) ;;
    ipc) echo tests/test_gpu bench/bench_gpu_normal_mode ;;
    ab) echo bench/bench_gpu_normal_mode ;;
    llab) echo bench/bench_gpu_low_latency ;;
    python | anchors) ;;  # built on the GPU machine
    *) echo "pack: unknown part '$1'" >&2 ;;
  esac
}

run_pack() {  # run_pack TO PART...
  local to="$1"
  shift
  local parts=("$@")
  [ ${#parts[@]} -eq 0 ] && parts=(tests cli bench)
  if [ ! -f "$BUILD/CMakeCache.txt" ]; then
    echo "pack: no build in $BUILD (run scripts/setup.sh release first, with nvcc present)" >&2
    return 1
  fi
  grep -q '^EPMOE_ENABLE_CUDA:BOOL=ON' "$BUILD/CMakeCache.txt" ||
    echo "pack: warning: $BUILD was configured without CUDA; its GPU tests will skip" >&2
  local bins=() p b
  for p in "${parts[@]}"; do
    for b in $(pack_binaries_of "$p"); do
      case " ${bins[*]} " in *" $b "*) ;; *) bins+=("$b") ;; esac
    done
  done
  rm -rf "$to" && mkdir -p "$to/lib"
  for b in "${bins[@]}"; do
    if [ ! -x "$BUILD/$b" ]; then
      echo "pack: $BUILD/$b is missing (build its target first)" >&2
      return 1
    fi
    mkdir -p "$to/$(dirname "$b")"
    cp "$BUILD/$b" "$to/$b"
    strip --strip-unneeded "$to/$b" 2>/dev/null || true
  done
  local lib path
  for lib in "${PACK_LIBS[@]}" ${EPMOE_PACK_LIBS:-}; do
    for b in "${bins[@]}"; do
      path="$(ldd "$BUILD/$b" 2>/dev/null | awk -v l="$lib" '$1 == l {print $3}')"
      if [ -n "$path" ]; then
        cp -L "$path" "$to/lib/"
        break
      fi
    done
  done
  # The commit of the checkout the build was configured from.
  local src
  src="$(sed -n 's/^CMAKE_HOME_DIRECTORY:INTERNAL=//p' "$BUILD/CMakeCache.txt")"
  git -C "${src:-$ROOT}" rev-parse --short HEAD >"$to/COMMIT" 2>/dev/null || echo unknown >"$to/COMMIT"
  git -C "${src:-$ROOT}" diff --quiet HEAD 2>/dev/null || sed -i 's/$/ (with local changes)/' "$to/COMMIT"
  du -sh "$to"
  echo "pack: $(cat "$to/COMMIT"): ${bins[*]}"
  echo "pack: on the GPU machine: scripts/gpu_check.sh ${parts[*]} --build ${to#"$ROOT"/} (carry ${to#"$ROOT"/})"
}
