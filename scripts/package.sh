#!/usr/bin/env bash
# Packages the three library crates and builds each from its package alone, in dependency order:
# `cargo publish --dry-run` minus its registry queries, so it runs offline.
#
# Each run checks this commit's sources from scratch. Cargo verifies nixl-connector against the
# nixl .crate it has just made, through a temporary local registry under the target folder, and
# takes crates of a registry as unchanging: it unpacks a version into
# $CARGO_HOME/registry/src/-<hash>/ only once (the hash comes from the registry's path) and reuses
# what it built from it. Where a checkout at the same path is packaged again with the same version
# number (a reused CI machine), both would be an older commit's. So the packages are built in a
# target folder of their own, emptied first, and the unpacked copies of these three crates are
# removed from CARGO_HOME. Nothing else there is touched.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
libraries=(nixl-capi-sys nixl nixl-connector)
sources="${CARGO_HOME:-$HOME/.cargo}/registry/src"
packages=()
for library in "${libraries[@]}"; do
    # Local registries have no host, so their folders are named -<hash>.
    rm -rf "$sources"/-*/"$library"-[0-9]*
    packages+=(-p "$library")
done
target_dir="${CARGO_TARGET_DIR:-$root/target}/package-check"
rm -rf "$target_dir"
CARGO_TARGET_DIR="$target_dir" cargo package --offline --locked "${packages[@]}"
