"""A decoder-only transformer (Llama / Qwen2 / Qwen3 family) in plain PyTorch, for benchmarks.

Built from a Hugging Face ``config.json`` with random weights: nothing is downloaded. It computes
what the real model computes (fused QKV and gate/up projections, RMSNorm, Qwen3's per-head q/k
norms, rotary embeddings, grouped-query attention through ``scaled_dot_product_attention``,
SwiGLU), so a prefill costs what the real model's prefill costs on the same GPU. The attention
KV cache is paged the way vLLM keeps it: one tensor per layer, ``[2, blocks, tokens_per_block,
kv_heads, head_dim]``, which kvtier's copiers describe as ``KvPageTensor`` split K/V pages.

The forward pass is exposed layer by layer (``forward_layer``) so that callers can overlap a
layer's KV load with the previous layer's compute, or start saving a layer's KV as soon as it
is written. Not modelled: rope scaling variants (long-context frequency rescaling changes values,
not cost), sliding-window attention, MoE, biases other than Qwen2's QKV bias.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "configs")


@dataclass(frozen=True)
class ModelConfig:
    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    qk_norm: bool  # Qwen3: RMSNorm over each head of q and k before the rotary embedding
    qkv_bias: bool  # Qwen2: biases on the q, k and v projections
    tie_word_embeddings: bool

    @staticmethod
    def load(name_or_path: str) -> "ModelConfig":
        """A config shipped with the package (``qwen3-8b``, ``qwen3-0.6b``) or a config.json path."""
        path = name_or_path
        if not os.path.exists(path):
            path = os.path.join(CONFIG_DIR, name_or_path + ".json")
        if not os.path.exists(path):
            shipped = sorted(f[:-5] for f in os.listdir(CONFIG_DIR) if f.endswith(".json"))
            raise ValueError(
                f"model {name_or_path!r}: neither a config.json path nor one of {shipped}")
        with open(path) as f:
            try:
                c = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: not valid JSON ({e})") from None
        return ModelConfig.from_dict(c, os.path.basename(path).removesuffix(".json"))

    @staticmethod
    def from_dict(c: dict, name: str = "model") -> "ModelConfig":
        missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                               "intermediate_size", "vocab_size") if k not in c]
        if missing:
            raise ValueError(f"{name}: config lacks {', '.join(missing)}")
        if c.get("num_experts") or c.get("n_routed_experts") or c.get("kv_lora_rank"):
            raise ValueError(f"{name}: MoE and MLA models are not supported by this benchmark")
        heads = int(c["num_attention_heads"])
        model_type = c.get("model_type", "")
        return ModelConfig(
            name=name,
            hidden_size=int(c["hidden_size"]),
            num_layers=int(c["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(c.get("num_key_value_heads") or heads),
            head_dim=int(c.get("head_dim") or c["hidden_size"] // heads),
            intermediate_size=int(c["intermediate_size"]),
            vocab_size=int(c["vocab_size"]),
            rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
            rope_theta=float(c.get("rope_theta", 10000.0)),
            qk_norm=model_type.startswith("qwen3"),
            qkv_bias=bool(c.get("attention_bias", model_type == "qwen2")),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        )

    def kv_token_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of one token's K (or V) in one layer."""
        return self.num_kv_heads * self.head_dim * torch.empty((), dtype=dtype).element_size()

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        return 2 * self.num_layers * self.kv_token_bytes(dtype)

    def num_parameters(self) -> int:
        h, d = self.hidden_size, self.head_dim
        attn = h * (self.num_heads + 2 * self.num_kv_heads) * d + self.num_heads * d * h
        mlp = 3 * h * self.intermediate_size
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attn + mlp) + embed


