"""Chunk keys from Python: the golden vectors of src/common/chunk_key_test.cc (they define the
encoding, docs/chunk-key.md), every accepted token container, and chunk_keys against a chain of
chain_chunk_key calls."""

import array
import pickle

import numpy as np
import pytest

import kvtier

ROOT = "6419fe86545df15be8b9b84c81eed28c8d52bd3b7939905bfd0eecd7bcdf26cb"
KEY0 = "ce919b35813315db02e8aa3a855099822bd33aa689c5ef5967e0131286d47f59"
KEY1 = "44667d31cd41b57d1286342a2de3f7e3f11ba799c02cb8842449f2925c2689ad"
CHAIN_123 = "3db346a400ab6b8db792fcf156443a8885b27db208362dcf77084f8c7648e645"


def qwen(**overrides):
    fields = dict(model_id="Qwen/Qwen3-8B", layout_fingerprint=0x0123456789ABCDEF, chunk_tokens=4)
    fields.update(overrides)
    return kvtier.KeyNamespace(**fields)


def test_golden_vectors():
    ns = qwen()
    assert ns.root().hex() == ROOT
    assert ns.id() == ROOT[:16]
    keys = kvtier.chunk_keys(ns, list(range(10)))
    assert [k.hex() for k in keys] == [KEY0, KEY1]  # the trailing 2 tokens form no full chunk
    assert kvtier.chain_chunk_key(bytes(32), [1, 2, 3]).hex() == CHAIN_123


@pytest.mark.parametrize("make", [
    lambda v: v,
    lambda v: tuple(v),
    lambda v: array.array("I", v),
    lambda v: array.array("i", v),
    lambda v: array.array("q", v),
    lambda v: np.array(v, dtype=np.uint32),
    lambda v: np.array(v, dtype=np.int64),
    lambda v: np.array(v, dtype=np.int16),
    lambda v: memoryview(array.array("I", v)),
    lambda v: [np.int64(x) for x in v],
])
def test_token_containers(make):
    assert [k.hex() for k in kvtier.chunk_keys(qwen(), make(list(range(10))))] == [KEY0, KEY1]
    assert kvtier.chain_chunk_key(bytes(32), make([1, 2, 3])).hex() == CHAIN_123


def test_torch_tensor_tokens():
    torch = pytest.importorskip("torch")
    for dtype in (torch.int32, torch.int64):
        keys = kvtier.chunk_keys(qwen(), torch.arange(10, dtype=dtype))
        assert [k.hex() for k in keys] == [KEY0, KEY1]


def test_chunk_keys_match_the_chain():
    ns = qwen(chunk_tokens=16, tenant_salt="t")
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, 2**32, size=16 * 9 + 5, dtype=np.uint64).astype(np.uint32)
    keys = kvtier.chunk_keys(ns, tokens)
    assert len(keys) == 9
    prev = ns.root()
    for i, key in enumerate(keys):
        prev = kvtier.chain_chunk_key(prev, tokens[i * 16:(i + 1) * 16])
        assert key == prev
        assert isinstance(key, bytes) and len(key) == 32
    # A longer sequence extends, never changes, the keys of its prefix.
    assert kvtier.chunk_keys(ns, tokens[:16 * 4]) == keys[:4]


def test_every_namespace_field_separates():
    variants = [qwen(), qwen(model_id="Qwen/Qwen3-8B-FP8"), qwen(layout_fingerprint=1),
                qwen(chunk_tokens=8), qwen(rank=1, world_size=2), qwen(world_size=2),
                qwen(tenant_salt="tenant-a")]
    assert len({ns.root() for ns in variants}) == len(variants)


def test_namespace_fields_are_read_only_values():
    ns = qwen(rank=1, world_size=4, tenant_salt="s")
    assert (ns.model_id, ns.layout_fingerprint, ns.chunk_tokens, ns.rank, ns.world_size,
            ns.tenant_salt) == ("Qwen/Qwen3-8B", 0x0123456789ABCDEF, 4, 1, 4, "s")
    with pytest.raises(AttributeError):
        ns.rank = 0
    assert ns == qwen(rank=1, world_size=4, tenant_salt="s")
    assert hash(ns) == hash(qwen(rank=1, world_size=4, tenant_salt="s"))
    assert ns != qwen()
    copy = pickle.loads(pickle.dumps(ns))
    assert copy == ns and copy.root() == ns.root()
    assert "Qwen/Qwen3-8B" in repr(ns)


@pytest.mark.parametrize("fields", [
    dict(model_id=""),
    dict(chunk_tokens=0),
    dict(chunk_tokens=(1 << 20) + 1),
    dict(rank=2, world_size=2),
    dict(model_id="x" * 2000),
])
def test_invalid_namespaces_raise(fields):
    with pytest.raises(kvtier.InvalidArgumentError) as e:
        qwen(**fields)
    assert e.value.code == "invalid_argument"
    assert isinstance(e.value, ValueError) and isinstance(e.value, kvtier.KvtierError)
    assert e.value.message and str(e.value) == e.value.message


def test_bad_arguments_raise():
    with pytest.raises(kvtier.InvalidArgumentError, match="32 bytes"):
        kvtier.chain_chunk_key(bytes(31), [1])
    with pytest.raises(kvtier.InvalidArgumentError, match="empty"):
        kvtier.chain_chunk_key(bytes(32), [])
    with pytest.raises(kvtier.InvalidArgumentError, match="uint32"):
        kvtier.chunk_keys(qwen(), [1, 2, 3, -1])
    with pytest.raises(kvtier.InvalidArgumentError, match="uint32"):
        kvtier.chunk_keys(qwen(), [1, 2, 3, 2**32])
    with pytest.raises(kvtier.InvalidArgumentError, match="out of range"):
        kvtier.chunk_keys(qwen(), [2**70])
    with pytest.raises(kvtier.InvalidArgumentError, match="integers"):
        kvtier.chunk_keys(qwen(), np.zeros(8, dtype=np.float32))
    with pytest.raises(TypeError):
        kvtier.chunk_keys(qwen(), ["a"])
    with pytest.raises(TypeError):
        kvtier.chunk_keys(qwen(), 5)
    with pytest.raises(TypeError):
        kvtier.chain_chunk_key("not bytes", [1])
