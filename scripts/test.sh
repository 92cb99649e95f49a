#!/usr/bin/env bash
# Runs the whole test suite against the real NIXL, installing what it needs first, then
# prints what ran: passed, failed and ignored tests per test binary, and any test that
# skipped itself for a missing prerequisite (with CI set, such a test fails instead).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
scripts/setup.sh
target=${CARGO_TARGET_DIR:-$root/target}
skips=$target/tmp/skipped-tests.txt
log=$target/test-output.log
mkdir -p "$target/tmp"
rm -f "$skips"
status=0
cargo test --workspace --locked --no-fail-fast "$@" 2>&1 | tee "$log" || status=$?
echo "== what ran"
scripts/test-summary.sh "$log" "$skips"
exit "$status"
