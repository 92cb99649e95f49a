#!/usr/bin/env bash
# A/B rounds of the prefill/decode demo: two builds' `prefill` and `decode` binaries, A and B,
# run through scripts/demo.sh at both bench shapes (256 requests x 16 blocks, 200 x 32), the
# order alternating round by round (A B, B A, ...) so that drift on a shared machine falls on
# both. Prints every figure (GB/s from decode's summary), then per shape the medians and the
# median of the paired per-round ratios B/A.
#
#   scripts/ab-demo.sh A_BIN_DIR B_BIN_DIR [ROUNDS]     # ROUNDS defaults to 6
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

# GB/s of one demo run of the binaries in $1 at shape $2 (a failed run is shown and retried
# once).
run() {
    local attempt
    for attempt in 1 2; do
        # shellcheck disable=SC2086 # the shape is words
        if NIXL_DEMO_BIN_DIR=$1 scripts/demo.sh ${2:+-- $2} >"$out" 2>&1; then
            sed -n 's/^  time: .*, \([0-9.]*\) GB\/s$/\1/p' "$out"
            return
        fi
        echo "ab-demo: a run of $1 failed (attempt $attempt):" >&2
        cat "$out" >&2
    done
    exit 1
}

declare -A figures
for ((round = 1; round <= rounds; round++)); do
    for s in "${!shapes[@]}"; do
        order=(a b)
        ((round % 2 == 0)) && order=(b a)
        for side in "${order[@]}"; do
            dir=$a
            [[ $side == b ]] && dir=$b
            gbps=$(run "$dir" "${shapes[$s]}")
            figures[$side,$s,$round]=$gbps
            echo "round $round shape ${shapes[$s]:-default} $side: $gbps GB/s"
        done
    done
done

for s in "${!shapes[@]}"; do
    as=() bs=() ratios=()
    for ((round = 1; round <= rounds; round++)); do
        as+=("${figures[a,$s,$round]}")
        bs+=("${figures[b,$s,$round]}")
        ratios+=("$(echo "scale=3; ${figures[b,$s,$round]} / ${figures[a,$s,$round]}" | bc)")
    done
    python3 - "${shapes[$s]:-default shape}" "${as[*]}" "${bs[*]}" "${ratios[*]}" <<'PY'
import statistics, sys
shape, a, b, r = sys.argv[1], *(list(map(float, x.split())) for x in sys.argv[2:])
print(f"{shape}: A {a} (median {statistics.median(a):.2f}), B {b} (median {statistics.median(b):.2f}), "
      f"B/A per round {r} (median {statistics.median(r):.3f})")
PY
done
