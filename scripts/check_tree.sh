#!/usr/bin/env bash
# Checks of the tree itself, run first by scripts/test.sh (so CI keeps them); offline once build/venv exists.
#
#   scripts/check_tree.sh [words] [functions]      # default: both
#
# words      no text outside bench/results names the project's working history (numbered sessions or issues,
#            the machines results were measured on by their lending names): the tree must read on its own.
#            Every hit is printed as path:line:text.
# functions  no function in src, tools and python/src is longer than 120 lines, except those listed with a
#            reason in scripts/long_functions.txt (scripts/function_length.py, on lizard from
#            python/requirements-dev.txt).
# Exit status: 0 when every check asked for passed.
set -u -o pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

CHECKS=("$@")
[ ${#CHECKS[@]} -eq 0 ] && CHECKS=(words functions)
STATUS=0

# The pattern is written so that this file does not match it ([ ] is a plain space).
WORDS='session ?[0-9]|this[ ]session|issue ?[0-9]|carried[ ]build|device[ ]kind|the[ ]brief'

check_words() {
  local hits n
  hits="$(git grep -nIEi -e "$WORDS" -- . ':(exclude)bench/results' 2>/dev/null)"
  n="$(printf '%s' "$hits" | grep -c .)"
  if [ "$n" -gt 0 ]; then
    echo "check_tree words: FAILED: $n lines outside bench/results name sessions, issues or lending words:"
    printf '%s\n' "$hits" | sed 's/^/  /'
    echo "check_tree words: $n hits in $(printf '%s\n' "$hits" | cut -d: -f1 | sort -u | wc -l) files"
    STATUS=1
  else
    echo "check_tree words: passed"
  fi
}

check_functions() {
  local py=python3
  [ -x "$ROOT/build/venv/bin/python" ] && py="$ROOT/build/venv/bin/python"
  if ! "$py" -c 'import lizard' 2>/dev/null; then
    echo "check_tree functions: FAILED: $py has no lizard (scripts/setup.sh installs python/requirements-dev.txt" \
      "into build/venv)"
    STATUS=1
    return
  fi
  if "$py" "$ROOT/scripts/function_length.py" --limit 120 --allow scripts/long_functions.txt src tools python/src; then
    echo "check_tree functions: passed"
  else
    echo "check_tree functions: FAILED"
    STATUS=1
  fi
}

for c in "${CHECKS[@]}"; do
  case "$c" in
    words) check_words ;;
    functions) check_functions ;;
    *) echo "check_tree.sh: unknown check '$c' (words, functions)" >&2; exit 2 ;;
  esac
done
exit $STATUS
