"""Worker side of the connector: moves chunks between vLLM's paged KV cache and kvtier.

Zero-copy in both modes: a save reserves chunk slots in kvtier's L1 pool (the server's shared
pool, or the in-process engine's arena) and the copier gathers the request's blocks straight into
them; a load pins the chunks' slots and scatters them straight into the blocks. Loads take one of
two paths, chosen per request by the scheduler:
  * layer-wise, for a hit whose every chunk the scheduler pinned in L1 at lookup: start_load_kv
    queues, on a copy stream of its own, each layer's scatter of every chunk (one copier per
    layer: a chunk is layer-major, so layer i is one contiguous range of it), with an event per
    layer; wait_for_layer_load makes the compute stream wait for that layer's event only, so
    layer i's copy overlaps layer i-1's attention and the request runs in the step it was
    scheduled in. The scheduler releases the pins after the step; the slots are read in the
    pool of the server that pinned them, which stays mapped even if that server died since;
Everything else runs on background threads (the copier and the store release the GIL), off the
forward pass:
  * loads are asynchronous in vLLM's sense: the request waits (WAITING_FOR_REMOTE_KVS) while
    other requests run, and is reported in finished_recving when its blocks are filled (only
    after the kernels queued before the load was handed over: with asynchronous scheduling, a
    step still running may write a token into a block that was freed and given to the load);
    chunks
    that could not be loaded (evicted meanwhile, past the load deadline, server gone, corrupt)
    are reported as failed blocks, which vLLM recomputes;
  * saves of a step are queued after its forward pass; a finished request's blocks stay
    allocated until its saves are done (finished_sending); a preempted request's blocks are
    freed by vLLM, so handle_preemptions waits for that request's queued saves (not the others')
    before they can be reused, and forgets them: a request that resumes and is aborted before
    it ran again is not reported finished a second time.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable

import torch

from vllm.logger import init_logger

import kvtier

from .config import ConnectorConfig
from .layout import describe_group, supported_groups
from .metadata import SKIP_BLOCK, ChunkJob, KvtierConnectorMetadata
from .prefix_loader import PrefixLoader
from .stats import KvtierConnectorStats
from .store import (Namespaces, ServerConnection, engine_core_pid, in_process_socket,
                    start_in_process_server)

logger = init_logger("vllm.kvtier")

# Layers of a layer-wise load queued ahead of the layer the forward pass is at.
LAYERS_AHEAD = 3


class _StepTimer:
    """Times the steps the scheduler marked (prefill_predicted_s): from the step's metadata
    (bound before the forward pass) to wait_for_save (after it), on the GPU's clock (CUDA
    events, read once they have completed, never waited for) or, on a host KV cache, the wall
    clock. Only the worker's step thread starts and stops; collect() runs on the same thread
    (vLLM asks for stats after a step)."""

    def __init__(self):
        self._open = None  # (start, predicted seconds, on the GPU)
        self._pending: list = []  # (start event, end event, predicted seconds)
        self._done: list[tuple[float, float]] = []

    def start(self, predicted_s: float, cuda: bool) -> None:
        self._open = None
        if predicted_s <= 0:
            return
        if cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            start = time.perf_counter()
        self._open = (start, predicted_s, cuda)

    def stop(self) -> None:
        if self._open is None:
            return
        start, predicted_s, cuda = self._open
        self._open = None
        if cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pending.append((start, end, predicted_s))
            del self._pending[:-64]  # not collected (no stats asked for): keep the newest
        else:
            self._done.append((time.perf_counter() - start, predicted_s))

    def collect(self) -> list[tuple[float, float]]:
        """(measured, predicted) seconds of the timed steps that have finished since the last
        call."""
        while self._pending and self._pending[0][1].query():
            start, end, predicted_s = self._pending.pop(0)
            self._done.append((start.elapsed_time(end) / 1e3, predicted_s))
        done, self._done = self._done, []
        return done


class _JobThread:
    """One background thread running jobs in order; join() waits for the queue to empty."""

    def __init__(self, name: str, run: Callable[[Any], None]):
        self._queue: queue.Queue = queue.Queue()
        self._run = run
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def put(self, job) -> None:
        self._queue.put(job)

    def join(self) -> None:
        self._queue.join()

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                self._run(job)
            except Exception:  # a job must never kill the thread (vLLM would hang on it)
                logger.exception("kvtier: background job failed")
            finally:
                self._queue.task_done()


class WorkerSide:
    def __init__(self, vllm_config, kv_cache_config, cfg: ConnectorConfig):
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        self.cfg = cfg
        self.kv_cache_config = kv_cache_config
        self.groups = supported_groups(kv_cache_config)
        self.block_size = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        tp, pp = get_tp_group(), get_pp_group()
        self.rank = pp.rank_in_group * tp.world_size + tp.rank_in_group
        namespaces = Namespaces(cfg, vllm_config, kv_cache_config)
        self.world_size = namespaces.world_size
        self.ns = namespaces.store(self.rank)
        self._socket = cfg.socket if cfg.server_mode else in_process_socket(
            engine_core_pid(vllm_config))
        self._copiers: list[kvtier.KvCopier] = []
        self._save_copiers: list[kvtier.KvCopier] = []  # the same caches, save_mechanism's way
        self._part_offsets: list[int] = []
        self._part_bytes: list[int] = []
        self._kernel_ratios: list[int] = []  # kernel blocks per vLLM block, per group
        self.chunk_bytes = 0
        self._device: torch.device | None = None
        self._embedded_server = None  # in-process mode: the engine's server, in this process
        self._server: ServerConnection | None = None
        self._registered_pools: set[int] = set()
        self._prefix_loader: PrefixLoader | None = None  # asynchronous loads, once registered

        self._lock = threading.Lock()
        self._saves_done = threading.Condition(self._lock)  # a request's pending saves fell
        self._stats = KvtierConnectorStats()
        self._pending_saves: dict[str, int] = {}  # queued save jobs per request
        self._had_saves: set[str] = set()
        self._finished: set[str] = set()  # finished requests waiting for their saves
        self._loaded: set[str] = set()  # loads done since the last get_finished
        self._failed_blocks: set[int] = set()  # one KV cache group: vLLM keeps the valid prefix
        self._failed_reqs: set[str] = set()  # several groups: block ids are ambiguous
        self._loader: _JobThread | None = None
        self._saver: _JobThread | None = None
        self._pool_lock = threading.Lock()
        # Layer-wise loads: one copier per layer of the (single) KV cache group.
        self._layer_copiers: list[kvtier.KvCopier] = []
        self._layer_offsets: list[int] = []
        self._layer_bytes: list[int] = []
        self._layer_of: dict[str, int] = {}
        self._load_stream = None
        self._layer_events: list | None = None  # this step's layer-wise load, one per layer
        # This step's layer-wise load: (block ids, chunk addresses, copy stream, its blocks).
        self._layer_plan = None
        self._step_timer = _StepTimer()

    # --- setup -------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        num_blocks = self.kv_cache_config.num_blocks
        first = next(iter(kv_caches.values()))
        self._device = first.device
        device = (first.device.index or 0) if first.device.type == "cuda" else -1
        offset = 0
        for g in self.groups:
            names = self.kv_cache_config.kv_cache_groups[g].layer_names
            tensors, ratio = describe_group(names, kv_caches, num_blocks, self.block_size)
            self._kernel_ratios.append(ratio)
            pages = [kvtier.KvPageTensor(**t) for t in tensors]
            copier = kvtier.KvCopier(pages, self.block_size // ratio, device=device)
            self._copiers.append(copier)
            self._save_copiers.append(
                copier if device < 0 or self.cfg.save_mechanism == "auto" else
                kvtier.KvCopier(pages, self.block_size // ratio, device=device,
                                mechanism=self.cfg.save_mechanism))
            self._part_offsets.append(offset)
            self._part_bytes.append(copier.chunk_bytes(self.cfg.chunk_tokens))
            offset += self._part_bytes[-1]
            logger.info("kvtier: KV cache group %d: %s", g, copier.describe())
        self.chunk_bytes = offset
        self._prefix_loader = PrefixLoader(self.chunk_bytes, self.cfg.file_read_gbps)
        if not self.cfg.server_mode:
            self._embedded_server = start_in_process_server(self.cfg, self.chunk_bytes,
                                                            self._socket)
        self._server = ServerConnection(self.cfg, self._socket, self.ns, self.chunk_bytes,
                                        f"vllm-worker-{self.rank}", self.cfg.rpc_timeout_ms,
                                        keep_mappings=True, on_close=self._unregister_pool,
                                        on_connect=self._register_pool)
        self._server.connect_now()  # if the server is up; a configuration it refuses raises
        self._setup_layerwise(kv_caches, num_blocks, device)
        logger.info("kvtier: %s mode, %d-byte chunks of %d tokens, rank %d of %d",
                    "server" if self.cfg.server_mode else "in-process", self.chunk_bytes,
                    self.cfg.chunk_tokens, self.rank, self.world_size)
        self._loader = _JobThread("kvtier-load", self._load)
        self._saver = _JobThread("kvtier-save", self._save)

    def _setup_layerwise(self, kv_caches, num_blocks: int, device: int) -> None:
        cuda = self._device.type == "cuda"
        if len(self.groups) != 1 or not (self.cfg.load_mode == "layerwise" or
                                         (self.cfg.load_mode == "auto" and cuda)):
            return
        names = self.kv_cache_config.kv_cache_groups[self.groups[0]].layer_names
        offset = 0
        for i, name in enumerate(names):
            tensors, ratio = describe_group([name], kv_caches, num_blocks, self.block_size)
            copier = kvtier.KvCopier([kvtier.KvPageTensor(**t) for t in tensors],
                                     self.block_size // ratio, device=device)
            self._layer_copiers.append(copier)
            self._layer_offsets.append(offset)
            self._layer_bytes.append(copier.chunk_bytes(self.cfg.chunk_tokens))
            self._layer_of[name] = i
            offset += self._layer_bytes[-1]
        if offset != self._part_bytes[0]:  # not layer-major: stay with whole-chunk loads
            logger.warning("kvtier: the layers' chunk parts (%d bytes) do not add up to a chunk "
                           "(%d): loads are not layer-wise", offset, self._part_bytes[0])
            self._layer_copiers, self._layer_of = [], {}
            return
        if cuda:
            self._load_stream = torch.cuda.Stream(device=self._device)
        logger.info("kvtier: L1 hits load layer by layer (%d layers)", len(names))

    def _get_store(self) -> kvtier.ChunkStore | None:
        store = self._server.get()
        if store is not None:
            self._register_pool(store)  # done at connect; a no-op unless that failed
        return store

    def _register_pool(self, store: kvtier.ChunkStore) -> None:
        """The copier's DMA needs the pool page-locked and mapped for the device. Runs when a
        server is connected (ServerConnection's on_connect, on its connecting thread: pinning
        8 GiB took 0.4 s on an H200, which no request should wait for). One thread
        registers a pool; the others wait (a copy from a half-registered pool fails)."""
        if self._device is None or self._device.type != "cuda":
            return
        base = store.pool_base
        if base in self._registered_pools:
            return
        with self._pool_lock:
            if base in self._registered_pools:
                return
            start = time.monotonic()
            torch.cuda.set_device(self._device)
            err = torch.cuda.cudart().cudaHostRegister(base, store.pool_bytes, 0x2 | 0x1)
            if int(err) != 0:
                raise kvtier.KvtierError(f"cudaHostRegister of kvtier's pool failed ({err})")
            self._registered_pools.add(base)
        logger.info("kvtier: the server's pool (%.1f GiB) registered for the GPU's DMA in %.0f ms",
                    store.pool_bytes / 2**30, (time.monotonic() - start) * 1e3)

    def _unregister_pool(self, store: kvtier.ChunkStore) -> None:
        # Before its mapping goes: a later mapping at the same address is another pool.
        if store.closed:
            return
        base = store.pool_base
        with self._pool_lock:
            if base not in self._registered_pools:
                return
            self._registered_pools.discard(base)
            start = time.monotonic()
            torch.cuda.cudart().cudaHostUnregister(base)
        logger.info("kvtier: a closed connection's pool (%.1f GiB) unregistered in %.0f ms",
                    store.pool_bytes / 2**30, (time.monotonic() - start) * 1e3)

    def _kernel_ids(self, block_ids: list[int], group: int) -> list[int]:
        r = self._kernel_ratios[group]
        if r == 1:
            return block_ids
        return [SKIP_BLOCK if b == SKIP_BLOCK else b * r + i for b in block_ids for i in range(r)]

    # --- per step ----------------------------------------------------------------------------

    def step_bound(self, meta: KvtierConnectorMetadata) -> None:
        """The step's metadata arrived, before its forward pass (start_load_kv may come after
        it: vLLM 0.32+ starts asynchronous loads once the forward pass is launched)."""
        self._step_timer.start(meta.prefill_predicted_s,
                               self._device is not None and self._device.type == "cuda")

    def start_load_kv(self, meta: KvtierConnectorMetadata) -> None:
        self._layer_events = None
        layerwise = [job for job in meta.loads if job.layerwise]
        later = [job for job in meta.loads if not job.layerwise]
        if later:
            ready = None
            if self._device is not None and self._device.type == "cuda":
                ready = torch.cuda.Event()
                ready.record()  # every kernel queued so far, the previous steps' included
            for job in later:
                self._loader.put((job, ready))
        if layerwise:
            self._start_layerwise(layerwise)

    def wait_for_layer_load(self, layer_name: str) -> None:
        events = self._layer_events
        if events is None:
            return
        i = self._layer_of.get(layer_name)
        if i is not None:
            self._queue_layers(i + 1 + LAYERS_AHEAD)
            if i < len(events):  # else the load failed, its blocks are reported
                torch.cuda.current_stream().wait_event(events[i])  # the GPU waits, not the host

    def _start_layerwise(self, jobs: list[ChunkJob]) -> None:
        """Queues every layer's scatter of the jobs' chunks, pinned by the scheduler, on the
        copy stream (or copies them now, on a host KV cache)."""
        ids, addrs, failed = [], [], set()
        loaded_chunks = loaded_tokens = 0
        for job in jobs:
            store = self._server.client_of_server(job.server_started)
            slots = job.pinned_slots[self.rank] if job.pinned_slots else []
            if store is None or len(slots) != len(job.keys) or not self._layer_copiers:
                # Not expected: this worker never reached the server that pinned them.
                logger.warning("kvtier: a layer-wise load of %s has no pool to read from; vLLM "
                               "recomputes its %d chunks", job.req_id, len(job.keys))
                failed |= {b for chunk in job.block_ids for b in chunk[0] if b != SKIP_BLOCK}
                continue
            self._register_pool(store)  # done at connect; a no-op unless that failed
            for i, slot in enumerate(slots):
                ids.append(self._kernel_ids(job.block_ids[i][0], 0))
                addrs.append(store.slot_address(slot))
                loaded_tokens += self.block_size * sum(
                    1 for b in job.block_ids[i][0] if b != SKIP_BLOCK)
            loaded_chunks += len(slots)
        self._layer_events = None
        self._layer_plan = None
        if addrs:
            stream = self._load_stream
            if stream is not None:
                # Blocks just allocated may still be read by the last step's kernels.
                stream.wait_stream(torch.cuda.current_stream())
            self._layer_events = []
            blocks = {b for job in jobs for chunk in job.block_ids for b in chunk[0]
                      if b != SKIP_BLOCK}
            self._layer_plan = (ids, addrs, stream, blocks)
            # On a GPU the first layers are queued now and each later one as the forward pass
            # reaches the layer LAYERS_AHEAD before it, so that queuing (host time) overlaps
            # the compute instead of holding up the forward pass's start. Host copies are
            # synchronous: all of them now.
            if not self._queue_layers(LAYERS_AHEAD if stream is not None
                                      else len(self._layer_copiers)):
                loaded_chunks = loaded_tokens = 0
            if stream is None:
                self._layer_events = self._layer_plan = None
        with self._lock:
            self._failed_blocks |= failed
            self._stats.add("chunks_loaded", loaded_chunks)
            self._stats.add("tokens_loaded", loaded_tokens)
            self._stats.add("load_errors", sum(len(j.keys) for j in jobs) - loaded_chunks)
            self._stats.add("layerwise_loads", len(jobs))

    def _queue_layers(self, end: int) -> bool:
        """Queues the scatters of this step's layer-wise load up to layer `end` (exclusive),
        each followed by its event. False if a copy could not be queued: then what was queued
        is waited for and every block of the load is reported failed (vLLM recomputes them;
        not expected: the chunks are pinned)."""
        plan, events = self._layer_plan, self._layer_events
        if plan is None:
            return True
        ids, addrs, stream, blocks = plan
        raw = stream.cuda_stream if stream is not None else 0
        try:
            for i in range(len(events), min(end, len(self._layer_copiers))):
                off = self._layer_offsets[i]
                self._layer_copiers[i].scatter_chunks(ids, self.cfg.chunk_tokens,
                                                      [a + off for a in addrs],
                                                      self._layer_bytes[i], stream=raw)
                if stream is not None:
                    event = torch.cuda.Event()
                    event.record(stream)
                    events.append(event)
                else:
                    events.append(None)
            return True
        except kvtier.KvtierError as e:
            logger.warning("kvtier: a layer-wise load failed: %s", e)
            self._layer_plan = None
            if stream is not None:
                stream.synchronize()
            with self._lock:
                self._failed_blocks |= blocks
            return False

    def wait_for_save(self, meta: KvtierConnectorMetadata) -> None:
        # Every layer of a layer-wise load is queued by now (a layer vLLM never waited for
        # included) and the compute stream waits for the last one.
        if self._layer_plan is not None and self._queue_layers(len(self._layer_copiers)) \
                and self._layer_events:
            torch.cuda.current_stream().wait_event(self._layer_events[-1])
        self._layer_plan = None
        self._step_timer.stop()
        if not meta.saves:
            return
        ready = None
        if self._device is not None and self._device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()  # the forward pass's writes to the blocks come before this
        with self._lock:
            for job in meta.saves:
                self._pending_saves[job.req_id] = self._pending_saves.get(job.req_id, 0) + 1
                self._had_saves.add(job.req_id)
        for job in meta.saves:
            self._saver.put((job, ready))

    def handle_preemptions(self, meta: KvtierConnectorMetadata) -> None:
        """The preempted requests' blocks are about to be reused: wait for their saves only."""
        if not meta.preempted_req_ids:
            return
        with self._lock:
            self._saves_done.wait_for(lambda: not any(
                self._pending_saves.get(r) for r in meta.preempted_req_ids))
            for r in meta.preempted_req_ids:
                self._pending_saves.pop(r, None)
                self._had_saves.discard(r)
                self._finished.discard(r)

    def drain(self) -> None:
        """Waits for every queued load and save (vLLM's sleep mode frees the KV cache next)."""
        for thread in (self._loader, self._saver):
            if thread is not None:
                thread.join()

    def transfer_results(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """(finished saves, finished loads, failed loads), in one snapshot."""
        with self._lock:
            self._finished.update(r for r in finished_req_ids if r in self._had_saves)
            sending = {r for r in self._finished if not self._pending_saves.get(r)}
            for r in sending:
                self._finished.discard(r)
                self._had_saves.discard(r)
                self._pending_saves.pop(r, None)
            recving, self._loaded = self._loaded, set()
            failed, self._failed_reqs = self._failed_reqs, set()
        return sending, recving, failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def get_stats(self) -> KvtierConnectorStats | None:
        timed = self._step_timer.collect()
        with self._lock:
            for measured_s, predicted_s in timed:
                self._stats.add("prefill_steps")
                self._stats.add("prefill_measured_us", int(measured_s * 1e6))
                self._stats.add("prefill_predicted_us", int(predicted_s * 1e6))
            if self._stats.is_empty():
                return None
            stats, self._stats = self._stats, KvtierConnectorStats()
        return stats

    def shutdown(self) -> None:
        for thread in (self._loader, self._saver):
            if thread is not None:
                thread.stop()
        self._loader = self._saver = None
        if self._server is not None:
            self._server.close()
        if self._embedded_server is not None:
            self._embedded_server.stop()  # write-back: flushes L1's chunks to the file tier
            self._embedded_server = None

    # --- background jobs ---------------------------------------------------------------------

    def _copy(self, gather: bool, block_ids: list[list[int]], address: int) -> None:
        handles = []
        for g, copier in enumerate(self._save_copiers if gather else self._copiers):
            ids = self._kernel_ids(block_ids[g], g)
            where = address + self._part_offsets[g]
            if gather:
                handles.append(copier.gather(ids, self.cfg.chunk_tokens, where,
                                             self._part_bytes[g]))
            else:
                handles.append(copier.scatter(ids, self.cfg.chunk_tokens, where,
                                              self._part_bytes[g]))
        for h in handles:
            h.wait()

    def _save(self, item) -> None:
        job, ready = item
        saved = skipped = errors = 0
        try:
            store = self._get_store()
            if store is None:
                skipped = len(job.keys)
                return
            if ready is not None:
                ready.synchronize()
            slots = store.reserve_slots(job.keys)
            # A short reservation: the pool is full of pinned chunks or (write_through) of
            # chunks still waiting for their file-tier write, which it keeps.
            skipped = len(job.keys) - len(slots)
            commit = list(slots)
            for i, slot in enumerate(slots):
                if slot < 0:  # already in L1
                    skipped += 1
                    continue
                try:
                    self._copy(True, job.block_ids[i], store.slot_address(slot))
                    saved += 1
                except kvtier.KvtierError as e:
                    logger.warning("kvtier: saving a chunk of %s failed: %s", job.req_id, e)
                    store.abort_slots([slot])
                    commit[i] = -1
                    errors += 1
            store.commit_slots(job.keys[:len(slots)], commit)
        except kvtier.KvtierError as e:
            logger.warning("kvtier: saving %d chunks of %s failed: %s", len(job.keys),
                           job.req_id, e)
            errors += len(job.keys) - saved
            saved = 0
        finally:
            with self._lock:
                self._pending_saves[job.req_id] -= 1
                self._saves_done.notify_all()
                self._stats.add("chunks_saved", saved)
                self._stats.add("tokens_saved", saved * self.cfg.chunk_tokens)
                self._stats.add("saves_skipped", skipped)
                self._stats.add("save_errors", errors)

    def _load(self, item) -> None:
        job, ready = item
        loaded = 0
        start = time.monotonic()
        try:
            store = self._get_store()
            if store is not None:
                if ready is not None:
                    ready.synchronize()

                def scatter(first: int, slots: list[int]) -> None:
                    nonlocal loaded
                    try:
                        for i, slot in enumerate(slots):
                            self._copy(False, job.block_ids[first + i], store.slot_address(slot))
                            loaded += 1
                    finally:
                        store.unpin(slots)

                # In batches sized to the file tier's rate: each ends within the server's load
                # deadline, and each is copied while the next is read.
                result = self._prefix_loader.load(store, job.keys, job.disk_chunks, scatter)
                if result.file_bytes:  # the file tier's part, as this load saw it (cost.py)
                    with self._lock:
                        self._stats.add("file_read_bytes", result.file_bytes)
                        self._stats.add("file_read_us", int(result.file_s * 1e6))
                if loaded < len(job.keys):
                    logger.info("kvtier: %d of %d chunks of %s could not be loaded (%s); "
                                "vLLM recomputes them", len(job.keys) - loaded, len(job.keys),
                                job.req_id, result.message or "no longer stored")
        except kvtier.KvtierError as e:
            logger.warning("kvtier: loading %s failed after %d chunks: %s", job.req_id, loaded, e)
        finally:
            failed = {b for chunk in job.block_ids[loaded:] for b in chunk[0] if b != SKIP_BLOCK}
            tokens = sum(1 for chunk in job.block_ids[:loaded] for b in chunk[0]
                         if b != SKIP_BLOCK) * self.block_size
            with self._lock:
                if len(self._copiers) == 1:
                    self._failed_blocks |= failed
                elif loaded < len(job.keys):
                    self._failed_reqs.add(job.req_id)
                self._loaded.add(job.req_id)
                self._stats.add("chunks_loaded", loaded)
                self._stats.add("tokens_loaded", tokens)
                self._stats.add("load_errors", len(job.keys) - loaded)
            logger.debug("kvtier: loaded %d chunks of %s in %.1f ms", loaded, job.req_id,
                         (time.monotonic() - start) * 1e3)
