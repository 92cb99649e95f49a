#!/usr/bin/env bash
# Installs what building nixl-rs needs on a fresh Debian/Ubuntu machine; safe to rerun.
#  - libclang (Debian libclang-dev), which bindgen loads, when no libclang is found;
#  - the pinned NIXL wheel, unpacked into vendor/nixl (skipped when NIXL_PREFIX or
#    NIXL_LIB_DIR points at another NIXL);
#  - etcd (Debian etcd-server), when no `etcd` binary is found: the prefill/decode demo's
#    etcd metadata mode and its tests start one on loopback.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

have_libclang() {
    [[ -n ${LIBCLANG_PATH:-} ]] && return 0
    ldconfig -p 2>/dev/null | grep -q 'libclang[-.0-9]*\.so' && return 0
    compgen -G '/usr/lib/llvm-*/lib/libclang*.so*' >/dev/null
}

if ! have_libclang; then
    echo "setup: installing libclang-dev (bindgen needs libclang)" >&2
    sudo_cmd=()
    [[ $(id -u) -eq 0 ]] || sudo_cmd=(sudo)
    "${sudo_cmd[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq libclang-dev >/dev/null
fi

if ! command -v etcd >/dev/null 2>&1; then
    echo "setup: installing etcd-server (etcd metadata exchange)" >&2
    sudo_cmd=()
    [[ $(id -u) -eq 0 ]] || sudo_cmd=(sudo)
    "${sudo_cmd[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq etcd-server >/dev/null
fi

if [[ -z ${NIXL_PREFIX:-}${NIXL_LIB_DIR:-} ]]; then
    "$root/vendor/install-nixl.sh"
fi
