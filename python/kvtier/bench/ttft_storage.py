"""The physical limits a TTFT run compares its hits with, measured in the same run.

The disk as a user measures it for the file tier (``kvtier bench storage``), the file tier itself
(``kvtier bench tier``), the same bytes read raw with O_DIRECT right before a timed file hit, and
the host<->GPU copy over PCIe. Also the ``kvtier serve`` daemon the server arm loads through.
Part of ``python -m kvtier.bench.ttft``, which re-exports these names.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from typing import TYPE_CHECKING

import torch

from kvtier.bench.ttft_common import GiB, log, median

if TYPE_CHECKING:
    from kvtier.bench.ttft import Env


# ------------------------------------------------------------------------------------------------
# Raw reads of chunk files, the reference a file hit is set beside


# The file tier's requests in flight per chunk (FileTierOptions::io_queue_depth) and their size
# (the io engine's max_request_bytes): the raw reference keeps as many in flight.
FILE_TIER_QUEUE_DEPTH = 8
FILE_TIER_REQUEST_BYTES = 4 << 20


def raw_read(paths, threads: int) -> float:
    """Seconds to read `paths` whole with O_DIRECT on `threads` threads (one 4 MiB request in
    flight per thread): the raw disk path the file tier's reads are compared with."""
    import concurrent.futures
    import mmap
    block = FILE_TIER_REQUEST_BYTES

    def read_files(mine):
        buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT needs
        try:
            for path in mine:
                fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
                try:
                    off = 0
                    while True:
                        n = os.preadv(fd, [buf], off)
                        if n <= 0:
                            break
                        off += n
                finally:
                    os.close(fd)
        finally:
            buf.close()

    threads = max(1, min(threads, len(paths)))
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(read_files, [paths[i::threads] for i in range(threads)]))
    return time.perf_counter() - t0


def chunk_files(directory: str, count: int, size: int):
    """`count` chunk files of `size` bytes or more under `directory` (any of them: they are
    alike on the disk), or None when there are fewer."""
    found = []
    for root, _, files in os.walk(directory):
        for f in files:
            path = os.path.join(root, f)
            try:
                if os.path.getsize(path) >= size:
                    found.append(path)
            except OSError:
                pass
    found.sort()
    return found[:count] if len(found) >= count else None


def drop_page_cache() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


# ------------------------------------------------------------------------------------------------
# The server arm's daemon


class ServeProcess:
    """A `kvtier serve` daemon with an L1 pool only, on a private socket."""

    def __init__(self, kvtier_bin: str, chunk_bytes: int, l1_gib: float, workdir: str):
        self.socket = os.path.join(workdir, "kvtier.sock")
        cmd = [kvtier_bin, "serve", "--socket", self.socket, "--no-l2", "--chunk-bytes",
               str(chunk_bytes), "--l1-size-gb", f"{l1_gib:.3f}", "--http-port", "-1",
               "--log-level", "warn"]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while not os.path.exists(self.socket):
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvtier serve exited with {self.proc.returncode}: {cmd}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("kvtier serve did not create its socket within 60 s")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# ------------------------------------------------------------------------------------------------
# The disk, the file tier and PCIe, measured in the run


# The per-context probe's pool: 16 readers x 2 files of one chunk each, so every read phase reads
# 32 chunks (1.2 GB at Qwen3-8B's 36 MiB: as much as an 8k prefix), about a second per phase on
# a 1-2 GB/s disk; the whole probe (write, three read phases, control, buffered) takes seconds.
DISK_PROBE_MAX_READERS = 16
DISK_PROBE_FILES_PER_READER = 2


def run_json(cmd: list[str], what: str) -> tuple[dict, float]:
    """Runs a `kvtier` command that prints JSON: (its JSON, seconds it took). Raises RuntimeError
    if it fails or prints no JSON object."""
    log("+ " + " ".join(cmd))
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if out.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {out.returncode}): {out.stderr.strip()[-500:]}")
    try:
        j = json.loads(out.stdout)
    except ValueError as e:
        raise RuntimeError(f"{what} printed no usable JSON ({e}): {out.stdout.strip()[-300:]}")
    if not isinstance(j, dict):
        raise RuntimeError(f"{what} printed no usable JSON (not an object): {out.stdout[-300:]}")
    return j, seconds


