#!/usr/bin/env bash
# Installs the pinned NIXL release (PyPI wheel nixl-cu12) into vendor/nixl/, untracked.
#
# Only the wheel's prebuilt libraries are unpacked, keeping the wheel's folder layout
# (.nixl_cu12.mesonpy.libs/ beside nixl_cu12.libs/) because the libraries find each other
# through $ORIGIN rpaths between those folders. None of the wheel's Python dependencies
# (torch, CUDA) are installed. A second run is instant.
set -euo pipefail

NIXL_VERSION=1.5.1
WHEEL=nixl_cu12-${NIXL_VERSION}-cp311-cp311-manylinux_2_28_x86_64.whl
WHEEL_SHA256=341d0dfa499f941c054614252f1d8047d1380e33f29c87707372ff5ec7d3779a

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
dest=${NIXL_VENDOR_DIR:-$here/nixl}
stamp=$dest/.installed-$WHEEL_SHA256

if [[ -f $stamp ]]; then
    exit 0
fi

if [[ $(uname -m) != x86_64 ]]; then
    echo "install-nixl: the pinned wheel is x86_64-only; on $(uname -m) build NIXL from source and set NIXL_PREFIX" >&2
    exit 1
fi

mkdir -p "$dest"
if [[ ! -f $dest/$WHEEL ]] || ! echo "$WHEEL_SHA256  $dest/$WHEEL" | sha256sum --check --status; then
    echo "install-nixl: downloading $WHEEL from PyPI" >&2
    rm -f "$dest/$WHEEL"
    python3 -m pip download --quiet --no-deps --only-binary=:all: \
        --python-version 3.11 --implementation cp --abi cp311 \
        --platform manylinux_2_28_x86_64 \
        --dest "$dest" "nixl-cu12==$NIXL_VERSION"
fi
if ! echo "$WHEEL_SHA256  $dest/$WHEEL" | sha256sum --check --status; then
    echo "install-nixl: sha256 of $dest/$WHEEL does not match the pinned $WHEEL_SHA256; refusing to use it" >&2
    exit 1
fi

rm -rf "$dest/.nixl_cu12.mesonpy.libs" "$dest/nixl_cu12.libs"
python3 - "$dest/$WHEEL" "$dest" <<'PY'
import sys, zipfile
wheel, dest = sys.argv[1], sys.argv[2]
keep = (".nixl_cu12.mesonpy.libs/", "nixl_cu12.libs/")
with zipfile.ZipFile(wheel) as z:
    z.extractall(dest, [n for n in z.namelist() if n.startswith(keep)])
PY
touch "$stamp"
echo "install-nixl: NIXL $NIXL_VERSION installed in $dest/.nixl_cu12.mesonpy.libs" >&2
