#!/usr/bin/env bash
# The model-mode benchmark: time to first token of prefill/decode (two processes, TP 1 -> 1,
# the KV over UCX through the connector) against one process serving the same prompt, and
# the KV transfer's share and GB/s, as medians of rounds. Each round runs model_prefill and
# model_decode, whose decode then serves the prompt alone: the two kinds alternate. Each
# round then measures the CMA limit of the same bytes (bench/cma_probe.rs: one process
# reading another's memory with process_vm_readv, in blocks of CMA_BLOCK_BYTES, default the
# demo model's 8 KiB block of a layer), so that the transfer's GB/s has its ceiling beside it.
#
#   scripts/bench-model.sh                      # 16 layers, a 2,048-token prompt, 3 rounds
#   BENCH_ROUNDS=5 scripts/bench-model.sh -- --layers 4 --prompt-len 512
#
# Environment: CARGO_TARGET_DIR (where to build), BENCH_ROUNDS (default 3).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
model_args=(--layers 16 --prompt-len 2048)
[[ ${1:-} == -- ]] && { shift; model_args=("$@"); }
rounds=${BENCH_ROUNDS:-3}

cargo build --release --locked -p nixl-rs --example model_prefill --example model_decode \
    --example cma_probe
block_bytes=${CMA_BLOCK_BYTES:-8192}
bin=${CARGO_TARGET_DIR:-$root/target}/release/examples
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

echo "bench-model: ${model_args[*]}, $rounds rounds; load before: $(cut -d' ' -f1-3 /proc/loadavg)"
for round in $(seq "$rounds"); do
    rm -f "$work/handoff.json"
    "$bin/model_prefill" --handoff "$work/handoff.json" "${model_args[@]}" >"$work/prefill.log" 2>&1 &
    prefill_pid=$!
    "$bin/model_decode" --handoff "$work/handoff.json" --timeout-s 600 "${model_args[@]}" \
        >"$work/decode.log" 2>&1 || { cat "$work/decode.log" "$work/prefill.log" >&2; exit 1; }
    wait "$prefill_pid"
    grep -E '^(ttft|KV transfer)' "$work/decode.log" | sed "s/^/round $round: /"
    result=$(sed -n 's/^RESULT //p' "$work/decode.log")
    kv_bytes=$(python3 -c 'import json, sys; print(json.loads(sys.argv[1])["kv_bytes"])' "$result")
    cma=$("$bin/cma_probe" --bytes "$kv_bytes" --block-bytes "$block_bytes" --passes 16 |
        sed -n 's/^cma one-iovec GB\/s //p')
    echo "round $round: CMA limit (one iovec per call) $cma GB/s"
    python3 -c 'import json, sys; r = json.loads(sys.argv[1]); r["cma_gbps"] = float(sys.argv[2]); print(json.dumps(r))' \
        "$result" "$cma" >>"$work/results.jsonl"
done
echo "bench-model: load after: $(cut -d' ' -f1-3 /proc/loadavg)"

python3 - "$work/results.jsonl" <<'PY'
import json, statistics, sys
runs = [json.loads(line) for line in open(sys.argv[1])]
med = lambda key: statistics.median(r[key] for r in runs)
pd, one, transfer = med("pd_ttft_s"), med("one_ttft_s"), med("transfer_s")
gbps = statistics.median(r["kv_bytes"] / r["transfer_s"] / 1e9 for r in runs)
print(f"median of {len(runs)} rounds:")
print(f"  ttft prefill/decode  {pd * 1e3:10.1f} ms (prefill compute {med('prefill_compute_s') * 1e3:.1f}"
      f" + KV transfer {transfer * 1e3:.1f} + first decode step {med('first_step_s') * 1e3:.1f})")
print(f"  ttft one process     {one * 1e3:10.1f} ms (prefill compute {med('one_compute_s') * 1e3:.1f}"
      f" + first decode step {med('one_first_step_s') * 1e3:.1f})")
print(f"  prefill/decode / one process: {pd / one:.3f}; KV transfer's share of P/D ttft:"
      f" {100 * statistics.median(r['transfer_s'] / r['pd_ttft_s'] for r in runs):.2f} %")
print(f"  KV transfer: {runs[0]['kv_bytes']} bytes, {gbps:.3f} GB/s (handshake included)")
cma = med("cma_gbps")
ratio = statistics.median(r["kv_bytes"] / r["transfer_s"] / 1e9 / r["cma_gbps"] for r in runs)
print(f"  CMA limit of the same bytes: {cma:.3f} GB/s; the transfer at {ratio:.3f}x of it (per round, median)")
PY
