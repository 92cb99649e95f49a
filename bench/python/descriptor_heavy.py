#!/usr/bin/env python3
"""Descriptor-heavy READs on NIXL's official Python API (`nixl_cu12`, the pinned wheel), made
as vLLM's worker makes them: both caches' block lists prepared once (`prep_xfer_dlist`), then
per request the descriptor ids of its blocks computed with NumPy, region by region,
`make_prepped_xfer` with them and a notification, `transfer`, and `check_xfer_state` until done.

The same workload as the Rust side (`benches/descriptor_heavy.rs`): 128 regions (64 layers, K
and V apart) of 4,096 blocks of 16 KiB, each region its own lazily zeroed NumPy array; 148
blocks per request; block ids (a) contiguous on both sides, (b) random from the pool, (c) half
a run and half random, drawn with the same splitmix64 seeds; the same byte pattern. Agents A
(decode) and B (prefill) in one process, created on core 1, measured on core 0. Each case's
first request runs into zeroed blocks and every byte is checked; then REPS requests are timed.

Prints one JSON object per figure (to stdout, or appended to --json).
Reproduce: scripts/bench-descriptors.sh (all rounds, alternating with the Rust side).
"""

import argparse
import json
import os
import time

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import numpy as np  # noqa: E402
from nixl_cu12 import nixl_agent  # noqa: E402

REGIONS = 128
POOL = 4096
BLOCK = 16 << 10
WORDS = BLOCK // 8
PER_REQUEST = 148
REQUEST_BYTES = REGIONS * PER_REQUEST * BLOCK
REPS = 5
AGENT_CORE = 1
MEASURE_CORE = 0
MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
CASES = ["a-contiguous", "b-fragmented", "c-half"]


class SplitMix:
    """splitmix64 (identical to the Rust bench)."""

    def __init__(self, seed):
        self.state = seed

    def next(self):
        self.state = (self.state + GOLDEN) & MASK64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        return z ^ (z >> 31)


def run(rng, n):
    start = rng.next() % (POOL - n + 1)
    return list(range(start, start + n))


def distinct(rng, n, ids):
    used = set(ids)
    while len(ids) < n:
        block = rng.next() % POOL
        if block not in used:
            used.add(block)
            ids.append(block)
    return ids


def draw(case, seed):
    rng = SplitMix(seed)
    if case == "a-contiguous":
        return run(rng, PER_REQUEST)
    if case == "b-fragmented":
        return distinct(rng, PER_REQUEST, [])
    return distinct(rng, PER_REQUEST, run(rng, PER_REQUEST // 2))


def tables(case):
    seed = 1000 + 2 * CASES.index(case)
    return np.array(draw(case, seed)), np.array(draw(case, seed + 1))


def pattern(region, block):
    base = np.uint64((region * POOL + int(block)) << 16)
    with np.errstate(over="ignore"):
        return (base | np.arange(WORDS, dtype=np.uint64)) * np.uint64(GOLDEN)


def emit(args, case, metric, value, unit):
    record = {
        "lang": "python",
        "config": "default",
        "workload": case,
        "metric": metric,
        "value": value,
        "unit": unit,
        "round": args.round,
    }
    line = json.dumps(record)
    print(line)
    if args.json:
        with open(args.json, "a", encoding="utf-8") as f:
            f.write(line + "\n")


def block_descs(agent, regions):
    table = np.empty((REGIONS * POOL, 3), dtype=np.uint64)
    offsets = np.arange(POOL, dtype=np.uint64) * BLOCK
    for r, region in enumerate(regions):
        table[r * POOL:(r + 1) * POOL, 0] = region.ctypes.data + offsets
    table[:, 1] = BLOCK
    table[:, 2] = 0
    return agent.get_xfer_descs(table, "DRAM")


class Pair:
    def __init__(self):
        os.sched_setaffinity(0, {AGENT_CORE})
        self.a = nixl_agent("A")
        self.b = nixl_agent("B")
        self.local = [np.zeros(POOL * BLOCK, dtype=np.uint8) for _ in range(REGIONS)]
        self.remote = [np.zeros(POOL * BLOCK, dtype=np.uint8) for _ in range(REGIONS)]
        for agent, regions in ((self.a, self.local), (self.b, self.remote)):
            agent.register_memory([(r.ctypes.data, r.nbytes, 0, "") for r in regions], "DRAM")
        self.a.add_remote_agent(self.b.get_agent_metadata())
        self.local_h = self.a.prep_xfer_dlist("NIXL_INIT_AGENT", block_descs(self.a, self.local))
        self.remote_h = self.a.prep_xfer_dlist("B", block_descs(self.a, self.remote))
        os.sched_setaffinity(0, {MEASURE_CORE})

    def fill(self, blocks):
        for r, region in enumerate(self.remote):
            words = region.view(np.uint64)
            for b in blocks:
                words[b * WORDS:(b + 1) * WORDS] = pattern(r, b)

    def clear(self, blocks):
        for region in self.local:
            words = region.view(np.uint64)
            for b in blocks:
                words[b * WORDS:(b + 1) * WORDS] = 0

    def check(self, case, local, remote):
        for r, region in enumerate(self.local):
            words = region.view(np.uint64)
            for lb, rb in zip(local, remote):
                if not np.array_equal(words[lb * WORDS:(lb + 1) * WORDS], pattern(r, rb)):
                    raise SystemExit(
                        f"python {case}: region {r} local block {lb} does not hold remote block {rb}"
                    )

    def read(self, local, remote):
        """One READ as vLLM's worker makes it; seconds to make, to post, to complete."""
        a = self.a
        t0 = time.perf_counter()
        region_base = (np.arange(REGIONS) * POOL)[:, None]
        local_ids = (region_base + local[None, :]).ravel()
        remote_ids = (region_base + remote[None, :]).ravel()
        handle = a.make_prepped_xfer(
            "READ", self.local_h, local_ids, self.remote_h, remote_ids, notif_msg=b"descriptor-heavy"
        )
        t_make = time.perf_counter()
        state = a.transfer(handle)
        t_post = time.perf_counter()
        while state != "DONE":
            if state == "ERR":
                raise RuntimeError("transfer failed")
            state = a.check_xfer_state(handle)
        t_done = time.perf_counter()
        a.release_xfer_handle(handle)
        return t_make - t0, t_post - t0, t_done - t0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--round", type=int, default=0)
    parser.add_argument("--json")
    args = parser.parse_args()
    pair = Pair()
    for case in CASES:
        local, remote = tables(case)
        pair.fill(remote)
        pair.clear(local)
        pair.read(local, remote)
        pair.check(case, local, remote)
        timed = sorted((pair.read(local, remote) for _ in range(REPS)), key=lambda t: t[2])
        med = timed[len(timed) // 2]
        make = sorted(t[0] for t in timed)[len(timed) // 2]
        post = sorted(t[1] for t in timed)[len(timed) // 2]
        emit(args, case, "make_ms", make * 1e3, "ms")
        emit(args, case, "post_ms", post * 1e3, "ms")
        emit(args, case, "complete_ms", med[2] * 1e3, "ms")
        emit(args, case, "gbps", REQUEST_BYTES / med[2] / 1e9, "GB/s")


if __name__ == "__main__":
    main()
