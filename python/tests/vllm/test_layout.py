"""The connector's reading of vLLM's KV cache tensors, checked against torch indexing.

Each case builds the tensors a vLLM attention backend hands to register_kv_caches (logical shape
and physical order), fills them with random bytes, gathers a chunk with kvtier's copier from the
description the connector derives, and compares it with the chunk computed by plain indexing:
for each layer, for each component (head or K/V), the chunk's tokens in order.
"""

from __future__ import annotations

import pytest
import torch

import kvtier
from kvtier.vllm.config import ConfigError, parse_config
from kvtier.vllm.layout import LayoutError, describe_group

BLOCKS, TOKENS, HEADS, CONTENT = 12, 16, 2, 24  # CONTENT: K and V of one head, in elements


def reference_chunk(layers: list[torch.Tensor], block_ids: list[int], head_major: bool):
    """The canonical chunk: layer by layer, component by component, token by token."""
    parts = []
    for t in layers:  # logical [B, H, N, C]
        blocks = t[block_ids]  # [b, H, N, C]
        if head_major:
            for h in range(t.shape[1]):
                parts.append(blocks[:, h].reshape(-1, t.shape[3]).contiguous().view(torch.uint8))
        else:
            parts.append(blocks.permute(0, 2, 1, 3).reshape(-1).contiguous().view(torch.uint8))
    return torch.cat([p.reshape(-1) for p in parts])


