#!/usr/bin/env bash
# The main job: sets up, builds, and runs `epmoe run` (a full expert-parallel MoE layer checked
# against the float64 reference). Extra arguments go to `epmoe run` (see `epmoe run --help`).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup.sh"
epmoe_install_apt
epmoe_build release >/dev/null
exec "$ROOT/build/release/tools/epmoe" run "$@"
