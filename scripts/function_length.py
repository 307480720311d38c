#!/usr/bin/env python3
"""Function-length report: every function of the C++/CUDA sources longer than a limit, by lizard.

    function_length.py [--limit 120] [--allow scripts/long_functions.txt] [PATH...]   (default: src tools python/src)

Lengths are lizard's: the lines from a function's first line to its closing brace. .cu and .cuh files are read as
C++. Functions listed in the allow file (lines `path:function  why`; `#` starts a comment) may be longer; the
report names every other one and exits 1 then. Entries that no longer match a long function are reported as
stale (to trim the list), without failing. Offline: needs only the lizard package (python/requirements-dev.txt).
"""

import argparse
import os
import subprocess
import sys

try:
    import lizard
except ImportError:
    sys.exit("function_length.py: the Python package 'lizard' is missing (pip install -r python/requirements-dev.txt)")

SUFFIXES = {".cpp": ".cpp", ".cc": ".cpp", ".hpp": ".hpp", ".h": ".h", ".cu": ".cpp", ".cuh": ".hpp"}


def source_files(root, paths):
    """Tracked files under `paths` (git ls-files), else every file found there."""
    try:
        out = subprocess.run(["git", "-C", root, "ls-files", "--", *paths], check=True, capture_output=True,
                             text=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        out = []
        for p in paths:
            for d, _, names in os.walk(os.path.join(root, p)):
                out += [os.path.relpath(os.path.join(d, n), root) for n in names]
    return sorted(f for f in out if os.path.splitext(f)[1] in SUFFIXES)


def long_functions(root, files, limit):
    """(path, function name, length, first line) of every function longer than `limit` lines."""
    found = []
    for rel in files:
        with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as fh:
            code = fh.read()
        base, ext = os.path.splitext(rel)
        info = lizard.analyze_file.analyze_source_code(base + SUFFIXES[ext], code)
        for fn in info.function_list:
            length = fn.end_line - fn.start_line + 1
            if length > limit:
                found.append((rel, fn.name, length, fn.start_line))
    return found


def read_allow_list(path):
    """{(path, function): why} from lines `path:function  why`."""
    allowed = {}
    if not os.path.exists(path):
        return allowed
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            key, _, why = line.partition(" ")
            file, sep, func = key.partition(":")
            if not sep or not func:
                sys.exit(f"{path}:{n}: expected 'path:function  why', got '{line}'")
            allowed[(file, func)] = why.strip()
    return allowed


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="*", default=["src", "tools", "python/src"])
    ap.add_argument("--limit", type=int, default=120)
    ap.add_argument("--allow", default="scripts/long_functions.txt")
    ap.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ap.add_argument("--list", action="store_true", help="print every long function as an allow-list line")
    args = ap.parse_args()

    found = long_functions(args.root, source_files(args.root, args.paths), args.limit)
    if args.list:
        for rel, name, length, line in found:
            print(f"{rel}:{name}  {length} lines (line {line})")
        return 0
    allowed = read_allow_list(os.path.join(args.root, args.allow))
    over = [f for f in found if (f[0], f[1]) not in allowed]
    seen = {(f[0], f[1]) for f in found}
    stale = [k for k in allowed if k not in seen]
    print(f"function length: {len(found)} functions over {args.limit} lines in {' '.join(args.paths)}; "
          f"{len(found) - len(over)} listed in {args.allow}, {len(over)} not")
    for rel, name, length, line in over:
        print(f"  {rel}:{line}: {name} has {length} lines (limit {args.limit}; split it, or list it in {args.allow})")
    for rel, name in stale:
        print(f"  stale entry in {args.allow}: {rel}:{name} (no longer over {args.limit} lines: remove it)")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
