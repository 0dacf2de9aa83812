"""Scheduler side of the connector: which prefix tokens kvtier has, what to load and save.

Runs in vLLM's scheduler loop, so nothing here touches storage: lookups go to the engine's index
(in process) or to `kvtier serve` (a few microseconds over a Unix socket), and chunk keys are
chained SHA-256 over token ids (docs/chunk-key.md), the same in every process and on every host.

Bookkeeping per request: the keys of its full chunks so far, and how many leading chunks were
handed to the workers to save (`saved`), so that no chunk is queued twice. Chunks kvtier loads, or
holds and the cost model declined to load, are not counted as saved: a save job names them too;
the store answers "already stored" for each one L1 holds, and a chunk that failed to load, or that
only the file tier held, is saved again (into L1, so that the next turn is a memory hit). The
chunks of vLLM's own prefix hit that kvtier holds in any tier are counted as saved at lookup: vLLM
hands a request's whole prefix to save, and saving those again would copy every returning
conversation's prefix out of the GPU each turn once L1 had moved it to the file tier.

The scheduler loop never waits on the store for long: a lookup runs on a background thread and,
when its answer is not there within LOOKUP_WAIT_S, the request is answered "ask again next step"
(vLLM skips it for this step and schedules the others). A lookup that fails (a stalled or dead
server) makes every lookup a miss for LOOKUP_BACKOFF_S.

A prefix whose every chunk is in L1 is pinned there by the lookup itself (as vLLM's own
offloading pins at schedule time), and loaded layer by layer within the step that computes the
rest of the prompt. Nothing can then evict it before the workers copy it, and even a server that
dies meanwhile leaves the pinned slots readable in the workers' mapping of its pool: such a load
cannot fail, which matters because a failure within the step is reported in the same step, and
vLLM's asynchronous scheduling (the default from 0.26) does not survive that. The scheduler
releases the pins once the step that copies them has run: vLLM has at most
max_concurrent_batches steps in flight, so the step RELEASE_AFTER_STEPS builds after it is done.
Prefixes that go on into the file tier, or that cannot all be pinned, load asynchronously.

With kvtier.prefetch on, finished requests and new ones feed the prefetch (prefetch.py), which
keeps the conversations expected back pinned in L1; a returning request's layer-wise load takes
those pins over.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from vllm.logger import init_logger
from vllm.v1.request import RequestStatus

import kvtier

from .compat import (BlockTables, event_hashing, features, full_cuda_graphs, hash_block_size,
                     skips_external_kv)
from .config import ConfigError, ConnectorConfig
from .cost import CostModel, ModelShapeCost, PrefillCost
from .events import Describer
from .layout import supported_groups
from .metadata import SKIP_BLOCK, ChunkJob, KvtierConnectorMetadata
from .prefetch import Prefetcher
from .stats import KvtierConnectorStats
from .store import Namespaces, ServerConnection, in_process_socket

logger = init_logger("vllm.kvtier")

LOOKUP_TIMEOUT_MS = 1000
# How long a lookup may hold the scheduler loop before the request is asked about again next step
# (a lookup in kvtier's index takes tens of microseconds).
LOOKUP_WAIT_S = 0.005
LOOKUP_BACKOFF_S = 2.0
# Steps built after the one carrying a layer-wise load before its pins are released, on top of
# vLLM's steps in flight (pipeline stages, and one more for asynchronous scheduling).
RELEASE_AFTER_STEPS = 2


@dataclass
class _Answer:
    """A lookup's answer: leading chunks every rank has, of those the leading ones in every
    rank's L1, and, for a layer-wise load, the pinned slots of chunks [first, hits) per rank."""
    hits: int = 0
    in_memory: int = 0
    held: int = 0  # leading chunks every rank has in any tier, before the cost model's choice
    first: int = 0
    pins: list[list[int]] | None = None
    server_started: float = 0.0  # the server the pins belong to (store.server_started)
    declined: int = 0  # chunks kvtier has that the cost model chose not to load
    read_s: float = 0.0  # predicted file-tier read time of the load
    counted: bool = False  # its decision is in the stats


