"""Host KvCopier: gathers and scatters between a paged cache in numpy arrays and chunks in the
canonical layout (docs/gpu-data-path.md), checked against a numpy model of that layout, for
split K/V, packed K/V and cross-layer tensors; and its argument errors."""

import numpy as np
import pytest

import kvtier

NUM_BLOCKS = 12
TPB = 4            # tokens per block
TOKEN_BYTES = 24   # one token's bytes in one page
LAYERS = 3


def split_caches(rng):
    """Per-layer tensors [2, num_blocks, tpb, token_bytes] (vLLM FlashAttention)."""
    return [rng.integers(0, 256, size=(2, NUM_BLOCKS, TPB, TOKEN_BYTES), dtype=np.uint8)
            for _ in range(LAYERS)]


def packed_caches(rng):
    """Per-layer tensors [num_blocks, 2, tpb, token_bytes] (K and V pages side by side)."""
    return [rng.integers(0, 256, size=(NUM_BLOCKS, 2, TPB, TOKEN_BYTES), dtype=np.uint8)
            for _ in range(LAYERS)]


def split_tensor(a):
    page = TPB * TOKEN_BYTES
    return kvtier.KvPageTensor(a.ctypes.data, NUM_BLOCKS, page, TOKEN_BYTES, num_components=2,
                               component_stride_bytes=NUM_BLOCKS * page)


def packed_tensor(a):
    return kvtier.KvPageTensor.packed_kv(a.ctypes.data, NUM_BLOCKS, TPB, TOKEN_BYTES)


def split_page(a, c, b):
    return a[c, b]


def packed_page(a, c, b):
    return a[b, c]


LAYOUTS = {
    "split": (split_caches, split_tensor, split_page),
    "packed": (packed_caches, packed_tensor, packed_page),
}


def model_chunk(caches, page, ids):
    """Streams in order (tensor, component); each stream's pages in block-id order."""
    parts = [page(a, c, b).reshape(-1) for a in caches for c in range(2) for b in ids]
    return np.concatenate(parts)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("as_array", [False, True])
def test_gather_scatter_round_trip(layout, as_array):
    make, describe, page = LAYOUTS[layout]
    rng = np.random.default_rng(1)
    caches = make(rng)
    copier = kvtier.KvCopier([describe(a) for a in caches], TPB)
    assert copier.tokens_per_block == TPB and copier.num_blocks == NUM_BLOCKS
    assert copier.bytes_per_token == LAYERS * 2 * TOKEN_BYTES
    assert copier.auto_mechanism == "memcpy"
    assert "3 tensors" in copier.describe()

    ids = [7, 2, 11]  # neither contiguous nor ordered, as an engine's blocks are
    num_tokens = len(ids) * TPB
    assert copier.chunk_bytes(num_tokens) == num_tokens * copier.bytes_per_token
    chunk = np.zeros(copier.chunk_bytes(num_tokens), dtype=np.uint8)
    h = copier.gather(np.array(ids, dtype=np.int64) if as_array else ids, num_tokens,
                      chunk.ctypes.data, chunk.nbytes)
    assert h.is_done() and h.event == 0 and h.mechanism == "memcpy"
    h.wait()
    np.testing.assert_array_equal(chunk, model_chunk(caches, page, ids))

    # Scatter the chunk into other blocks of an empty cache of the same shape.
    empty = [np.zeros_like(a) for a in caches]
    target = kvtier.KvCopier([describe(a) for a in empty], TPB)
    dst_ids = [0, 5, 9]
    target.scatter(dst_ids, num_tokens, chunk.ctypes.data, chunk.nbytes).wait()
    for a, e in zip(caches, empty):
        for c in range(2):
            for src_b, dst_b in zip(ids, dst_ids):
                np.testing.assert_array_equal(page(e, c, dst_b), page(a, c, src_b))
            for b in set(range(NUM_BLOCKS)) - set(dst_ids):
                assert not page(e, c, b).any()  # nothing else touched


