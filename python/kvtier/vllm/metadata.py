"""What the scheduler-side connector tells the workers each step (pickled across processes)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

# A block id that the copier leaves untouched (kvtier's kSkipBlock): the engine's own prefix
# cache already holds that block, possibly shared with running requests.
SKIP_BLOCK = -1


@dataclass
class ChunkJob:
    """Chunks of one request to load or save.

    keys[i] is chunk i's key (the same on every tensor-parallel rank: each rank's store scopes it
    by the rank's namespace); block_ids[i][group] lists the vLLM blocks holding chunk i's tokens in
    KV cache group `group` (SKIP_BLOCK: leave as is)."""

    req_id: str
    keys: list[bytes]
    block_ids: list[list[list[int]]]
    # A load done within the step, layer by layer; else between steps.
    layerwise: bool = False
    # A layer-wise load's chunks, pinned in the L1 pool by the scheduler when it looked them up
    # (so that nothing can evict them before the step runs): pinned_slots[rank][i] is chunk i's
    # slot in that rank's pool. The scheduler releases the pins once the step has run.
    pinned_slots: list[list[int]] | None = None
    # The server holding the pins (its start, store.server_started): a worker reads their slots
    # in that server's pool, even after the server is gone or replaced.
    server_started: float = 0.0
    # Chunks of this load expected from the file tier (its read rate is measured on them).
    disk_chunks: int = 0


@dataclass
class KvtierConnectorMetadata(KVConnectorMetadata):
    loads: list[ChunkJob] = field(default_factory=list)
    saves: list[ChunkJob] = field(default_factory=list)
    # Requests preempted this step: their blocks are freed, so pending saves must finish first.
    preempted_req_ids: set[str] = field(default_factory=set)
    # The step's prefill compute as the cost model's table predicts it (0: not timed): the workers
    # time the step and report both, and the model learns how far off its table is (cost.py).
    prefill_predicted_s: float = 0.0
