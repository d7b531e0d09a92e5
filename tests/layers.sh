#!/bin/bash
# Which file of psd's server calls which: the edges between server/*.c
# (from the compiled objects' symbols: each undefined function of a file and
# the file that defines it), and the circles among them (files that call
# each other, directly or around). A layered server has no circle.
#   bash tests/layers.sh [BUILD_DIR]     (default build/)
# Prints the edges, then "circle: a b c" for each set of files that call
# each other; exit 0 either way (a map, not a test).
set -euo pipefail
cd "$(dirname "$0")/.."
B=${1:-build}
OBJ="$B/libpsdserver.a.p"
[ -d "$OBJ" ] || { echo "layers: no $OBJ (build first: ninja -C $B)" >&2; exit 2; }
python3 - "$OBJ" <<'PY'
import collections, glob, os, subprocess, sys
obj = sys.argv[1]
defs, uses = {}, collections.defaultdict(set)
for o in sorted(glob.glob(os.path.join(obj, "server_*.c.o"))):
    f = os.path.basename(o)[len("server_"):-len(".o")]
    for line in subprocess.run(["nm", o], capture_output=True, text=True, check=True).stdout.splitlines():
        p = line.split()
        if len(p) == 3 and p[1] == "T":
            defs[p[2]] = f
        elif len(p) == 2 and p[0] == "U":
            uses[f].add(p[1])
edges = collections.defaultdict(set)
for f, syms in uses.items():
    for s in syms:
        g = defs.get(s)
        if g and g != f:
            edges[f].add(g)
for f in sorted(edges):
    print(f"{f} -> {' '.join(sorted(edges[f]))}")
# strongly connected components (Tarjan)
index, low, stack, on, out, n = {}, {}, [], set(), [], [0]
def visit(v):
    index[v] = low[v] = n[0]; n[0] += 1; stack.append(v); on.add(v)
    for w in edges.get(v, ()):
        if w not in index:
            visit(w); low[v] = min(low[v], low[w])
        elif w in on:
            low[v] = min(low[v], index[w])
    if low[v] == index[v]:
        comp = []
        while True:
            w = stack.pop(); on.discard(w); comp.append(w)
            if w == v: break
        if len(comp) > 1: out.append(sorted(comp))
for v in sorted(set(edges) | {g for s in edges.values() for g in s}):
    if v not in index: visit(v)
for c in out:
    print("circle:", " ".join(c))
if not out:
    print("no circle")
PY
