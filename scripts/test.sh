#!/usr/bin/env bash
# Runs the whole test suite against the real NIXL, installing what it needs first.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
scripts/setup.sh
cargo test --workspace --locked "$@"
