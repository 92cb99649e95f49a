#!/usr/bin/env bash
# Runs the tests of the nixl crate's atomic_copy module (what Registration::read / write copy
# with) under Miri, which reports any data race or mixed-size atomic access as undefined
# behaviour. Needs the nightly toolchain with the miri component
# (`rustup component add --toolchain nightly miri rust-src`); where it is absent this says
# so plainly and exits 0. Bounded by MIRI_TIMEOUT seconds (default 900), a failure past it.
# MIRI_TOOLCHAIN names another toolchain than nightly.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
toolchain=${MIRI_TOOLCHAIN:-nightly}
if ! cargo +"$toolchain" miri --version >/dev/null 2>&1; then
    echo "miri: SKIPPED: Miri is not installed (no $toolchain toolchain with the miri component);" \
        "the atomic_copy tests ran without it in scripts/test.sh." \
        "Install: rustup component add --toolchain $toolchain miri rust-src"
    exit 0
fi
if ! cargo +"$toolchain" miri setup >/dev/null 2>&1; then
    echo "miri: SKIPPED: Miri is installed but cannot build its sysroot (is rust-src missing?" \
        "rustup component add --toolchain $toolchain rust-src)"
    exit 0
fi
echo "miri: $(cargo +"$toolchain" miri --version)"
exec timeout "${MIRI_TIMEOUT:-900}" cargo +"$toolchain" miri test --locked -p nixl --lib atomic_copy
