#!/usr/bin/env bash
# Descriptor-heavy READs (benches/descriptor_heavy.rs): 128 regions x 148 blocks of 16 KiB per
# request, block ids contiguous, fragmented and half and half; the nixl crate's prepared-list
# path (the connector's load path) and the CMA limit of the same bytes (Rust), against NIXL's
# Python API as vLLM's worker uses it (bench/python/descriptor_heavy.py), alternating A B A B
# for BENCH_ROUNDS rounds (default 6). Appends every figure to
# bench/results/descriptor-heavy.jsonl (emptied first) and writes the table, with the goals
# met or missed, to bench/results/descriptor-heavy.md.
# The caches are allocated lazily (only the blocks read are touched): a Rust round touches
# about 3.7 GB (both caches in one process, 0.9 GB each for the CMA probe and its child), a
# Python round about 1.9 GB. Honours CARGO_TARGET_DIR; BENCH_VENV overrides the venv location.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

rounds=${BENCH_ROUNDS:-6}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$root/target}
export NIXL_LOG_LEVEL=${NIXL_LOG_LEVEL:-WARN}
results=$root/bench/results
venv=${BENCH_VENV:-$CARGO_TARGET_DIR/bench-venv}

scripts/setup.sh
venv=$(NIXL_PY_VENV=$venv scripts/python-venv.sh)

echo "bench-descriptors: building benches/descriptor_heavy.rs (target dir $CARGO_TARGET_DIR)" >&2
bin=$(cargo bench --locked -p nixl-rs --bench descriptor_heavy --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "descriptor_heavy" and m.get("executable"):
        print(m["executable"])')
if [[ -z $bin ]]; then
    cargo bench --locked -p nixl-rs --bench descriptor_heavy --no-run
    exit 1
fi

mkdir -p "$results"
jsonl=$results/descriptor-heavy.jsonl
: >"$jsonl"
echo "bench-descriptors: the descriptors NIXL posts for each case (telemetry on, untimed)" >&2
"$bin" --telemetry --json "$jsonl" >/dev/null
start=$SECONDS
for ((round = 1; round <= rounds; round++)); do
    echo "bench-descriptors: round $round/$rounds: Rust (NIXL + CMA)" >&2
    "$bin" --round "$round" --json "$jsonl" >/dev/null
    echo "bench-descriptors: round $round/$rounds: Python" >&2
    "$venv/bin/python" bench/python/descriptor_heavy.py --round "$round" --json "$jsonl" >/dev/null
done
echo "bench-descriptors: $rounds rounds in $((SECONDS - start)) s; load average: $(cut -d' ' -f1-3 /proc/loadavg)" >&2
"$bin" report "$jsonl" "$results/descriptor-heavy.md"
cat <<EOF

Reproduce: scripts/bench-descriptors.sh   (BENCH_ROUNDS=$rounds)
One Rust round (NIXL + CMA):  CARGO_TARGET_DIR=$CARGO_TARGET_DIR cargo bench -p nixl-rs --bench descriptor_heavy
One Python round:             $venv/bin/python bench/python/descriptor_heavy.py
Descriptors NIXL posts after merging (telemetry on):  cargo bench -p nixl-rs --bench descriptor_heavy -- --telemetry
EOF
