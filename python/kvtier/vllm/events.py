"""Descriptors for kvtier's KV-cache events: vLLM's block hashes of each chunk the connector saves.

kvtier publishes what its tiers hold as vLLM's own KV-cache events (docs/kv-events.md), under the
block hashes vLLM gives the same tokens. kvtier's chunk keys cannot be turned into those hashes
(they share nothing but the tokens, and vLLM's depend on settings kvtier cannot see), so the
scheduler side, which holds both, records them when it hands a chunk to the workers to save: the
descriptor of chunk i is blocks i*n .. i*n+n-1 of `request.block_hashes`, seen at the KV cache
group's block size and converted as vLLM's events convert them (n = chunk_tokens / block_size),
with block i*n-1's hash as parent, and the extra keys and LoRA fields vLLM publishes.

The scheduler loop only takes the hashes and tokens out of the request (list slices) and queues
them; a background thread encodes the descriptors and sends them on rank 0's connection (the
server files one descriptor for the shards of every rank). A full queue drops descriptors,
counted: those chunks are stored and served as ever, only not announced.
"""

from __future__ import annotations

import array
import queue
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import msgspec

from vllm.logger import init_logger

import kvtier

from .compat import EventHashing

logger = init_logger("vllm.kvtier")

# Chunks queued for the describer thread (a few KB each): past this the scheduler drops them.
MAX_PENDING = 4096
# Descriptors per describe call.
BATCH = 64

_encoder = msgspec.msgpack.Encoder()


@dataclass(slots=True)
class ChunkHashes:
    """What a descriptor needs of the request, taken in the scheduler loop."""

    key: bytes
    index: int
    hashes: list  # vLLM's digests of the chunk's blocks, at the group's block size
    parent: Any  # the digest of the block before the chunk; None for chunk 0
    tokens: list[int] | None  # the chunk's token ids, None when events carry none
    request: Any  # for its LoRA and extra keys (fields that never change)


def chunk_hashes(hashing: EventHashing, request: Any, keys: list[bytes], first: int,
                 chunk_tokens: int, block_size: int, hash_block_size: int,
                 token_ids: bool = True) -> list[ChunkHashes]:
    """Chunks [first, first + len(keys)) of the request, as far as vLLM has hashed their
    blocks (prefix caching off: none)."""
    n = chunk_tokens // block_size
    blocks = hashing.resolve(request.block_hashes, hash_block_size, block_size)
    tokens = request.all_token_ids
    out = []
    for j, key in enumerate(keys):
        i = first + j
        if len(blocks) < (i + 1) * n:
            break
        lo = i * n
        out.append(ChunkHashes(
            key, i, list(blocks[lo:lo + n]), blocks[lo - 1] if lo else None,
            tokens[i * chunk_tokens:(i + 1) * chunk_tokens] if token_ids else None, request))
    return out


def _pack_tokens(tokens: list[int]) -> bytes:
    packed = array.array("I", tokens)  # 32-bit on every platform vLLM runs on
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def encode_descriptor(hashing: EventHashing, chunk: ChunkHashes, block_size: int,
                      group_idx: int) -> bytes:
    """The chunk's descriptor, the msgpack map the server's describe takes (docs/kv-events.md,
    "The descriptor")."""
    request = chunk.request
    lora = request.lora_request
    desc: dict[str, Any] = {
        "index": chunk.index,
        "block_size": block_size,
        "group_idx": group_idx,
        "block_hashes": [hashing.convert(h) for h in chunk.hashes],
        "parent_block_hash": None if chunk.parent is None else hashing.convert(chunk.parent),
    }
    if chunk.tokens is not None:
        desc["token_ids"] = _pack_tokens(chunk.tokens)
    desc["lora_id"] = lora.adapter_id if lora is not None else None
    desc["lora_name"] = lora.name if lora is not None else None
    # Per block, as vLLM's block pool builds them for its own events (only chunk 0's first block
    # carries a cache salt; every block a LoRA name).
    start = chunk.index * len(chunk.hashes) * block_size
    extra = [hashing.extra_keys(request, start + b * block_size, start + (b + 1) * block_size,
                                0)[0]
             for b in range(len(chunk.hashes))]
    if any(k is not None for k in extra):
        if hashing.to_event_extra_keys is not None:
            extra = hashing.to_event_extra_keys(extra)
        desc["extra_keys"] = _encoder.encode(extra)
    return _encoder.encode(desc)


