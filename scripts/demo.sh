#!/usr/bin/env bash
# Main job: the prefill/decode KV-cache demo over real NIXL.
#
# Builds the `prefill` and `decode` examples in release, starts prefill on loopback, runs
# decode against it (256 requests of 16 blocks x 32 layers x 16 KiB: 2 GiB pulled with NIXL
# READs, every byte checked), then prints both sides' output and a verdict. Exits non-zero
# if either side fails or any byte mismatches. In the native protocol both sides get a fresh
# shared secret (--secret-file), so their connector side channels authenticate each other.
#
#   scripts/demo.sh                            # metadata inside the connector's handshake
#   scripts/demo.sh --etcd                     # metadata through a private etcd on loopback
#   scripts/demo.sh --protocol vllm            # the connectors speak vLLM's NixlConnector protocol
#   scripts/demo.sh --transfer-mode push       # the prefill WRITEs into blocks the decode registers
#   scripts/demo.sh --protocol vllm --transfer-mode push   # the same over vLLM's NixlPushConnector wire
#   scripts/demo.sh --turns 3                  # conversations of 3 turns, answers read back
#   scripts/demo.sh --prefill-pp 2 --prefill-tp 2 --decode-tp 1   # parallel engines
#   scripts/demo.sh -- --requests 32 --in-flight 8   # flags after -- go to decode
#   scripts/demo.sh --model                    # a real model's KV instead of a byte pattern
#   scripts/demo.sh --model -- --layers 16 --prompt-len 2048   # flags after -- go to both
#
# --turns N makes every request a conversation of N turns (vLLM 0.33's bidirectional KV
# transfer): decode answers each turn but the last with 1 to 4 blocks of its own (a block is a
# token here; decode's --answer-blocks) and keeps them; the next turn's prompt is the last
# prompt, its answer and 16 new blocks: prefill's prefix cache holds the last prompt, it reads
# the answer back from decode (answers under its --recompute-threshold of 2 tokens it computes
# itself) and checks every byte of it, and decode loads only the new blocks, its prefix cache
# holding the rest. Both sides print the tokens read back, recomputed and loaded.
#
# --prefill-tp/--prefill-pp/--decode-tp/--decode-pp N run each engine as TP x PP ranks, one
# connector worker per rank inside the prefill (decode) process, each stage holding vLLM's even
# split of the layers and each TP rank its share of every block's KV heads (--kv-heads, by
# default the least common multiple of both TP sizes); every byte of every rank is checked.
# --dcp N (decode context parallelism) is refused above 1: it needs an MLA cache, and the
# demo's cache is MHA-like.
#
# --model runs the `model_prefill` and `model_decode` examples: the prefill computes a
# prompt's KV with a seeded transformer (kv-model) into its registered blocks, the decode
# loads them through the connector, generates 32 tokens and compares them with one process
# serving the same prompt; it prints the prompt, both runs' tokens and the time to first
# token in parts, and exits non-zero if the runs differ.
#
# Environment:
#   CARGO_TARGET_DIR        where to build (default: target/)
#   NIXL_DEMO_BIN_DIR       use the prefill/decode binaries in this directory, skip the build
#   NIXL_DEMO_CACHE_ARGS    cache flags for both sides (e.g. "--layers 4 --blocks 64")
#   NIXL_DEMO_LISTEN        prefill's control-channel address (default 127.0.0.1:0, any port)
#   NIXL_DEMO_PREFILL_WRAP  words run before prefill (e.g. "ip netns exec ns env UCX_TLS=tcp")
#   NIXL_DEMO_DECODE_WRAP   words run before decode
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
scripts/setup.sh

