#!/usr/bin/env bash
# The whole test suite: sets up, checks the tree (scripts/check_tree.sh: wording, function lengths), builds and
# tests the release build (CUDA sources compiled when nvcc is present; GPU tests skip without a GPU), then a
# CPU-only build under AddressSanitizer + UndefinedBehaviorSanitizer, then the Python tests when the package
# exists. A failed tree check fails the run at the end, after the tests (so both are reported).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup.sh"
cd "$ROOT"
epmoe_install_apt
epmoe_venv
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
jobs="$(nproc 2>/dev/null || echo 2)"

echo "== tree checks"
tree_ok=1
"$ROOT/scripts/check_tree.sh" || tree_ok=0

echo "== release build and tests"
epmoe_build release
ctest --preset release -j "$jobs"

echo "== AddressSanitizer + UndefinedBehaviorSanitizer build and tests (CPU only)"
epmoe_build asan
ASAN_OPTIONS="detect_leaks=1:abort_on_error=1" UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1" \
  ctest --preset asan -j "$jobs"

if [ -f "$ROOT/python/pyproject.toml" ] || [ -f "$ROOT/pyproject.toml" ]; then
  echo "== Python tests"
  # Offline-capable (the venv holds nanobind and scikit-build-core); builds in build/python, CPU-only.
  CMAKE_BUILD_PARALLEL_LEVEL="$jobs" "$ROOT/build/venv/bin/pip" install -q --no-build-isolation "$ROOT"
  "$ROOT/build/venv/bin/python" -m pytest -q "$ROOT/python/tests"
fi
if [ "$tree_ok" = 0 ]; then
  echo "== tests passed, but the tree checks FAILED (scripts/check_tree.sh, output at the top)"
  exit 1
fi
echo "== all tests passed"
