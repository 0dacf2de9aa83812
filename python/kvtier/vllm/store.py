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
miss, so vLLM keeps serving by recomputing.
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
                "socket": socket_path, "http_port": cfg.http_port}
    if cfg.l2:
        settings["l2"] = cfg.l2
    else:
        settings["no_l2"] = True
    try:
        server = kvtier.start_server(json.dumps(settings))
    except kvtier.InvalidArgumentError as e:
        raise ConfigError(f"kvtier in-process settings refused: {e}") from None
    logger.info("kvtier: in-process engine serving this vLLM instance on %s%s", socket_path,
                f", metrics on http://127.0.0.1:{server.http_port}/metrics"
                if server.http_port > 0 else "")
    return server


class ServerConnection:
    """A kvtier client that reconnects in the background when the server comes back."""

    def __init__(self, cfg: ConnectorConfig, socket_path: str, ns: kvtier.KeyNamespace,
                 chunk_bytes: int, client_name: str, rpc_timeout_ms: int):
        self._cfg, self._socket, self._ns = cfg, socket_path, ns
        self._chunk_bytes, self._name = chunk_bytes, client_name
        self._rpc_timeout_ms = rpc_timeout_ms
        self._lock = threading.Lock()
        self._client: kvtier.ServerClient | None = None
        self._connecting = False
        self._next_attempt = 0.0
        self._logged_down = False
        self._closed = False

    def connect_now(self) -> None:
        """One synchronous attempt; raises ConfigError if the server refuses this model."""
        self._connect()

    def get(self) -> kvtier.ServerClient | None:
        """The connected client, or None while the server is unreachable. Never blocks: a lost
        server is retried on a background thread at most every RETRY_SECONDS (a stalled server
        would hold a connection attempt for its whole timeout)."""
        with self._lock:
            client = self._client
            if client is not None and client.connected:
                return client
            if client is not None:
                logger.warning("kvtier: lost the server at %s; recomputing until it is back",
                               self._socket)
                self._client = None
                self._logged_down = True
            if self._connecting or self._closed or time.monotonic() < self._next_attempt:
                return None
            self._connecting = True
        if client is not None:
            client.close()
        threading.Thread(target=self._connect_quietly, name="kvtier-connect", daemon=True).start()
        return None

    def _connect_quietly(self) -> None:
        try:
            self._connect()
        except ConfigError as e:
            logger.error("kvtier: %s", e)

    def _connect(self) -> None:
        client = None
        try:
            client = kvtier.connect(
                self._ns, self._chunk_bytes, socket_path=self._socket, token=self._cfg.token,
                client_name=self._name, connect_timeout_ms=min(2000, self._rpc_timeout_ms),
                rpc_timeout_ms=self._rpc_timeout_ms)
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
                    if self._logged_down:
                        logger.info("kvtier: connected to the server at %s", self._socket)
                        self._logged_down = False

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
            self._closed = True
        if client is not None:
            client.close()
