"""Pins a run of chunks through prepare_load in batches, two in flight, sized to the file
tier's read rate.

The server ends a prepare_load still waiting on its file tier at its load deadline (`kvtier
serve --load-deadline-ms`, 2 s by default) and reports the chunks not read by then as missing.
One prepare_load of a whole long prefix from a slow tier loses its tail that way: 64 chunks of
36 MiB (a 16k-token Qwen3-8B prefix) read at 1 GB/s take 2.4 s, and 63 of them were reported
failed and recomputed. Batches of about BATCH_S of reading each, at the rate the tier has been
seen to read (starting each load at one chunk), end well within any deadline whatever the
prefix's length; two in flight keep the tier's readers busy, and the caller copies one batch
while the next is read.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

BATCH_S = 0.25  # reading time aimed at per batch: an eighth of the default load deadline
FIRST_BATCH = 1  # chunks in a load's first batch
MAX_BATCH = 256  # chunks (9 GiB of Qwen3-8B), well under the server's 4,096 keys per request
IN_FLIGHT = 2


@dataclass
class PrefixLoad:
    chunks: int = 0  # leading chunks delivered
    message: str = ""  # why the rest were not ("" if all were)
    file_bytes: int = 0  # of the file tier's part: bytes delivered
    file_s: float = 0.0  # and the time from its first request to its last reply


class PrefixLoader:
    """One per process side (worker, prefetch): the file tier's read rate it learns is kept
    across loads (a moving average) and bounds each load's batches until that load has measured
    its own."""

    def __init__(self, chunk_bytes: int, read_gbps: float = 0.0):
        self._chunk_bytes = max(1, chunk_bytes)
        self._lock = threading.Lock()
        self._rate = read_gbps * 1e9  # bytes per second; 0: not known yet

    @property
    def rate_gbps(self) -> float:
        with self._lock:
            return self._rate / 1e9

    def _batch(self, rate: float, previous: int) -> int:
        """Chunks for the next batch. Every load starts at FIRST_BATCH and at most doubles a
        batch: the rate learned from earlier loads may no longer hold (a tier slowed since,
        by others' reads), and the rate measured on this load's first batches takes over."""
        if previous == 0:
            return FIRST_BATCH
        if rate <= 0:
            return previous
        return max(1, min(MAX_BATCH, 2 * previous, int(rate * BATCH_S / self._chunk_bytes)))

    def load(self, client, keys: list[bytes], from_file: int,
             deliver: Callable[[int, list[int]], None]) -> PrefixLoad:
        """Pins `keys`' chunks in order through `client`. The last `from_file` are expected on
        the file tier (they are batched by its rate; the ones before, in L1, go in one
        request). deliver(start, slots) runs on this thread, in order, with each batch's
        pinned slots (of keys[start:start + len(slots)]), which it then owns and must unpin. A
        batch delivered short ends the load: the result's `chunks` is the prefix delivered.
        Raises what prepare_load raises (a broken connection); the pins of batches not yet
        delivered are given back (an AsyncOp not waited for releases them)."""
        out = PrefixLoad()
        in_memory = max(0, len(keys) - from_file)
        with self._lock:
            rate = self._rate
        pending: list[tuple[int, int, object]] = []  # (start, count, op), oldest first
        sent = batch = 0
        file_start = 0.0

        def ask() -> None:  # up to IN_FLIGHT batches
            nonlocal sent, batch, file_start
            while sent < len(keys) and len(pending) < IN_FLIGHT:
                if sent < in_memory:
                    count = in_memory - sent
                else:
                    batch = self._batch(rate, batch)
                    count = min(batch, len(keys) - sent)
                    if sent == in_memory:
                        file_start = time.monotonic()
                pending.append((sent, count, client.prepare_load(keys[sent:sent + count])))
                sent += count

        try:
            ask()
            while pending:
                start, count, op = pending.pop(0)
                result = op.wait()
                slots = list(result.slots)
                if start >= in_memory and slots:
                    out.file_bytes += len(slots) * self._chunk_bytes
                    out.file_s = time.monotonic() - file_start
                    rate = out.file_bytes / max(out.file_s, 1e-6)
                if len(slots) < count:  # the load ends here
                    out.message = result.message or "no longer stored"
                    pending.clear()  # their pins go back with the ops
                else:
                    ask()  # the next batch is read while this one is delivered
                if slots:
                    deliver(start, slots)
                    out.chunks += len(slots)
        except BaseException:
            pending.clear()  # the pins of the batches in flight go back with their ops
            raise
        if out.file_bytes >= 2 * self._chunk_bytes:  # `rate` is then this load's own
            with self._lock:
                self._rate = rate if self._rate <= 0 else (self._rate + rate) / 2
        return out
