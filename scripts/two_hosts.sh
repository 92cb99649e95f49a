#!/usr/bin/env bash
# The prefill/decode demo across two "hosts": two network namespaces joined by a veth pair,
# prefill at 10.77.0.1 and decode at 10.77.0.2, NIXL's UCX backend restricted to its TCP
# transport on the veth devices. Needs root and `ip netns`; creates the namespaces and the
# veth pair and deletes them again, whatever happens.
#
#   scripts/two_hosts.sh                      # 64 requests of 16 blocks x 32 layers x 16 KiB
#   scripts/two_hosts.sh -- --requests 8      # flags after -- go to decode
#
# Honours CARGO_TARGET_DIR and NIXL_DEMO_BIN_DIR / NIXL_DEMO_CACHE_ARGS like scripts/demo.sh.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

if [[ $(id -u) -ne 0 ]]; then
    echo "two_hosts: needs root (ip netns)" >&2
    exit 1
fi

decode_args=(--requests 64)
if [[ ${1:-} == -- ]]; then
    shift
    decode_args+=("$@")
elif [[ $# -gt 0 ]]; then
    echo "usage: $0 [-- decode flags...]" >&2
    exit 2
fi

# Unique per run, so that concurrent runs do not collide; veth names fit in 15 bytes.
id=$$
ns_prefill=nixl-prefill-$id
ns_decode=nixl-decode-$id
veth_prefill=nxp$id
veth_decode=nxd$id

cleanup() {
    ip netns del "$ns_prefill" 2>/dev/null || true
    ip netns del "$ns_decode" 2>/dev/null || true
}
trap cleanup EXIT

ip netns add "$ns_prefill"
ip netns add "$ns_decode"
ip link add "$veth_prefill" type veth peer name "$veth_decode"
ip link set "$veth_prefill" netns "$ns_prefill"
ip link set "$veth_decode" netns "$ns_decode"
ip -n "$ns_prefill" addr add 10.77.0.1/24 dev "$veth_prefill"
ip -n "$ns_decode" addr add 10.77.0.2/24 dev "$veth_decode"
for ns in "$ns_prefill" "$ns_decode"; do
    ip -n "$ns" link set lo up
done
ip -n "$ns_prefill" link set "$veth_prefill" up
ip -n "$ns_decode" link set "$veth_decode" up
echo "two_hosts: prefill in netns $ns_prefill (10.77.0.1, $veth_prefill), decode in netns $ns_decode (10.77.0.2, $veth_decode), UCX over TCP"

NIXL_DEMO_LISTEN=10.77.0.1:7800 \
NIXL_DEMO_PREFILL_WRAP="ip netns exec $ns_prefill env UCX_TLS=tcp UCX_NET_DEVICES=$veth_prefill" \
NIXL_DEMO_DECODE_WRAP="ip netns exec $ns_decode env UCX_TLS=tcp UCX_NET_DEVICES=$veth_decode" \
    "$root/scripts/demo.sh" -- "${decode_args[@]}"
