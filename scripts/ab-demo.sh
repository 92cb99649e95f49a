#!/usr/bin/env bash
# A/B rounds of the prefill/decode demo: two builds' `prefill` and `decode` binaries, A and B,
# run through scripts/demo.sh at both bench shapes (256 requests x 16 blocks, 200 x 32), the
# order alternating round by round (A B, B A, ...) so that drift on a shared machine falls on
# both. Prints every figure, then per shape the medians and the median of the paired
# per-round ratios B/A of: GB/s from decode's summary; the CPU seconds that prefill and
# decode spent together per GB moved (user + system, from /usr/bin/time), which other work on
# a shared machine disturbs less; decode's CPU seconds per GB alone; and decode's p50 and p99
# time from the announcement (prefill's finish) to the request's data landed, in ms.
#
#   scripts/ab-demo.sh A_BIN_DIR B_BIN_DIR [ROUNDS]     # ROUNDS defaults to 6
#
# AB_A_FLAGS and AB_B_FLAGS are scripts/demo.sh flags of each side, e.g. the same build with
# and without the vLLM protocol:
#   AB_B_FLAGS="--protocol vllm" scripts/ab-demo.sh target/release/examples target/release/examples
#
# Build A from another checkout into its own target dir, e.g. for main:
#   git archive main | tar -x -C /tmp/ab-main && ln -s "$PWD/vendor/nixl" /tmp/ab-main/vendor/nixl
#   (cd /tmp/ab-main && CARGO_TARGET_DIR=/tmp/ab-main/target \
#       cargo build --release --locked -p nixl-rs --example prefill --example decode)
#   cargo build --release --locked -p nixl-rs --example prefill --example decode
#   scripts/ab-demo.sh /tmp/ab-main/target/release/examples target/release/examples
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
[[ $# -ge 2 ]] || { echo "usage: $0 A_BIN_DIR B_BIN_DIR [ROUNDS]" >&2; exit 2; }
a=$1 b=$2 rounds=${3:-6}
export NIXL_LOG_LEVEL=${NIXL_LOG_LEVEL:-WARN}
shapes=("" "--requests 200 --blocks-per-request 32")
# Temporary files (demo.sh's too) in a folder of this run's own.
TMPDIR=$(mktemp -d "${TMPDIR:-/tmp}/ab-demo.XXXXXX")
export TMPDIR
trap 'rm -rf "$TMPDIR"' EXIT
out=$TMPDIR/demo.out
cpu() { echo "$TMPDIR/$1.cpu"; }

# "GB/s CPU-s/GB decode-CPU-s/GB p50-ms p99-ms" of one demo run of the binaries in $1 at
# shape $2 with demo.sh flags $3 (a failed run is shown and retried once).
run() {
    local attempt gbps bytes seconds decode latency
    for attempt in 1 2; do
        # shellcheck disable=SC2086 # the shape and the flags are words
        if NIXL_DEMO_PREFILL_WRAP="/usr/bin/time -o $(cpu prefill) -f %U+%S" \
            NIXL_DEMO_DECODE_WRAP="/usr/bin/time -o $(cpu decode) -f %U+%S" \
            NIXL_DEMO_BIN_DIR=$1 scripts/demo.sh $3 ${2:+-- $2} >"$out" 2>&1; then
            gbps=$(sed -n 's/^  time: .*, \([0-9.]*\) GB\/s$/\1/p' "$out")
            bytes=$(sed -n 's/^  bytes: *\([0-9]*\) .*/\1/p' "$out")
            decode=$(echo "$(tail -n 1 "$(cpu decode)")" | bc)
            seconds=$(echo "$(tail -n 1 "$(cpu prefill)") + $decode" | bc)
            latency=$(sed -n 's/^  latency: *p50 \([0-9.]*\) ms, p99 \([0-9.]*\) ms.*/\1 \2/p' "$out")
            echo "$gbps $(echo "scale=4; $seconds * 1000000000 / $bytes" | bc)" \
                "$(echo "scale=4; $decode * 1000000000 / $bytes" | bc) $latency"
            return
        fi
        echo "ab-demo: a run of $1 failed (attempt $attempt):" >&2
        cat "$out" >&2
    done
    exit 1
}

declare -A figures cpus decodes p50s p99s
for ((round = 1; round <= rounds; round++)); do
    for s in "${!shapes[@]}"; do
        order=(a b)
        ((round % 2 == 0)) && order=(b a)
        for side in "${order[@]}"; do
            dir=$a flags=${AB_A_FLAGS:-}
            [[ $side == b ]] && dir=$b flags=${AB_B_FLAGS:-}
            read -r gbps cpu_per_gb decode_per_gb p50 p99 < <(run "$dir" "${shapes[$s]}" "$flags")
            figures[$side,$s,$round]=$gbps
            cpus[$side,$s,$round]=$cpu_per_gb
            decodes[$side,$s,$round]=$decode_per_gb
            p50s[$side,$s,$round]=$p50
            p99s[$side,$s,$round]=$p99
            echo "round $round shape ${shapes[$s]:-default} $side: $gbps GB/s, $cpu_per_gb CPU s/GB," \
                "decode $decode_per_gb CPU s/GB, announce to landed p50 $p50 ms, p99 $p99 ms"
        done
    done
done

summary() {
    local -n values=$1
    local unit=$2 s=$3 as=() bs=() round
    for ((round = 1; round <= rounds; round++)); do
        as+=("${values[a,$s,$round]}")
        bs+=("${values[b,$s,$round]}")
    done
    python3 - "${shapes[$s]:-default shape}" "$unit" "${as[*]}" "${bs[*]}" <<'PY'
import statistics, sys
shape, unit, a, b = sys.argv[1], sys.argv[2], *(list(map(float, x.split())) for x in sys.argv[3:])
r = [round(y / x, 3) for x, y in zip(a, b)]
print(f"{shape}, {unit}: A {a} (median {statistics.median(a):.3f}), B {b} (median {statistics.median(b):.3f}), "
      f"B/A per round {r} (median {statistics.median(r):.3f})")
PY
}

for s in "${!shapes[@]}"; do
    summary figures GB/s "$s"
    summary cpus "CPU s/GB" "$s"
    summary decodes "decode CPU s/GB" "$s"
    summary p50s "announce to landed p50 ms" "$s"
    summary p99s "announce to landed p99 ms" "$s"
done
