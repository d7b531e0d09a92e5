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
OUT=$(mktemp -d /tmp/psd-bench-all-XXXXXX)
trap 'rm -rf "$OUT"' EXIT
bash bench/wire_bench.sh >"$OUT/wire.txt" 2>"$OUT/wire.err"
bash bench/bench_mlp.sh >"$OUT/mlp.txt" 2>&1
bash bench/wait_bench.sh >"$OUT/wait.txt" 2>&1
bash bench/mem_bench.sh >"$OUT/mem-shm.txt" 2>&1
bash bench/mem_bench.sh 300 --no-shm >"$OUT/mem-tcp.txt" 2>&1
sed -n '/^push+pull of a 4 MiB/,$p' "$OUT/wire.txt"
echo
grep -E '^(psd \+ 2|pytorch|ratio)' "$OUT/mlp.txt"
echo
tail -n 3 "$OUT/wait.txt"
echo
echo "psd memory, Adam (shared memory / tcp):"
grep -E '^psd steady' "$OUT/mem-shm.txt" "$OUT/mem-tcp.txt" | sed 's/^[^:]*mem-\([a-z]*\).txt:/  \1: /'
