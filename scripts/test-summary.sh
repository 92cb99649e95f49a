#!/usr/bin/env bash
# Prints, from the output of `cargo test` (file $1), one line per test binary: how many tests
# passed, failed and were ignored; then the tests that skipped themselves (file $2, written
# by tests/common's `skip`), and the totals.
set -euo pipefail
log=$1 skips=${2:-}
awk '
    /^ *Running / {
        name = $2
        if (name == "unittests") {
            crate = $NF; sub(/.*\//, "", crate); sub(/-[0-9a-f]+\)$/, "", crate)
            name = "unittests " crate
        }
        next
    }
    /^ *Doc-tests / { name = "doc-tests " $2; next }
    /^test result:/ {
        passed = $4; failed = $6; ignored = $8
        sub(";", "", passed); sub(";", "", failed); sub(";", "", ignored)
        printf "%-40s %5d passed %3d failed %3d ignored\n", name, passed, failed, ignored
        tp += passed; tf += failed; ti += ignored
    }
    END { printf "%-40s %5d passed %3d failed %3d ignored\n", "total", tp, tf, ti }
' "$log"
if [[ -n $skips && -s $skips ]]; then
    echo "skipped (a prerequisite was missing):"
    sed 's/^/  /' "$skips"
else
    echo "skipped: none"
fi
