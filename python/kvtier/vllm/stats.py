"""The connector's counters, reported through vLLM's connector stats (KV Transfer metrics log)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

# tokens_declined: tokens kvtier had that the cost model chose not to load (cost.py);
# file_read_predicted_us / file_read_us: the file tier's reads of loads, predicted at lookup and
# measured by the workers (with file_read_bytes, the rate the cost model learns).
COUNTERS = ("tokens_loaded", "tokens_saved", "chunks_loaded", "chunks_saved", "load_errors",
            "save_errors", "saves_skipped", "layerwise_loads", "tokens_declined",
            "file_read_predicted_us", "file_read_us", "file_read_bytes")


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