use_etcd=0
model_mode=0
decode_args=(--requests 256)
protocol_args=()
mode_args=()
turns_args=()
prefill_tp=1 prefill_pp=1 decode_tp=1 decode_pp=1 dcp=1
usage="usage: $0 [--etcd | --model] [--protocol native|vllm] [--transfer-mode pull|push] [--turns N] [--prefill-tp N] [--prefill-pp N] [--decode-tp N] [--decode-pp N] [--dcp N] [-- decode flags...]"
while [[ $# -gt 0 ]]; do
    case $1 in
        --etcd) use_etcd=1 ;;
        --model) model_mode=1 ;;
        --protocol)
            [[ $# -ge 2 ]] || { echo "$usage" >&2; exit 2; }
            protocol_args=(--protocol "$2")
            shift
            ;;
        --transfer-mode)
            [[ $# -ge 2 ]] || { echo "$usage" >&2; exit 2; }
            mode_args=(--transfer-mode "$2")
            shift
            ;;
        --turns)
            [[ $# -ge 2 ]] || { echo "$usage" >&2; exit 2; }
            turns_args=(--turns "$2")
            shift
            ;;
        --prefill-tp | --prefill-pp | --decode-tp | --decode-pp | --dcp)
            [[ $# -ge 2 && $2 =~ ^[1-9][0-9]*$ ]] || { echo "$1 takes a whole number of at least 1; $usage" >&2; exit 2; }
            name=${1#--}
            printf -v "${name//-/_}" '%s' "$2"
            shift
            ;;
        --) shift; decode_args+=("$@"); break ;;
        *) echo "$usage" >&2; exit 2 ;;
    esac
    shift
done

[[ $use_etcd == 1 && $model_mode == 1 ]] && { echo "$usage" >&2; exit 2; }
[[ $model_mode == 1 && ${#turns_args[@]} -gt 0 ]] && { echo "$usage" >&2; exit 2; }
# The model examples move their KV by pull only.
[[ $model_mode == 1 && ${#mode_args[@]} -gt 0 ]] && { echo "$usage" >&2; exit 2; }
# The engines' ranks: each side's TP and PP, the KV heads shared by both TP sizes.
parallel=0
[[ $prefill_tp$prefill_pp$decode_tp$decode_pp$dcp != 11111 ]] && parallel=1
[[ $parallel == 1 && $model_mode == 1 ]] && { echo "$usage" >&2; exit 2; }
if [[ $dcp != 1 ]]; then
    echo "demo: --dcp $dcp: decode context parallelism shards an MLA cache (vLLM 0.33 runs it for MLA only), and the demo's KV cache is MHA-like; run with --dcp 1" >&2
    exit 2
fi
gcd() { local a=$1 b=$2; while ((b)); do local t=$((a % b)); a=$b b=$t; done; echo "$a"; }
kv_heads=$((prefill_tp / $(gcd "$prefill_tp" "$decode_tp") * decode_tp))
prefill_rank_args=() decode_rank_args=()
if [[ $parallel == 1 ]]; then
    prefill_rank_args=(--tp "$prefill_tp" --pp "$prefill_pp" --kv-heads "$kv_heads")
    decode_rank_args=(--tp "$decode_tp" --pp "$decode_pp" --kv-heads "$kv_heads")
fi
# Answers of one block fall under prefill's recompute threshold, longer ones are read back.
prefill_turns_args=()
[[ ${#turns_args[@]} -gt 0 ]] && prefill_turns_args=(--recompute-threshold 2)

if [[ -n ${NIXL_DEMO_BIN_DIR:-} ]]; then
    bin=$NIXL_DEMO_BIN_DIR
elif [[ $model_mode == 1 ]]; then
    cargo build --release --locked -p nixl-rs --example model_prefill --example model_decode
    bin=${CARGO_TARGET_DIR:-$root/target}/release/examples
else
    cargo build --release --locked -p nixl-rs --example prefill --example decode
    bin=${CARGO_TARGET_DIR:-$root/target}/release/examples
fi

if [[ $model_mode == 1 ]]; then
    # The byte-pattern mode's --requests default is not a model flag.
    model_args=("${decode_args[@]:2}" "${protocol_args[@]}")
    work=$(mktemp -d)
    "$bin/model_prefill" --handoff "$work/handoff.json" "${model_args[@]}" >"$work/prefill.log" 2>&1 &
    prefill_pid=$!
    trap 'kill "$prefill_pid" 2>/dev/null || true; rm -rf "$work"' EXIT
    decode_rc=0
    "$bin/model_decode" --handoff "$work/handoff.json" "${model_args[@]}" || decode_rc=$?
    # A decode that failed may never have read the blocks the prefill waits on.
    [[ $decode_rc == 0 ]] || kill "$prefill_pid" 2>/dev/null || true
    prefill_rc=0
    wait "$prefill_pid" || prefill_rc=$?
    echo "--- model_prefill output"
    cat "$work/prefill.log"
    echo "---"
    if [[ $decode_rc == 0 && $prefill_rc == 0 ]]; then
        echo "demo: PASSED (model mode: prefill/decode tokens equal one process's)"
        exit 0
    fi
    echo "demo: FAILED (model_decode exit $decode_rc, model_prefill exit $prefill_rc)" >&2
    exit 1
fi

read -r -a cache_args <<<"${NIXL_DEMO_CACHE_ARGS:-}"
read -r -a prefill_wrap <<<"${NIXL_DEMO_PREFILL_WRAP:-}"
read -r -a decode_wrap <<<"${NIXL_DEMO_DECODE_WRAP:-}"
work=$(mktemp -d)
prefill_pid='' etcd_pid=''
cleanup() {
    [[ -n $prefill_pid ]] && kill "$prefill_pid" 2>/dev/null || true
    [[ -n $etcd_pid ]] && kill "$etcd_pid" 2>/dev/null || true
    wait 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

secret_args=()
if [[ ${protocol_args[1]:-native} == native ]]; then
    (umask 077 && od -An -tx1 -N32 /dev/urandom | tr -d ' \n' >"$work/secret")
    secret_args=(--secret-file "$work/secret")
fi

metadata_args=()
if [[ $use_etcd == 1 ]]; then
    client_port=$(free_port) peer_port=$(free_port)
    etcd --name demo --data-dir "$work/etcd" \
        --listen-client-urls "http://127.0.0.1:$client_port" \
        --advertise-client-urls "http://127.0.0.1:$client_port" \
        --listen-peer-urls "http://127.0.0.1:$peer_port" \
        --initial-advertise-peer-urls "http://127.0.0.1:$peer_port" \
        --initial-cluster "demo=http://127.0.0.1:$peer_port" >"$work/etcd.log" 2>&1 &
    etcd_pid=$!
    for _ in $(seq 100); do
        if { exec 3<>"/dev/tcp/127.0.0.1/$client_port"; } 2>/dev/null; then
            printf 'GET /health HTTP/1.0\r\n\r\n' >&3
            health=$(cat <&3 || true)
            exec 3<&-
            [[ $health == *'"health":"true"'* ]] && break
        fi
        sleep 0.1
    done
    [[ ${health:-} == *'"health":"true"'* ]] || { echo "demo: etcd did not start:" >&2; cat "$work/etcd.log" >&2; exit 1; }
    echo "demo: etcd on 127.0.0.1:$client_port"
    metadata_args=(--metadata etcd --etcd-endpoints "http://127.0.0.1:$client_port")
fi

# Created here, not by the background job's redirection, which a busy machine may run only
# after the first look below.
: >"$work/prefill.log"
"${prefill_wrap[@]}" "$bin/prefill" --listen "${NIXL_DEMO_LISTEN:-127.0.0.1:0}" --sessions 1 \
    "${cache_args[@]}" "${metadata_args[@]}" "${protocol_args[@]}" "${mode_args[@]}" \
    "${secret_args[@]}" "${prefill_turns_args[@]}" "${prefill_rank_args[@]}" >"$work/prefill.log" 2>&1 &
prefill_pid=$!
addr=''
for _ in $(seq 300); do
    addr=$(sed -n 's/.* listening on \([^ ]*\) .*/\1/p' "$work/prefill.log")
    [[ -n $addr ]] && break
    kill -0 "$prefill_pid" 2>/dev/null || break
    sleep 0.1
done
if [[ -z $addr ]]; then
    echo "demo: prefill did not start:" >&2
    cat "$work/prefill.log" >&2
    exit 1
fi

start=$(date +%s.%N)
decode_rc=0
"${decode_wrap[@]}" "$bin/decode" --prefill "$addr" "${cache_args[@]}" "${metadata_args[@]}" \
    "${protocol_args[@]}" "${mode_args[@]}" "${secret_args[@]}" "${turns_args[@]}" \
    "${decode_rank_args[@]}" "${decode_args[@]}" || decode_rc=$?

prefill_rc=0
for _ in $(seq 100); do
    kill -0 "$prefill_pid" 2>/dev/null || break
    sleep 0.1
done
if kill -0 "$prefill_pid" 2>/dev/null; then
    echo "demo: prefill still running after decode ended; stopping it" >&2
    kill "$prefill_pid"
fi
wait "$prefill_pid" || prefill_rc=$?
prefill_pid=''
elapsed=$(echo "$(date +%s.%N) - $start" | bc 2>/dev/null || echo '?')

echo "--- prefill output"
cat "$work/prefill.log"
echo "---"
if [[ $decode_rc == 0 && $prefill_rc == 0 ]]; then
    echo "demo: PASSED (decode and prefill exited 0, ${elapsed}s after prefill was up)"
else
    echo "demo: FAILED (decode exit $decode_rc, prefill exit $prefill_rc)" >&2
    exit 1
fi
