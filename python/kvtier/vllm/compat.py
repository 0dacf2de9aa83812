"""Everything that differs between the vLLM versions the connector supports, in one place.

vLLM's KV-connector interface changes from release to release. The connector is written against
what every supported version has; where versions differ, this module decides by looking at what
the installed vLLM has (feature detection), never by its version string, and the rest of the
package asks it. The version string is used only to name the tested range in messages.

What differs, as read from vLLM's own sources (docs/vllm.md, "Supported vLLM versions"):

* `KVConnectorTransferResults` and `get_transfer_results` (0.30 and later): the worker reports
  finished and failed loads together; a request whose load partly failed with several KV cache
  groups is reported in `failed_recving`. Before: `get_finished` returns (sending, recving), and
  a failed block can only be reported through `get_block_ids_with_load_errors`, which vLLM's
  scheduler of those versions handles for one KV cache group only.
* `CacheHitSource` and `get_external_cache_hit_sources` (0.32 and later): hits broken down by
  tier in vLLM's metrics. Before: nothing to report to.
* The scheduler's view of a request's blocks: `bind_kv_cache_manager` exists from 0.30 only, so
  the connector follows every request's block table from the scheduler output instead (new
  requests carry their whole table, running ones the blocks added this step, resumed ones their
  whole table again: in `resumed_req_ids` up to 0.33, among the new requests from 0.34).
* `skip_reading_prefix_cache` is applied to connector hits by vLLM's scheduler in some versions
  only (0.31 to 0.33); `skip_reading_external_kv` from 0.34. The connector checks both itself.
* The tiering interface of vLLM's native offloading (`kvtier.vllm.tiering`): an out-of-tree
  secondary tier named by module path from 0.28; before, tiers are vLLM's own only. Fields and
  arguments that came in 0.32 (`JobResult.transfer_bytes`, `SecondaryTierManager`'s
  `backpressure_detector`, `OffloadingGroupConfig.group_id`) are passed only where the installed
  vLLM takes them (`known_fields`); a job's and a CPU spec's ids, `chunk_ids` from 0.32, were
  `block_ids` before (read through `chunk_ids()`); `block_size_bytes` came in 0.32 too.
* KV-cache events (`event_hashing`): `to_event_extra_keys` (0.31 and later) turns the tagged
  extra keys of block hashes (`("lora", name, path)`, ...) into the bare ones events publish;
  before, events publish `generate_block_hash_extra_keys`' keys as they are (already bare).
  `maybe_convert_block_hash`, `resolve_block_hashes` and `resolve_kv_cache_block_sizes` are in
  every supported version; the last two are looked up anyway, with the equivalent of their
  single-block-size case where they are missing.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from typing import Any

# The versions whose interface the connector was read against and tested on (docs/vllm.md).
TESTED_RANGE = ("0.26", "0.34")


def known_fields(target: Any, **values: Any) -> dict[str, Any]:
    """`values` less those `target` (a class, or a callable) takes no parameter for: what to
    pass to a vLLM class whose fields grew across versions. Only what an older vLLM neither
    reads nor passes goes this way (reporting fields, an argument it never gives). A class's
    parameters are its constructor's: a dataclass's init fields, and a pydantic dataclass's
    init-only ones too (vLLM's SchedulerConfig takes max_model_len that way)."""
    try:
        names = set(inspect.signature(target).parameters)
    except (TypeError, ValueError):  # no signature to read: a dataclass's fields
        names = {f.name for f in dataclasses.fields(target)}
    return {k: v for k, v in values.items() if k in names}


def chunk_ids(job_or_spec: Any) -> Any:
    """The primary tier's chunk ids of a tiering TransferJob or a CPU load/store spec:
    `chunk_ids` from vLLM 0.32, `block_ids` before (the same ids, renamed)."""
    ids = getattr(job_or_spec, "chunk_ids", None)
    return job_or_spec.block_ids if ids is None else ids


class UnsupportedVllmError(ImportError):
    """The installed vLLM lacks something the connector needs; the message names the range."""


def installed_version() -> str:
    try:
        from vllm import __version__
    except ImportError:
        return "unknown"
    return str(__version__)


def _release(version: str) -> tuple[int, ...]:
    parts = []
    for p in version.split("+")[0].split("."):
        digits = "".join(ch for ch in p if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
        if len(parts) == 2:
            break
    return tuple(parts)


def in_tested_range(version: str) -> bool:
    release = _release(version)
    return bool(release) and _release(TESTED_RANGE[0]) <= release <= _release(TESTED_RANGE[1])


def range_text() -> str:
    return f"vLLM {TESTED_RANGE[0]} to {TESTED_RANGE[1]}"


def unsupported(what: str) -> UnsupportedVllmError:
    return UnsupportedVllmError(
        f"kvtier's vLLM connector supports {range_text()}; the installed vLLM "
        f"{installed_version()} lacks {what}. Install a vLLM in that range, or a kvtier release "
        "that supports this one.")


def require(module: str, *names: str) -> Any:
    """`from module import names`, or an UnsupportedVllmError naming the range (not a traceback
    from deep inside the connector). Returns the module."""
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise unsupported(f"{module} ({e})") from None
    missing = [n for n in names if not hasattr(mod, n)]
    if missing:
        raise unsupported(f"{', '.join(missing)} in {module}")
    return mod


def require_secondary_tier() -> None:
    """vLLM takes an out-of-tree secondary tier (by module path) and passes it TransferJobs from
    0.28; 0.26 and 0.27 have only their own tiers and another job interface (JobMetadata).
    Raises an UnsupportedVllmError that says so, for KvtierTier and its benchmark."""
    try:
        require("vllm.v1.kv_offload.tiering.base", "TransferJob", "SecondaryTierManager")
    except UnsupportedVllmError as e:
        raise UnsupportedVllmError(
            f"{e} kvtier.vllm.tiering.KvtierTier needs vLLM 0.28 or later (earlier versions take "
            "no out-of-tree secondary tier); with this vLLM use kvtier's own connector "
            "(kv_connector_module_path: kvtier.vllm)") from None


@dataclasses.dataclass(frozen=True)
class Features:
    """What the installed vLLM's connector interface has. Built by `detect` from the modules
    themselves, so a test can build it from another version's interface."""

    transfer_results: Any = None  # KVConnectorTransferResults, or None (get_finished only)
    failed_recving: bool = False  # transfer results carry failed_recving
    cache_hit_source: Any = None  # the CacheHitSource enum, or None (no per-tier hit metrics)
    sleep_mode_hooks: bool = False  # unregister_kv_caches / restore_kv_caches are called

    @property
    def reports_failed_requests(self) -> bool:
        """A load that failed with several KV cache groups can be reported (as a request)."""
        return self.transfer_results is not None and self.failed_recving


def detect(base_module: Any, hit_source_module: Any | None) -> Features:
    """The decisions, from vLLM's connector base module and its cache_hit_source module (None
    where the installed vLLM has none)."""
    results = getattr(base_module, "KVConnectorTransferResults", None)
    failed = results is not None and any(
        f.name == "failed_recving" for f in dataclasses.fields(results)) \
        if dataclasses.is_dataclass(results) else False
    base = getattr(base_module, "KVConnectorBase_V1")
    return Features(
        transfer_results=results,
        failed_recving=failed,
        cache_hit_source=getattr(hit_source_module, "CacheHitSource", None),
        sleep_mode_hooks=hasattr(base, "unregister_kv_caches"),
    )


_FEATURES: Features | None = None


def features() -> Features:
    """The installed vLLM's features (detected once)."""
    global _FEATURES
    if _FEATURES is None:
        base = require("vllm.distributed.kv_transfer.kv_connector.v1.base", "KVConnectorBase_V1",
                       "KVConnectorMetadata", "KVConnectorRole", "SupportsHMA")
        try:
            hit_source = importlib.import_module("vllm.v1.metrics.cache_hit_source")
        except ImportError:
            hit_source = None
        _FEATURES = detect(base, hit_source)
    return _FEATURES


def full_cuda_graphs(vllm_config: Any) -> bool:
    """vLLM will replay whole forward passes as CUDA graphs (connector hooks inside are not
    run). vLLM turns them off for a connector whose requires_piecewise_for_cudagraph says so,
    where it has that hook; older versions keep them."""
    mode = getattr(getattr(vllm_config, "compilation_config", None), "cudagraph_mode", None)
    has_full = getattr(mode, "has_full_cudagraphs", None)
    return bool(has_full()) if callable(has_full) else False


def skips_external_kv(request: Any) -> bool:
    """The request asked not to read cached KV (prompt logprobs of every token, say). Some vLLM
    versions apply this to connector hits themselves, others do not: the connector always does."""
    return bool(getattr(request, "skip_reading_prefix_cache", False)
                or getattr(request, "skip_reading_external_kv", False))


@dataclasses.dataclass(frozen=True)
class EventHashing:
    """vLLM's own functions for the block hashes its KV-cache events publish (docs/kv-events.md,
    "Block hashes"), so that kvtier's events name a chunk's blocks exactly as vLLM's GPU events
    name the same blocks."""

    convert: Any  # maybe_convert_block_hash: a digest as events publish it (int or bytes)
    resolve: Any  # resolve_block_hashes(hashes, hash_block_size, block_size): a group's view
    extra_keys: Any  # generate_block_hash_extra_keys(request, start, end, mm_idx)
    to_event_extra_keys: Any  # per-block keys as events publish them; None: as they are


def _resolve_same_size(block_hashes, hash_block_size: int, block_size: int):
    if block_size != hash_block_size:
        raise unsupported("resolve_block_hashes (block hashes at another block size)")
    return block_hashes


def detect_event_hashing(utils: Any) -> EventHashing:
    """The decisions, from vLLM's kv_cache_utils module (or one shaped like it)."""
    for name in ("maybe_convert_block_hash", "generate_block_hash_extra_keys"):
        if not hasattr(utils, name):
            raise unsupported(f"{name} in vllm.v1.core.kv_cache_utils")
    return EventHashing(
        convert=utils.maybe_convert_block_hash,
        resolve=getattr(utils, "resolve_block_hashes", _resolve_same_size),
        extra_keys=utils.generate_block_hash_extra_keys,
        to_event_extra_keys=getattr(utils, "to_event_extra_keys", None),
    )


def event_hashing() -> EventHashing:
    return detect_event_hashing(importlib.import_module("vllm.v1.core.kv_cache_utils"))


def hash_block_size(vllm_config: Any, kv_cache_config: Any, block_size: int) -> int:
    """The block size `Request.block_hashes` are computed at: the KV cache groups' block size
    unless vLLM hashes finer (several groups and a prefix_match_unit)."""
    utils = importlib.import_module("vllm.v1.core.kv_cache_utils")
    resolve = getattr(utils, "resolve_kv_cache_block_sizes", None)
    if resolve is None:
        return block_size
    return int(resolve(kv_cache_config, vllm_config)[1])


class BlockTables:
    """Every scheduled request's block ids per KV cache group, as the scheduler output tells them,
    in every supported version (the scheduler's KV cache manager is not reachable before 0.30).

    New requests carry their whole table; running ones the blocks added this step (None: none);
    a request resumed after preemption carries its whole table again, listed in the cached
    requests' `resumed_req_ids` (up to 0.33) or among the new requests (0.34)."""

    def __init__(self) -> None:
        self._tables: dict[str, list[list[int]]] = {}

    def update(self, scheduler_output: Any) -> None:
        for req in scheduler_output.scheduled_new_reqs:
            self._replace(req.req_id, req.block_ids)
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", None) or ()
        for req_id, new_ids in zip(cached.req_ids, cached.new_block_ids):
            if req_id in resumed:
                self._replace(req_id, new_ids)
            elif new_ids is not None:
                table = self._tables.setdefault(req_id, [[] for _ in new_ids])
                for group, ids in enumerate(new_ids):
                    if ids:
                        table[group].extend(ids)
        for req_id in getattr(scheduler_output, "preempted_req_ids", None) or ():
            self._tables.pop(req_id, None)  # its blocks are freed; a resume brings new ones

    def _replace(self, req_id: str, block_ids) -> None:
        if block_ids is None:
            self._tables.pop(req_id, None)
        else:
            self._tables[req_id] = [list(ids) for ids in block_ids]

    def get(self, req_id: str) -> list[list[int]] | None:
        return self._tables.get(req_id)

    def forget(self, req_id: str) -> None:
        self._tables.pop(req_id, None)