class Describer:
    """Sends descriptors of saved chunks from a background thread; the scheduler loop only
    queues them (`add`), never waits."""

    def __init__(self, hashing: EventHashing, client: Callable[[], Any],
                 count: Callable[[str, int], None], chunk_tokens: int, block_size: int,
                 hash_block_size: int, group_idx: int, token_ids: bool = True):
        self._hashing = hashing
        self._client = client  # rank 0's connected client, or None
        self._count = count
        self._chunk_tokens, self._block_size = chunk_tokens, block_size
        self._hash_block_size, self._group_idx = hash_block_size, group_idx
        self._token_ids = token_ids
        self._queue: queue.Queue[ChunkHashes | None] = queue.Queue(MAX_PENDING)
        self._warned: set[str] = set()
        self._thread = threading.Thread(target=self._run, name="kvtier-describe", daemon=True)
        self._thread.start()

    def add(self, request: Any, keys: list[bytes], first: int) -> None:
        """Chunks [first, first + len(keys)) of the request are being handed to the workers to
        save under `keys`. Runs in the scheduler loop."""
        chunks = chunk_hashes(self._hashing, request, keys, first, self._chunk_tokens,
                              self._block_size, self._hash_block_size, self._token_ids)
        if len(chunks) < len(keys):
            self._warn_once("unhashed", "kvtier: vLLM has no block hashes for some saved chunks "
                            "(prefix caching off?): they are stored but not announced in KV "
                            "events")
            self._count("describes_dropped", len(keys) - len(chunks))
        for i, chunk in enumerate(chunks):
            try:
                self._queue.put_nowait(chunk)
            except queue.Full:
                self._count("describes_dropped", len(chunks) - i)
                self._warn_once("full", "kvtier: the describe queue is full; descriptors are "
                                "dropped (those chunks are stored but not announced)")
                return

    def _warn_once(self, what: str, message: str, *args) -> None:
        if what not in self._warned:
            self._warned.add(what)
            logger.warning(message, *args)

    def _run(self) -> None:
        while True:
            chunk = self._queue.get()
            if chunk is None:
                return
            batch = [chunk]
            while len(batch) < BATCH:
                try:
                    chunk = self._queue.get_nowait()
                except queue.Empty:
                    break
                if chunk is None:
                    self._send(batch)
                    return
                batch.append(chunk)
            self._send(batch)

    def _send(self, batch: list[ChunkHashes]) -> None:
        try:
            descriptors = []
            for c in batch:
                descriptors.append(encode_descriptor(self._hashing, c, self._block_size,
                                                     self._group_idx))
                # Tens of microseconds of Python each: the GIL goes back to the scheduler loop
                # between chunks, not after the interpreter's 5 ms switch interval.
                time.sleep(0)
        except Exception:  # a request shaped unlike any vLLM read: never the scheduler's problem
            logger.exception("kvtier: encoding %d chunk descriptors failed", len(batch))
            self._count("describes_dropped", len(batch))
            return
        client = self._client()
        if client is None:  # the server is down: lookups miss and saves fail as well
            self._count("describes_dropped", len(batch))
            return
        try:
            client.describe([c.key for c in batch], descriptors)
        except (kvtier.KvtierError, AttributeError) as e:  # AttributeError: a kvtier without it
            self._count("describes_dropped", len(batch))
            self._warn_once("failed", "kvtier: describing chunks failed (%s); those chunks are "
                            "stored but not announced in KV events", e)
            return
        self._count("chunks_described", len(batch))

    def close(self) -> None:
        try:
            self._queue.put_nowait(None)
        except queue.Full:  # the thread is a daemon: it goes with the process
            return
        self._thread.join(timeout=2)
