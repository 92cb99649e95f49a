#!/usr/bin/env python3
"""NIXL transfer benchmarks against the official Python API (`nixl_cu12`, the pinned wheel).

The same workloads as the Rust benchmark (`benches/transfer.rs`), on the same setup: two
agents "A" and "B" in one process, UCX with default parameters, the Python API's default
agent configuration, DRAM buffers from NumPy (large ones backed by transparent huge pages),
metadata exchanged in-process. Agents are created while the creating thread is pinned to
core 1 (NIXL and UCX threads inherit that affinity); the measuring thread then pins itself
to core 0.

Prints one JSON object per figure (to stdout, or appended to --json), then a summary.
"""

import argparse
import json
import os
import resource
import sys
import time

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import numpy as np  # noqa: E402
from nixl_cu12 import nixl_agent, nixl_agent_config  # noqa: E402

KIB = 1 << 10
MIB = 1 << 20
BULK = 64 * MIB
BULK_ITERS = 20
KV_BLOCKS = 8192
KV_BLOCK = 32 * KIB
KV_READ = 1024
KV_ITERS = 16
SMALL = 4 * KIB
SMALL_ITERS = 2000
RT_ITERS = 10_000
BUILD_DESCS = 100_000
BUILD_DESC = 64
BUILD_STRIDE = 128
BUILD_REPS = 5
SWEEP = [4 * KIB, 64 * KIB, MIB, 16 * MIB, 64 * MIB]
IDLE_SECONDS = 1.0
AGENT_CORE = 1
MEASURE_CORE = 0
MASK64 = (1 << 64) - 1

OUT = []


def emit(args, config, workload, metric, value, unit):
    record = {
        "lang": "python",
        "config": config,
        "workload": workload,
        "metric": metric,
        "value": value,
        "unit": unit,
        "round": args.round,
    }
    OUT.append(record)
    line = json.dumps(record)
    if args.json:
        with open(args.json, "a", encoding="utf-8") as f:
            f.write(line + "\n")
    else:
        print(line)


def cpu_seconds():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def splitmix64_permutation(n, seed):
    """Fisher-Yates shuffle of 0..n driven by splitmix64 (identical to the Rust bench)."""
    state = seed
    perm = list(range(n))
    for i in range(n - 1, 0, -1):
        state = (state + 0x9E3779B97F4A7C15) & MASK64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        z ^= z >> 31
        j = z % (i + 1)
        perm[i], perm[j] = perm[j], perm[i]
    return np.array(perm, dtype=np.int64)