class PagedKvCache:
    """vLLM's per-layer paged layout: layer i is ``[2, num_blocks, tokens_per_block, kv_heads,
    head_dim]``. One request at a time, in blocks 0, 1, 2, ... in token order, so a layer's first T
    tokens are one strided view (what a paged attention kernel reads through its block table)."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, tokens_per_block: int,
                 dtype: torch.dtype, device: torch.device):
        self.cfg = cfg
        self.num_blocks = num_blocks
        self.tokens_per_block = tokens_per_block
        self.layers = [
            torch.empty((2, num_blocks, tokens_per_block, cfg.num_kv_heads, cfg.head_dim),
                        dtype=dtype, device=device) for _ in range(cfg.num_layers)
        ]
        self.token_bytes = cfg.kv_token_bytes(dtype)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.tokens_per_block

    def flat(self, layer: int, component: int) -> torch.Tensor:
        """Layer's K (0) or V (1) as ``[capacity_tokens, kv_heads, head_dim]``."""
        return self.layers[layer][component].view(-1, self.cfg.num_kv_heads, self.cfg.head_dim)

    def poison(self, tokens: int) -> None:
        """Fills the first ``tokens`` of every layer with NaN, so a load that misses a page shows."""
        for i in range(self.cfg.num_layers):
            self.flat(i, 0)[:tokens].fill_(float("nan"))
            self.flat(i, 1)[:tokens].fill_(float("nan"))

    def snapshot(self, tokens: int) -> list[torch.Tensor]:
        return [torch.stack([self.flat(i, 0)[:tokens], self.flat(i, 1)[:tokens]]).clone()
                for i in range(self.cfg.num_layers)]

    def equals(self, snapshot: list[torch.Tensor], tokens: int) -> bool:
        """Bit-exact comparison of the first ``tokens`` with a snapshot (NaN never equals)."""
        for i, s in enumerate(snapshot):
            for c in (0, 1):
                a = self.flat(i, c)[:tokens].view(torch.int16 if s.element_size() == 2 else
                                                  torch.int32)
                b = s[c][:tokens].view(a.dtype)
                if not torch.equal(a, b):
                    return False
        return True


