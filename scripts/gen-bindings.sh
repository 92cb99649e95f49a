#!/usr/bin/env bash
# Regenerates nixl-sys/src/bindings.rs (bindgen's output for nixl-sys/nixl_capi.h, shipped so
# that builds need neither NIXL nor libclang) by running the drift test in write mode.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
# The crate includes the file, so it must exist for the test to build.
touch nixl-sys/src/bindings.rs
NIXL_CAPI_SYS_WRITE_BINDINGS=1 cargo test --locked -p nixl-capi-sys --test bindings_drift
echo "gen-bindings: wrote nixl-sys/src/bindings.rs" >&2
