"""kvtier as a secondary tier of vLLM's native KV offloading (`TieringOffloadingSpec`).

vLLM's OffloadingConnector keeps its CPU tier (the primary) and cascades every chunk it stores
there to its secondary tiers; a chunk found only in a secondary tier is promoted back into the
primary before the GPU reads it. `KvtierTier` is such a secondary tier, configured by vLLM
itself from `kv_connector_extra_config`:

    {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 100000000000, "block_size": 256,
     "secondary_tiers": [{"type": "KvtierTier", "module_path": "kvtier.vllm.tiering",
                          "l2": {"type": "fs", "path": "/mnt/kvcache", "max_size_gb": 2000}}]}

Underneath is kvtier's file tier (`kvtier.open_file_tier`), not a second host-memory cache: the
primary already is one. Chunks move between the primary's memory and kvtier's chunk files
(checksummed header, atomic publish, capacity-managed, docs/file-format.md) on the file tier's
C++ read and write pools, O_DIRECT straight into and out of the primary's 4 KiB-aligned slots;
this process's Python only submits jobs and collects finished ones, with the GIL released.

Everything here runs in vLLM's scheduler loop and never blocks it: a lookup is answered from
kvtier's index (a chunk missing from it costs at most one stat of its file per half second, which
is how chunks written by other hosts are found); a submission queues and returns. A chunk that
is missing, corrupt or foreign when read fails its job: vLLM frees the slot and recomputes, and
the chunk is a miss here from then on. docs/vllm.md ("vLLM's native offloading") says how to
configure it and how to move from vLLM's own `fs` tier.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar

from . import compat

compat.require_secondary_tier()  # before vLLM 0.28: a message, not an ImportError

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (  # noqa: E402
    OffloadingConnectorStats,
)
from vllm.logger import init_logger
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingGaugeMetadata,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import JobId, JobResult, SecondaryTierManager, TransferJob

import kvtier

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

logger = init_logger("vllm.kvtier.tiering")

# vLLM's own fs tier defaults to 16 read and 16 write threads; so does this tier, unless its
# "l2" names other counts.
DEFAULT_READ_THREADS = 16
DEFAULT_WRITE_THREADS = 16
# Keys whose load failed are misses until stored again; this many are remembered at most.
FAILED_KEYS_REMEMBERED = 65536


class KvtierTierMetrics:
    """The tier's own Prometheus metrics (vLLM exports them with its offloading metrics)."""

    CHUNKS = "vllm:kv_offload_kvtier_chunks"
    BYTES = "vllm:kv_offload_kvtier_bytes"
    CAPACITY_BYTES = "vllm:kv_offload_kvtier_capacity_bytes"
    EVICTIONS = "vllm:kv_offload_kvtier_evictions"
    CORRUPT = "vllm:kv_offload_kvtier_corrupt_chunks"
    FOREIGN = "vllm:kv_offload_kvtier_foreign_chunks"
    ERRORS = "vllm:kv_offload_kvtier_io_errors"
    REJECTIONS = "vllm:kv_offload_kvtier_rejections"
    FOUND_ON_DISK = "vllm:kv_offload_kvtier_found_on_disk"
    LOAD_FAILURES = "vllm:kv_offload_kvtier_load_failures"


# Counters of the file tier's stats() reported as deltas, and gauges reported as they are.
_COUNTERS = {
    KvtierTierMetrics.EVICTIONS: "evictions",
    KvtierTierMetrics.CORRUPT: "corrupt",
    KvtierTierMetrics.FOREIGN: "foreign",
    KvtierTierMetrics.ERRORS: "errors",
    KvtierTierMetrics.REJECTIONS: "rejections",
    KvtierTierMetrics.FOUND_ON_DISK: "found_on_disk",
}
_GAUGES = {
    KvtierTierMetrics.CHUNKS: "chunks",
    KvtierTierMetrics.BYTES: "bytes",
    KvtierTierMetrics.CAPACITY_BYTES: "capacity_bytes",
}