def test_scatter_skip_block_leaves_it_alone():
    rng = np.random.default_rng(2)
    caches = split_caches(rng)
    copier = kvtier.KvCopier([split_tensor(a) for a in caches], TPB)
    before = [a.copy() for a in caches]
    chunk = np.full(copier.chunk_bytes(2 * TPB), 0xAB, dtype=np.uint8)
    copier.scatter([-1, 3], 2 * TPB, chunk.ctypes.data, chunk.nbytes).wait()
    for a, b in zip(caches, before):
        assert (a[:, 3] == 0xAB).all()
        np.testing.assert_array_equal(np.delete(a, 3, axis=1), np.delete(b, 3, axis=1))


def test_batched_chunks_match_one_call_per_chunk():
    rng = np.random.default_rng(5)
    caches = split_caches(rng)
    copier = kvtier.KvCopier([split_tensor(a) for a in caches], TPB)
    n = copier.chunk_bytes(2 * TPB)
    ids = [[3, 7], [0, 11], [5, 1]]
    out = np.zeros((3, n), dtype=np.uint8)
    addrs = [out[i].ctypes.data for i in range(3)]
    copier.gather_chunks(ids, 2 * TPB, addrs, n).wait()
    for i, chunk_ids in enumerate(ids):
        np.testing.assert_array_equal(out[i], model_chunk(caches, split_page, chunk_ids))
    # Scatter them back elsewhere; a mismatch of ids and addresses, or a bad chunk, is refused
    # before anything moves.
    before = [a.copy() for a in caches]
    with pytest.raises(TypeError):
        copier.scatter_chunks(ids[:2], 2 * TPB, addrs, n)
    with pytest.raises(kvtier.InvalidArgumentError, match="chunk 2 of 3"):
        copier.scatter_chunks([[2, 4], [6, 8], [9, 99]], 2 * TPB, addrs, n)
    for a, b in zip(caches, before):
        np.testing.assert_array_equal(a, b)
    copier.scatter_chunks([[2, 4], [6, 8], [9, 10]], 2 * TPB, addrs, n).wait()
    for i, chunk_ids in enumerate([[2, 4], [6, 8], [9, 10]]):
        np.testing.assert_array_equal(model_chunk(caches, split_page, chunk_ids), out[i])


def test_cross_layer_tensor_gives_the_same_chunk():
    rng = np.random.default_rng(3)
    # [num_blocks, layers, 2, tpb, token_bytes]: every layer of a block together.
    cross = rng.integers(0, 256, size=(NUM_BLOCKS, LAYERS, 2, TPB, TOKEN_BYTES), dtype=np.uint8)
    per_layer = [np.ascontiguousarray(cross[:, l].transpose(1, 0, 2, 3)) for l in range(LAYERS)]
    one = kvtier.KvCopier([kvtier.KvPageTensor.cross_layer(cross.ctypes.data, NUM_BLOCKS, LAYERS,
                                                           TPB, TOKEN_BYTES)], TPB)
    many = kvtier.KvCopier([kvtier.KvPageTensor.split_kv(a.ctypes.data, NUM_BLOCKS, TPB,
                                                         TOKEN_BYTES) for a in per_layer], TPB)
    ids = [4, 1]
    a = np.zeros(one.chunk_bytes(2 * TPB), dtype=np.uint8)
    b = np.zeros_like(a)
    one.gather(ids, 2 * TPB, a.ctypes.data, a.nbytes).wait()
    many.gather(ids, 2 * TPB, b.ctypes.data, b.nbytes).wait()
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, model_chunk(per_layer, split_page, ids))


