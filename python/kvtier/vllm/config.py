"""The connector's settings: `kv_connector_extra_config` keys, validated once.

Every key starts with ``kvtier.``; unknown keys are refused with the list of known ones, so a
typo never silently falls back to a default. docs/vllm.md documents each key.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

_PREFIX = "kvtier."


@dataclasses.dataclass(frozen=True)
class ConnectorConfig:
    # Server mode when set: every vLLM instance on the node shares one `kvtier serve`.
    socket: str | None = None
    token: str = ""
    # Separates tenants (or deployments) that share one server or directory: chunk keys of two
    # namespaces never match.
    namespace: str = ""
    chunk_tokens: int = 256
    # Names the model in chunk keys; defaults to vLLM's model name. Two instances must agree on it
    # to share chunks.
    model_id: str | None = None
    # In-process mode: the engine lives in vLLM's worker process.
    l1_size_gb: float = 4.0
    l2: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    # write_through: the engine dies with vLLM's worker, and a killed worker never flushes.
    write_policy: str = "write_through"
    eviction_policy: str = "prefix-aware"
    worker_threads: int = 2
    http_port: int = -1  # Prometheus /metrics and /stats of the in-process engine; -1: none
    # A load still waiting on the file tier this long after it started reports the chunks not
    # read by then as missing (vLLM recomputes them); kvtier serve's --load-deadline-ms. Loads
    # are asked for in batches of a quarter second of reading, so only a tier that stalls, or
    # reads one chunk slower than this, runs into it. Below rpc_timeout_ms.
    load_deadline_ms: int = 2000
    # Both modes.
    # Longer than the server's load deadline (kvtier serve --load-deadline-ms, 2000 by default;
    # in process load_deadline_ms): a load's reply waits for file-tier reads.
    rpc_timeout_ms: int = 5000
    save_decode_tokens: bool = True  # also save chunks of generated tokens (preemption, next turns)
    # How a hit reaches the GPU. auto: layer by layer within the step when every chunk of the hit
    # is in L1 and the KV cache is on a CUDA device (layer i's copy overlaps layer i-1's compute),
    # else asynchronously between steps (file-tier hits: the request waits, others run).
    # layerwise / async: always that way (layerwise also on a CPU KV cache, for tests).
    load_mode: str = "auto"
    # How a save's gather moves KV off a CUDA device: the copier's choice ("auto": for pages
    # under 64 KiB an SM kernel into device staging, then one DMA), or "dma" (the copy engines
    # only: no SM taken from the forward pass that runs beside the save), "kernel", "staged".
    save_mechanism: str = "auto"
    # Cost-aware lookups (cost.py): a file-tier hit is loaded only where reading it is predicted
    # to be faster than computing its tokens, from a prefill table (seconds to prefill prompts of
    # so many tokens on this machine) or, without one, the model's shape scaled to the prefills
    # the engine has been timed at (until the first, every hit loads); below min_file_read_gbps
    # (the file tier's read rate measured on loads) file-tier hits are never loaded.
    # cost_aware = false turns both off.
    # file_read_gbps: the file tier's read rate measured beforehand (`kvtier bench storage`),
    # the estimate before the first load and the one it decays back to; 0: an optimistic 4 GB/s.
    cost_aware: bool = True
    prefill_table: tuple = ()
    min_file_read_gbps: float = 0.0
    file_read_gbps: float = 0.0
    # KV-cache events (docs/kv-events.md): "off"; "describe" (server mode: tell `kvtier serve
    # --kv-events` vLLM's block hashes of every saved chunk, its publisher announces them); in
    # process, an object of the server's kv_events keys (endpoint, replay_endpoint, topic, ...:
    # the embedded engine publishes, the connector describes).
    kv_events: Any = "off"
    # Prefetch into L1 (docs/prefetch.md): once conversations come back at a steady pace, those
    # expected back soonest are promoted from the file tier and pinned in L1, up to
    # prefetch_fraction of its pool.
    prefetch: bool = False
    prefetch_fraction: float = 0.5

    @property
    def server_mode(self) -> bool:
        return self.socket is not None

    @property
    def describes(self) -> bool:
        """The scheduler sends descriptors of the chunks it saves."""
        if isinstance(self.kv_events, dict):  # off as vLLM's KVEventsConfig keys say it
            e = self.kv_events
            return not (e.get("enabled") is False or e.get("enable_kv_cache_events") is False
                        or e.get("publisher") == "null")
        return self.kv_events != "off"


_FIELDS = {f.name: f for f in dataclasses.fields(ConnectorConfig)}
_SERVER_ONLY = {"socket", "token"}
_IN_PROCESS_ONLY = {"l1_size_gb", "l2", "write_policy", "eviction_policy", "worker_threads",
                    "http_port", "load_deadline_ms"}


class ConfigError(ValueError):
    """A bad `kv_connector_extra_config`: the message names the key and what is accepted."""


def _kv_events(value: Any) -> str | dict[str, Any]:
    if isinstance(value, str) and value.strip().startswith("{"):
        value = json.loads(value)
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise ValueError("the object's keys must be strings")
        if "relay" in value:
            raise ValueError("\"relay\" (kvtier's events through vLLM's own publisher) is not "
                             "supported yet")
        return dict(value)
    if value in ("off", "describe"):
        return value
    if value == "vllm":
        raise ValueError("\"vllm\" (kvtier's events through vLLM's own publisher) is not "
                         "supported yet; use \"describe\" with kvtier serve --kv-events-endpoint, "
                         "or in process an object such as {\"endpoint\": \"tcp://*:5560\"}")
    raise ValueError("expected \"off\", \"describe\" (server mode) or, in process, an object "
                     "of kv_events keys such as {\"endpoint\": \"tcp://*:5560\"}")


def _coerce(name: str, value: Any) -> Any:
    field_type = _FIELDS[name].type
    try:
        if name == "kv_events":
            return _kv_events(value)
        if name == "l2":
            if isinstance(value, str):
                value = json.loads(value)
            if isinstance(value, dict):
                value = [value]
            if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
                raise ValueError("expected a JSON object (or a list of them)")
            if len(value) > 1:
                raise ValueError("one L2 tier is supported")
            return value
        if name == "prefill_table":
            from .cost import PrefillCost, parse_prefill_table

            table = tuple(parse_prefill_table(value))
            PrefillCost(list(table))  # refuses an empty or shrinking table
            return table
        if name == "socket" and value == "":
            # An empty socket means the server's default path.
            from kvtier import default_socket_path
            return default_socket_path()
        if "bool" in field_type:
            if isinstance(value, str):
                if value.lower() in ("1", "true", "yes", "on"):
                    return True
                if value.lower() in ("0", "false", "no", "off"):
                    return False
                raise ValueError("expected true or false")
            return bool(value)
        if "int" in field_type and "float" not in field_type:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError("expected an integer")
            return int(value)
        if "float" in field_type:
            return float(value)
        if not isinstance(value, str):
            raise ValueError("expected a string")
        return value
    except (TypeError, ValueError, json.JSONDecodeError) as e:
        raise ConfigError(f"kv_connector_extra_config: bad value {value!r} for "
                          f"'{_PREFIX}{name}': {e}") from None


def parse_config(extra: dict[str, Any] | None) -> ConnectorConfig:
    """Builds the config from vLLM's `kv_connector_extra_config` dict."""
    values: dict[str, Any] = {}
    for key, value in (extra or {}).items():
        if not key.startswith(_PREFIX):
            raise ConfigError(f"kv_connector_extra_config: unknown key '{key}' (kvtier's keys "
                              f"start with '{_PREFIX}': {', '.join(_known())})")
        name = key[len(_PREFIX):].replace("-", "_")
        if name not in _FIELDS:
            raise ConfigError(f"kv_connector_extra_config: unknown key '{key}'; known keys: "
                              f"{', '.join(_known())}")
        values[name] = _coerce(name, value)
    token_file = os.environ.get("KVTIER_TOKEN_FILE")
    if "token" not in values and token_file:
        with open(token_file, encoding="utf-8") as f:
            values["token"] = f.read().strip()
    config = ConnectorConfig(**values)
    mode_keys = _IN_PROCESS_ONLY if config.server_mode else _SERVER_ONLY
    wrong = sorted(k for k in values if k in mode_keys)
    if wrong:
        mode = "server mode (kvtier.socket is set)" if config.server_mode else "in-process mode"
        raise ConfigError(f"kv_connector_extra_config: {', '.join(_PREFIX + k for k in wrong)} "
                          f"do not apply in {mode}")
    if not 1 <= config.chunk_tokens <= 1 << 20:
        raise ConfigError(f"'{_PREFIX}chunk_tokens' must be in [1, 1048576], got "
                          f"{config.chunk_tokens}")
    if config.l1_size_gb <= 0:
        raise ConfigError(f"'{_PREFIX}l1_size_gb' must be positive, got {config.l1_size_gb}")
    if config.load_mode not in ("auto", "layerwise", "async"):
        raise ConfigError(f"'{_PREFIX}load_mode' must be auto, layerwise or async, got "
                          f"{config.load_mode!r}")
    if config.save_mechanism not in ("auto", "dma", "kernel", "staged"):
        raise ConfigError(f"'{_PREFIX}save_mechanism' must be auto, dma, kernel or staged, got "
                          f"{config.save_mechanism!r}")
    if not 0 < config.prefetch_fraction <= 1:
        raise ConfigError(f"'{_PREFIX}prefetch_fraction' must be in (0, 1], got "
                          f"{config.prefetch_fraction}")
    for name in ("min_file_read_gbps", "file_read_gbps"):
        if getattr(config, name) < 0:
            raise ConfigError(f"'{_PREFIX}{name}' must not be negative, got "
                              f"{getattr(config, name)}")
    if config.server_mode and isinstance(config.kv_events, dict):
        raise ConfigError(f"'{_PREFIX}kv_events' as an object configures the in-process "
                          "engine's publisher; in server mode set it to \"describe\" and give "
                          "kvtier serve the --kv-events-* flags")
    if not config.server_mode and config.kv_events == "describe":
        raise ConfigError(f"'{_PREFIX}kv_events' \"describe\" is for server mode (kvtier serve "
                          "--kv-events publishes); in process give an object of kv_events keys, "
                          "such as {\"endpoint\": \"tcp://*:5560\"}, and the embedded engine "
                          "publishes")
    if not config.server_mode and not 0 < config.load_deadline_ms < config.rpc_timeout_ms:
        raise ConfigError(f"'{_PREFIX}load_deadline_ms' must be in (0, '{_PREFIX}rpc_timeout_ms' "
                          f"= {config.rpc_timeout_ms}): a load's reply later than the RPC "
                          f"timeout breaks the connection; got {config.load_deadline_ms}")
    if config.write_policy not in ("write_back", "write_through", "none"):
        raise ConfigError(f"'{_PREFIX}write_policy' must be write_back, write_through or none, "
                          f"got {config.write_policy!r}")
    return config


def _known() -> list[str]:
    return [_PREFIX + name for name in _FIELDS]
