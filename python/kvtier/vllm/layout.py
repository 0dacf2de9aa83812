"""vLLM's paged KV cache, described to kvtier's copier as raw pages (docs/gpu-data-path.md).

vLLM hands each attention layer's cache to `register_kv_caches` as a tensor whose logical shape is
[blocks, heads, tokens, content] (since vLLM's KV-cache-layout RFC; older backends add a leading
K/V axis), with a physical order that depends on the attention backend. Nothing here assumes a
shape: the page structure is read off the tensor's strides. A block's bytes for one layer become
"components" of contiguous token runs:
  * head-major blocks ([B, H, N, C] in memory): one component per head, token = C elements;
  * token-major blocks ([B, N, H, C]): one component, token = H x C elements;
  * a leading K/V axis adds a factor 2 to the components.
Layers whose views interleave in one allocation (cross-layer blocks) become one tensor with
several layers, so the copier sees them as one allocation.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch


class LayoutError(ValueError):
    """A KV cache kvtier cannot describe; the message says which layer and why."""


@dataclass
class _Pages:
    base: int
    num_blocks: int
    block_stride: int
    token_bytes: int
    components: int
    component_stride: int
    storage: int  # data pointer of the allocation, to find layers sharing one


def _describe_layer(name: str, t: torch.Tensor, num_blocks: int,
                    tokens_per_block: int) -> tuple[_Pages, int]:
    """Pages of one layer, in kernel blocks, and the number of kernel blocks per vLLM block."""
    if t.dim() == 0 or t.numel() == 0:
        raise LayoutError(f"layer {name}: empty KV cache tensor")
    elem = t.element_size()
    shape, stride = list(t.shape), list(t.stride())
    where = f"layer {name} (shape {tuple(t.shape)}, strides {tuple(t.stride())})"
    kv_axis = None  # a leading K/V axis of 2 before the block axis: [2, B, ...]
    if len(shape) >= 2 and shape[0] == 2 and shape[1] % num_blocks == 0:
        kv_axis = stride[0]
        shape, stride = shape[1:], stride[1:]
    if shape[0] % num_blocks != 0:
        raise LayoutError(f"{where}: first axis is not a multiple of the {num_blocks} blocks "
                          "vLLM allocated")
    # Attention kernels may split a vLLM block into equal kernel blocks (the leading axis then
    # counts kernel blocks); the copier works in kernel blocks.
    ratio = shape[0] // num_blocks
    if tokens_per_block % ratio != 0:
        raise LayoutError(f"{where}: {ratio} kernel blocks do not divide a "
                          f"{tokens_per_block}-token block")
    kernel_tokens = tokens_per_block // ratio
    dims = [(s, st) for s, st in zip(shape[1:], stride[1:]) if s != 1]  # size-1 axes: no stride
    if kernel_tokens == 1:
        dims.append((1, 1 << 62))  # one token per block: the whole page is the token
    # The token axis has kernel_tokens entries; the axes with smaller strides form one dense run
    # (a token's bytes, in whatever order the backend keeps heads and content), and at most one
    # axis (heads, or K/V) has a larger stride. Another axis may have the token axis's size (e.g.
    # 128 tokens of 128 elements): the outermost axis that fits is the token axis.
    found = None
    for n, n_stride in sorted(dims, key=lambda d: -d[1]):
        if n != kernel_tokens:
            continue
        inner = sorted((d for d in dims if d[1] < n_stride), key=lambda d: d[1])
        outer = [d for d in dims if d[1] > n_stride]
        token_elems, dense = 1, True
        for s, st in inner:
            dense = dense and st == token_elems
            token_elems *= s
        fits = n == 1 or n_stride == token_elems
        if dense and fits and len(outer) + (kv_axis is not None) <= 1:
            found = token_elems, outer
            break
    if found is None:
        raise LayoutError(f"{where}: no axis of {kernel_tokens} tokens with each token's bytes "
                          "contiguous and at most one axis between it and the block axis")
    token_elems, outer = found
    components, component_stride = outer[0] if outer else (1, 0)
    if kv_axis is not None:
        components, component_stride = 2, kv_axis
    return _Pages(base=t.data_ptr(), num_blocks=shape[0], block_stride=stride[0] * elem,
                  token_bytes=token_elems * elem, components=components,
                  component_stride=component_stride * elem,
                  storage=t.untyped_storage().data_ptr()), ratio


def describe_group(layer_names: list[str], kv_caches: dict[str, torch.Tensor], num_blocks: int,
                   tokens_per_block: int) -> tuple[list[dict], int]:
    """KvPageTensor arguments (dicts) for one KV cache group, layers in vLLM's order, and the
    kernel blocks per vLLM block."""
    described = [_describe_layer(n, kv_caches[n], num_blocks, tokens_per_block)
                 for n in layer_names]
    ratios = {r for _, r in described}
    if len(ratios) != 1:
        raise LayoutError(f"layers split their blocks differently ({sorted(ratios)})")
    pages = [p for p, _ in described]
    tensors = []
    i = 0
    while i < len(pages):
        p = pages[i]
        # Cross-layer blocks: consecutive layers with equal page structure in one allocation,
        # their bases one constant step apart within a block.
        j, step = i + 1, 0
        while j < len(pages):
            q = pages[j]
            same = (q.storage == p.storage and q.block_stride == p.block_stride
                    and q.token_bytes == p.token_bytes and q.components == p.components
                    and q.component_stride == p.component_stride)
            delta = q.base - pages[j - 1].base
            if not same or delta <= 0 or delta >= p.block_stride or (step and delta != step):
                break
            step = delta
            j += 1
        tensors.append(dict(base=p.base, num_blocks=p.num_blocks,
                            block_stride_bytes=p.block_stride, token_bytes=p.token_bytes,
                            num_layers=j - i, layer_stride_bytes=step,
                            num_components=p.components,
                            component_stride_bytes=p.component_stride))
        i = j
    return tensors, ratios.pop()


def layout_fingerprint(vllm_config, kv_cache_config, chunk_tokens: int) -> int:
    """A 64-bit fingerprint of everything that decides a chunk's bytes, from configuration alone
    (the scheduler, which never sees the tensors, must compute the same value as the workers)."""
    parts = [f"chunk_tokens={chunk_tokens}",
             f"layout={getattr(kv_cache_config, 'kv_cache_layout', None)}",
             f"device={getattr(vllm_config.device_config, 'device_type', '')}",
             f"cache_dtype={vllm_config.cache_config.cache_dtype}"]
    for g in kv_cache_config.kv_cache_groups:
        spec = g.kv_cache_spec
        fields = [type(spec).__name__, len(g.layer_names)]
        for attr in ("block_size", "num_kv_heads", "head_size", "head_size_v", "dtype",
                     "page_size_bytes", "sliding_window", "kv_quant_mode"):
            fields.append(f"{attr}={getattr(spec, attr, None)}")
        parts.append("/".join(str(f) for f in fields))
    digest = hashlib.sha256("\n".join(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little")


def supported_groups(kv_cache_config) -> list[int]:
    """Indices of the KV cache groups kvtier stores; raises LayoutError for a model it cannot
    serve correctly (a chunk must hold every layer's KV of its tokens)."""
    groups = list(range(len(kv_cache_config.kv_cache_groups)))
    if not groups:
        raise LayoutError("the model has no KV cache groups")
    for g in groups:
        spec = kv_cache_config.kv_cache_groups[g].kv_cache_spec
        if type(spec).__name__ not in ("FullAttentionSpec", "MLAAttentionSpec"):
            raise LayoutError(f"KV cache group {g} is {type(spec).__name__}; kvtier stores "
                              "full-attention (and MLA) layers only")
        if getattr(spec, "sliding_window", None):
            raise LayoutError(f"KV cache group {g} uses a sliding window; not supported")
    sizes = {kv_cache_config.kv_cache_groups[g].kv_cache_spec.block_size for g in groups}
    if len(sizes) != 1:
        raise LayoutError(f"KV cache groups with different block sizes {sorted(sizes)}")
    return groups
