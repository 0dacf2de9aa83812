"""Reaching kvtier's chunk store from the connector, in either mode.

Server mode: every process connects to a `kvtier serve` shared by the node.

In-process mode: the worker runs kvtier's server inside its own process (the engine, its L1 pool
and its file tier live in vLLM's worker, as LMCache's in-process mode does), on a private
owner-only socket. The worker and the scheduler then reach it exactly as in server mode, which
matters because vLLM runs its scheduler and its workers in different processes: the scheduler's
lookups must see the worker's L1. The socket is named after the engine-core process (the
scheduler's), which is the workers' parent under vLLM's multiprocessing executor and the
workers' own process under its single-process one, so both sides find it without talking.

A server that is down or dies is retried at most every RETRY_SECONDS; meanwhile every lookup is a
miss, so vLLM keeps serving by recomputing. Each connection is also checked every RETRY_SECONDS
while idle, so that a restarted server is found and connected to before the next request, not
by it.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time

from vllm.logger import init_logger

import kvtier

from .config import ConfigError, ConnectorConfig
from .layout import layout_fingerprint

logger = init_logger("vllm.kvtier")

RETRY_SECONDS = 2.0


class Namespaces:
    """The namespaces of one vLLM deployment, from configuration alone, so that the scheduler
    and every worker (other processes) derive the same ones."""

    def __init__(self, cfg: ConnectorConfig, vllm_config, kv_cache_config):
        self._cfg = cfg
        self.model_id = cfg.model_id or vllm_config.model_config.model
        self.fingerprint = layout_fingerprint(vllm_config, kv_cache_config, cfg.chunk_tokens)
        parallel = vllm_config.parallel_config
        self.world_size = parallel.tensor_parallel_size * parallel.pipeline_parallel_size

    def keys(self, salt: str = "") -> kvtier.KeyNamespace:
        """The namespace chunk keys are chained from: identical on every rank, so the scheduler
        computes one key list for all of them. `salt` is a request's cache salt or LoRA name."""
        cfg = self._cfg
        tenant = cfg.namespace if not salt else f"{cfg.namespace}\x00{salt}"
        return kvtier.KeyNamespace(self.model_id, self.fingerprint, cfg.chunk_tokens, 0,
                                   self.world_size, tenant)

    def store(self, rank: int) -> kvtier.KeyNamespace:
        """The namespace a rank's client declares: the server keeps the ranks' shards apart."""
        cfg = self._cfg
        return kvtier.KeyNamespace(self.model_id, self.fingerprint, cfg.chunk_tokens, rank,
                                   self.world_size, cfg.namespace)


def in_process_socket(engine_core_pid: int) -> str:
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return os.path.join(base, f"kvtier-vllm-{os.getuid()}-{engine_core_pid}.sock")


def engine_core_pid(vllm_config) -> int:
    """The scheduler's process id, seen from a worker."""
    backend = vllm_config.parallel_config.distributed_executor_backend
    if backend in (None, "uni", "external_launcher") or isinstance(backend, type):
        return os.getpid()
    if backend == "mp":
        return os.getppid()
    raise ConfigError(f"kvtier in-process mode cannot run with vLLM's '{backend}' executor "
                      "(its workers are not local to the scheduler); use server mode")