class DecoderModel:
    """Weights on one device; ``prefill`` or, step by step, ``embed`` / ``forward_layer`` /
    ``first_token``."""

    def __init__(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
                 seed: int = 0, init_std: float = 0.02):
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = dtype
        g = torch.Generator(device=self.device).manual_seed(seed)
        h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
        q_out, kv_out = cfg.num_heads * d, cfg.num_kv_heads * d

        def rand(*shape):
            t = torch.empty(shape, device=self.device, dtype=dtype)
            return t.normal_(0.0, init_std, generator=g)

        def ones(n):  # RMSNorm gains near 1, not exactly (a constant hides broadcasting bugs)
            return 1.0 + rand(n)

        self.embed_tokens = rand(cfg.vocab_size, h)
        self.wqkv = [rand(q_out + 2 * kv_out, h) for _ in range(cfg.num_layers)]
        self.bqkv = [rand(q_out + 2 * kv_out) if cfg.qkv_bias else None
                     for _ in range(cfg.num_layers)]
        self.wo = [rand(h, q_out) for _ in range(cfg.num_layers)]
        self.w_gate_up = [rand(2 * inter, h) for _ in range(cfg.num_layers)]
        self.w_down = [rand(h, inter) for _ in range(cfg.num_layers)]
        self.ln1 = [ones(h) for _ in range(cfg.num_layers)]
        self.ln2 = [ones(h) for _ in range(cfg.num_layers)]
        self.q_norm = [ones(d) for _ in range(cfg.num_layers)] if cfg.qk_norm else None
        self.k_norm = [ones(d) for _ in range(cfg.num_layers)] if cfg.qk_norm else None
        self.norm = ones(h)
        self.lm_head = self.embed_tokens if cfg.tie_word_embeddings else rand(cfg.vocab_size, h)
        self._rope_cache: tuple[int, torch.Tensor, torch.Tensor] | None = None

    # -- pieces ------------------------------------------------------------------------------

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps)
        return weight * x32.to(self.dtype)

    def _rope(self, positions_end: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._rope_cache is None or self._rope_cache[0] < positions_end:
            n = max(positions_end, 4096)
            d = self.cfg.head_dim
            inv = 1.0 / (self.cfg.rope_theta ** (
                torch.arange(0, d, 2, device=self.device, dtype=torch.float32) / d))
            freqs = torch.outer(torch.arange(n, device=self.device, dtype=torch.float32), inv)
            emb = torch.cat([freqs, freqs], dim=-1)
            self._rope_cache = (n, emb.cos().to(self.dtype), emb.sin().to(self.dtype))
        return self._rope_cache[1], self._rope_cache[2]

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat([-x[..., half:], x[..., :half]], dim=-1)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens[tokens]

    def forward_layer(self, i: int, x: torch.Tensor, cache: PagedKvCache, start: int,
                      before_attention=None) -> torch.Tensor:
        """Layer i over the ``n = len(x)`` tokens at positions ``start .. start+n-1``: writes their
        K and V into the cache, then attends over cache tokens ``[0, start+n)`` with the causal
        mask aligned to the end. ``before_attention()`` runs just before the cache is read (a
        caller waits there for the layer's prefix to arrive)."""
        q = self.layer_qkv(i, x, cache, start)
        if before_attention is not None:
            before_attention()
        return self.layer_attention_mlp(i, x, q, cache, start)

    def layer_qkv(self, i: int, x: torch.Tensor, cache: PagedKvCache, start: int) -> torch.Tensor:
        """Layer i up to the attention: writes the tokens' K and V into the cache, returns q."""
        cfg = self.cfg
        n, d = x.shape[0], cfg.head_dim
        q_out, kv_out = cfg.num_heads * d, cfg.num_kv_heads * d
        h = self._rms_norm(x, self.ln1[i])
        qkv = F.linear(h, self.wqkv[i], self.bqkv[i])
        q = qkv[:, :q_out].view(n, cfg.num_heads, d)
        k = qkv[:, q_out:q_out + kv_out].view(n, cfg.num_kv_heads, d)
        v = qkv[:, q_out + kv_out:].view(n, cfg.num_kv_heads, d)
        if cfg.qk_norm:
            q = self._rms_norm(q, self.q_norm[i])
            k = self._rms_norm(k, self.k_norm[i])
        cos, sin = self._rope(start + n)
        cos, sin = cos[start:start + n, None, :], sin[start:start + n, None, :]
        q = q * cos + self._rotate_half(q) * sin
        k = k * cos + self._rotate_half(k) * sin
        end = start + n
        if end > cache.capacity_tokens:
            raise ValueError(f"{end} tokens do not fit the KV cache ({cache.capacity_tokens})")
        cache.flat(i, 0)[start:end] = k
        cache.flat(i, 1)[start:end] = v
        return q

    def layer_attention_mlp(self, i: int, x: torch.Tensor, q: torch.Tensor, cache: PagedKvCache,
                            start: int) -> torch.Tensor:
        """Layer i from the attention over cache tokens ``[0, start+n)`` on: the layer's output."""
        n, end = x.shape[0], start + x.shape[0]
        q_out = self.cfg.num_heads * self.cfg.head_dim
        attn = _attention(q, cache.flat(i, 0)[:end], cache.flat(i, 1)[:end], start)
        x = x + F.linear(attn.reshape(n, q_out), self.wo[i])
        h = self._rms_norm(x, self.ln2[i])
        gate, up = F.linear(h, self.w_gate_up[i]).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, self.w_down[i])

    def first_token(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of the last position (what the first generated token is sampled from)."""
        return F.linear(self._rms_norm(x[-1:], self.norm), self.lm_head)[0]

    def prefill(self, tokens: torch.Tensor, cache: PagedKvCache, start: int = 0) -> torch.Tensor:
        """Tokens at positions ``start..``, the cache holding positions ``[0, start)`` already;
        returns the last position's logits."""
        x = self.embed(tokens)
        for i in range(self.cfg.num_layers):
            x = self.forward_layer(i, x, cache, start)
        return self.first_token(x)


class SuffixGraphs:
    """The forward pass of ``n`` tokens at positions ``start..start+n-1`` (the cache holding
    ``[0, start)``) as CUDA graphs, replayed instead of launching each kernel from Python.

    Two graphs per layer, split where ``forward_layer`` calls ``before_attention``: up to the KV
    write (``layer_qkv``), and from the attention on (``layer_attention_mlp``); a caller can make
    the stream wait for layer i's prefix KV between the two, exactly as in the eager pass. The
    graphs read the model's weights and the cache in place and the tokens from ``self.tokens``
    (``run`` copies them in), so a replay computes what ``prefill(tokens, cache, start)`` computes
    with the same kernels, at a host cost of two graph launches per layer instead of ~30 kernel
    launches (an eager 256-token pass is bound by the launching thread, ~30 ms on an H200's host,
    and moves with that CPU's speed). Like a serving engine's graphs (vLLM captures batches of up
    to 512 tokens), they are captured once per shape, here per (start, n), outside any timing.
    """

    def __init__(self, model: "DecoderModel", cache: PagedKvCache, start: int, n: int,
                 warmup: int = 2):
        self.model, self.cache, self.start, self.n = model, cache, start, n
        layers = model.cfg.num_layers
        dev = model.device
        self.tokens = torch.zeros(n, dtype=torch.long, device=dev)
        model._rope(start + n)  # grown now, outside the capture
        self.pre, self.post = [], []
        self.embed_graph = torch.cuda.CUDAGraph()
        self.head_graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # warm-up off the capture (lazy handles, workspaces)
            for _ in range(warmup):
                model.prefill(self.tokens, cache, start)
        torch.cuda.current_stream(dev).wait_stream(side)
        torch.cuda.synchronize(dev)
        self.pool = torch.cuda.graph_pool_handle()

        def capture(graph, fn):
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                out = fn()
            return out

        self.x = [capture(self.embed_graph, lambda: model.embed(self.tokens))]
        self.q = []
        for i in range(layers):
            g = torch.cuda.CUDAGraph()
            self.q.append(capture(g, lambda: model.layer_qkv(i, self.x[i], cache, start)))
            self.pre.append(g)
            g = torch.cuda.CUDAGraph()
            self.x.append(capture(g, lambda: model.layer_attention_mlp(i, self.x[i], self.q[i],
                                                                       cache, start)))
            self.post.append(g)
        self.logits = capture(self.head_graph, lambda: model.first_token(self.x[layers]))
        torch.cuda.synchronize(dev)

    def run(self, tokens: torch.Tensor, before_layer=None, before_attention=None) -> torch.Tensor:
        """Replays the pass over ``tokens`` (n of them, on the device). ``before_layer(i)`` runs on
        the host before layer i's graphs are launched, ``before_attention(i)`` between its two.
        The logits are overwritten by the next replay: clone them to keep them."""
        self.tokens.copy_(tokens, non_blocking=True)
        self.embed_graph.replay()
        for i in range(len(self.pre)):
            if before_layer is not None:
                before_layer(i)
            self.pre[i].replay()
            if before_attention is not None:
                before_attention(i)
            self.post[i].replay()
        self.head_graph.replay()
        return self.logits


_LOWER_RIGHT_GQA_OK: bool | None = None


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """q ``[n, heads, d]`` at positions start..start+n-1 over k, v ``[start+n, kv_heads, d]``."""
    global _LOWER_RIGHT_GQA_OK
    qt, kt, vt = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if start == 0:  # square: the usual causal mask
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)
        return out[0].transpose(0, 1)
    from torch.nn.attention.bias import causal_lower_right
    mask = causal_lower_right(q.shape[0], k.shape[0])
    if _LOWER_RIGHT_GQA_OK is not False:
        try:
            out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, enable_gqa=True)
            _LOWER_RIGHT_GQA_OK = True
            return out[0].transpose(0, 1)
        except (RuntimeError, TypeError, ValueError):
            if _LOWER_RIGHT_GQA_OK:
                raise
            _LOWER_RIGHT_GQA_OK = False
    # This PyTorch cannot combine the lower-right mask with grouped KV heads: expand them.
    rep = q.shape[1] // k.shape[1]
    kt, vt = kt.repeat_interleave(rep, dim=1), vt.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask)[0].transpose(0, 1)


def prefill_flops(cfg: ModelConfig, cached: int, new: int) -> float:
    """Matrix FLOPs of computing ``new`` tokens after ``cached`` ones (attention included)."""
    dense = 2.0 * new * (cfg.num_parameters() - cfg.vocab_size * cfg.hidden_size *
                         (1 if cfg.tie_word_embeddings else 2))
    pairs = new * cached + new * (new + 1) / 2
    attn = 4.0 * pairs * cfg.num_heads * cfg.head_dim * cfg.num_layers
    return dense + attn + 2.0 * cfg.vocab_size * cfg.hidden_size


def blocks_for(tokens: int, tokens_per_block: int) -> int:
    return math.ceil(tokens / tokens_per_block)
