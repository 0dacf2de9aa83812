"""kvtier's vLLM integration: `kv_connector_module_path: "kvtier.vllm"` finds KvtierConnector here.

Imports vLLM; the rest of the kvtier package does not.
"""

from .connector import KvtierConnector

__all__ = ["KvtierConnector"]