def start_in_process_server(cfg: ConnectorConfig, chunk_bytes: int, socket_path: str):
    settings = {"chunk_bytes": chunk_bytes, "chunk_size": cfg.chunk_tokens,
                "l1_size_gb": cfg.l1_size_gb, "write_policy": cfg.write_policy,
                "eviction_policy": cfg.eviction_policy, "worker_threads": cfg.worker_threads,
                "socket": socket_path, "http_port": cfg.http_port,
                "load_deadline_ms": cfg.load_deadline_ms,
                # Its clients are this vLLM's scheduler and worker (one process, or two): the
                # scheduler's pins of a layer-wise load may take up to three quarters of the
                # pool (a whole long prompt), the rest stays for the worker's saves.
                "max_client_slots": max(1, int(cfg.l1_size_gb * 2**30 * 3 / 4 // chunk_bytes))}
    if isinstance(cfg.kv_events, dict):
        # The embedded engine publishes kvtier's KV-cache events (the same keys as kvtier
        # serve's --kv-events-* flags); the scheduler side describes the chunks it saves.
        settings["kv_events"] = cfg.kv_events
    if cfg.l2:
        settings["l2"] = cfg.l2
    else:
        settings["no_l2"] = True
    try:
        server = kvtier.start_server(json.dumps(settings))
    except kvtier.InvalidArgumentError as e:
        raise ConfigError(f"kvtier in-process settings refused: {e}") from None
    except kvtier.KvtierError as e:
        if getattr(e, "code", "") == "unimplemented":  # kv_events in a build without them
            raise ConfigError(f"kvtier in-process settings refused: {e}") from None
        raise
    logger.info("kvtier: in-process engine serving this vLLM instance on %s%s", socket_path,
                f", metrics on http://127.0.0.1:{server.http_port}/metrics"
                if server.http_port > 0 else "")
    return server


# How long a lost or replaced server's pool stays mapped (ServerConnection, keep_mappings).
KEEP_LOST_S = 10.0
# Two stamps of one server's start (wall clock, from its uptime) that differ by less than this
# name the same server: a restarted one takes longer to map its pool and take the socket.
SAME_SERVER_S = 0.25


def server_started(client) -> float:
    """When the server behind `client` started (wall clock), as the server says. Stamps of the
    same server taken by different processes agree within a few milliseconds."""
    return time.time() - float(client.stats()["uptime_s"])


class ServerConnection:
    """A kvtier client that reconnects in the background when the server comes back.

    With keep_mappings, a client stays open (its pool mapped) for KEEP_LOST_S after its server
    is lost or replaced: a slot pinned in a server's pool stays readable in that pool's mapping
    even after the server died (nothing else writes a pinned slot), so a load whose chunks were
    pinned just before (the step after the lookup, milliseconds) can still complete. Not longer:
    the mapping holds the lost pool's memory. on_close(client) runs before a client is closed
    (to unregister its pool from the GPU, say); on_connect(client) runs on the connecting
    thread before a new client is handed out (to register its pool with the GPU: a restarted
    server's pool is registered in the background, not in the time of the request that finds
    it), and a client it raises KvtierError for is dropped and retried later."""

    def __init__(self, cfg: ConnectorConfig, socket_path: str, ns: kvtier.KeyNamespace,
                 chunk_bytes: int, client_name: str, rpc_timeout_ms: int,
                 keep_mappings: bool = False, on_close=None, on_connect=None):
        self._cfg, self._socket, self._ns = cfg, socket_path, ns
        self._chunk_bytes, self._name = chunk_bytes, client_name
        self._rpc_timeout_ms = rpc_timeout_ms
        self._keep = keep_mappings
        self._on_close = on_close
        self._on_connect = on_connect
        self._lock = threading.Lock()
        self._client: kvtier.ServerClient | None = None
        self.started = 0.0  # the current client's server_started(), 0 if unknown
        # With keep_mappings: (server stamp, client, monotonic time it was lost or replaced or
        # None while current), newest last.
        self._kept: list[list] = []
        self._connecting = False
        self._next_attempt = 0.0
        self._logged_down = False
        self._closed = False
        self._stop = threading.Event()
        threading.Thread(target=self._watch, name="kvtier-watch", daemon=True).start()

    def connect_now(self) -> None:
        """One synchronous attempt; raises ConfigError if the server refuses this model."""
        self._connect()

    def get(self) -> kvtier.ServerClient | None:
        """The connected client, or None while the server is unreachable. Never blocks: a lost
        server is retried on a background thread at most every RETRY_SECONDS (a stalled server
        would hold a connection attempt for its whole timeout)."""
        with self._lock:
            to_close = self._expire_locked()
            client = self._client
            if client is not None and not client.connected:
                logger.warning("kvtier: lost the server at %s; recomputing until it is back",
                               self._socket)
                self._client = None
                self.started = 0.0
                self._logged_down = True
                if self._keep:
                    self._lost_locked(client)  # stays open a while in _kept
                else:
                    to_close.append(client)
            start = self._client is None and not (
                self._connecting or self._closed or time.monotonic() < self._next_attempt)
            if start:
                self._connecting = True
            current = self._client
        if to_close:  # unregistering a pool can take a while: not on the caller's time
            threading.Thread(target=lambda: [self._close_client(c) for c in to_close],
                             name="kvtier-close", daemon=True).start()
        if start:
            threading.Thread(target=self._connect_quietly, name="kvtier-connect",
                             daemon=True).start()
        return current

    def client_of_server(self, started: float) -> kvtier.ServerClient | None:
        """The client, connected or not, whose pool is that of the server started at `started`
        (a server_started() stamp); None if none is kept."""
        with self._lock:
            for stamp, client, _ in reversed(self._kept):
                if abs(stamp - started) < SAME_SERVER_S:
                    return client
        return None

    def _lost_locked(self, client) -> None:
        for entry in self._kept:
            if entry[1] is client and entry[2] is None:
                entry[2] = time.monotonic()

    def _expire_locked(self) -> list:
        """Kept clients lost or replaced more than KEEP_LOST_S ago, taken out (to be closed)."""
        now = time.monotonic()
        expired = [e[1] for e in self._kept if e[2] is not None and now - e[2] > KEEP_LOST_S]
        self._kept = [e for e in self._kept if e[1] not in expired]
        return expired

    def _close_client(self, client) -> None:
        if self._on_close is not None:
            try:
                self._on_close(client)
            except Exception:  # closing must go on
                logger.exception("kvtier: cleaning up a client before closing it failed")
        client.close()

    def _connect_quietly(self) -> None:
        try:
            self._connect()
        except ConfigError as e:
            logger.error("kvtier: %s", e)

    def _connect(self) -> None:
        client = None
        started = 0.0
        try:
            client = kvtier.connect(
                self._ns, self._chunk_bytes, socket_path=self._socket, token=self._cfg.token,
                client_name=self._name, connect_timeout_ms=min(2000, self._rpc_timeout_ms),
                rpc_timeout_ms=self._rpc_timeout_ms)
            started = server_started(client)
            if self._on_connect is not None:
                try:
                    self._on_connect(client)
                except kvtier.KvtierError:
                    self._close_client(client)
                    client = None
                    raise
        except kvtier.InvalidArgumentError as e:
            # A configuration mismatch does not heal by retrying: say what to change.
            raise ConfigError(
                f"kvtier serve at {self._socket} refused this model: {e} (this model needs "
                f"{self._chunk_bytes}-byte chunks of {self._cfg.chunk_tokens} tokens: start "
                f"kvtier serve with --chunk-bytes {self._chunk_bytes} --chunk-size "
                f"{self._cfg.chunk_tokens})") from None
        except kvtier.KvtierError as e:
            if not self._logged_down:
                logger.warning("kvtier: no server at %s (%s); recomputing until it is up",
                               self._socket, e)
                self._logged_down = True
        finally:
            with self._lock:
                self._connecting = False
                self._next_attempt = time.monotonic() + RETRY_SECONDS
                if client is not None and self._closed:
                    client, stale = None, client
                    stale.close()
                if client is not None:
                    self._client = client
                    self.started = started
                    if self._keep:
                        for entry in self._kept:  # replaced: kept a while for pinned loads
                            if entry[2] is None:
                                entry[2] = time.monotonic()
                        self._kept.append([started, client, None])
                    if self._logged_down:
                        logger.info("kvtier: connected to the server at %s", self._socket)
                        self._logged_down = False

    def _watch(self) -> None:
        """A ping every RETRY_SECONDS, and a reconnect where it failed: an idle connector
        would otherwise learn of a restarted server only at its next use, whose lookups then
        miss (and, on a GPU, whose worker would register the new pool meanwhile)."""
        while not self._stop.wait(RETRY_SECONDS):
            with self._lock:
                client = None if self._connecting else self._client
            if client is not None and client.connected:
                try:
                    client.ping()
                except kvtier.KvtierError:
                    pass  # the connection is broken now: get() sees it
            self.get()

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            client, self._client = self._client, None
            self._closed = True
            kept, self._kept = [e[1] for e in self._kept], []
        for c in kept:
            self._close_client(c)
        if client is not None and client not in kept:
            self._close_client(client)
