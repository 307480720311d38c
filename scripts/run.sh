#!/usr/bin/env bash
# The main job: sets up, builds, and runs `epmoe run` (a full expert-parallel MoE layer checked
# against the float64 reference). Extra arguments go to `epmoe run` (see `epmoe run --help`).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup.sh"
epmoe_install_apt
echo "epmoe: building (the first build takes a few minutes; log in build/run-build.log)" >&2
mkdir -p "$ROOT/build"
epmoe_build release >"$ROOT/build/run-build.log" 2>&1 || { tail -30 "$ROOT/build/run-build.log" >&2; exit 1; }
exec "$ROOT/build/release/tools/epmoe" run "$@"
