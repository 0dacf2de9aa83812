"""Opening kvtier's chunk store for the connector, in either mode, and keeping it open.

Server mode connects to `kvtier serve`; a server that is down or dies is retried at most every
`RETRY_SECONDS`, and meanwhile every lookup is a miss, so vLLM keeps serving by recomputing.
In-process mode opens an Engine in the worker process and registers it here, so that the
scheduler-side connector (same process with vLLM's single-process executor) answers lookups
from the same index.
"""

from __future__ import annotations

from vllm.logger import init_logger
import threading
import time

import kvtier

from .config import ConfigError, ConnectorConfig

logger = init_logger("vllm.kvtier")

RETRY_SECONDS = 2.0

# In-process engines of this process, by store namespace id.
_ENGINES: dict[str, kvtier.ChunkStore] = {}
_ENGINES_LOCK = threading.Lock()


def key_namespace(cfg: ConnectorConfig, model_id: str, fingerprint: int, world_size: int,
                  salt: str = "") -> kvtier.KeyNamespace:
    """The namespace chunk keys are chained from: identical on every rank, so the scheduler
    computes one key list for all of them. `salt` is a request's cache salt or LoRA name."""
    tenant = cfg.namespace if not salt else f"{cfg.namespace}\x00{salt}"
    return kvtier.KeyNamespace(model_id, fingerprint, cfg.chunk_tokens, 0, world_size, tenant)


def store_namespace(cfg: ConnectorConfig, model_id: str, fingerprint: int, rank: int,
                    world_size: int) -> kvtier.KeyNamespace:
    """The namespace a rank's store is opened with: separates the ranks' shards."""
    return kvtier.KeyNamespace(model_id, fingerprint, cfg.chunk_tokens, rank, world_size,
                               cfg.namespace)


def open_in_process(cfg: ConnectorConfig, ns: kvtier.KeyNamespace,
                    chunk_bytes: int) -> kvtier.ChunkStore:
    with _ENGINES_LOCK:
        store = _ENGINES.get(ns.id())
        if store is None:
            store = kvtier.open_engine(
                ns, chunk_bytes, l1_size_gb=cfg.l1_size_gb, l2=cfg.l2[0] if cfg.l2 else None,
                write_policy=cfg.write_policy, eviction_policy=cfg.eviction_policy,
                load_deadline_ms=cfg.load_deadline_ms, worker_threads=cfg.worker_threads)
            _ENGINES[ns.id()] = store
        elif store.chunk_bytes != chunk_bytes:
            raise ConfigError(f"an in-process kvtier engine for this namespace already uses "
                              f"{store.chunk_bytes}-byte chunks, not {chunk_bytes}")
        return store


def registered_engine(ns: kvtier.KeyNamespace) -> kvtier.ChunkStore | None:
    with _ENGINES_LOCK:
        return _ENGINES.get(ns.id())


def close_in_process(ns: kvtier.KeyNamespace) -> None:
    with _ENGINES_LOCK:
        store = _ENGINES.pop(ns.id(), None)
    if store is not None:
        store.close()  # writes back dirty chunks to L2 (write_back)


class ServerConnection:
    """A `kvtier serve` client that reconnects when the server comes back."""

    def __init__(self, cfg: ConnectorConfig, ns: kvtier.KeyNamespace, chunk_bytes: int,
                 client_name: str):
        self._cfg, self._ns, self._chunk_bytes, self._name = cfg, ns, chunk_bytes, client_name
        self._lock = threading.Lock()
        self._client: kvtier.ServerClient | None = None
        self._next_attempt = 0.0
        self._logged_down = False

    def get(self) -> kvtier.ServerClient | None:
        """The connected client, or None while the server is unreachable (never blocks longer
        than one connection attempt, and tries at most every RETRY_SECONDS)."""
        with self._lock:
            if self._client is not None and self._client.connected:
                return self._client
            if self._client is not None:
                logger.warning("kvtier: lost the server at %s; recomputing until it is back",
                               self._cfg.socket)
                self._client = None
                self._logged_down = True
            now = time.monotonic()
            if now < self._next_attempt:
                return None
            self._next_attempt = now + RETRY_SECONDS
            try:
                self._client = kvtier.connect(
                    self._ns, self._chunk_bytes, socket_path=self._cfg.socket,
                    token=self._cfg.token, client_name=self._name,
                    connect_timeout_ms=min(2000, self._cfg.rpc_timeout_ms),
                    rpc_timeout_ms=self._cfg.rpc_timeout_ms)
            except kvtier.InvalidArgumentError as e:
                # A configuration mismatch will not heal by retrying: say what to change.
                raise ConfigError(f"kvtier serve at {self._cfg.socket} refused this model: {e} "
                                  f"(this model needs {self._chunk_bytes}-byte chunks of "
                                  f"{self._cfg.chunk_tokens} tokens: start kvtier serve with "
                                  f"--chunk-bytes {self._chunk_bytes})") from None
            except kvtier.KvtierError as e:
                if not self._logged_down:
                    logger.warning("kvtier: no server at %s (%s); recomputing until it is up",
                                   self._cfg.socket, e)
                    self._logged_down = True
                return None
            if self._logged_down:
                logger.info("kvtier: connected to the server at %s", self._cfg.socket)
                self._logged_down = False
            return self._client

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()