def storage_bandwidth(kvtier_bin: str, directory: str, chunk_bytes: int, read_threads: int) -> dict:
    """`kvtier bench storage` on the file tier's directory: O_DIRECT reads of chunk-sized files
    with 1, `read_threads` and 16 readers. ``read_GBps`` is the figure at `read_threads` readers,
    the tier's own concurrency (what docs/planner.md tells a user to measure); ``read_GBps_max``
    the best reader count's. Raises RuntimeError if the probe fails or gives no usable figure."""
    reader_counts = sorted({1, read_threads, DISK_PROBE_MAX_READERS})
    cmd = [kvtier_bin, "bench", "storage", directory, "--file-size", str(chunk_bytes),
           "--readers", ",".join(map(str, reader_counts)),
           "--files-per-reader", str(DISK_PROBE_FILES_PER_READER), "--json"]
    j, probe_s = run_json(cmd, "kvtier bench storage")
    try:
        reads = {int(r["readers"]): float(r["read_GBps"]) for r in j["readers"]}
    except (ValueError, KeyError, TypeError) as e:
        raise RuntimeError(f"kvtier bench storage printed no usable JSON ({e}): {j}")
    if not reads.get(read_threads, 0) > 0:
        raise RuntimeError(f"kvtier bench storage gave no read figure at {read_threads} readers: "
                           f"{reads}")
    bytes_per_phase = next((int(r["bytes"]) for r in j["readers"] if "bytes" in r), None)
    return {"read_GBps": reads[read_threads], "readers": read_threads,
            "read_GBps_max": max(reads.values()), "read_GBps_by_readers": reads,
            "write_GBps": j.get("write_GBps"), "o_direct": j.get("o_direct"),
            "bytes_per_phase": bytes_per_phase, "probe_s": probe_s}


# The per-context file-tier benchmark: 24 chunks written and read per round, two rounds (raw and
# tier alternate going first), so 1.8 GB read through the tier at 36 MiB, as much as a 12k prefix;
# about 5 s on a 1-2 GB/s disk, write phases included.
TIER_PROBE_CHUNKS = 24
TIER_PROBE_REPEATS = 2


def tier_chunk_mib(chunk_bytes: int) -> int:
    """The run's chunk size in whole MiB (`kvtier bench tier --chunk-mib`), at least 1."""
    return max(1, round(chunk_bytes / (1 << 20)))


def tier_bandwidth(kvtier_bin: str, directory: str, chunk_bytes: int, read_threads: int) -> dict:
    """`kvtier bench tier` on the file tier's directory: chunks of the run's size written and read
    through a file tier with `read_threads` read threads and the tier's queue depth, the page cache
    dropped before the reads and checked empty after, and plain O_DIRECT reads of the same files in
    the same run. ``read_GBps`` is the tier's read figure, ``raw_read_GBps`` the plain reads'.
    Raises RuntimeError if it fails (a page cache that served the reads makes it exit 1), reports
    no cold reads or gives no usable figure."""
    chunk_mib = tier_chunk_mib(chunk_bytes)
    cmd = [kvtier_bin, "bench", "tier", "--dir", directory, "--chunk-mib", str(chunk_mib),
           "--chunks", str(TIER_PROBE_CHUNKS), "--readers", str(read_threads),
           "--io-depth", str(FILE_TIER_QUEUE_DEPTH), "--repeats", str(TIER_PROBE_REPEATS),
           "--json"]
    j, bench_s = run_json(cmd, "kvtier bench tier")
    try:
        read, raw = float(j["read_GBps"]), float(j["raw_read_GBps"])
        write, raw_write = float(j["write_GBps"]), float(j["raw_write_GBps"])
    except (ValueError, KeyError, TypeError) as e:
        raise RuntimeError(f"kvtier bench tier printed no usable JSON ({e}): {j}")
    if j.get("o_direct") is not True:
        raise RuntimeError(f"kvtier bench tier did not read cold (o_direct {j.get('o_direct')}, "
                           f"{j.get('page_cache_resident_bytes')} bytes left in the page cache): "
                           f"{j.get('warnings')}")
    if not (read > 0 and raw > 0):
        raise RuntimeError(f"kvtier bench tier gave no read figure: tier {read}, raw {raw}")
    return {"read_GBps": read, "raw_read_GBps": raw, "read_ratio": read / raw,
            "write_GBps": write, "raw_write_GBps": raw_write,
            "readers": read_threads, "io_depth": FILE_TIER_QUEUE_DEPTH, "chunk_mib": chunk_mib,
            "chunk_bytes_exact": chunk_mib << 20 == chunk_bytes,
            "chunks": TIER_PROBE_CHUNKS, "repeats": TIER_PROBE_REPEATS,
            "read_bytes": TIER_PROBE_CHUNKS * TIER_PROBE_REPEATS * (chunk_mib << 20),
            "io_engine": j.get("io_engine"), "o_direct": True,
            "page_cache_resident_bytes": j.get("page_cache_resident_bytes"), "bench_s": bench_s}


def copy_bandwidth(env: Env, nbytes: int = GiB, repeats: int = 5) -> dict:
    """Host->GPU and GPU->host over PCIe from pinned memory, median of repeats (GB/s). On a CPU
    "device" the KV cache is host memory and the copy is a memcpy: that is measured instead."""
    if not env.cuda:
        nbytes = min(nbytes, 256 << 20)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=env.cuda)
    host.random_(0, 255)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=env.device)
    res = {}
    for name, fn in (("h2d_GBps", lambda: dev.copy_(host, non_blocking=True)),
                     ("d2h_GBps", lambda: host.copy_(dev, non_blocking=True))):
        times = []
        for _ in range(repeats + 1):
            env.sync()
            t0 = time.perf_counter()
            fn()
            env.sync()
            times.append(time.perf_counter() - t0)
        res[name] = nbytes / median(times[1:]) / 1e9
    return res
