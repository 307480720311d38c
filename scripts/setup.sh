#!/usr/bin/env bash
# Installs what is missing (Debian packages; Python packages into build/venv), then configures and
# builds one CMake preset. Sourced by run.sh and test.sh; usable alone: scripts/setup.sh [preset...]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

APT_PACKAGES=(cmake g++ make libgtest-dev libgmock-dev libbenchmark-dev libcli11-dev nlohmann-json3-dev
              libspdlog-dev libfmt-dev libopenblas-dev libopenmpi-dev openmpi-bin python3-venv)

epmoe_install_apt() {
  local missing=()
  for p in "${APT_PACKAGES[@]}"; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  echo "epmoe setup: installing ${missing[*]}"
  local sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  $sudo apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q "${missing[@]}" >/dev/null
}

epmoe_venv() {
  # Python tooling lives in a venv inside the build folder (never the system's site-packages).
  local req="$ROOT/python/requirements-dev.txt"
  [ -f "$req" ] || return 0
  local venv="$ROOT/build/venv"
  if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
  fi
  if [ ! -f "$venv/.stamp" ] || [ "$req" -nt "$venv/.stamp" ]; then
    "$venv/bin/pip" install -q --upgrade pip >/dev/null
    "$venv/bin/pip" install -q -r "$req"
    touch "$venv/.stamp"
  fi
}

epmoe_build() {
  local preset="$1"
  local jobs
  jobs="$(nproc 2>/dev/null || echo 2)"
  cmake --preset "$preset" >/dev/null
  cmake --build --preset "$preset" -j "$jobs"
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  epmoe_install_apt
  epmoe_venv
  for preset in "${@:-release}"; do epmoe_build "$preset"; done
fi