def pattern(nbytes, seed):
    words = np.arange(nbytes // 8, dtype=np.uint64)
    words *= np.uint64(0x9E3779B97F4A7C15)
    words ^= np.uint64(seed)
    return words.view(np.uint8)


def wait(agent, handle):
    while True:
        state = agent.check_xfer_state(handle)
        if state == "DONE":
            return
        if state == "ERR":
            raise RuntimeError("transfer failed")


def post_wait(agent, handle):
    state = agent.transfer(handle)
    if state == "ERR":
        raise RuntimeError("post failed")
    if state != "DONE":
        wait(agent, handle)


def addr(array):
    return array.ctypes.data


def descs(agent, base, offsets, length):
    table = np.empty((len(offsets), 3), dtype=np.uint64)
    table[:, 0] = base + offsets
    table[:, 1] = length
    table[:, 2] = 0
    return agent.get_xfer_descs(table, "DRAM")


def register(agent, array):
    agent.register_memory([(addr(array), array.nbytes, 0, "")], "DRAM")


def check(ok, what):
    if not ok:
        raise SystemExit(f"python bench: destination bytes wrong after {what}")


class Pair:
    def __init__(self):
        os.sched_setaffinity(0, {AGENT_CORE})
        self.a = nixl_agent("A")
        self.b = nixl_agent("B")
        # One buffer per role, registered while still on the agents' core.
        self.a_bulk = np.zeros(BULK, dtype=np.uint8)
        self.b_bulk = np.zeros(BULK, dtype=np.uint8)
        self.a_kv = np.zeros(KV_BLOCKS * KV_BLOCK, dtype=np.uint8)
        self.b_kv = np.zeros(KV_BLOCKS * KV_BLOCK, dtype=np.uint8)
        self.a_small = np.zeros(SMALL, dtype=np.uint8)
        self.b_small = np.zeros(SMALL, dtype=np.uint8)
        self.a_build = np.zeros(BUILD_DESCS * BUILD_STRIDE, dtype=np.uint8)
        self.b_build = np.zeros(BUILD_DESCS * BUILD_STRIDE, dtype=np.uint8)
        for array in (self.a_bulk, self.a_kv, self.a_small, self.a_build):
            register(self.a, array)
        for array in (self.b_bulk, self.b_kv, self.b_small, self.b_build):
            register(self.b, array)
        self.a.add_remote_agent(self.b.get_agent_metadata())
        os.sched_setaffinity(0, {MEASURE_CORE})


def bulk(args, pair, size, iters, op, workload, seed):
    a = pair.a
    local, remote = pair.a_bulk[:size], pair.b_bulk[:size]
    local_d = descs(a, addr(local), np.array([0]), size)
    remote_d = descs(a, addr(remote), np.array([0]), size)
    handle = a.initialize_xfer(op, local_d, remote_d, "B")
    if op == "WRITE":
        src, dst = local, remote
    else:
        src, dst = remote, local
    src[:] = pattern(size, seed)
    dst[:] = 0
    post_wait(a, handle)
    check(np.array_equal(src, dst), f"{workload} {op}")
    cpu0, t0 = cpu_seconds(), time.perf_counter()
    for _ in range(iters):
        post_wait(a, handle)
    elapsed, cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
    handle.release()
    gb = size * iters / 1e9
    emit(args, "default", workload, "gbps", gb / elapsed, "GB/s")
    if size == BULK:
        emit(args, "default", workload, "cpu_s_per_gb", cpu / gb, "CPU s/GB")
    return gb / elapsed


def kv(args, pair, perm, prepared):
    a = pair.a
    a_blocks = pair.a_kv.reshape(KV_BLOCKS, KV_BLOCK)
    b_blocks = pair.b_kv.reshape(KV_BLOCKS, KV_BLOCK)
    chunks = KV_BLOCKS // KV_READ
    a_base, b_base = addr(pair.a_kv), addr(pair.b_kv)
    if prepared:
        offsets = np.arange(KV_BLOCKS, dtype=np.uint64) * KV_BLOCK
        local_h = a.prep_xfer_dlist("NIXL_INIT_AGENT", descs(a, a_base, offsets, KV_BLOCK))
        remote_h = a.prep_xfer_dlist("B", descs(a, b_base, offsets, KV_BLOCK))

    def one(i):
        c = i % chunks
        remote_idx = perm[c * KV_READ:(c + 1) * KV_READ]
        lc = (c + chunks // 2) % chunks
        local_idx = perm[lc * KV_READ:(lc + 1) * KV_READ]
        if prepared:
            handle = a.make_prepped_xfer(
                "READ", local_h, local_idx.astype(np.int32), remote_h,
                remote_idx.astype(np.int32))
        else:
            l_off = local_idx.astype(np.uint64) * KV_BLOCK
            r_off = remote_idx.astype(np.uint64) * KV_BLOCK
            handle = a.initialize_xfer(
                "READ", descs(a, a_base, l_off, KV_BLOCK), descs(a, b_base, r_off, KV_BLOCK), "B")
        post_wait(a, handle)
        handle.release()
        return local_idx, remote_idx

    pair.b_kv[:] = pattern(pair.b_kv.nbytes, 7 + args.round)
    pair.a_kv[:] = 0
    local_idx, remote_idx = one(0)
    check(np.array_equal(a_blocks[local_idx], b_blocks[remote_idx]), "kv READ")
    cpu0, t0 = cpu_seconds(), time.perf_counter()
    for i in range(KV_ITERS):
        one(i)
    elapsed, cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
    if prepared:
        local_h.release()
        remote_h.release()
    name = "w2_prepared" if prepared else "w2_fresh"
    gb = KV_ITERS * KV_READ * KV_BLOCK / 1e9
    emit(args, "default", name, "req_per_s", KV_ITERS / elapsed, "req/s")
    emit(args, "default", name, "gbps", gb / elapsed, "GB/s")
    emit(args, "default", name, "cpu_s_per_gb", cpu / gb, "CPU s/GB")


def small(args, pair):
    a = pair.a
    local_d = descs(a, addr(pair.a_small), np.array([0]), SMALL)
    remote_d = descs(a, addr(pair.b_small), np.array([0]), SMALL)

    def one():
        handle = a.initialize_xfer("WRITE", local_d, remote_d, "B")
        post_wait(a, handle)
        handle.release()

    pair.a_small[:] = pattern(SMALL, 11 + args.round)
    pair.b_small[:] = 0
    one()
    check(np.array_equal(pair.a_small, pair.b_small), "small WRITE")
    t0 = time.perf_counter()
    for _ in range(SMALL_ITERS):
        one()
    elapsed = time.perf_counter() - t0
    emit(args, "default", "w3_small", "us_per_iter", elapsed / SMALL_ITERS * 1e6, "us")


def quantile(sorted_samples, q):
    """The value below which q of the sorted samples lie (the Rust bench's rule)."""
    return float(sorted_samples[int(round((len(sorted_samples) - 1) * q))])


def round_trip(args, pair):
    """The 4 KiB round trip: one WRITE handle made once, posted and waited for RT_ITERS
    times, each timed; mean, p50 and p99 in microseconds."""
    a = pair.a
    local_d = descs(a, addr(pair.a_small), np.array([0]), SMALL)
    remote_d = descs(a, addr(pair.b_small), np.array([0]), SMALL)
    handle = a.initialize_xfer("WRITE", local_d, remote_d, "B")
    pair.a_small[:] = pattern(SMALL, 11 + args.round)
    pair.b_small[:] = 0
    post_wait(a, handle)
    check(np.array_equal(pair.a_small, pair.b_small), "4 KiB round trip")
    us = np.empty(RT_ITERS)
    for i in range(RT_ITERS):
        t0 = time.perf_counter()
        post_wait(a, handle)
        us[i] = (time.perf_counter() - t0) * 1e6
    handle.release()
    us.sort()
    emit(args, "default", "rt_4k_write", "us_per_iter", float(us.mean()), "us")
    emit(args, "default", "rt_4k_write", "p50_us", quantile(us, 0.5), "us")
    emit(args, "default", "rt_4k_write", "p99_us", quantile(us, 0.99), "us")


def build(args, pair):
    a = pair.a
    offsets = np.arange(BUILD_DESCS, dtype=np.uint64) * BUILD_STRIDE
    a_base, b_base = addr(pair.a_build), addr(pair.b_build)
    times = []
    for _ in range(BUILD_REPS):
        cpu0 = time.thread_time()
        t0 = time.perf_counter()
        local_d = descs(a, a_base, offsets, BUILD_DESC)
        t1 = time.perf_counter()
        remote_d = descs(a, b_base, offsets, BUILD_DESC)
        t2 = time.perf_counter()
        handle = a.initialize_xfer("WRITE", local_d, remote_d, "B")
        t3 = time.perf_counter()
        cpu = time.thread_time() - cpu0
        handle.release()
        times.append((t3 - t0, t1 - t0, t2 - t1, t3 - t2, cpu))
    best = sorted(times)[len(times) // 2]
    for metric, value in zip(("ms", "local_ms", "remote_ms", "create_ms", "cpu_ms"), best):
        emit(args, "default", "w4_build", metric, value * 1e3, "ms")


def idle(args):
    """CPU one idle agent (UCX backend, default config) burns per second of wall time."""
    os.sched_setaffinity(0, {AGENT_CORE})
    agent = nixl_agent("idle")
    os.sched_setaffinity(0, {MEASURE_CORE})
    time.sleep(0.1)
    cpu0, t0 = cpu_seconds(), time.perf_counter()
    time.sleep(IDLE_SECONDS)
    cpu, elapsed = cpu_seconds() - cpu0, time.perf_counter() - t0
    del agent
    emit(args, "default", "idle", "core_pct", cpu / elapsed * 100, "% of a core")


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--round", type=int, default=0, help="round number put in each record")
    parser.add_argument("--json", help="append JSON lines here instead of printing them")
    parser.add_argument("--w4", action="store_true", help="run W4 alone (as the Rust bench's `w4`)")
    args = parser.parse_args()

    if args.w4:
        build(args, Pair())
        return
    idle(args)
    pair = Pair()
    perm = splitmix64_permutation(KV_BLOCKS, 42)
    for size in SWEEP:
        iters = max(BULK_ITERS, min(SMALL_ITERS, (256 * MIB) // size))
        bulk(args, pair, size, iters, "WRITE", f"sweep_{size}", 3 + args.round)
    bulk(args, pair, BULK, BULK_ITERS, "WRITE", "w1_write", 5 + args.round)
    bulk(args, pair, BULK, BULK_ITERS, "READ", "w1_read", 6 + args.round)
    kv(args, pair, perm, prepared=False)
    kv(args, pair, perm, prepared=True)
    small(args, pair)
    round_trip(args, pair)
    build(args, pair)

    print(
        f"python bench round {args.round}: agents A,B created on core {AGENT_CORE} "
        f"(NIXL/UCX threads inherit it), measured on core {MEASURE_CORE}; "
        "nixl_agent defaults (progress thread on, delay 0, sync NONE), UCX defaults",
        file=sys.stderr,
    )
    for r in OUT:
        print(f"  {r['workload']:<16} {r['metric']:<13} {r['value']:>12.4f} {r['unit']}",
              file=sys.stderr)
    print(f"reproduce: {sys.executable} {' '.join(sys.argv)}", file=sys.stderr)


if __name__ == "__main__":
    main()
