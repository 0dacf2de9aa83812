"""kvtier's vLLM integration: `kv_connector_module_path: "kvtier.vllm"` finds KvtierConnector here.

The connector imports vLLM, so it is loaded on first use: the layout code (kvtier.vllm.layout)
works without vLLM installed.
"""

__all__ = ["KvtierConnector"]


def __getattr__(name):
    if name == "KvtierConnector":
        from .connector import KvtierConnector

        return KvtierConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