def gather(layers: dict[str, torch.Tensor], block_ids: list[int], tokens_per_block: int):
    tensors, ratio = describe_group(list(layers), layers, BLOCKS, tokens_per_block)
    copier = kvtier.KvCopier([kvtier.KvPageTensor(**t) for t in tensors],
                             tokens_per_block // ratio)
    ids = [b * ratio + i for b in block_ids for i in range(ratio)]
    n = len(block_ids) * tokens_per_block
    out = torch.zeros(copier.chunk_bytes(n), dtype=torch.uint8)
    copier.gather(ids, n, out.data_ptr(), out.numel()).wait()
    return out, tensors


def random_layers(n: int, shape, permute=None) -> dict[str, torch.Tensor]:
    layers = {}
    for i in range(n):
        t = torch.randint(-100, 100, shape, dtype=torch.int16).to(torch.bfloat16)
        if permute is not None:  # physical order differs from the logical one
            t = t.permute(*permute).contiguous().permute(*[permute.index(d)
                                                          for d in range(len(permute))])
        layers[f"model.layers.{i}.attn"] = t
    return layers


def test_head_major_blocks():  # vLLM's LBHNC: [B, H, N, C] in memory
    layers = random_layers(3, (BLOCKS, HEADS, TOKENS, CONTENT))
    ids = [7, 2, 9]
    out, tensors = gather(layers, ids, TOKENS)
    assert all(t["num_components"] == HEADS for t in tensors)
    assert torch.equal(out, reference_chunk(list(layers.values()), ids, head_major=True))


def test_token_major_blocks():  # LBNHC: logical [B, H, N, C], memory [B, N, H, C]
    layers = random_layers(3, (BLOCKS, HEADS, TOKENS, CONTENT), permute=(0, 2, 1, 3))
    ids = [0, 11]
    out, tensors = gather(layers, ids, TOKENS)
    assert all(t["num_components"] == 1 for t in tensors)
    assert torch.equal(out, reference_chunk(list(layers.values()), ids, head_major=False))


def test_tokens_and_content_of_equal_size():  # 128 tokens of 128 elements: the CPU backend
    layers = random_layers(2, (4, HEADS, 32, 32))
    tensors, _ = describe_group(list(layers), layers, 4, 32)
    assert tensors[0]["token_bytes"] == 32 * 2 and tensors[0]["num_components"] == HEADS


def test_leading_kv_axis():  # older FlashAttention: [2, B, N, H, D]
    layers = {f"l{i}": torch.randint(0, 100, (2, BLOCKS, TOKENS, HEADS, 8),
                                     dtype=torch.int16).to(torch.float16) for i in range(2)}
    ids = [3, 4]
    out, tensors = gather(layers, ids, TOKENS)
    assert tensors[0]["num_components"] == 2
    expected = torch.cat([t[c][ids].reshape(-1).view(torch.uint8)
                          for t in layers.values() for c in range(2)])
    assert torch.equal(out, expected)


def test_cross_layer_blocks_become_one_tensor():  # BLHNC: every layer of a block together
    whole = torch.randint(0, 100, (BLOCKS, 4, HEADS, TOKENS, CONTENT),
                          dtype=torch.int16).to(torch.bfloat16)
    layers = {f"l{i}": whole[:, i] for i in range(4)}
    ids = [5, 1]
    out, tensors = gather(layers, ids, TOKENS)
    assert len(tensors) == 1 and tensors[0]["num_layers"] == 4
    assert torch.equal(out, reference_chunk(list(layers.values()), ids, head_major=True))


def test_kernel_blocks_smaller_than_blocks():  # a 16-token block split into two kernel blocks
    layers = random_layers(2, (BLOCKS * 2, HEADS, TOKENS // 2, CONTENT))
    ids = [4, 10]
    out, _ = gather(layers, ids, TOKENS)
    kernel_ids = [b * 2 + i for b in ids for i in range(2)]
    parts = []
    for t in layers.values():
        for h in range(HEADS):
            parts.append(t[kernel_ids][:, h].reshape(-1).view(torch.uint8))
    assert torch.equal(out, torch.cat(parts))


def test_unsupported_layouts_are_refused_with_the_layer_name():
    odd = {"model.layers.0.attn": torch.zeros(BLOCKS, HEADS, TOKENS + 1, CONTENT)}
    with pytest.raises(LayoutError, match="model.layers.0.attn"):
        describe_group(list(odd), odd, BLOCKS, TOKENS)
    strided = {"l": torch.zeros(BLOCKS, HEADS, TOKENS, CONTENT * 2)[..., ::2]}
    with pytest.raises(LayoutError, match="contiguous"):
        describe_group(list(strided), strided, BLOCKS, TOKENS)


def test_config_keys():
    assert parse_config({}).server_mode is False
    cfg = parse_config({"kvtier.socket": "/run/k.sock", "kvtier.chunk_tokens": "512"})
    assert cfg.server_mode and cfg.chunk_tokens == 512
    cfg = parse_config({"kvtier.l2": '{"type": "fs", "path": "/x"}', "kvtier.l1_size_gb": 2})
    assert cfg.l2 == [{"type": "fs", "path": "/x"}] and cfg.write_policy == "write_through"
    cfg = parse_config({"kvtier.load_deadline_ms": 9000, "kvtier.rpc_timeout_ms": 12000})
    assert cfg.load_deadline_ms == 9000 and parse_config({}).load_deadline_ms == 2000
    for bad, match in [({"chunk_tokens": 1}, "unknown key 'chunk_tokens'"),
                       ({"kvtier.chunk_token": 1}, "known keys"),
                       ({"kvtier.chunk_tokens": "x"}, "kvtier.chunk_tokens"),
                       ({"kvtier.socket": "/s", "kvtier.l1_size_gb": 1}, "server mode"),
                       ({"kvtier.token": "t"}, "in-process mode"),
                       ({"kvtier.write_policy": "sometimes"}, "write_policy"),
                       ({"kvtier.l2": "[1]"}, "kvtier.l2"),
                       ({"kvtier.save_decode_tokens": "perhaps"}, "true or false"),
                       # The load deadline is the in-process server's, and a reply must come
                       # before the RPC timeout gives up on the connection.
                       ({"kvtier.socket": "/s", "kvtier.load_deadline_ms": 1000}, "server mode"),
                       ({"kvtier.load_deadline_ms": 5000}, "rpc_timeout_ms"),
                       ({"kvtier.load_deadline_ms": 0}, "load_deadline_ms")]:
        with pytest.raises(ConfigError, match=match):
            parse_config(bad)
