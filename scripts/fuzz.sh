#!/usr/bin/env bash
# Fuzzes Agent::load_remote_metadata for SECONDS (default 60) with structure-aware mutants
# of real metadata (examples/fuzz_metadata); every batch of inputs runs in a child process.
# Fails if any input crashed or hung a child; crashing inputs (original and minimised) are
# saved under $CARGO_TARGET_DIR/fuzz-metadata/crashes. Extra arguments go to the harness,
# e.g. scripts/fuzz.sh 3600 --seed 7.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
seconds=${1:-60}
shift || true
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$root/target}
cargo build --release --locked -p nixl-rs --example fuzz_metadata
exec "$CARGO_TARGET_DIR/release/examples/fuzz_metadata" --seconds "$seconds" \
    --out "$CARGO_TARGET_DIR/fuzz-metadata" "$@"
