#!/usr/bin/env bash
# The main job: sets up, builds, and runs `epmoe run` (a full expert-parallel MoE layer checked
# against the float64 reference). Extra arguments go to `epmoe run` (see `epmoe run --help`).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup.sh"
epmoe_install_apt
# Says it is building only when there is something to build: no binary yet, or build inputs newer than the binary
# and than the last build this script finished (its stamp; a build of the tests alone leaves the binary older). With
# inputs newer than the binary but no stamp (a build made another way), whether anything is built is not known.
BIN="$ROOT/build/release/tools/epmoe"
STAMP="$ROOT/build/run-build.stamp"
newer_inputs() {  # the first build input newer than every file given
  local newer=()
  for f in "$@"; do newer+=(-newer "$f"); done
  find "$ROOT/CMakeLists.txt" "$ROOT/CMakePresets.json" "$ROOT/cmake" "$ROOT/include" "$ROOT/src" "$ROOT/tools" \
    "$ROOT/tests" "$ROOT/bench" -path "$ROOT/bench/results" -prune -o -type f "${newer[@]}" -print -quit 2>/dev/null
}
if [[ ! -x "$BIN" ]]; then
  echo "epmoe: building (the first build takes a few minutes; log in build/run-build.log)" >&2
elif [[ -n "$(newer_inputs "$BIN")" ]]; then
  if [[ ! -e "$STAMP" ]]; then
    echo "epmoe: checking the build (log in build/run-build.log)" >&2
  elif [[ -n "$(newer_inputs "$BIN" "$STAMP")" ]]; then
    echo "epmoe: building (sources changed since the last build; log in build/run-build.log)" >&2
  fi
fi
mkdir -p "$ROOT/build"
touch "$STAMP.new"  # before the build: a source saved during it is newer than the stamp, so built next time
epmoe_build release >"$ROOT/build/run-build.log" 2>&1 || { tail -30 "$ROOT/build/run-build.log" >&2; exit 1; }
mv -f "$STAMP.new" "$STAMP"
exec "$ROOT/build/release/tools/epmoe" run "$@"
