#!/bin/bash
# Which file of psd's server calls which: the edges between server/*.c
# (from the compiled objects' symbols: each undefined function of a file and
# the file that defines it), and the circles among them (files that call
# each other, directly or around). A layered server has no circle: a
# message's calls from the dispatch to its reply only ever go down, never
# back into a file they left.
#   bash tests/layers.sh [--check] [BUILD_DIR]     (default build/)
# Prints the edges, then "circle: a b c" for each set of files that call
# each other, or "no circle", and each use of a layer above (the order in
# psd_core.h). With --check (the "server-layers" test) it exits 1 on a
# circle, a use of a layer above, or psd_shard.c (shards 1..n-1) including
# or using anything of the coordinator's. Functions and data (tables,
# names) count alike.
# The names (issue 61): --check also exits 1, naming each, on a global
# symbol (nm T, D, R, B) of a server object without the prefix psd_ (but
# those of UNPREFIXED below, each with its reason; compiler-made names,
# with a "." or a leading "__", aside), on a static (t, d, r, b) of one file
# named as another file's global, and on psd_core.h including the shell's
# header (psd_server.h).
set -euo pipefail
cd "$(dirname "$0")/.."
CHECK=0
if [ "${1:-}" = "--check" ]; then CHECK=1; shift; fi
B=${1:-build}
OBJ="$B/libpsdserver.a.p"
[ -d "$OBJ" ] || { echo "layers: no $OBJ (build first: ninja -C $B)" >&2; exit 2; }
python3 - "$OBJ" "$CHECK" <<'PY'
import collections, glob, os, subprocess, sys
obj, check = sys.argv[1], sys.argv[2] == "1"
# globals a server object may define without the prefix psd_: name -> why
UNPREFIXED = {}
defs, uses, statics = {}, collections.defaultdict(set), []
for o in sorted(glob.glob(os.path.join(obj, "server_*.c.o"))):
    f = os.path.basename(o)[len("server_"):-len(".o")]
    for line in subprocess.run(["nm", o], capture_output=True, text=True, check=True).stdout.splitlines():
        p = line.split()
        if len(p) == 3 and p[1] in "TDRB":  # functions, and data (tables, names)
            defs[p[2]] = f
        elif len(p) == 3 and p[1] in "tdrb":
            statics.append((f, p[2].split(".")[0]))  # foo.constprop.0, foo.avx2: foo
        elif len(p) == 2 and p[0] == "U":
            uses[f].add(p[1])
unprefixed = sorted((f, s) for s, f in defs.items()
                    if not s.startswith("psd_") and s not in UNPREFIXED and "." not in s and not s.startswith("__"))
for f, s in unprefixed:
    print(f"unprefixed: {f} exports {s} (name it psd_..., or make it static)")
shadows = sorted({(f, s, defs[s]) for f, s in statics if s in defs and defs[s] != f})
for f, s, g in shadows:
    print(f"static: {f}'s static {s} is named as {g}'s exported {s}")
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
# the coordinator's files, top to bottom (psd_core.h): a file may use only
# those after it in this list
order = ["psd_server.c", "psd_run.c", "psd_offer.c", "psd_model.c", "psd_shard0.c", "psd_push.c", "psd_stream.c", "psd_step.c", "psd_give.c",
         "psd_peers.c"]
up = [(f, g) for f in order for g in sorted(edges.get(f, ())) if g in order and order.index(g) < order.index(f)]
for f, g in up:
    print(f"up: {f} uses {g}, a layer above it")
coord = set(order) | {"psd_status.c"}
bad = sorted(g for g in edges.get("psd_shard.c", ()) if g in coord)
if bad:
    print("psd_shard.c uses the coordinator's", " ".join(bad))
sys.exit(1 if check and (out or up or bad or unprefixed or shadows) else 0)
PY
if [ "$CHECK" = 1 ] && grep -nE '#include "(psd_core|psd_server)\.h"' server/psd_shard.c; then
    echo "psd_shard.c includes the coordinator's header" >&2
    exit 1
fi
if [ "$CHECK" = 1 ] && grep -nE '#include "psd_server\.h"' server/psd_core.h; then
    echo "psd_core.h includes the shell's header (psd_server.h)" >&2
    exit 1
fi
