#!/usr/bin/env bash
# The Python package on a GPU machine: builds epmoe with CUDA for that machine's python3, offline, then
# runs the whole Python suite (python/tests: CPU tests, torch tests, and python/tests/gpu).
#
#   python/tests/gpu/run_gpu_tests.sh        # from anywhere; results in $OUT (or ./gpu-results)
#
# One GPU is enough: when nvidia-smi lists one GPU, this sets EPMOE_TEST_SHARE_GPU=1 (unless already set), and
# the GPU tests' two processes share cuda:0 (python/tests/gpu/launch.py); the NCCL-group and thread-rank tests
# then skip (they need a GPU per rank). With 2 or more GPUs each process has its own (EPMOE_TEST_SHARE_GPU=1
# forces sharing cuda:0 there too).
#
# Needs there: python3 with torch, numpy, ml_dtypes, nanobind, scikit-build-core and pytest; nvcc and cmake;
# no network. The C++ libraries epmoe builds against come from the system, or from a prefix made here by
# python/tests/gpu/make_deps_prefix.sh (default build/h3-py-deps; set EPMOE_DEPS_PREFIX) and carried along.
# The package goes to a private folder ($EPMOE_PY_TARGET, default /tmp/epmoe-py) put first on PYTHONPATH,
# so the machine's own site-packages stay untouched; the build folder (build/gpu-py) is reused by a later
# call on the same machine.
#
# Writes to $OUT: build.log (the pip build), pytest.log, junit.xml, env.txt. Exit status: pytest's (or 1
# when the build fails). Limits in seconds, so the logs come back inside a 600 s device call: the build
# EPMOE_BUILD_LIMIT (default 420), pytest EPMOE_PYTEST_LIMIT (default 300). EPMOE_PYTEST_ARGS adds pytest
# arguments (e.g. "-k thread_ranks"). EPMOE_SKIP_BUILD=1 reuses the package a previous call installed in
# $EPMOE_PY_TARGET (a warm machine), e.g. to re-run the tests alone.
set -u -o pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
cd "$ROOT"
RESULTS="${OUT:-$ROOT/gpu-results}"
mkdir -p "$RESULTS"
PY="${EPMOE_PYTHON:-python3}"
TARGET="${EPMOE_PY_TARGET:-/tmp/epmoe-py}"
DEPS="${EPMOE_DEPS_PREFIX:-$ROOT/build/h3-py-deps}"
# NVLink multicast stays off on shared machines (KINDS.md); epmoe never uses it, this guards NCCL.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export EPMOE_TIMEOUT_S="${EPMOE_TIMEOUT_S:-20}" PYTHONUNBUFFERED=1
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
# One GPU: the GPU tests' two processes share it (launch.py would choose so too; set here so env.txt says it).
GPUS="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)"
if [ "${GPUS:-0}" = 1 ] && [ -z "${EPMOE_TEST_SHARE_GPU:-}" ]; then
  export EPMOE_TEST_SHARE_GPU=1
fi

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: ${EPMOE_COMMIT:-$(git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo unknown)}"
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader 2>&1
  "$PY" -c 'import sys, torch, numpy; print("python", sys.version.split()[0], "torch", torch.__version__,
"cuda", torch.version.cuda, "gpus", torch.cuda.device_count(), "numpy", numpy.__version__)' 2>&1
  "$PY" -m pip list 2>/dev/null | grep -iE '^(nanobind|scikit.build.core|ml.dtypes|pytest|cupy|mpi4py) ' || true
  command -v nvcc cmake ninja 2>&1
  echo "GPUs (nvidia-smi -L): ${GPUS:-0}; EPMOE_TEST_SHARE_GPU=${EPMOE_TEST_SHARE_GPU:-unset}"
} >"$RESULTS/env.txt"
cat "$RESULTS/env.txt"