def test_gather_into_a_store_slot():
    rng = np.random.default_rng(4)
    caches = packed_caches(rng)
    copier = kvtier.KvCopier([packed_tensor(a) for a in caches], TPB)
    ns = kvtier.KeyNamespace("copier/model", chunk_tokens=2 * TPB)
    chunk_bytes = copier.chunk_bytes(2 * TPB)
    with kvtier.open_engine(ns, chunk_bytes, l1_size_gb=0.001) as store:
        keys = kvtier.chunk_keys(ns, range(2 * TPB))
        slots = store.reserve_slots(keys)
        copier.gather([6, 8], 2 * TPB, store.slot_address(slots[0]), store.chunk_bytes).wait()
        store.commit_slots(keys, slots)
        r = store.prepare_load(keys).wait()
        empty = [np.zeros_like(a) for a in caches]
        kvtier.KvCopier([packed_tensor(a) for a in empty], TPB).scatter(
            [1, 2], 2 * TPB, store.slot_address(r.slots[0]), store.chunk_bytes).wait()
        store.unpin(r.slots)
    for a, e in zip(caches, empty):
        np.testing.assert_array_equal(e[[1, 2]], a[[6, 8]])


def test_errors():
    rng = np.random.default_rng(5)
    caches = split_caches(rng)
    copier = kvtier.KvCopier([split_tensor(a) for a in caches], TPB)
    chunk = np.zeros(copier.chunk_bytes(2 * TPB), dtype=np.uint8)
    addr, size = chunk.ctypes.data, chunk.nbytes
    invalid = kvtier.InvalidArgumentError
    with pytest.raises(invalid):
        copier.gather([0, NUM_BLOCKS], 2 * TPB, addr, size)  # block id out of range
    with pytest.raises(invalid):
        copier.gather([0, -1], 2 * TPB, addr, size)  # skipping is for scatters only
    with pytest.raises(invalid):
        copier.gather([0], 2 * TPB, addr, size)  # fewer ids than blocks
    with pytest.raises(invalid):
        copier.gather([0, 1], 2 * TPB - 1, addr, size)  # a partial block
    with pytest.raises(invalid):
        copier.gather([0, 1], 2 * TPB, addr, size - 1)  # no room
    with pytest.raises(invalid):
        copier.gather([0, 1], 2 * TPB, 0, size)  # no buffer
    with pytest.raises(invalid):
        copier.scatter([3, 3], 2 * TPB, addr, size)  # duplicate ids race for one page
    with pytest.raises(invalid):
        copier.scatter([0, 1], 2 * TPB, addr, size + 1)  # not exactly one chunk
    with pytest.raises(invalid, match="out of range"):
        copier.gather([0, 2**64], 2 * TPB, addr, size)
    with pytest.raises(TypeError):
        copier.gather(["a", "b"], 2 * TPB, addr, size)
    with pytest.raises(invalid):
        copier.gather(np.array([0.0, 1.0]), 2 * TPB, addr, size)
    # Descriptions are validated once, when the copier is made.
    with pytest.raises(invalid):
        kvtier.KvCopier([], TPB)
    with pytest.raises(invalid):
        kvtier.KvCopier([split_tensor(caches[0])], 0)
    with pytest.raises(invalid):
        kvtier.KvCopier([split_tensor(caches[0]), split_tensor(caches[0])], TPB)  # overlap
    with pytest.raises(invalid):
        kvtier.KvCopier([kvtier.KvPageTensor(0, NUM_BLOCKS, 96, TOKEN_BYTES)], TPB)  # null base
    with pytest.raises(invalid):
        kvtier.KvCopier([split_tensor(caches[0])], TPB, mechanism="teleport")
    dma = kvtier.KvCopier([split_tensor(caches[0])], TPB, mechanism="dma")
    with pytest.raises(invalid):
        dma.gather([0, 1], 2 * TPB, addr, size)  # a host cache is copied with memcpy only
    # A CUDA copier: not built here, or no device, or host memory where device memory is due.
    with pytest.raises(kvtier.KvtierError) as e:
        kvtier.KvCopier([split_tensor(caches[0])], TPB, device=0)
    if not kvtier.cuda_built():
        assert e.value.code == "unimplemented"