@dataclass
class _Request:
    request: Any
    root: bytes
    keys: list[bytes] = field(default_factory=list)
    saved: int = 0  # leading chunks queued for saving
    saves_scheduled: bool = False  # since the last preemption: the workers hold saves of it
    load: tuple[int, int] | None = None  # (locally computed tokens, tokens after the load)
    # A load was handed to the workers since the request last (re)entered the waiting queue:
    # no second one, so that a load that fails is recomputed, never retried for ever.
    load_issued: bool = False
    # ((prompt tokens, tokens in vLLM's cache), the _Answer's future)
    lookup: tuple[tuple[int, int], concurrent.futures.Future] | None = None
    layerwise: bool = False  # the planned load runs within the step (every chunk pinned in L1)
    in_memory_tokens: int = 0  # of the looked-up prefix, tokens in kvtier's L1 (the rest: L2)
    hit_sources: dict | None = None  # the planned load's tokens per tier, for vLLM's metrics
    seen: bool = False  # its first lookup told the prefetch of its arrival


class SchedulerSide:
    def __init__(self, vllm_config, kv_cache_config, cfg: ConnectorConfig):
        self.cfg = cfg
        self.groups = supported_groups(kv_cache_config)
        self.block_size = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        if cfg.chunk_tokens % self.block_size != 0:
            raise ConfigError(f"kvtier.chunk_tokens ({cfg.chunk_tokens}) must be a multiple of "
                              f"vLLM's block size ({self.block_size})")
        self.blocks_per_chunk = cfg.chunk_tokens // self.block_size
        self.ns = Namespaces(cfg, vllm_config, kv_cache_config)
        if not cfg.server_mode and self.ns.world_size > 1:
            raise ConfigError("kvtier in-process mode serves one worker process; with tensor or "
                              "pipeline parallelism use server mode (set kvtier.socket)")
        self._features = features()
        # A partly failed load with several KV cache groups can only be reported where vLLM
        # takes failed requests (failed_recving); elsewhere kvtier saves but does not load.
        self._loads_enabled = len(self.groups) == 1 or self._features.reports_failed_requests
        if not self._loads_enabled:
            logger.warning("kvtier: this vLLM cannot take a failed load with %d KV cache groups; "
                           "kvtier saves chunks but serves no hits (vLLM 0.30 or later does)",
                           len(self.groups))
        from vllm.platforms import current_platform

        self._layerwise = len(self.groups) == 1 and (
            cfg.load_mode == "layerwise" or (cfg.load_mode == "auto" and current_platform.is_cuda()))
        if self._layerwise and full_cuda_graphs(vllm_config):
            # vLLM kept full CUDA graphs (a version without requires_piecewise_for_cudagraph):
            # their replay skips wait_for_layer_load, so every hit loads between steps.
            logger.warning("kvtier: vLLM replays full CUDA graphs; hits load between steps, not "
                           "layer by layer (use a piecewise cudagraph_mode for layer-wise loads)")
            self._layerwise = False
        async_scheduling = bool(getattr(vllm_config.scheduler_config, "async_scheduling", False))
        self._pipeline_stages = vllm_config.parallel_config.pipeline_parallel_size
        self._steps_in_flight = self._pipeline_stages + int(async_scheduling)
        self._step = 0  # build_connector_meta calls so far
        # Pins of layer-wise loads handed to the workers: (step, request id, pins per rank),
        # released RELEASE_AFTER_STEPS + steps in flight later.
        self._held: list[tuple[int, str, list[list[int]]]] = []
        self._tables = BlockTables()
        self._stats = KvtierConnectorStats()
        self._stats_lock = threading.Lock()
        self._cost: CostModel | None = None  # made at the first lookup (it needs the chunk size)
        # Without a prefill table, the cost model's prefill times come from the model's shape.
        self._model_shape = ModelShapeCost.from_hf_config(
            getattr(vllm_config.model_config, "hf_text_config", None))
        self._lookup_thread = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="kvtier-lookup")
        self._lookups_down_until = 0.0
        self._lookups_down_on: list[float] = []  # the servers (start stamps) a lookup failed on
        self._requests: dict[str, _Request] = {}
        self._pending_loads: list[ChunkJob] = []
        self._roots: dict[str, bytes] = {}
        # One client per rank: a prefix is a hit only if every rank has its shard.
        socket = cfg.socket if cfg.server_mode else in_process_socket(os.getpid())
        self._servers = [
            ServerConnection(cfg, socket, self.ns.store(r), 0, "vllm-scheduler",
                             # Lookups are quick: a stalled server must not hold the
                             # scheduler loop for long.
                             min(cfg.rpc_timeout_ms, LOOKUP_TIMEOUT_MS))
            for r in range(self.ns.world_size)]
        for server in self._servers:
            server.connect_now()  # if the server is up, the first lookups can hit
        # KV-cache events: vLLM's block hashes of every chunk handed to the workers to save,
        # sent on rank 0's connection (the server files them for every rank's shard).
        self._describer = None
        if cfg.describes:
            token_ids = not (isinstance(cfg.kv_events, dict)
                             and cfg.kv_events.get("token_ids") in (False, "off"))
            self._describer = Describer(
                event_hashing(), self._servers[0].get, self._count, cfg.chunk_tokens,
                self.block_size, hash_block_size(vllm_config, kv_cache_config, self.block_size),
                self.groups[0], token_ids)
        self.resumed_from_kvtier = 0  # preempted requests whose prefix came back from kvtier
        self._prefetch = None
        if cfg.prefetch:
            self._prefetch = Prefetcher(
                lambda: [s.get() for s in self._servers], cfg.prefetch_fraction, self._count,
                lambda: self._cost.file_rate.bytes_per_s() if self._cost is not None else 0.0,
                cfg.chunk_tokens, self._prefetch_pays)

    # --- lookups -----------------------------------------------------------------------------

    def _cost_model(self, chunk_bytes: int) -> CostModel | None:
        cfg = self.cfg
        if self._cost is None and cfg.cost_aware:
            prefill = (PrefillCost(list(cfg.prefill_table)) if cfg.prefill_table
                       else self._model_shape)
            if prefill is None and cfg.min_file_read_gbps <= 0:
                return None
            self._cost = CostModel(prefill, cfg.chunk_tokens, chunk_bytes,  # one rank's share
                                   cfg.min_file_read_gbps * 1e9, cfg.file_read_gbps * 1e9)
        return self._cost

    def _prefetch_pays(self, chunks: int, resident: int) -> bool:
        """Whether the return of a conversation of `chunks` chunks, `resident` of them in L1,
        would recompute what only the file tier holds (the cost model declines it): a prefetch
        turns that into a memory hit. Where the load would read it anyway, prefetching only
        adds reads. Without a cost model (cost_aware off) there is no telling: prefetch, as
        asked."""
        cost = self._cost
        if cost is None:
            return True
        return cost.choose((chunks + 1) * self.cfg.chunk_tokens, 0, resident, chunks).chunks < chunks

    def _lookup(self, req_id: str, keys: list[bytes], first: int, n_tokens: int,
                local: int) -> _Answer:
        """Runs on the lookup thread. A miss when the store is unreachable. The cost model may
        shorten the hit (cost.py). With layer-wise loads on, a hit whose every chunk is in L1
        has chunks [first, hits) pinned: by the prefetch already, if it held them."""
        try:
            return self._lookup_pinned(req_id, keys, first, n_tokens, local)
        finally:
            if self._prefetch is not None:
                self._prefetch.forget(req_id)  # the prefetch's pins it did not take

    def _lookup_pinned(self, req_id: str, keys: list[bytes], first: int, n_tokens: int,
                       local: int) -> _Answer:
        # The backoff after a failed lookup holds for the servers it failed on: once the
        # connections are to a restarted server, lookups go to it at once.
        if not keys or (time.monotonic() < self._lookups_down_until and
                        self._lookups_down_on == [s.started for s in self._servers]):
            return _Answer()
        hits = in_memory = len(keys)
        clients = []
        for server in self._servers:
            client = server.get()
            if client is None:
                return _Answer()
            try:
                total, memory = client.lookup(keys)
            except kvtier.KvtierError as e:
                logger.warning("kvtier: a lookup failed (%s); every lookup is a miss for %.0f s",
                               e, LOOKUP_BACKOFF_S)
                self._lookups_down_until = time.monotonic() + LOOKUP_BACKOFF_S
                self._lookups_down_on = [s.started for s in self._servers]
                return _Answer()
            hits, in_memory = min(hits, total), min(in_memory, memory)
            clients.append((client, server.started))
        answer = _Answer(hits, min(hits, in_memory), held=hits, first=first)
        cost = self._cost_model(clients[0][0].chunk_bytes)
        if cost is not None and answer.hits > answer.in_memory:
            choice = cost.choose(n_tokens, local, answer.in_memory, answer.hits)
            answer.declined = max(0, answer.hits - max(choice.chunks, first))
            answer.hits, answer.read_s = choice.chunks, choice.read_s
            answer.in_memory = min(answer.in_memory, answer.hits)
            hits, in_memory = answer.hits, answer.in_memory
        if self._layerwise and first < hits <= in_memory:
            answer.pins, answer.server_started = self._pin(clients, keys[first:hits], req_id,
                                                           first)
        return answer

    def _pin(self, clients, keys: list[bytes], req_id: str, first: int
             ) -> tuple[list[list[int]] | None, float]:
        """Every rank's slots of `keys` (chunks [first, ...) of the request's), pinned; (None, 0)
        unless every rank pinned them all (evicted meanwhile, or over the server's per-client
        limit: the load goes asynchronous). Pins the prefetch holds are taken over."""
        started = {s for _, s in clients}
        if len(started) != 1 or 0.0 in started:
            return None, 0.0  # ranks on different servers, or one's start unknown
        if self._prefetch is not None:
            pins = self._prefetch.take_pins(req_id, [c for c, _ in clients], first,
                                            first + len(keys))
            if pins is not None:
                return pins, started.pop()
        pins = []
        for client, _ in clients:
            try:
                slots = list(client.prepare_load(keys).wait().slots)
            except kvtier.KvtierError as e:
                logger.debug("kvtier: pinning %d chunks failed: %s", len(keys), e)
                slots = []
            pins.append(slots)
            if len(slots) < len(keys):
                self._unpin(pins)
                return None, 0.0
        return pins, started.pop()

    def _unpin(self, pins: list[list[int]]) -> None:
        """Runs on the lookup thread. Pins of a server that is gone went with it."""
        for rank, slots in enumerate(pins):
            if not slots:
                continue
            client = self._servers[rank].get()
            if client is None:
                continue
            try:
                client.unpin(slots)
            except kvtier.KvtierError as e:  # a new server: these pins died with the old one
                logger.debug("kvtier: releasing %d pins failed: %s", len(slots), e)

    def _release(self, pins: list[list[int]] | None) -> None:
        if pins and any(pins):
            try:
                self._lookup_thread.submit(self._unpin, pins)
            except RuntimeError:  # shut down: the connections' close releases every pin
                pass

    def _drop_lookup(self, st: _Request) -> None:
        """Forgets the request's lookup, releasing its pins (once it is answered)."""
        if st.lookup is None:
            return
        future = st.lookup[1]
        st.lookup = None
        future.add_done_callback(
            lambda f: None if f.cancelled() or f.exception() else self._release(f.result().pins))

    def _lookup_now(self, st: _Request, keys: list[bytes], first: int, n_tokens: int,
                    local: int) -> _Answer | None:
        """The lookup's answer, or None when it is still under way (vLLM asks again next
        step). One lookup per request, prompt length and local prefix: a repeated question is
        answered from the last answer (and its pins)."""
        if st.lookup is None or st.lookup[0] != (n_tokens, local):
            self._drop_lookup(st)
            st.lookup = ((n_tokens, local),
                         self._lookup_thread.submit(self._lookup, st.request.request_id, keys,
                                                    first, n_tokens, local))
            self._count("lookups", 1)
        future = st.lookup[1]
        if future.done():
            return future.result()
        started = time.perf_counter()
        try:
            return future.result(timeout=LOOKUP_WAIT_S)
        except concurrent.futures.TimeoutError:
            self._count("lookups_deferred", 1)
            return None
        finally:
            self._count("lookup_wait_us", int((time.perf_counter() - started) * 1e6))

    def _state(self, request) -> _Request | None:
        st = self._requests.get(request.request_id)
        if st is not None:
            return st
        if request.mm_features or getattr(request, "prompt_embeds", None) is not None:
            return None  # token ids do not name the content: never share these prefixes
        salt = request.cache_salt or ""
        if request.lora_request is not None:
            salt += f"\x00lora:{request.lora_request.lora_name}"
        root = self._roots.get(salt)
        if root is None:
            if len(self._roots) >= 4096:  # per-request salts: keep the cache bounded
                self._roots.clear()
            root = self.ns.keys(salt).root()
            self._roots[salt] = root
        st = _Request(request=request, root=root)
        self._requests[request.request_id] = st
        return st

    def _keys(self, st: _Request, n_chunks: int) -> list[bytes]:
        ct = self.cfg.chunk_tokens
        tokens = st.request.all_token_ids
        while len(st.keys) < n_chunks:
            i = len(st.keys)
            prev = st.keys[-1] if st.keys else st.root
            st.keys.append(kvtier.chain_chunk_key(prev, tokens[i * ct:(i + 1) * ct]))
        return st.keys[:n_chunks]

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        st = self._state(request)
        if st is None:
            return 0, False
        if not st.seen:
            st.seen = True
            if self._prefetch is not None:
                ct = self.cfg.chunk_tokens
                self._prefetch.arrived(request.request_id, self._keys(st, request.num_tokens // ct),
                                       getattr(request, "arrival_time", None) or time.time(),
                                       num_computed_tokens // ct)
        st.load = None
        if st.load_issued or not self._loads_enabled or skips_external_kv(request):
            return 0, False
        n_tokens = request.num_tokens
        ct = self.cfg.chunk_tokens
        answer = self._lookup_now(st, self._keys(st, n_tokens // ct), num_computed_tokens // ct,
                                  n_tokens, num_computed_tokens)
        if answer is None:
            return None, False
        if not answer.counted:
            answer.counted = True
            if answer.declined:
                self._count("tokens_declined", answer.declined * ct)
            # vLLM's own hit, as far as kvtier holds it: no saves (the module's docstring).
            held_locally = min(answer.held, num_computed_tokens // ct)
            if held_locally > st.saved:
                self._count("saves_skipped", held_locally - st.saved)
                st.saved = held_locally
        # vLLM must compute at least the last token itself.
        hit_tokens = min(answer.hits * ct, n_tokens - 1)
        st.in_memory_tokens = min(answer.in_memory * ct, hit_tokens)
        external = hit_tokens - num_computed_tokens
        if external < self.block_size:
            # Less than a block beyond vLLM's own cache (its hits stop a block short of the
            # prompt's end): computing it costs nothing, a load would cost a pin and a copy.
            self._drop_lookup(st)
            return 0, False
        st.load = (num_computed_tokens, hit_tokens)
        # Every chunk pinned in L1: loaded within this step, layer by layer, overlapped with
        # the compute. Otherwise asynchronous: the request waits while the workers read the
        # file tier, and other requests keep running.
        st.layerwise = answer.pins is not None
        return external, not st.layerwise

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        st = self._requests.get(request.request_id)
        if st is None:
            return
        if num_external_tokens == 0 or st.load is None:
            self._drop_lookup(st)
            return
        local, hit_tokens = st.load
        st.load = None
        st.load_issued = True
        answer = None
        if st.lookup is not None and st.lookup[1].done():
            answer = st.lookup[1].result()
        st.lookup = None  # its pins, if any, go to the load below
        from_memory = min(max(st.in_memory_tokens - local, 0), num_external_tokens)
        st.hit_sources = {"host": from_memory, "disk": num_external_tokens - from_memory}
        self._count("tokens_hit_memory", from_memory)
        self._count("tokens_hit_file", num_external_tokens - from_memory)
        ct = self.cfg.chunk_tokens
        first, end = local // ct, -(-hit_tokens // ct)
        block_ids = blocks.get_block_ids()
        first_new_block = local // self.block_size
        chunk_blocks = []
        for c in range(first, end):
            per_group = []
            for g in self.groups:
                ids = list(block_ids[g][c * self.blocks_per_chunk:(c + 1) * self.blocks_per_chunk])
                start = c * self.blocks_per_chunk
                per_group.append([SKIP_BLOCK if start + j < first_new_block else b
                                  for j, b in enumerate(ids)])
            chunk_blocks.append(per_group)
        job = ChunkJob(request.request_id, st.keys[first:end], chunk_blocks,
                       layerwise=st.layerwise,
                       disk_chunks=max(0, end - max(first, -(-st.in_memory_tokens // ct))))
        if answer is not None and job.disk_chunks:
            self._count("file_read_predicted_us", int(answer.read_s * 1e6))
        pins = answer.pins if answer is not None else None
        if st.layerwise and pins is not None and answer.first == first:
            n = end - first
            self._release([p[n:] for p in pins])  # past the last token vLLM takes from kvtier
            job.pinned_slots = [p[:n] for p in pins]
            job.server_started = answer.server_started
        else:  # an asynchronous load (the workers pin), or, never expected, a layer-wise one
            self._release(pins)  # without its pins: the workers report its blocks failed
        self._pending_loads.append(job)
        if request.num_preemptions > 0:
            self.resumed_from_kvtier += 1
            logger.info("kvtier: preempted request %s resumes with %d tokens from kvtier "
                        "(%d preempted requests resumed so far)", request.request_id,
                        num_external_tokens, self.resumed_from_kvtier)

    def get_external_cache_hit_sources(self, request, num_external_tokens: int) -> dict:
        """vLLM's per-tier hit metrics (versions that have CacheHitSource)."""
        source = self._features.cache_hit_source
        st = self._requests.get(request.request_id)
        sources = st.hit_sources if st is not None else None
        if not num_external_tokens or source is None:
            return {}
        if not sources or sum(sources.values()) != num_external_tokens:
            return {source.EXTERNAL_UNSPECIFIED: num_external_tokens}
        names = {"host": source.HOST, "disk": source.DISK}
        return {names[k]: v for k, v in sources.items() if v}

    # --- per step ----------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output) -> KvtierConnectorMetadata:
        meta = KvtierConnectorMetadata(loads=self._pending_loads)
        self._pending_loads = []
        self._step += 1
        self._held += [(self._step, job.req_id, job.pinned_slots)
                       for job in meta.loads if job.pinned_slots is not None]
        done = self._step - RELEASE_AFTER_STEPS - self._steps_in_flight
        while self._held and self._held[0][0] <= done:
            self._release(self._held.pop(0)[2])
        self._tables.update(scheduler_output)
        meta.preempted_req_ids = set(scheduler_output.preempted_req_ids or ())
        for req_id in meta.preempted_req_ids:
            st = self._requests.get(req_id)
            if st is not None:
                # Its blocks are freed once the workers' saves of it are done (handle_preemptions);
                # it may come back through a load, and saves after that are new ones.
                st.load = None
                self._drop_lookup(st)
                st.load_issued = st.saves_scheduled = False
        # A step that also loads is not timed: its time holds the load's copies.
        meta.prefill_predicted_s = 0.0 if meta.loads else self._step_prediction(scheduler_output)
        ct = self.cfg.chunk_tokens
        spec = scheduler_output.scheduled_spec_decode_tokens
        for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            st = self._requests.get(req_id)
            if st is None:
                continue
            request = st.request
            # KV that exists once this step ran; speculative tokens may be rejected.
            done = request.num_computed_tokens + scheduled - len(spec.get(req_id, ()))
            if not self.cfg.save_decode_tokens:
                done = min(done, request.num_prompt_tokens)
            n_chunks = min(done, len(request.all_token_ids)) // ct
            if n_chunks <= st.saved:
                continue
            keys = self._keys(st, n_chunks)
            block_ids = self._tables.get(req_id)
            if block_ids is None:
                continue
            b = self.blocks_per_chunk
            chunks = [[list(block_ids[g][c * b:(c + 1) * b]) for g in self.groups]
                      for c in range(st.saved, n_chunks)]
            meta.saves.append(ChunkJob(req_id, keys[st.saved:n_chunks], chunks))
            if self._describer is not None:
                self._describer.add(request, keys[st.saved:n_chunks], st.saved)
            st.saved = n_chunks
            st.saves_scheduled = True
        return meta

    def _step_prediction(self, scheduler_output) -> float:
        """The table's seconds for this step's prompt tokens, for the workers to time (0: not
        timed: no cost model, a request the connector does not know, or too little prefill)."""
        if self._cost is None or self._cost.prefill is None:
            return 0.0
        work = []
        for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            st = self._requests.get(req_id)
            if st is None:
                return 0.0
            start = st.request.num_computed_tokens  # before this step
            end = min(start + scheduled, st.request.num_prompt_tokens)
            if end > start:
                work.append((start, end))
        return self._cost.step_prediction(work)

    def _count(self, name: str, value: int) -> None:
        with self._stats_lock:
            self._stats.add(name, value)

    def get_stats(self) -> KvtierConnectorStats | None:
        with self._stats_lock:
            if self._stats.is_empty():
                return None
            stats, self._stats = self._stats, KvtierConnectorStats()
        return stats

    def update_connector_output(self, output) -> None:
        """The workers' counters of this step: the file tier's measured reads and the timed
        prefill steps feed the cost model."""
        stats = getattr(output, "kv_connector_stats", None)
        data = getattr(stats, "data", None)
        if self._cost is None or not isinstance(data, dict):
            return
        self._cost.file_rate.observe(data.get("file_read_bytes", 0),
                                     data.get("file_read_us", 0) / 1e6)
        # Every rank reports the step's whole prediction; a pipeline stage times only its own
        # layers, so the stages' times add up to one step's.
        self._cost.compute_scale.observe(
            data.get("prefill_measured_us", 0) * self._pipeline_stages,
            data.get("prefill_predicted_us", 0))

    def request_finished(self, request) -> tuple[bool, dict | None]:
        st = self._requests.pop(request.request_id, None)
        self._tables.forget(request.request_id)
        if st is not None:
            self._drop_lookup(st)  # pins of a load never scheduled
            if self._prefetch is not None:
                self._prefetch.forget(request.request_id)
            if request.status in (RequestStatus.FINISHED_STOPPED,
                                  RequestStatus.FINISHED_LENGTH_CAPPED):
                if self._prefetch is not None:
                    # Its conversation may come back: it starts with the chunks it saved.
                    self._prefetch.finished(st.keys[:st.saved],
                                            request.num_prompt_tokens // self.cfg.chunk_tokens,
                                            time.time())
                # It finished on the output of a step after its load's: that has run. (An
                # aborted one may be in a step still running: its pins wait for the steps.)
                mine = [h for h in self._held if h[1] == request.request_id]
                self._held = [h for h in self._held if h[1] != request.request_id]
                for h in mine:
                    self._release(h[2])
        # The workers report a request with saves through finished_sending once its saves are
        # done; until then vLLM keeps its blocks. A request finished while its load runs has no
        # saves (saves start once it runs): vLLM itself keeps its blocks until the load is done.
        return (st is not None and st.saves_scheduled), None

    def shutdown(self) -> None:
        self._lookup_thread.shutdown(wait=False, cancel_futures=True)
        if self._prefetch is not None:
            self._prefetch.close()
        if self._describer is not None:
            self._describer.close()
        for server in self._servers:
            server.close()