# C++ libraries from the carried prefix, when there is one.
CMAKE_DEFS=(-C cmake.define.EPMOE_ENABLE_CUDA=ON -C build-dir=build/gpu-py)
if [ -d "$DEPS" ]; then
  LIBDIRS="$(find "$DEPS/lib" -maxdepth 1 -mindepth 1 -type d -printf '%p:' 2>/dev/null)$DEPS/lib"
  export CMAKE_PREFIX_PATH="$DEPS${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
  export LD_LIBRARY_PATH="$LIBDIRS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export LIBRARY_PATH="$LIBDIRS${LIBRARY_PATH:+:$LIBRARY_PATH}"
  export CPATH="$DEPS/include${CPATH:+:$CPATH}"
  CMAKE_DEFS+=(-C cmake.define.BLA_VENDOR=OpenBLAS)
  echo "C++ libraries from $DEPS"
fi
# cuBLAS: the toolkit's, else the pip wheel's (nvidia-cublas ships only versioned names: link them).
if ! ls /usr/local/cuda/lib64/libcublas.so /usr/local/cuda/lib/libcublas.so >/dev/null 2>&1; then
  CUBLAS="$("$PY" -c 'import nvidia.cublas as m, os; print(os.path.join(list(m.__path__)[0], "lib"))' 2>/dev/null)"
  if [ -n "$CUBLAS" ] && [ -d "$CUBLAS" ]; then
    LINKS=/tmp/epmoe-cublas-links
    mkdir -p "$LINKS"
    for so in "$CUBLAS"/libcublas*.so.*; do
      base="$(basename "$so")"
      ln -sf "$so" "$LINKS/${base%%.so.*}.so"
    done
    export LIBRARY_PATH="$LINKS${LIBRARY_PATH:+:$LIBRARY_PATH}"
    export LD_LIBRARY_PATH="$CUBLAS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    CMAKE_DEFS+=(-C "cmake.define.CMAKE_LIBRARY_PATH=$LINKS")
    echo "cuBLAS from $CUBLAS"
  fi
fi

if [ "${EPMOE_SKIP_BUILD:-0}" = 1 ] && [ -d "$TARGET/epmoe" ]; then
  echo "== reusing the package in $TARGET (EPMOE_SKIP_BUILD=1)"
else
  echo "== building epmoe (CUDA on) into $TARGET"
  rm -rf "$TARGET"
  t0=$SECONDS
  if ! timeout --kill-after=10 "${EPMOE_BUILD_LIMIT:-420}" "$PY" -m pip install --no-build-isolation --no-deps \
       --no-index --no-cache-dir --target "$TARGET" "${CMAKE_DEFS[@]}" "$ROOT" >"$RESULTS/build.log" 2>&1; then
    echo "build FAILED (or timed out) after $((SECONDS - t0)) s; the end of $RESULTS/build.log:"
    tail -40 "$RESULTS/build.log"
    exit 1
  fi
  echo "built in $((SECONDS - t0)) s"
fi
export PYTHONPATH="$TARGET${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c 'import epmoe; print("epmoe", epmoe.__version__, "from", epmoe.__file__, "built_with_cuda", epmoe.built_with_cuda())' \
  | tee -a "$RESULTS/env.txt"

echo "== pytest python/tests (GPU tests included)"
cd "$RESULTS"  # so no ./epmoe source folder shadows the installed package
timeout --kill-after=10 "${EPMOE_PYTEST_LIMIT:-300}" "$PY" -m pytest -v -rs -p no:cacheprovider \
  --junitxml="$RESULTS/junit.xml" "$ROOT/python/tests" ${EPMOE_PYTEST_ARGS:-} >"$RESULTS/pytest.log" 2>&1
STATUS=$?
grep -E "PASSED|FAILED|ERROR|SKIPPED" "$RESULTS/pytest.log" | grep -E "gpu/|FAILED|ERROR" | head -40
tail -5 "$RESULTS/pytest.log"
exit $STATUS
