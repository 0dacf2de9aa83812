"""The CUDA copier from Python, the way the vLLM connector drives it: a paged KV cache of CUDA
tensors described by kvtier.vllm.layout, chunks gathered straight into slots of a kvtier pool
registered with CUDA, and scattered back (with skipped blocks). Skipped without a GPU."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
import kvtier  # noqa: E402
from kvtier.vllm.layout import describe_group  # noqa: E402

pytestmark = pytest.mark.skipif(
    not (kvtier.cuda_built() and torch.cuda.is_available()),
    reason="needs a CUDA build of kvtier and a GPU")

BLOCKS, TOKENS, HEADS, CONTENT, LAYERS = 64, 16, 8, 256, 4  # CONTENT: K and V of a 128-dim head


def cuda_cache(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return {f"layers.{i}.attn": torch.randn(BLOCKS, HEADS, TOKENS, CONTENT, device="cuda",
                                            dtype=torch.bfloat16, generator=g)
            for i in range(LAYERS)}


def copier_for(layers):
    tensors, ratio = describe_group(list(layers), layers, BLOCKS, TOKENS)
    assert ratio == 1
    return kvtier.KvCopier([kvtier.KvPageTensor(**t) for t in tensors], TOKENS, device=0)


def reference(layers, ids):
    return torch.cat([t[ids][:, h].reshape(-1).view(torch.uint8).cpu()
                      for t in layers.values() for h in range(HEADS)])


def test_round_trip_through_a_registered_pool(tmp_path):
    src, dst = cuda_cache(1), cuda_cache(2)
    copy_src, copy_dst = copier_for(src), copier_for(dst)
    n = 4 * TOKENS
    chunk_bytes = copy_src.chunk_bytes(n)
    ns = kvtier.KeyNamespace("cuda-test", 1, n)
    with kvtier.open_engine(ns, chunk_bytes, l1_size_gb=0.0625) as store:
        cudart = torch.cuda.cudart()
        assert int(cudart.cudaHostRegister(store.pool_base, store.pool_bytes, 3)) == 0
        try:
            keys = [bytes([i]) * 32 for i in range(3)]
            chunks = [[7, 3, 60, 12], [0, 1, 2, 5], [40, 41, 42, 43]]
            slots = store.reserve_slots(keys)
            assert len(slots) == 3 and all(s >= 0 for s in slots)
            for ids, slot in zip(chunks, slots):
                h = copy_src.gather(ids, n, store.slot_address(slot), chunk_bytes)
                h.wait()
                view = torch.frombuffer(store.slot_view(slot), dtype=torch.uint8)
                assert torch.equal(view, reference(src, ids))
            store.commit_slots(keys, slots)

            result = store.prepare_load(keys).wait()
            assert result.ok and result.chunks == 3
            targets = [[9, 8, 7, 6], [kvtier_skip(), kvtier_skip(), 20, 21], [30, 31, 32, 33]]
            before = {k: v.clone() for k, v in dst.items()}
            for ids, slot in zip(targets, result.slots):
                copy_dst.scatter(ids, n, store.slot_address(slot), chunk_bytes).wait()
            store.unpin(result.slots)
            for ids_src, ids_dst in zip(chunks, targets):
                for j, (a, b) in enumerate(zip(ids_src, ids_dst)):
                    for name in src:
                        if b < 0:
                            continue
                        assert torch.equal(dst[name][b], src[name][a]), (name, a, b)
            # Skipped blocks and every block not written are as they were.
            written = {b for ids in targets for b in ids if b >= 0}
            for name in dst:
                for b in range(BLOCKS):
                    if b not in written:
                        assert torch.equal(dst[name][b], before[name][b])
        finally:
            torch.cuda.synchronize()
            cudart.cudaHostUnregister(store.pool_base)


def kvtier_skip() -> int:
    return -1  # kvtier's kSkipBlock
