#!/usr/bin/env bash
# Gathers the C++ libraries epmoe builds against (fmt, spdlog, nlohmann_json, CLI11, OpenBLAS with its
# Fortran runtime) from this machine's Debian packages into one relocatable prefix, for a machine that has
# a compiler and CUDA but not these -dev packages (the GPU machines): carry the prefix there and
# `scripts/gpu_check.sh python` builds the Python package against it (CMAKE_PREFIX_PATH, LD_LIBRARY_PATH).
#
#   scripts/gpu/make_deps_prefix.sh [PREFIX]     # default build/deps (ignored by git), ~42 MB
#   scripts/gpu_check.sh deps                    # the same
#
# The CMake package files of these packages compute their prefix from their own location, so the copy
# works wherever it lands. Needs scripts/setup.sh's packages installed here.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PREFIX="${1:-$ROOT/build/deps}"
ARCH="$(gcc -print-multiarch 2>/dev/null || echo x86_64-linux-gnu)"
LIB="$PREFIX/lib/$ARCH"
rm -rf "$PREFIX"
mkdir -p "$PREFIX/include" "$LIB/cmake" "$PREFIX/share/cmake"

# Headers.
for d in fmt spdlog nlohmann CLI; do cp -r "/usr/include/$d" "$PREFIX/include/"; done
cp -L "/usr/include/$ARCH/cblas.h" "/usr/include/$ARCH/openblas_config.h" "$PREFIX/include/"

# Libraries (with their SONAME links) and CMake package files.
copy_lib() { # copy_lib GLOB...: every file or link matching, links kept as links
  local f
  for f in "$@"; do cp -P "$f" "$LIB/"; done
}
copy_lib /usr/lib/$ARCH/libfmt.so* /usr/lib/$ARCH/libspdlog.so*
cp -r "/usr/lib/$ARCH/cmake/fmt" "/usr/lib/$ARCH/cmake/spdlog" "$LIB/cmake/"
cp -r /usr/share/cmake/CLI11 /usr/share/cmake/nlohmann_json "$PREFIX/share/cmake/"
# OpenBLAS: the real file behind Debian's alternatives, under the names the linker and FindBLAS look for.
cp -L "/usr/lib/$ARCH/libopenblas.so.0" "$LIB/libopenblas.so.0"
ln -sf libopenblas.so.0 "$LIB/libopenblas.so"
for so in libgfortran.so.5 libquadmath.so.0; do cp -L "/usr/lib/$ARCH/$so" "$LIB/$so"; done
du -sh "$PREFIX"
echo "carry $(realpath --relative-to="$ROOT" "$PREFIX") to the GPU machine (device run: carry=[\"$(realpath --relative-to="$ROOT" "$PREFIX")\"])"
