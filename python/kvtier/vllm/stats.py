"""The connector's counters, reported through vLLM's connector stats: its "KV Transfer metrics"
log line and, as counters named vllm:kvtier_<counter>_total, its Prometheus /metrics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

try:  # vLLM's per-connector Prometheus metrics (in every tested version; optional elsewhere)
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics
except ImportError:  # pragma: no cover
    KVConnectorPromMetrics = None

# tokens_declined: tokens kvtier had that the cost model chose not to load (cost.py);
# lookups / lookups_deferred / lookup_wait_us: the scheduler's lookups, the steps a request sat
# out because its lookup took over LOOKUP_WAIT_S, and the loop's time spent waiting on them
# (what the lookups cost the whole batch);
# file_read_predicted_us / file_read_us: the file tier's reads of loads, predicted at lookup and
# measured by the workers (with file_read_bytes, the rate the cost model learns);
# prefill_predicted_us / prefill_measured_us: the timed prefill steps, as the cost model's table
# predicted them and as the workers measured them (their ratio scales the table);
# chunks_described / describes_dropped: descriptors sent for kvtier's KV-cache events, and those
# dropped (queue full, server down, no block hashes): chunks stored but never announced.
HELP = {
    "tokens_loaded": "Tokens loaded from kvtier into vLLM's KV cache",
    "tokens_saved": "Tokens saved to kvtier",
    "chunks_loaded": "Chunks loaded from kvtier",
    "chunks_saved": "Chunks saved to kvtier",
    "load_errors": "Chunks that failed to load (recomputed)",
    "save_errors": "Chunks that failed to save",
    "saves_skipped": "Saves skipped (kvtier had the chunk, or the store was unreachable)",
    "layerwise_loads": "Loads done layer by layer within the step",
    "tokens_hit_memory": "Tokens of the loads handed to the workers that L1 held",
    "tokens_hit_file": "Tokens of the loads handed to the workers that came from the file tier",
    "tokens_declined": "Tokens kvtier held that the cost model chose to recompute instead",
    "lookups": "Lookups of a request's prompt (one per prompt length and vLLM's own hit)",
    "lookups_deferred": "Scheduling steps a request waited for its lookup (asked again)",
    "lookup_wait_us": "Time the scheduler loop waited on lookups (us)",
    "file_read_predicted_us": "File-tier read time of loads as predicted at lookup (us)",
    "file_read_us": "File-tier read time of loads as measured (us)",
    "file_read_bytes": "Bytes the loads read from the file tier",
    "prefill_steps": "Prefill steps timed for the cost model",
    "prefill_predicted_us": "Timed steps' prefill time as the prefill table predicts it (us)",
    "prefill_measured_us": "Timed steps' time as measured (us)",
    "chunks_described": "Chunk descriptors sent for kvtier's KV-cache events",
    "describes_dropped": "Chunk descriptors dropped (those chunks are stored, never announced)",
    "chunks_prefetched": "Chunks the prefetch promoted into (or kept in) L1 and pinned",
    "prefetched_returns": "Conversations that came back to a prefix the prefetch held in L1",
    "prefetches_late": "Conversations not prefetched: their read would end after their return",
    "prefetches_unneeded": "Conversations not prefetched: their return reads the file tier anyway",
    "tokens_prefetched_from_file": "Tokens the prefetch read from the file tier into L1",
}
COUNTERS = tuple(HELP)  # the names, in the order vLLM's log line shows them


@dataclass
class KvtierConnectorStats(KVConnectorStats):
    """Counts since the last report; every field is a sum, so aggregation adds."""

    data: dict[str, Any] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))

    def reset(self):
        self.data = dict.fromkeys(COUNTERS, 0)

    def add(self, name: str, value: int = 1):
        self.data[name] = self.data.get(name, 0) + value

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: self.data.get(k, 0) for k in COUNTERS}

    def is_empty(self) -> bool:
        return not any(self.data.get(k, 0) for k in COUNTERS)


if KVConnectorPromMetrics is not None:
    class KvtierPromMetrics(KVConnectorPromMetrics):
        """One Prometheus counter per COUNTERS entry, per engine."""

        def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
            super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
            self._children: dict[tuple[str, int], Any] = {}
            self._counters = {
                name: self._counter_cls(name=f"vllm:kvtier_{name}_total",
                                        documentation=HELP[name], labelnames=labelnames)
                for name in COUNTERS}

        def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
            for name, value in transfer_stats_data.items():
                counter = self._counters.get(name)
                if counter is None or not value:
                    continue
                child = self._children.get((name, engine_idx))
                if child is None:
                    child = counter.labels(*self.per_engine_labelvalues[engine_idx])
                    self._children[(name, engine_idx)] = child
                child.inc(value)
else:  # pragma: no cover
    KvtierPromMetrics = None
