"""Scheduler side of the connector: which prefix tokens kvtier has, what to load and save.

Runs in vLLM's scheduler loop, so nothing here touches storage: lookups go to the engine's index
(in process) or to `kvtier serve` (a few microseconds over a Unix socket), and chunk keys are
chained SHA-256 over token ids (docs/chunk-key.md), the same in every process and on every host.

Bookkeeping per request: the keys of its full chunks so far, and how many leading chunks are in
kvtier or already handed to the workers to save (`saved`), so that no chunk is saved twice.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable

from vllm.logger import init_logger
from vllm.v1.metrics.cache_hit_source import CacheHitSource

import kvtier

from .config import ConfigError, ConnectorConfig
from .layout import supported_groups
from .metadata import SKIP_BLOCK, ChunkJob, KvtierConnectorMetadata
from .store import Namespaces, ServerConnection, in_process_socket

logger = init_logger("vllm.kvtier")

LOOKUP_TIMEOUT_MS = 1000


@dataclass
class _Request:
    request: Any
    root: bytes
    keys: list[bytes] = field(default_factory=list)
    saved: int = 0  # leading chunks in kvtier or queued for saving
    saves_scheduled: bool = False
    load: tuple[int, int] | None = None  # (locally computed tokens, tokens after the load)
    in_memory_tokens: int = 0  # of the looked-up prefix, tokens in kvtier's L1 (the rest: L2)
    hit_sources: dict | None = None  # the planned load's tokens per tier, for vLLM's metrics


class SchedulerSide:
    def __init__(self, vllm_config, kv_cache_config, cfg: ConnectorConfig,
                 block_ids_of: Callable[[str], tuple[list[int], ...]]):
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
        self._block_ids_of = block_ids_of
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
        self.resumed_from_kvtier = 0  # preempted requests whose prefix came back from kvtier

    # --- lookups -----------------------------------------------------------------------------

    def _lookup(self, keys: list[bytes]) -> tuple[int, int]:
        """(leading chunks every rank has, of those the leading ones in every rank's L1);
        (0, 0) when the store is unreachable."""
        if not keys:
            return 0, 0
        hits = in_memory = len(keys)
        for server in self._servers:
            client = server.get()
            if client is None:
                return 0, 0
            try:
                total, memory = client.lookup(keys)
            except kvtier.KvtierError:
                return 0, 0
            hits, in_memory = min(hits, total), min(in_memory, memory)
        return hits, min(hits, in_memory)

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

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        st = self._state(request)
        if st is None:
            return 0, False
        st.load = None
        n_tokens = request.num_tokens
        hits, in_memory = self._lookup(self._keys(st, n_tokens // self.cfg.chunk_tokens))
        st.saved = max(st.saved, hits)
        # vLLM must compute at least the last token itself.
        hit_tokens = min(hits * self.cfg.chunk_tokens, n_tokens - 1)
        st.in_memory_tokens = min(in_memory * self.cfg.chunk_tokens, hit_tokens)
        external = hit_tokens - num_computed_tokens
        if external <= 0:
            return 0, False
        st.load = (num_computed_tokens, hit_tokens)
        # Asynchronous: the request waits while the workers load, other requests keep running.
        return external, True

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        st = self._requests.get(request.request_id)
        if st is None or num_external_tokens == 0 or st.load is None:
            return
        local, hit_tokens = st.load
        st.load = None
        from_memory = min(max(st.in_memory_tokens - local, 0), num_external_tokens)
        st.hit_sources = {CacheHitSource.HOST: from_memory,
                          CacheHitSource.DISK: num_external_tokens - from_memory}
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
        self._pending_loads.append(ChunkJob(request.request_id, st.keys[first:end], chunk_blocks))
        st.saved = max(st.saved, end)
        if request.num_preemptions > 0:
            self.resumed_from_kvtier += 1
            logger.info("kvtier: preempted request %s resumes with %d tokens from kvtier "
                        "(%d preempted requests resumed so far)", request.request_id,
                        num_external_tokens, self.resumed_from_kvtier)

    def get_external_cache_hit_sources(self, request, num_external_tokens: int) -> dict:
        st = self._requests.get(request.request_id)
        sources = st.hit_sources if st is not None else None
        if not num_external_tokens:
            return {}
        if not sources or sum(sources.values()) != num_external_tokens:
            return {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens}
        return {k: v for k, v in sources.items() if v}

    # --- per step ----------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output) -> KvtierConnectorMetadata:
        meta = KvtierConnectorMetadata(loads=self._pending_loads)
        self._pending_loads = []
        meta.preempted_req_ids = set(scheduler_output.preempted_req_ids or ())
        for req_id in meta.preempted_req_ids:
            st = self._requests.get(req_id)
            if st is not None:
                st.load = None
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
            block_ids = self._block_ids_of(req_id)
            b = self.blocks_per_chunk
            chunks = [[list(block_ids[g][c * b:(c + 1) * b]) for g in self.groups]
                      for c in range(st.saved, n_chunks)]
            meta.saves.append(ChunkJob(req_id, keys[st.saved:n_chunks], chunks))
            st.saved = n_chunks
            st.saves_scheduled = True
        return meta

    def request_finished(self, request) -> tuple[bool, dict | None]:
        st = self._requests.pop(request.request_id, None)
        # The workers report a request with saves through finished_sending once its saves are
        # done; until then vLLM keeps its blocks.
        return (st is not None and st.saves_scheduled), None

    def shutdown(self) -> None:
        for server in self._servers:
            server.close()
