#!/usr/bin/env bash
# Where loading KV from a remote engine beats recomputing it (vLLM's kv_recompute_threshold,
# default 64 tokens): for each token count N, the time to load N tokens' KV through the
# connector from a second engine (handshaken before) against the time to recompute them with
# kv-model (f32, CPU) after a cached prefix, alternating, medians of rounds
# (examples/recompute_crossover.rs). Prints the table, the crossover, the machine's load
# before and after, and how to reproduce. About a minute at the defaults on 2 cores.
#
#   scripts/bench-recompute.sh                  # 4 layers, prefix 256, N = 16 ... 1024, 5 rounds
#   scripts/bench-recompute.sh -- --layers 16 --prefix 512 --rounds 7
#
# Environment: CARGO_TARGET_DIR (where to build).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
args=()
[[ ${1:-} == -- ]] && { shift; args=("$@"); }

scripts/setup.sh
cargo build --release --locked -p nixl-rs --example recompute_crossover
bin=${CARGO_TARGET_DIR:-$root/target}/release/examples/recompute_crossover

echo "bench-recompute: commit $(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo ' (modified)'), $(nproc) cores; load before: $(cut -d' ' -f1-3 /proc/loadavg)"
start=$SECONDS
NIXL_LOG_LEVEL=${NIXL_LOG_LEVEL:-WARN} "$bin" "${args[@]}"
echo "bench-recompute: $((SECONDS - start)) s; load after: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "reproduce everything: scripts/bench-recompute.sh${args[*]:+ -- ${args[*]}}"
