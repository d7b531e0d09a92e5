#!/bin/bash
# Every benchmark of the fast path, in one go on this machine, and one table
# of the ratios the fast-path issue sets as targets:
#   bench/wire_bench.sh  memcpy and raw ZeroMQ probes; psbench over tcp
#                        (1, 2, 4 workers; 1 and 2 psd shards), ipc and shared
#                        memory (1, 2 workers)
#   bench/bench_mlp.sh   psd + 2 pworkers against PyTorch DDP (gloo)
#   bench/wait_bench.sh  the workers' waiting share, shared memory and tcp
#   bench/mem_bench.sh   psd's memory for Adam with P = 20M, both modes
# Not a test.
#   bash bench/all.sh          (about 8 minutes on a 2-core VM)
set -euo pipefail
cd "$(dirname "$0")/.."
# first line: the machine (bench/lib.sh)
. bench/lib.sh
machine_line
OUT=$(mktemp -d /tmp/psd-bench-all-XXXXXX)
trap 'rm -rf "$OUT"' EXIT
# one benchmark, its output into $OUT/$1.txt (and .err); if it fails, what it
# printed last goes to stderr before all.sh exits with its status
stage() {
    local name=$1
    shift
    local rc=0
    "$@" >"$OUT/$name.txt" 2>"$OUT/$name.err" || rc=$?
    if [ "$rc" -ne 0 ]; then
        echo "bench/all.sh: '$*' failed (exit $rc); its last output:" >&2
        tail -n 30 "$OUT/$name.txt" "$OUT/$name.err" >&2
        exit "$rc"
    fi
}
stage wire bash bench/wire_bench.sh
stage mlp bash bench/bench_mlp.sh
stage wait bash bench/wait_bench.sh
stage mem-shm bash bench/mem_bench.sh
stage mem-tcp bash bench/mem_bench.sh 300 --no-shm
sed -n '/^push+pull of a 4 MiB/,$p' "$OUT/wire.txt"
echo
grep -E '^(psd \+ 2|pytorch|ratio)' "$OUT/mlp.txt"
echo
tail -n 3 "$OUT/wait.txt"
echo
echo "psd memory, Adam (shared memory / tcp):"
grep -E '^psd steady' "$OUT/mem-shm.txt" "$OUT/mem-tcp.txt" | sed 's/^[^:]*mem-\([a-z]*\).txt:/  \1: /'
