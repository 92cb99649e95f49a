#!/usr/bin/env bash
# Installs what building nixl-rs needs on a fresh Debian/Ubuntu machine; safe to rerun.
#  - libclang (Debian libclang-dev), which bindgen loads in the bindings drift test (building
#    needs none), when scripts/find-libclang.sh finds none (a machine with only libclang-cpp
#    has none);
#  - the pinned NIXL wheel, unpacked into vendor/nixl (skipped when NIXL_PREFIX or
#    NIXL_LIB_DIR points at another NIXL);
#  - etcd (Debian etcd-server), when no `etcd` binary is found: the prefill/decode demo's
#    etcd metadata mode and its tests start one on loopback.
#  - openssl (Debian openssl), when no `openssl` binary is found: tests/etcd_tls.rs makes its
#    CA and certificates with it.
#  - nftables (Debian nftables), when no `nft` binary is found: the connector's network fault
#    tests (nixl-connector/tests/network_faults/) cut the data path or the side channel by port.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# bindgen's libclang, found by the rules clang-sys uses (libclang-cpp does not count).
have_libclang() {
    "$root/scripts/find-libclang.sh" >/dev/null
}

# Installs a Debian package, as root or through sudo, saying why.
apt_install() {
    local package=$1 why=$2
    echo "setup: installing $package ($why)" >&2
    local sudo_cmd=()
    [[ $(id -u) -eq 0 ]] || sudo_cmd=(sudo)
    "${sudo_cmd[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq "$package" >/dev/null
}

have_libclang || apt_install libclang-dev "the bindings drift test runs bindgen, which needs libclang"
command -v etcd >/dev/null 2>&1 || apt_install etcd-server "etcd metadata exchange"
command -v openssl >/dev/null 2>&1 || apt_install openssl "the etcd TLS test's certificates"
command -v nft >/dev/null 2>&1 || [[ -x /usr/sbin/nft ]] || apt_install nftables "the network fault tests drop packets by port"

if [[ -z ${NIXL_PREFIX:-}${NIXL_LIB_DIR:-} ]]; then
    "$root/vendor/install-nixl.sh"
fi
