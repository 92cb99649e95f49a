#!/usr/bin/env bash
# Prefill/decode across hosts without RDMA: two network namespaces joined by a veth pair, NIXL's
# UCX backend on its TCP transport, against what the link carries. Each of BENCH_ROUNDS rounds
# (default 5) runs, in turn:
#   iperf3      one TCP stream, 3 s, decode's namespace to prefill's
#   P/D         scripts/demo.sh at both of its shapes (256 requests x 16 blocks, 200 x 32; 32
#               layers x 16 KiB, 4 in flight, every byte verified) with the connector's
#               defaults, then at the default shape with UCX's own TCP send segment (8 KiB,
#               UCX_TCP_TX_SEG_SIZE on both sides): what the connector's default buys; and 4
#               requests one at a time, for the first load of a request alone on the link;
#               and both shapes in push mode (--transfer-mode push: the prefill WRITEs)
#   shaped      the same link held to BENCH_TCP_SHAPED (default 8gbit) by a token bucket
#               (tc tbf) on both ends: iperf3 and P/D at both shapes, pull and push. There the
#               wire is the limit; unshaped, the two cores are (both hosts' kernels, the
#               copies and the demo's checks share them), which the CPU column shows
#   UCX alone   bench/tcp_probe/: READs and WRITEs of 256 MiB in 256 KiB descriptors (the
#               runs the demo's READs merge into), 4 requests in flight, no connector, no
#               checks, with the connector's send segment and with UCX's own, and in 16 KiB
#               descriptors (one block of one layer, a run that did not merge); then 1000
#               awaited 16 KiB READs at once on a multi-thread tokio runtime (1, 2 and 4
#               workers) against the same READs one after another, every byte checked
# and writes bench/results/cross-host.md (medians over rounds, each P/D rate as a ratio to
# the same round's iperf3 stream, goals met or missed) and cross-host.log (every run's lines).
# Needs root (ip netns); installs iperf3 where it is missing. Honours CARGO_TARGET_DIR.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

if [[ $(id -u) -ne 0 ]]; then
    echo "bench-tcp: needs root (ip netns)" >&2
    exit 1
fi
rounds=${BENCH_ROUNDS:-5}
shaped_rate=${BENCH_TCP_SHAPED:-8gbit}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$root/target}
export NIXL_LOG_LEVEL=${NIXL_LOG_LEVEL:-WARN}
results=$root/bench/results
log=$results/cross-host.log

scripts/setup.sh
if ! command -v iperf3 >/dev/null; then
    echo "bench-tcp: installing iperf3" >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iperf3 >/dev/null
fi
echo "bench-tcp: building the demo and the probe (release, target dir $CARGO_TARGET_DIR)" >&2
cargo build --release --locked -p nixl-rs --example prefill --example decode --example tcp_probe
bin=$CARGO_TARGET_DIR/release/examples

