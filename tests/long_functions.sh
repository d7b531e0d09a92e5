#!/bin/bash
# No function of server/ or worker/ longer than a limit (issue 61: a function that long mixes
# concerns; split it). Counts a function from the line of its name to its closing brace, the
# style every file here follows (the opening and closing braces of a function at column 0).
#   bash tests/long_functions.sh [LIMIT]     (default 120; the "long-functions" unit test)
# Prints every function over LIMIT lines (lines, file:line, name) and exits 1 if there is one.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 - "${1:-120}" <<'PY'
import glob, re, sys
limit = int(sys.argv[1])
files = sorted(glob.glob("server/*.c") + glob.glob("worker/*.c") + glob.glob("worker/*/*.c") + glob.glob("worker/*/*.cu"))
over = []
for f in files:
    lines = open(f, errors="replace").read().split("\n")
    i = 0
    while i < len(lines):
        if lines[i] == "{" and i > 0:
            j = i - 1  # the line with the function's name: the first of its declarator
            while j > 0 and "(" not in lines[j]:
                j -= 1
            names = re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*\(", lines[j])
            k = i + 1
            while k < len(lines) and lines[k] != "}":
                k += 1
            if k - j + 1 > limit:
                over.append((k - j + 1, "%s:%d" % (f, j + 1), names[0] if names else "?"))
            i = k
        i += 1
for n, where, name in sorted(over, reverse=True):
    print("%4d lines  %s  %s" % (n, where, name))
print("long-functions: %d files, %s" % (len(files), "%d function(s) over %d lines" % (len(over), limit) if over
                                        else "none over %d lines" % limit))
sys.exit(1 if over else 0)
PY