def _l2_settings(l2: Any) -> dict[str, Any]:
    """The tier's "l2" as a dict: the JSON object `kvtier serve --l2` takes (or its text)."""
    if isinstance(l2, str):
        try:
            l2 = json.loads(l2)
        except json.JSONDecodeError as e:
            raise ValueError(f"KvtierTier: 'l2' is not valid JSON: {e}") from None
    if isinstance(l2, list) and len(l2) == 1:
        l2 = l2[0]
    if not isinstance(l2, dict):
        raise ValueError("KvtierTier needs 'l2': a JSON object like "
                         '{"type": "fs", "path": "/mnt/kvcache", "max_size_gb": 2000}')
    settings = dict(l2)
    # kvtier serve's L2 JSON takes it too; here the tier's own key decides, and two places for
    # one setting would have one of them silently ignored.
    for key in ("sync_data", "sync-data"):
        if key in settings:
            raise ValueError(f"KvtierTier: give sync_data as the tier's own key (beside 'l2'), "
                             f"not inside 'l2' ({key!r})")
    settings.setdefault("read_threads", DEFAULT_READ_THREADS)
    settings.setdefault("write_threads", DEFAULT_WRITE_THREADS)
    return settings


def layout_fingerprint(spec: OffloadingSpec, chunk_bytes: int) -> int:
    """64 bits naming what the bytes of one primary chunk mean: the model's KV dtype, cache
    groups and layers, bytes per block, blocks per chunk, parallelism and byte layout. Chunks
    of two deployments share files only if this and the model id agree."""
    config = spec.config
    parallel = config.parallel
    fields = {
        "dtype": config.model.dtype,
        "groups": [[g.tokens_per_block, list(g.layer_names)] for g in config.groups],
        "worker_kv_bytes_per_block": config.worker_kv_bytes_per_block,
        "tokens_per_hash": config.cache.tokens_per_hash,
        "blocks_per_chunk": config.cache.blocks_per_chunk,
        "chunk_bytes": chunk_bytes,
        "parallel": [parallel.world_size, parallel.tp_size, parallel.pp_size, parallel.pcp_size,
                     parallel.dcp_size],
        "replicated_layout": config.replicated_layout,
        "canonical_layout": config.canonical_layout,
        "kv_cache_layout": config.kv_cache_layout if config.canonical_layout else None,
    }
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


