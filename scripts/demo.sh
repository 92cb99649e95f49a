#!/usr/bin/env bash
# Main job: for now the raw smoke transfer (two agents, 1 MiB WRITE over UCX, checked).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
scripts/setup.sh
cargo test --release --locked -p nixl-sys --test raw_smoke -- --nocapture
