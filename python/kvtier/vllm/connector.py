"""KvtierConnector: vLLM's KV connector (v1 API) backed by kvtier.

    vllm serve MODEL --kv-transfer-config '{"kv_connector":"KvtierConnector",
        "kv_connector_module_path":"kvtier.vllm","kv_role":"kv_both",
        "kv_connector_extra_config":{"kvtier.socket":"/run/kvtier.sock"}}'

vLLM builds one instance in the scheduler (role SCHEDULER) and one in each worker (role WORKER);
this class only dispatches to SchedulerSide or WorkerSide. docs/vllm.md describes both modes and
every setting, and the vLLM versions supported (what differs between them is in compat.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import compat

_base = compat.require("vllm.distributed.kv_transfer.kv_connector.v1.base",
                       "KVConnectorBase_V1", "KVConnectorRole", "SupportsHMA")
KVConnectorBase_V1, KVConnectorRole, SupportsHMA = (
    _base.KVConnectorBase_V1, _base.KVConnectorRole, _base.SupportsHMA)

from vllm.logger import init_logger  # noqa: E402

from .config import parse_config  # noqa: E402
from .metadata import KvtierConnectorMetadata
from .stats import KvtierConnectorStats, KvtierPromMetrics

if TYPE_CHECKING:
    import torch

logger = init_logger("vllm.kvtier")
_features = compat.features()
if not compat.in_tested_range(compat.installed_version()):
    logger.warning("kvtier: vLLM %s is outside the tested range (%s); its connector interface "
                   "was found complete, but this pairing is untested",
                   compat.installed_version(), compat.range_text())


class KvtierConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cfg = parse_config(self._kv_transfer_config.kv_connector_extra_config)
        self._scheduler = self._worker = None
        if role == KVConnectorRole.SCHEDULER:
            from .scheduler import SchedulerSide

            # kvtier is a cache: a chunk that cannot be loaded is recomputed, never an error
            # for the request. vLLM's default policy fails the request instead.
            if self._kv_transfer_config.kv_load_failure_policy != "recompute":
                logger.info("kvtier: kv_load_failure_policy set to 'recompute' (a chunk kvtier "
                            "cannot deliver is recomputed)")
                self._kv_transfer_config.kv_load_failure_policy = "recompute"
            self._scheduler = SchedulerSide(vllm_config, kv_cache_config, cfg)
        else:
            from .worker import WorkerSide

            self._worker = WorkerSide(vllm_config, kv_cache_config, cfg)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # A full CUDA graph replays the forward pass without calling wait_for_layer_load: a
        # step with a layer-wise load would read layers before their copies landed.
        return (extra_config or {}).get("kvtier.load_mode", "auto") != "async"

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a dropped save is a future miss, nothing more

    # --- worker side -------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]):
        self._worker.register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KvtierConnectorMetadata):
        self._worker.handle_preemptions(kv_connector_metadata)

    def bind_connector_metadata(self, connector_metadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            self._worker.step_bound(connector_metadata)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        self._worker.start_load_kv(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        # A layer-wise load: the compute stream waits for this layer's copy (asynchronous loads
        # need nothing: their requests run only once their blocks are filled).
        self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return  # saves are queued once per step, in wait_for_save

    def wait_for_save(self):
        self._worker.wait_for_save(self._get_connector_metadata())

    def get_finished(self, finished_req_ids: set[str]):
        # vLLM before 0.30; failed loads reach it through get_block_ids_with_load_errors.
        sending, recving, _ = self._worker.transfer_results(finished_req_ids)
        return sending or None, recving or None

    if _features.transfer_results is not None:
        def get_transfer_results(self, finished_req_ids: set[str]):
            sending, recving, failed = self._worker.transfer_results(finished_req_ids)
            extra = {"failed_recving": failed} if _features.failed_recving else {}
            return _features.transfer_results(finished_sending=sending,
                                              finished_recving=recving, **extra)

    # Sleep mode (on by default from vLLM 0.34): vLLM drains transfers first, then frees the KV
    # cache's memory; the copier's addresses stay valid (the same virtual range is mapped again
    # on wake-up), so only work queued after the drain must wait.
    def unregister_kv_caches(self) -> None:
        if self._worker is not None:
            self._worker.drain()

    def restore_kv_caches(self) -> None:
        return

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors()

    def get_kv_connector_stats(self):
        side = self._worker if self._worker is not None else self._scheduler
        return side.get_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None):
        return KvtierConnectorStats(data=dict(data)) if data is not None else KvtierConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        if KvtierPromMetrics is None:
            return None
        return KvtierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self):
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    # --- scheduler side ----------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def get_external_cache_hit_sources(self, request, num_external_tokens: int):
        return self._scheduler.get_external_cache_hit_sources(request, num_external_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KvtierConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request, block_ids: list[int]):
        return self._scheduler.request_finished(request)

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]):
        return self._scheduler.request_finished(request)
