# Part `python` of scripts/gpu_check.sh (sourced): builds the Python package with CUDA for this machine's python3,
# offline, then runs the whole Python suite (python/tests: CPU tests, torch tests, and python/tests/gpu).
#
# One GPU is enough: with one GPU listed, EPMOE_TEST_SHARE_GPU=1 is set (unless already set) and the GPU tests'
# two processes share cuda:0 (python/tests/gpu/launch.py); the NCCL-group and thread-rank tests then skip (they
# need a GPU per rank).
#
# Needs there: python3 with torch, numpy, ml_dtypes, nanobind, scikit-build-core and pytest; nvcc and cmake; no
# network. The C++ libraries come from the system, or from the prefix `scripts/gpu_check.sh deps` makes on a
# machine that has them (build/deps; --deps DIR or EPMOE_DEPS_PREFIX), carried along. The package goes to a private
# folder (EPMOE_PY_TARGET, default /tmp/epmoe-py) put first on PYTHONPATH, so the machine's site-packages stay
# untouched; its CMake build folder is build/python-gpu (reused by a later run on the same machine).
# EPMOE_PYTEST_ARGS adds pytest arguments, split at spaces (e.g. "-x -q"); EPMOE_PYTEST_K a -k expression, kept whole
# (e.g. "low_latency or accessors"); EPMOE_SKIP_BUILD=1 reuses the package an
# earlier run on the same machine installed. Writes python_env.txt and junit.xml; the pip build's and pytest's
# output go to gpu_check.log.

# Builds the Python package with CUDA for `py` into the folder `target` (offline; C++ libraries from `deps` when
# that folder exists, cuBLAS from the toolkit or the pip wheel), as one step of the calling part; with
# EPMOE_SKIP_BUILD=1 reuses an earlier build there. Returns non-zero (after a note) when no package came out. Used
# by the parts python and deepep.
build_python_package() {
  local py="$1" target="$2" deps="$3"
  local defs=(-C cmake.define.EPMOE_ENABLE_CUDA=ON -C build-dir=build/python-gpu)
  if [ -d "$deps" ]; then
    local libdirs
    libdirs="$(find "$deps/lib" -maxdepth 1 -mindepth 1 -type d -printf '%p:' 2>/dev/null)$deps/lib"
    export CMAKE_PREFIX_PATH="$deps${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
    export LD_LIBRARY_PATH="$libdirs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export LIBRARY_PATH="$libdirs${LIBRARY_PATH:+:$LIBRARY_PATH}"
    export CPATH="$deps/include${CPATH:+:$CPATH}"
    defs+=(-C cmake.define.BLA_VENDOR=OpenBLAS)
    note "C++ libraries from $deps"
  fi
  # cuBLAS: the toolkit's, else the pip wheel's (nvidia-cublas ships only versioned names: link them).
  if ! ls /usr/local/cuda/lib64/libcublas.so /usr/local/cuda/lib/libcublas.so >/dev/null 2>&1; then
    local cublas
    cublas="$("$py" -c 'import nvidia.cublas as m, os; print(os.path.join(list(m.__path__)[0], "lib"))' 2>/dev/null)"
    if [ -n "$cublas" ] && [ -d "$cublas" ]; then
      local links=/tmp/epmoe-cublas-links so base
      mkdir -p "$links"
      for so in "$cublas"/libcublas*.so.*; do
        base="$(basename "$so")"
        ln -sf "$so" "$links/${base%%.so.*}.so"
      done
      export LIBRARY_PATH="$links${LIBRARY_PATH:+:$LIBRARY_PATH}"
      export LD_LIBRARY_PATH="$cublas${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
      defs+=(-C "cmake.define.CMAKE_LIBRARY_PATH=$links")
      note "cuBLAS from $cublas"
    fi
  fi

  if [ "${EPMOE_SKIP_BUILD:-0}" = 1 ] && [ -d "$target/epmoe" ]; then
    note "== reusing the package in $target (EPMOE_SKIP_BUILD=1)"
  else
    rm -rf "$target"
    step "python package build (CUDA on)" 330 "$py" -m pip install --no-build-isolation --no-deps --no-index \
      --no-cache-dir --target "$target" "${defs[@]}" "$ROOT"
    if [ ! -d "$target/epmoe" ]; then
      note "the package did not build; the end of the log:"
      grep -n 'error\|Error' "$LOG" | tail -20
      return 1
    fi
  fi
}

part_python() {
  part_begin python 570
  local py="${EPMOE_PYTHON:-python3}"
  local target="${EPMOE_PY_TARGET:-/tmp/epmoe-py}"
  local deps="${DEPS_PREFIX:-${EPMOE_DEPS_PREFIX:-$ROOT/build/deps}}"
  export EPMOE_TIMEOUT_S="${EPMOE_TIMEOUT_S:-20}"
  export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
  local gpus
  gpus="$(gpu_count)"
  [ "${gpus:-0}" = 1 ] && [ -z "${EPMOE_TEST_SHARE_GPU:-}" ] && export EPMOE_TEST_SHARE_GPU=1
  {
    "$py" -c 'import sys, torch, numpy; print("python", sys.version.split()[0], "torch", torch.__version__,
"cuda", torch.version.cuda, "gpus", torch.cuda.device_count(), "numpy", numpy.__version__)' 2>&1
    "$py" -m pip list 2>/dev/null | grep -iE '^(nanobind|scikit.build.core|ml.dtypes|pytest|cupy|mpi4py) ' || true
    command -v nvcc cmake ninja 2>&1
    echo "GPUs (nvidia-smi -L): ${gpus:-0}; EPMOE_TEST_SHARE_GPU=${EPMOE_TEST_SHARE_GPU:-unset}"
  } >"$RESULTS/python_env.txt"
  cat "$RESULTS/python_env.txt" >>"$LOG"

  build_python_package "$py" "$target" "$deps" || return 0
  export PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}"
  "$py" -c 'import epmoe; print("epmoe", epmoe.__version__, "from", epmoe.__file__, "built_with_cuda",
epmoe.built_with_cuda())' >>"$RESULTS/python_env.txt" 2>&1
  # From the results folder, so no ./epmoe source folder shadows the installed package.
  # shellcheck disable=SC2086
  step "python suite (python/tests, GPU tests included)" 300 bash -c 'cd "$1" && shift && "$@"' _ "$RESULTS" \
    "$py" -m pytest -v -rs -p no:cacheprovider --junitxml="$RESULTS/junit.xml" "$ROOT/python/tests" \
    ${EPMOE_PYTEST_K:+-k "$EPMOE_PYTEST_K"} ${EPMOE_PYTEST_ARGS:-}
  grep -E '(PASSED|FAILED|ERROR|SKIPPED)' "$LOG" | grep -E 'gpu/|FAILED|ERROR' | tail -40
}
