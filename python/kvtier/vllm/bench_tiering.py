"""Head to head through vLLM's secondary-tier interface: vLLM's own `fs` tier against KvtierTier.

    python -m kvtier.vllm.bench_tiering --dir /mnt/kvcache/bench       (scripts/bench-vllm-tiering.sh)

Both tiers are built by vLLM's own code (TieringOffloadingSpec and its tier factory, from the
`secondary_tiers` configuration) over the same CPU primary (vLLM's shared-memory offload region),
in the same directory, with the same chunk size and thread counts (vLLM's defaults: 16 read, 16
write threads). Both are driven with vLLM's TransferJob objects as its TieringOffloadingManager
drives them: submit_store / submit_load, then get_finished_jobs polled like a scheduler step. The
same jobs (same keys, same bytes) are stored by each tier in its own format, then loaded back
with 1, 4 and 16 jobs in flight; arms alternate, and their order flips every repeat.

Page cache: both tiers read and write with O_DIRECT (the benchmark checks that each did: vLLM's
probe and kvtier's stats), so the page cache holds none of the chunk data, for either arm.

Printed per workload and arm: throughput (GB/s of chunk payload), per-job latency p50/p99 (ms,
submission to the poll that saw it finished), and CPU time of this process (the scheduler's: the
tiers' I/O threads and the polling thread) per GB moved, then the kvtier/vLLM ratios. Loaded
bytes are compared with what was stored, outside the timed part.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import compat

try:  # before vLLM 0.28: its message, and from the command line no traceback
    compat.require_secondary_tier()
except compat.UnsupportedVllmError as e:
    if __name__ == "__main__":
        sys.exit(f"bench_tiering: {e}")
    raise

# vLLM's own classes; nothing here stands in for them.
from vllm.v1.kv_offload.base import ReqContext, make_offload_key  # noqa: E402
from vllm.v1.kv_offload.config import (  # noqa: E402
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.base import TransferJob  # noqa: E402
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec  # noqa: E402

GPU_BLOCK_TOKENS = 16


def offloading_config(extra_config: dict[str, Any], *, bytes_per_token: int,
                      num_layers: int = 2, model: str = "kvtier-bench/model",
                      dtype: str = "bfloat16") -> OffloadingConfig:
    """vLLM's normalized offloading configuration for a single-GPU full-attention model, as
    vLLM's build_offloading_config derives it (block_size / GPU block = blocks per chunk)."""
    block_size = int(extra_config.get("block_size", GPU_BLOCK_TOKENS))
    if block_size % GPU_BLOCK_TOKENS:
        raise ValueError(f"block_size must be a multiple of {GPU_BLOCK_TOKENS}")
    group = OffloadingGroupConfig(**compat.known_fields(  # group_id: from vLLM 0.32
        OffloadingGroupConfig, tokens_per_block=GPU_BLOCK_TOKENS, group_id=0,
        layer_names=tuple(f"model.layers.{i}.self_attn.attn" for i in range(num_layers))))
    return OffloadingConfig(
        groups=(group,),
        worker_kv_bytes_per_block=bytes_per_token * GPU_BLOCK_TOKENS,
        enable_kv_cache_events=False,
        extra_config=extra_config,
        engine_id=f"kvtier-{uuid.uuid4().hex[:12]}",
        model=OffloadingModelConfig(name=model, dtype=dtype),
        cache=OffloadingCacheConfig(tokens_per_hash=GPU_BLOCK_TOKENS,
                                    blocks_per_chunk=block_size // GPU_BLOCK_TOKENS),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=True),
    )


def offload_keys(seed: str, n: int) -> list[bytes]:
    """n chained block hashes (SHA-256, as vLLM's default prefix hash), as offload keys."""
    keys, prev = [], hashlib.sha256(seed.encode()).digest()
    for i in range(n):
        prev = hashlib.sha256(prev + i.to_bytes(4, "little")).digest()
        keys.append(make_offload_key(prev, 0))
    return keys


@dataclass
class Arm:
    name: str
    spec: TieringOffloadingSpec
    tier: Any
    results: dict[str, list[dict[str, float]]] = field(default_factory=dict)


def build_arm(name: str, tier_config: dict[str, Any], common: dict[str, Any],
              bytes_per_token: int) -> Arm:
    extra = dict(common, secondary_tiers=[tier_config])
    spec = TieringOffloadingSpec(offloading_config(extra, bytes_per_token=bytes_per_token))
    manager = spec.get_manager()
    return Arm(name, spec, manager.secondary_tiers[0])


def run_jobs(tier, jobs: list[TransferJob], in_flight: int, store: bool,
             poll_interval: float) -> dict[str, float]:
    """Submits `jobs` keeping at most `in_flight` outstanding, polls get_finished_jobs like a
    scheduler step every `poll_interval` seconds; returns throughput, latencies and CPU."""
    submit = tier.submit_store if store else tier.submit_load
    pending = list(reversed(jobs))
    started: dict[int, float] = {}
    latencies: list[float] = []
    failed = 0
    cpu0, main0, t0 = time.process_time(), time.thread_time(), time.perf_counter()
    while pending or started:
        while pending and len(started) < in_flight:
            job = pending.pop()
            started[job.job_id] = time.perf_counter()
            submit(job)
        time.sleep(poll_interval)
        for r in tier.get_finished_jobs():
            latencies.append(time.perf_counter() - started.pop(r.job_id))
            failed += not r.success
    wall = time.perf_counter() - t0
    cpu, main_cpu = time.process_time() - cpu0, time.thread_time() - main0
    nbytes = sum(len(j.keys) for j in jobs) * tier.block_size_bytes
    latencies.sort()
    return {"gbps": nbytes / wall / 1e9, "wall_s": wall, "bytes": nbytes,
            "p50_ms": 1e3 * latencies[len(latencies) // 2],
            "p99_ms": 1e3 * latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))],
            "cpu_s_per_gb": cpu / (nbytes / 1e9), "main_cpu_s_per_gb": main_cpu / (nbytes / 1e9),
            "failed": failed}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default=None,
                   help="cache directory (on the storage to measure; default: a new folder in "
                        "$TMPDIR, removed afterwards)")
    p.add_argument("--bytes-per-token", type=int, default=36 * 8 * 128 * 2 * 2,
                   help="KV bytes per token (default: Qwen3-8B, 147456)")
    p.add_argument("--block-size", type=int, default=256, help="tokens per chunk (default 256)")
    p.add_argument("--chunks-per-job", type=int, default=4,
                   help="chunks per job: one request's promotion or cascade (default 4)")
    p.add_argument("--jobs", type=int, default=16, help="jobs per workload (default 16)")
    p.add_argument("--in-flight", default="1,4,16",
                   help="jobs in flight for the load workloads (default 1,4,16)")
    p.add_argument("--threads", type=int, default=16,
                   help="read threads and write threads of each tier (default 16, vLLM's)")
    p.add_argument("--repeats", type=int, default=3, help="repeats of every arm (default 3)")
    p.add_argument("--kvtier-sync-data", action="store_true",
                   help="kvtier's tier fdatasyncs every chunk before publishing it (its "
                        "sync_data; default off, as vLLM's fs tier, which never syncs)")
    p.add_argument("--poll-ms", type=float, default=0.5,
                   help="scheduler poll interval in ms (default 0.5)")
    args = p.parse_args(argv)

    own_dir = args.dir is None
    root = tempfile.mkdtemp(prefix="kvtier-bench-tiering-") if own_dir else args.dir
    os.makedirs(root, exist_ok=True)
    n_chunks = args.jobs * args.chunks_per_job
    chunk_payload = args.bytes_per_token * args.block_size
    common = {"cpu_bytes_to_use": (n_chunks + 1) * (chunk_payload + 4096),
              "block_size": args.block_size}
    arms = [
        build_arm("vllm-fs", {"type": "fs", "root_dir": os.path.join(root, "vllm-fs"),
                              "n_read_threads": args.threads, "n_write_threads": args.threads},
                  common, args.bytes_per_token),
        build_arm("kvtier", {"type": "KvtierTier", "module_path": "kvtier.vllm.tiering",
                             "l2": {"type": "fs", "path": os.path.join(root, "kvtier"),
                                    "read_threads": args.threads,
                                    "write_threads": args.threads},
                             "sync_data": args.kvtier_sync_data},
                  common, args.bytes_per_token),
    ]
    chunk_bytes = arms[0].tier.block_size_bytes
    assert all(a.tier.block_size_bytes == chunk_bytes for a in arms)
    if not getattr(arms[0].tier, "_use_o_direct", False):
        print(f"warning: vLLM's fs tier could not use O_DIRECT in {root}: its reads may come "
              "from the page cache", file=sys.stderr)

    # The same bytes in both primaries, chunk i in slot i: random, so no filesystem or device
    # can compress or deduplicate them. Loads are checked against each chunk's CRC.
    views = {}
    for a in arms:
        views[a.name] = np.frombuffer(
            a.spec.get_manager().primary_tier.get_kv_memoryview().cast("B"),
            dtype=np.uint8).reshape(-1, chunk_bytes)
    crcs = []
    for i in range(n_chunks):
        chunk = np.random.default_rng(i).integers(0, 256, chunk_bytes, dtype=np.uint8)
        crcs.append(zlib.crc32(chunk))
        for view in views.values():
            view[i] = chunk

    in_flights = [int(x) for x in args.in_flight.split(",")]
    # As vLLM does once it has started: the objects of the start-up (vLLM's and torch's modules,
    # millions of them) leave the collector's generations, so a collection during a timed run
    # (of either arm) walks only what the run itself made.
    gc.collect()
    gc.freeze()
    load_start = os.getloadavg()
    print(f"# {args.jobs} jobs of {args.chunks_per_job} chunks of {chunk_bytes / 2**20:.1f} MiB "
          f"({n_chunks * chunk_bytes / 1e9:.2f} GB per workload), {args.threads} read + "
          f"{args.threads} write threads per tier, {args.repeats} repeats, arms interleaved, "
          f"kvtier's fdatasync per chunk {'on' if args.kvtier_sync_data else 'off'}; "
          f"directory {root}; {os.cpu_count()} CPUs")
    job_id = 0

    def jobs_for(seed: str, is_promotion: bool, chunk_offset: int = 0) -> list[TransferJob]:
        nonlocal job_id
        keys = offload_keys(seed, n_chunks)
        out = []
        for j in range(args.jobs):
            lo = j * args.chunks_per_job
            ids = np.arange(lo, lo + args.chunks_per_job, dtype=np.int64) + chunk_offset
            out.append(TransferJob(**compat.known_fields(  # chunk_ids: block_ids before 0.32
                TransferJob, job_id=job_id, keys=keys[lo:lo + args.chunks_per_job],
                chunk_ids=ids, block_ids=ids, is_promotion=is_promotion,
                req_context=ReqContext(req_id=f"r{j}"))))
            job_id += 1
        return out

    for rep in range(args.repeats):
        order = arms if rep % 2 == 0 else arms[::-1]
        seed = f"rep{rep}-{uuid.uuid4().hex}"
        # Stores: fresh keys every repeat, so every store writes.
        for a in order:
            r = run_jobs(a.tier, jobs_for(seed, False), args.jobs, True, args.poll_ms / 1e3)
            a.results.setdefault("store", []).append(r)
        for k in in_flights:
            for a in order:
                view = views[a.name]
                view[:n_chunks] = 0  # loads must bring the bytes back
                r = run_jobs(a.tier, jobs_for(seed, True), k, False, args.poll_ms / 1e3)
                if r["failed"] or [zlib.crc32(view[i]) for i in range(n_chunks)] != crcs:
                    raise SystemExit(f"{a.name}: loaded chunks differ from the stored ones")
                a.results.setdefault(f"load-{k}x", []).append(r)

    load_end = os.getloadavg()
    print("# load average (1, 5, 15 min) at the start " +
          " ".join(f"{x:.2f}" for x in load_start) + ", at the end " +
          " ".join(f"{x:.2f}" for x in load_end))
    kv = next(a for a in arms if a.name == "kvtier")
    stats = kv.tier.file_tier.stats()
    if not stats["o_direct"]:
        print("warning: kvtier's file tier could not use O_DIRECT", file=sys.stderr)

    def med(a: Arm, w: str, key: str) -> float:
        return statistics.median(r[key] for r in a.results[w])

    print(f"{'workload':<10} {'arm':<8} {'GB/s':>7} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'CPU s/GB':>9} {'main s/GB':>9}  (medians of {args.repeats}; all GB/s)")
    for w in arms[0].results:
        for a in arms:
            runs = " ".join(f"{r['gbps']:.2f}" for r in a.results[w])
            print(f"{w:<10} {a.name:<8} {med(a, w, 'gbps'):>7.2f} {med(a, w, 'p50_ms'):>8.1f} "
                  f"{med(a, w, 'p99_ms'):>8.1f} {med(a, w, 'cpu_s_per_gb'):>9.3f} "
                  f"{med(a, w, 'main_cpu_s_per_gb'):>9.4f}  [{runs}]")
        base = next(a for a in arms if a.name == "vllm-fs")
        print(f"{w:<10} {'ratio':<8} {med(kv, w, 'gbps') / med(base, w, 'gbps'):>6.2f}x "
              f"{med(base, w, 'p50_ms') / med(kv, w, 'p50_ms'):>7.2f}x "
              f"{med(base, w, 'p99_ms') / med(kv, w, 'p99_ms'):>7.2f}x "
              f"{med(base, w, 'cpu_s_per_gb') / med(kv, w, 'cpu_s_per_gb'):>8.2f}x  "
              "(kvtier over vLLM: throughput; vLLM over kvtier: latency, CPU)")
    del view, chunk
    views.clear()  # numpy's exports of the primaries, which shutdown unmaps
    for a in arms:
        a.spec.get_manager().shutdown()
    if own_dir:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
