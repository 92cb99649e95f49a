#!/usr/bin/env bash
# Benchmarks the nixl crate side by side with NIXL's official Python API and memcpy.
#
# Installs what it needs (scripts/setup.sh, then a venv with numpy and the pinned NIXL wheel,
# --no-deps), builds benches/transfer.rs, runs the Rust and the Python benchmark alternately
# (A B A B ...) for BENCH_ROUNDS rounds (default 6), each round followed by two runs of the
# prefill/decode demo (scripts/demo.sh, release build: two processes over NIXL/UCX; 256
# requests x 16 blocks, then 200 x 32, all pulled and verified), each with a single-thread
# memcpy probe of the same blocks, and writes into
# bench/results/:
#   transfer.jsonl  every figure of every round, one JSON object a line
#   results.md      medians over rounds, ratios Rust/Python and Rust/memcpy from the same run,
#                   and the async completion variants with ratios await/blocking and
#                   await/sleep-poll (benches/transfer/awaiting.rs), many tasks awaiting 16 KiB
#                   READs against the same READs one after another at 1, 2 and 4 tokio workers,
#                   in-process and across processes, with UCX's mutex and spinlock worker lock
#                   and with two UCX workers
#                   (benches/transfer/concurrent.rs), then the recorded figures of
#                   benches/registered_copy.rs (registered_copy.md, which that bench does not
#                   rewrite: run it on its own, `cargo bench -p nixl-rs --bench registered_copy`)
#   transfer.svg    GB/s against transfer size for Rust, Python and memcpy
#   latency.svg     p50/p99 of the 4 KiB round trip: .await, blocking wait, 5 ms sleep-poll, Python
#   transfer.log    what each benchmark printed: its figures and the command reproducing them
#   handshake-auth.log  the side-channel handshake with and without a shared secret, as a ratio
#   descriptor-heavy.{jsonl,md}  READs of 128 regions x 148 blocks of 16 KiB (contiguous,
#                   fragmented, half and half) against Python and the CMA limit, in their own
#                   alternating rounds after the others (scripts/bench-descriptors.sh); the
#                   table, with its goals met or missed, is appended to results.md
#   cross-host.{md,log}  prefill/decode across two network namespaces over UCX's TCP transport
#                   against an iperf3 stream on the same link, and UCX alone (bench/tcp_probe/),
#                   in their own rounds (scripts/bench-tcp.sh, as root only); the table joins
#                   results.md
# Honours an existing CARGO_TARGET_DIR; BENCH_VENV overrides the venv location.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

rounds=${BENCH_ROUNDS:-6}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$root/target}
export NIXL_LOG_LEVEL=${NIXL_LOG_LEVEL:-WARN}
results=$root/bench/results
venv=${BENCH_VENV:-$CARGO_TARGET_DIR/bench-venv}

scripts/setup.sh

# The official Python API in a venv (CPython 3.11, numpy, the vendored wheel --no-deps).
venv=$(NIXL_PY_VENV=$venv scripts/python-venv.sh)

