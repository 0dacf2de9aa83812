"""kvtier: a KV-cache offload engine for LLM inference.

The attention KV cache an inference engine would throw away is kept in host memory (L1) and on
local or shared storage (L2), and handed back faster than the GPU can recompute it. This package
exposes the C++ core (``kvtier._native``):

* chunk keys: ``KeyNamespace``, ``chain_chunk_key``, ``chunk_keys``;
* stores: ``open_engine`` (an engine in this process) and ``connect`` (a ``kvtier serve`` daemon),
  both ``ChunkStore``s with asynchronous ``store``/``load`` and zero-copy slot access;
  ``start_server`` runs ``kvtier serve`` inside this process;
* the file tier alone: ``open_file_tier`` (a ``FileTier`` moving chunks between its files and a
  buffer the caller owns, for systems with a host-memory tier of their own);
* the GPU data path: ``KvPageTensor``, ``KvCopier`` (paged KV cache <-> chunks).

Errors raise ``KvtierError`` (``InvalidArgumentError``, also a ``ValueError``, for bad
arguments); operation results (``OpResult``) report failures as values.
"""

from kvtier._native import (
    AsyncOp,
    ChunkStore,
    CopyHandle,
    FileTier,
    InvalidArgumentError,
    KeyNamespace,
    KvCopier,
    KvPageTensor,
    KvtierError,
    OpResult,
    Server,
    ServerClient,
    __version__,
    chain_chunk_key,
    chunk_keys,
    connect,
    cuda_built,
    default_socket_path,
    open_engine,
    open_file_tier,
    start_server,
)

__all__ = [
    "AsyncOp",
    "ChunkStore",
    "CopyHandle",
    "FileTier",
    "InvalidArgumentError",
    "KeyNamespace",
    "KvCopier",
    "KvPageTensor",
    "KvtierError",
    "OpResult",
    "Server",
    "ServerClient",
    "__version__",
    "chain_chunk_key",
    "chunk_keys",
    "connect",
    "cuda_built",
    "default_socket_path",
    "open_engine",
    "open_file_tier",
    "start_server",
]