class KvtierTier(SecondaryTierManager):
    """A vLLM secondary tier whose storage is kvtier's file tier.

    Constructor keywords (the tier's entry in `secondary_tiers`, besides type and module_path):
      l2:         the file tier, as `kvtier serve --l2` takes it: {"type": "fs", "path": ...,
                  "max_size_gb": ..., "read_threads": 16, "write_threads": 16}. REQUIRED.
      namespace:  separates deployments or tenants sharing one directory ("" by default).
      model_id:   the model's name in chunk keys (default: vLLM's model name).
      max_queued_chunks: chunks waiting for an I/O thread before more are refused (default:
                  the primary's chunk count, which bounds what vLLM can have in flight).
      sync_data:  fdatasync every chunk file before publishing it (default False, as vLLM's
                  own fs tier: a power loss may then leave chunks that fail their checksum,
                  which are misses, never served; docs/file-format.md). True makes published
                  chunks survive a power loss, at a disk flush per chunk.
      locality, enable_kv_events: as for vLLM's fs tier.

    Methods run on vLLM's scheduler thread and do not block it, except drain_jobs and shutdown,
    which wait for the jobs in flight (as vLLM requires of them).
    """

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        l2: Any = None,
        namespace: str = "",
        model_id: str | None = None,
        max_queued_chunks: int | None = None,
        sync_data: bool = False,
        locality: str | None = None,
        enable_kv_events: bool = False,
        backpressure_detector: BackpressureDetector | None = None,
    ):
        super().__init__(offloading_spec, primary_kv_view, tier_type,
                         **compat.known_fields(SecondaryTierManager.__init__,
                                               backpressure_detector=backpressure_detector))
        self.locality = Locality(locality) if locality is not None else None
        settings = _l2_settings(l2)
        chunk_bytes = self.block_size_bytes
        config = offloading_spec.config
        tokens_per_block = config.groups[0].tokens_per_block if config.groups else 1
        self.ns = kvtier.KeyNamespace(
            model_id or config.model.name,
            layout_fingerprint(offloading_spec, chunk_bytes),
            max(1, tokens_per_block * config.cache.blocks_per_chunk), 0, 1, namespace)
        self._key_root = self.ns.root()
        num_chunks = primary_kv_view.shape[0] if primary_kv_view.ndim else 0
        queue = max_queued_chunks or max(1024, num_chunks)
        if not isinstance(sync_data, bool):
            raise ValueError(f"KvtierTier: 'sync_data' must be true or false, not {sync_data!r}")
        try:
            self._tier = kvtier.open_file_tier(self.ns, chunk_bytes, settings,
                                               max_queued_chunks=queue, sync_data=sync_data)
        except kvtier.InvalidArgumentError as e:
            raise ValueError(f"KvtierTier: {e}") from None
        # The primary's bytes, flat: a job names chunk c by the offset c * chunk_bytes.
        self._view = primary_kv_view.cast("B")
        self._chunk_bytes = chunk_bytes
        self._loads: dict[JobId, list[OffloadKey]] = {}  # keys of loads in flight
        self._stores: dict[JobId, list[OffloadKey]] = {}  # keys of stores in flight
        self._failed: OrderedDict[bytes, None] = OrderedDict()  # misses until stored again
        self.events: list[OffloadingEvent] | None = None
        if enable_kv_events and offloading_spec.kv_events_config.enable_kv_cache_events:
            self.events = []
        self._reported: dict[str, int] = {}
        self._load_failures = 0
        self._closed = False
        stats = self._tier.stats()
        logger.info(
            "kvtier tier: %d chunks of %d bytes indexed in %s (%s, O_DIRECT %s, %d read and "
            "%d write threads, capacity %s, fdatasync per chunk %s)", stats["chunks"], chunk_bytes,
            self._tier.namespace_dir, stats["io_engine"],
            "on" if stats["o_direct"] else "off (the filesystem refused it)",
            settings["read_threads"], settings["write_threads"],
            f"{stats['capacity_bytes'] / 2**30:.1f} GiB" if stats["capacity_bytes"]
            else "unlimited", "on" if sync_data else "off")

    @property
    def block_size_bytes(self) -> int:
        """Bytes of one chunk in the primary tier's view (vLLM's own property from 0.32, the
        same stride; absent in 0.28)."""
        return self._primary_kv_view.strides[0]

    def kvtier_key(self, key: OffloadKey) -> bytes:
        """kvtier's 32-byte key of a vLLM offload key (block hash and group): bound to this
        tier's namespace, the same in every process and on every host."""
        return hashlib.sha256(self._key_root + key).digest()

    # --- lookups and per-request hooks -----------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        k = self.kvtier_key(key)
        if k in self._failed:
            return LookupResult.MISS
        return LookupResult.HIT if self._tier.contains([k])[0] else LookupResult.MISS

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    # --- transfers -------------------------------------------------------------------------

    def _offsets(self, job: TransferJob) -> list[int]:
        n = self._chunk_bytes
        return [int(c) * n for c in compat.chunk_ids(job)]

    def submit_store(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        kkeys = [self.kvtier_key(k) for k in keys]
        for k in kkeys:
            self._failed.pop(k, None)
        self._stores[job_metadata.job_id] = keys
        self._tier.submit_write(job_metadata.job_id, kkeys, self._view,
                                self._offsets(job_metadata))

    def submit_load(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        self._loads[job_metadata.job_id] = keys
        self._tier.submit_read(job_metadata.job_id, [self.kvtier_key(k) for k in keys],
                               self._view, self._offsets(job_metadata))

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results = []
        for job_id, ok, chunks, error, seconds in self._tier.finished():
            load_keys = self._loads.pop(job_id, None)
            if load_keys is None:
                store_keys = self._stores.pop(job_id, [])
                if not ok:
                    logger.warning("kvtier tier: %d of %d chunks not stored: %s",
                                   len(store_keys) - chunks, len(store_keys), error)
                elif self.events is not None and store_keys:
                    self.events.append(OffloadingEvent(keys=store_keys, medium=self.medium,
                                                       removed=False, locality=self.locality))
                results.append(self._result(job_id, ok, seconds, chunks))
                continue
            if ok:
                results.append(self._result(job_id, True, seconds, chunks))
                continue
            # The leading `chunks` were read and verified; the rest are misses from now on, so
            # vLLM does not promote them again, and recomputes.
            self._load_failures += 1
            logger.warning("kvtier tier: loading %d chunks: %d delivered, the rest recomputed "
                           "(%s)", len(load_keys), chunks, error)
            for key in load_keys[chunks:]:
                self._remember_failed(self.kvtier_key(key))
            results.append(self._result(job_id, False, seconds, chunks,
                                        tuple(load_keys[:chunks]) if chunks else None))
        return results

    def _result(self, job_id: JobId, ok: bool, seconds: float, chunks: int,
                successful_keys=None) -> JobResult:
        # transfer_bytes (vLLM's tiering metrics) is a field from 0.32 on.
        return JobResult(**compat.known_fields(
            JobResult, job_id=job_id, success=ok, successful_keys=successful_keys,
            transfer_time=seconds, transfer_bytes=chunks * self._chunk_bytes))

    def _remember_failed(self, key: bytes) -> None:
        self._failed[key] = None
        self._failed.move_to_end(key)
        while len(self._failed) > FAILED_KEYS_REMEMBERED:
            self._failed.popitem(last=False)

    def has_pending_work(self) -> bool:
        return bool(self._loads or self._stores)

    def drain_jobs(self) -> None:
        if not self._closed:
            self._tier.wait_idle()

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self.events:
            events, self.events = self.events, []
            yield from events

    def shutdown(self) -> None:
        """Waits for the jobs in flight, then closes the file tier: its files stay for the next
        start, which indexes them again."""
        if self._closed:
            return
        self._closed = True
        self._tier.close()
        self._view.release()

    # --- metrics ---------------------------------------------------------------------------

    @classmethod
    def build_metric_definitions(
            cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        return {
            KvtierTierMetrics.CHUNKS: OffloadingGaugeMetadata(
                documentation="Chunks in kvtier's file tier."),
            KvtierTierMetrics.BYTES: OffloadingGaugeMetadata(
                documentation="Bytes of kvtier's chunk files (headers and padding included)."),
            KvtierTierMetrics.CAPACITY_BYTES: OffloadingGaugeMetadata(
                documentation="Capacity of kvtier's file tier in bytes (0 = unlimited)."),
            KvtierTierMetrics.EVICTIONS: OffloadingCounterMetadata(
                documentation="Chunks kvtier's file tier removed to stay within its capacity."),
            KvtierTierMetrics.CORRUPT: OffloadingCounterMetadata(
                documentation="Chunk files that failed kvtier's header or checksum check "
                              "(removed, never served)."),
            KvtierTierMetrics.FOREIGN: OffloadingCounterMetadata(
                documentation="Chunk files of another namespace or chunk size (left in place, "
                              "never served)."),
            KvtierTierMetrics.ERRORS: OffloadingCounterMetadata(
                documentation="I/O errors of kvtier's file tier."),
            KvtierTierMetrics.REJECTIONS: OffloadingCounterMetadata(
                documentation="Chunk reads or writes kvtier refused (queue full, no room)."),
            KvtierTierMetrics.FOUND_ON_DISK: OffloadingCounterMetadata(
                documentation="Chunks found on disk that another process or host had written."),
            KvtierTierMetrics.LOAD_FAILURES: OffloadingCounterMetadata(
                documentation="Load jobs of kvtier's tier that failed (vLLM recomputed)."),
        }

    def get_stats(self) -> OffloadingConnectorStats | None:
        if self._closed:
            return None
        s = self._tier.stats()
        stats = OffloadingConnectorStats()
        for name, field in _GAUGES.items():
            stats.set_gauge(name, s[field])
        for name, field in _COUNTERS.items():
            delta = s[field] - self._reported.get(field, 0)
            self._reported[field] = s[field]
            if delta:
                stats.increase_counter(name, delta)
        if self._load_failures:
            stats.increase_counter(KvtierTierMetrics.LOAD_FAILURES, self._load_failures)
            self._load_failures = 0
        return stats

    # --- for tests and tools ----------------------------------------------------------------

    @property
    def file_tier(self) -> kvtier.FileTier:
        """kvtier's file tier underneath (stats(), chunk_path())."""
        return self._tier

    def wait_idle(self, timeout: float | None = None) -> bool:
        return self._tier.wait_idle(timeout)


__all__ = ["KvtierTier", "KvtierTierMetrics", "layout_fingerprint"]