echo "bench: building benches/transfer.rs (target dir $CARGO_TARGET_DIR)" >&2
bin=$(cargo bench -p nixl-rs --bench transfer --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "transfer" and m.get("executable"):
        print(m["executable"])')
if [[ -z $bin ]]; then
    cargo bench -p nixl-rs --bench transfer --no-run
    exit 1
fi

echo "bench: building the prefill/decode demo (release)" >&2
cargo build --release --locked -p nixl-rs --example prefill --example decode
demo_bin=$CARGO_TARGET_DIR/release/examples
demo_out=$(mktemp)
trap 'rm -f "$demo_out"' EXIT

mkdir -p "$results"
jsonl=$results/transfer.jsonl
: >"$jsonl"
log=$results/transfer.log
: >"$log"
# NIXL 1.5.1's UCX worker-thread mode (configs ucx-mt2+*, ucx-threads2) can crash on a race
# (see nixl::Agent::create_backend); a Rust round that dies is logged, its records are dropped
# and it runs once more.
rust_round() {
    local round=$1 attempt status
    for attempt in 1 2; do
        status=0
        "$bin" --round "$round" --json "$jsonl" 2>>"$log" || status=$?
        [[ $status -eq 0 ]] && return 0
        echo "bench: round $round: Rust benchmark exited with status $status (attempt $attempt)" >&2
        echo "round $round: Rust benchmark exited with status $status (attempt $attempt); its records are dropped" >>"$log"
        python3 - "$jsonl" "$round" <<'PY'
import json, sys
path, round_ = sys.argv[1], int(sys.argv[2])
with open(path) as f:
    kept = [line for line in f if json.loads(line)["round"] != round_]
with open(path, "w") as f:
    f.writelines(kept)
PY
    done
    return 1
}

start=$SECONDS
for ((round = 1; round <= rounds; round++)); do
    echo "bench: round $round/$rounds: Rust" >&2
    rust_round "$round"
    echo "bench: round $round/$rounds: Python" >&2
    "$venv/bin/python" bench/python/transfer.py --round "$round" --json "$jsonl" 2>>"$log"
    for shape in "" "--requests 200 --blocks-per-request 32"; do
        echo "bench: round $round/$rounds: prefill/decode demo ${shape:-(default shape)} + memcpy probe" >&2
        echo "demo round $round: NIXL_DEMO_BIN_DIR=$demo_bin scripts/demo.sh ${shape:+-- $shape}" >>"$log"
        # shellcheck disable=SC2086 # the shape is words
        if ! NIXL_DEMO_BIN_DIR=$demo_bin scripts/demo.sh ${shape:+-- $shape} >"$demo_out" 2>&1; then
            cat "$demo_out" >&2
            exit 1
        fi
        grep -v 'decode: progress:' "$demo_out" >>"$log"
        "$bin" cross-process "$demo_out" --round "$round" --json "$jsonl" 2>>"$log"
    done
done
echo "bench: $rounds rounds in $((SECONDS - start)) s" >&2

"$bin" report "$jsonl" "$results"

# Descriptor-heavy READs: their own alternating rounds; their table joins results.md.
BENCH_ROUNDS=$rounds BENCH_VENV=$venv scripts/bench-descriptors.sh
{
    echo
    cat "$results/descriptor-heavy.md"
} >>"$results/results.md"

# Across hosts over TCP: namespaces need root; the table joins results.md.
if [[ $(id -u) -eq 0 ]]; then
    BENCH_ROUNDS=$rounds scripts/bench-tcp.sh
    {
        echo
        cat "$results/cross-host.md"
    } >>"$results/results.md"
else
    echo "bench: not root, so no cross-host rows (scripts/bench-tcp.sh needs ip netns)" >&2
fi

# What authentication costs a handshake: the side-channel exchange with and without a shared
# secret, alternating, as a ratio (bench/results/handshake-auth.log).
cargo build --release --locked -p nixl-connector --example handshake_bench
"$CARGO_TARGET_DIR/release/examples/handshake_bench" --rounds 10 --exchanges 200 |
    tee "$results/handshake-auth.log"
cat <<EOF

Setup: two agents A and B in one process; Rust: the crate's default UCX backend (the plugin's
defaults, no worker threads, UCX's mutex worker lock; ucx-threads2: num_threads=2 split_batch_size=2; ucx-mt2+*:
num_threads=2 split_batch_size=1), Python: UCX defaults; DRAM (huge-page-backed buffers in both languages), agents created on core 1
(NIXL/UCX threads inherit it; ucx-mt2+* and *desc: cores 0-1), measuring thread on core 0.
Async completion (each Rust round, variants alternating): .await, blocking wait and a 5 ms
sleep-poll loop on one tokio current-thread runtime, with the crate's default UCX backend
(copies within post) and with UCX num_threads=2 split_batch_size=1 (copies after post).
Many tasks (each Rust round): 1000 tokio tasks each posting, awaiting and checking a 16 KiB
READ vs the same READs one after another (post + blocking wait), 1, 2 and 4 workers, agents
in one process and B in a child process, UCX worker lock mutex (default) vs spinlock.
Cross-process: scripts/demo.sh (prefill and decode processes, the connector's loads of 256
requests x 16 blocks, then 200 requests x 32 blocks, x 32 layers x 16 KiB READ over UCX, 4 in
flight, every byte verified) once per shape and round, GB/s from decode's summary.
Results: $results/{transfer.jsonl,results.md,transfer.svg,latency.svg,transfer.log}
Reproduce everything:  scripts/bench.sh            (BENCH_ROUNDS=$rounds)
One Rust round:        CARGO_TARGET_DIR=$CARGO_TARGET_DIR cargo bench -p nixl-rs --bench transfer
One Python round:      $venv/bin/python bench/python/transfer.py
Many tasks alone:      CARGO_TARGET_DIR=$CARGO_TARGET_DIR cargo bench -p nixl-rs --bench transfer -- concurrent   (ratios concurrent/sequential)
Descriptor-heavy READs: scripts/bench-descriptors.sh   (Rust, Python and CMA, alternating rounds)
Across hosts over TCP:  scripts/bench-tcp.sh   (as root: P/D and UCX alone against iperf3, in namespaces)
One demo run:          CARGO_TARGET_DIR=$CARGO_TARGET_DIR scripts/demo.sh [-- --requests 200 --blocks-per-request 32]   (decode prints GB/s)
EOF