# Unique per run; veth names fit in 15 bytes.
id=$$
ns_p=nixl-tcpb-p-$id ns_d=nixl-tcpb-d-$id veth_p=ntbp$id veth_d=ntbd$id
addr_p=10.78.0.1 addr_d=10.78.0.2
work=$(mktemp -d)
sampler=''
cleanup() {
    [[ -z $sampler ]] || kill "$sampler" 2>/dev/null || true
    ip netns del "$ns_p" 2>/dev/null || true
    ip netns del "$ns_d" 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT
ip netns add "$ns_p"
ip netns add "$ns_d"
ip link add "$veth_p" type veth peer name "$veth_d"
ip link set "$veth_p" netns "$ns_p"
ip link set "$veth_d" netns "$ns_d"
ip -n "$ns_p" addr add "$addr_p/24" dev "$veth_p"
ip -n "$ns_d" addr add "$addr_d/24" dev "$veth_d"
for ns in "$ns_p" "$ns_d"; do ip -n "$ns" link set lo up; done
ip -n "$ns_p" link set "$veth_p" up
ip -n "$ns_d" link set "$veth_d" up

mkdir -p "$results"
{
    echo "# scripts/bench-tcp.sh, $(date -u +%Y-%m-%dT%H:%M:%SZ), $rounds rounds, $(nproc) cores"
    echo "# prefill in $ns_p ($addr_p), decode in $ns_d ($addr_d), one veth pair, UCX_TLS=tcp"
} >"$log"
records=$work/records

# The machine's CPU while the KV moves: `cpu_start [FILE]` samples `/proc/stat` every
# 250 ms into $work/cpu, from when FILE (if given) shows the decode's run begin (the
# engines started and registered); `cpu_busy` prints the median share of both cores busy
# over those intervals.
cpu_start() {
    : >"$work/cpu"
    (
        if [[ -n ${1:-} ]]; then
            until grep -qs '^decode: agent .* pulling' "$1"; do sleep 0.05; done
        fi
        while :; do head -1 /proc/stat >>"$work/cpu"; sleep 0.25; done
    ) &
    sampler=$!
}
cpu_busy() {
    kill "$sampler" 2>/dev/null || true
    wait "$sampler" 2>/dev/null || true
    python3 - "$work/cpu" <<'PY'
import statistics, sys
rows = [[int(v) for v in line.split()[1:]] for line in open(sys.argv[1])]
busy = []
for a, b in zip(rows, rows[1:]):
    d = [y - x for x, y in zip(a, b)]
    total = sum(d[:8])
    if total > 0:
        busy.append(1 - (d[3] + d[4]) / total)
print("%.2f" % statistics.median(busy) if busy else "nan")
PY
}

# The link's rate: `shape RATE` holds both ends to RATE (tc tbf), `shape none` frees it.
shape() {
    local ns dev
    for pair in "$ns_p $veth_p" "$ns_d $veth_d"; do
        read -r ns dev <<<"$pair"
        ip netns exec "$ns" tc qdisc del dev "$dev" root 2>/dev/null || true
        if [[ $1 != none ]]; then
            ip netns exec "$ns" tc qdisc add dev "$dev" root tbf rate "$1" burst 4mb latency 20ms
        fi
    done
}

# One P/D run: `pd LABEL [ENV=VALUE...] -- [decode flags...]`, with scripts/demo.sh's own
# flags from the array `mode` (e.g. --transfer-mode push); records GB/s, first-load ms and
# the share of the two cores busy.
mode=()
pd() {
    local label=$1 env=()
    shift
    while [[ $1 != -- ]]; do env+=("$1"); shift; done
    shift
    echo "pd $label: $* ${env[*]}" >>"$log"
    : >"$work/demo.out"
    cpu_start "$work/demo.out"
    NIXL_DEMO_BIN_DIR=$bin NIXL_DEMO_LISTEN=$addr_p:7811 \
        NIXL_DEMO_PREFILL_WRAP="ip netns exec $ns_p env UCX_TLS=tcp UCX_NET_DEVICES=$veth_p ${env[*]}" \
        NIXL_DEMO_DECODE_WRAP="ip netns exec $ns_d env UCX_TLS=tcp UCX_NET_DEVICES=$veth_d ${env[*]}" \
        scripts/demo.sh ${mode[@]+"${mode[@]}"} -- "$@" >"$work/demo.out" 2>&1 ||
        { cat "$work/demo.out" >&2; exit 1; }
    local busy
    busy=$(cpu_busy)
    grep -E '^  (time|latency|first|errors):' "$work/demo.out" >>"$log"
    echo "  cpu busy: $busy" >>"$log"
    local gbps first
    gbps=$(sed -n 's/^  time: .*, \([0-9.]*\) GB\/s$/\1/p' "$work/demo.out")
    first=$(sed -n 's/^  first: *\([0-9.]*\) ms .*/\1/p' "$work/demo.out")
    echo "$round pd-$label $gbps $first $busy" >>"$records"
}

# UCX alone: `probe LABEL ENGINE_CONFIG [DESCRIPTOR_BYTES]`; records READ and WRITE GB/s.
probe() {
    ip netns exec "$ns_d" env UCX_TLS=tcp UCX_NET_DEVICES="$veth_d,$veth_p" \
        "$bin/tcp_probe" --target-netns "$ns_p" --bytes $((256 << 20)) --desc-bytes "${3:-$((256 << 10))}" \
        --engine-config "$2" >"$work/probe.out" 2>&1 || { cat "$work/probe.out" >&2; exit 1; }
    echo "probe $1 (engine_config '$2'):" >>"$log"
    grep '^tcp-probe' "$work/probe.out" >>"$log"
    echo "$round probe-read-$1 $(sed -n 's/^tcp-probe read GB\/s //p' "$work/probe.out")" >>"$records"
    echo "$round probe-write-$1 $(sed -n 's/^tcp-probe write GB\/s //p' "$work/probe.out")" >>"$records"
}

# Overlap: `overlap WORKERS`; records the median ratio concurrent/sequential of its reps.
overlap() {
    ip netns exec "$ns_d" env UCX_TLS=tcp UCX_NET_DEVICES="$veth_d,$veth_p" \
        "$bin/tcp_probe" --target-netns "$ns_p" --bytes $((16 << 20)) --concurrent-reads 1000 \
        --workers "$1" --reps 3 --engine-config "TCP_TX_SEG_SIZE=64k" >"$work/probe.out" 2>&1 ||
        { cat "$work/probe.out" >&2; exit 1; }
    echo "overlap, $1 tokio workers:" >>"$log"
    grep '^tcp-probe' "$work/probe.out" >>"$log"
    echo "$round overlap-$1 $(sed -n 's/^tcp-probe concurrent\/sequential //p' "$work/probe.out")" >>"$records"
}

# One TCP stream, prefill's namespace to decode's (the way the KV moves): `iperf NAME`.
iperf() {
    ip netns exec "$ns_d" iperf3 -s -1 -B "$addr_d" >/dev/null 2>&1 &
    local server=$! gbps='' busy
    cpu_start
    for _ in $(seq 50); do
        gbps=$(ip netns exec "$ns_p" iperf3 -c "$addr_d" -t 3 -J 2>/dev/null |
            python3 -c 'import json, sys; print("%.3f" % (json.load(sys.stdin)["end"]["sum_received"]["bits_per_second"] / 8e9))' 2>/dev/null) && break
        sleep 0.1
    done
    busy=$(cpu_busy)
    wait "$server" || true
    echo "$1: $gbps GB/s, cpu busy $busy" >>"$log"
    echo "$round $1 $gbps 0 $busy" >>"$records"
}

start=$SECONDS
for ((round = 1; round <= rounds; round++)); do
    echo "bench-tcp: round $round/$rounds" >&2
    echo "## round $round" >>"$log"
    iperf iperf
    pd default -- --requests 256
    pd 32-blocks -- --requests 200 --blocks-per-request 32
    pd ucx-segment UCX_TCP_TX_SEG_SIZE=8k -- --requests 256
    pd one-at-a-time -- --requests 4 --in-flight 1
    mode=(--transfer-mode push)
    pd push -- --requests 256
    pd push-32-blocks -- --requests 200 --blocks-per-request 32
    mode=()
    shape "$shaped_rate"
    echo "shaped to $shaped_rate:" >>"$log"
    iperf iperf-shaped
    pd shaped -- --requests 256
    pd shaped-32-blocks -- --requests 200 --blocks-per-request 32
    mode=(--transfer-mode push)
    pd shaped-push -- --requests 256
    pd shaped-push-32-blocks -- --requests 200 --blocks-per-request 32
    mode=()
    shape none
    probe connector "TCP_TX_SEG_SIZE=64k"
    probe ucx ""
    probe 16k "TCP_TX_SEG_SIZE=64k" $((16 << 10))
    for workers in 1 2 4; do overlap "$workers"; done
done
echo "bench-tcp: $rounds rounds in $((SECONDS - start)) s; load average: $(cut -d' ' -f1-3 /proc/loadavg)" >&2

python3 - "$records" "$results/cross-host.md" "$rounds" "$shaped_rate" <<'EOF'
import statistics, sys
from collections import defaultdict

records, out, rounds, shaped_rate = sys.argv[1:5]
by = defaultdict(dict)   # name -> round -> [values]
for line in open(records):
    round_, name, *values = line.split()
    by[name][round_] = [float(v) for v in values]

def median(name, i=0):
    return statistics.median(v[i] for v in by[name].values())

def ratio(name, link="iperf"):
    # Per round against that round's iperf3 stream, then the median over rounds.
    return statistics.median(v[0] / by[link][r][0] for r, v in by[name].items())

def busy(name):
    # Blank where the run was too short to sample (nan).
    b = median(name, 2)
    return "" if b != b else f"{b:.2f}"

def goal(name, r, first):
    first_goal = "first load < 100 ms: " + ("met" if first < 100 else "missed")
    return {"pd-ucx-segment": "", "pd-one-at-a-time": first_goal}.get(
        name, "≥ 0.8x: " + ("met" if r >= 0.8 else "missed") + "; " + first_goal)

link = median("iperf")
rows = [
    ("P/D, default shape (256 requests x 16 blocks), connector defaults", "pd-default"),
    ("P/D, 200 requests x 32 blocks, connector defaults", "pd-32-blocks"),
    ("P/D, default shape, UCX's own TCP send segment (8 KiB)", "pd-ucx-segment"),
    ("P/D, 4 requests one at a time (a first load alone on the link)", "pd-one-at-a-time"),
    ("P/D, default shape, push mode (the prefill WRITEs)", "pd-push"),
    ("P/D, 200 requests x 32 blocks, push mode", "pd-push-32-blocks"),
]
shaped_rows = [
    ("P/D, default shape, link held", "pd-shaped"),
    ("P/D, 200 requests x 32 blocks, link held", "pd-shaped-32-blocks"),
    ("P/D, default shape, push mode, link held", "pd-shaped-push"),
    ("P/D, 200 requests x 32 blocks, push mode, link held", "pd-shaped-push-32-blocks"),
]
with open(out, "w") as md:
    md.write(f"**Across hosts over TCP** (scripts/bench-tcp.sh, {rounds} rounds: prefill and decode "
             "in two network namespaces joined by a veth pair, UCX_TLS=tcp; GB/s medians over "
             "rounds; ratios per round against the same round's iperf3 stream, then their median):\n\n")
    md.write("| what | GB/s | x iperf3 | first load (ms) | CPU busy (2 cores) | goal |\n|---|---|---|---|---|---|\n")
    md.write(f"| iperf3, one TCP stream | {link:.2f} | 1.00 | | {busy('iperf')} | |\n")
    for label, name in rows:
        r, first = ratio(name), median(name, 1)
        md.write(f"| {label} | {median(name):.2f} | {r:.2f} | {first:.0f} | {busy(name)} | {goal(name, r, first)} |\n")
    md.write(f"| **The link held to {shaped_rate}** (tc tbf): iperf3, one TCP stream | {median('iperf-shaped'):.2f} | 1.00 | | {busy('iperf-shaped')} | |\n")
    for label, name in shaped_rows:
        r, first = ratio(name, "iperf-shaped"), median(name, 1)
        md.write(f"| {label} | {median(name):.2f} | {r:.2f} | {first:.0f} | {busy(name)} | {goal(name, r, first)} |\n")
    for op in ("read", "write"):
        for seg, what in (("connector", "64 KiB send segment"), ("ucx", "UCX's defaults"),
                          ("16k", "16 KiB descriptors, 64 KiB send segment")):
            name = f"probe-{op}-{seg}"
            md.write(f"| UCX alone (tcp_probe), {op.upper()}, {what} | {median(name):.2f} | {ratio(name):.2f} | | | |\n")
    md.write("\nFirst load: from decode's first try to reach prefill to its first request loaded "
             "(the handshake, prefill's first announcement and the READs of 16 (or 32) blocks x "
             "32 layers, 8 MiB (16 MiB), 4 requests in flight, or 1). UCX alone bounds P/D: over TCP, UCX emulates a READ "
             "with active messages (two copies more than a WRITE, which TCP does zero-copy). CPU busy: the median "
             "share of the machine's two cores busy over 250 ms intervals (/proc/stat) while the KV moves; both hosts, their "
             "kernels and the link share them. Held to a rate below what the cores carry, the wire is the limit, as "
             "between two real hosts.\n")
    md.write("\n| 1000 awaited 16 KiB READs at once / the same one after another | time ratio | goal |\n|---|---|---|\n")
    for workers in (1, 2, 4):
        r = median(f"overlap-{workers}")
        md.write(f"| {workers} tokio worker{'s' if workers > 1 else ''} | {r:.2f} | ≤ 0.5x: {'met' if r <= 0.5 else 'missed'} |\n")
print(open(out).read())
EOF
cat <<EOF
Log of every run: $log
Reproduce: scripts/bench-tcp.sh   (BENCH_ROUNDS=$rounds)
UCX alone: ip netns exec NS_A env UCX_TLS=tcp cargo run --release --example tcp_probe -- --target-netns NS_B
EOF
