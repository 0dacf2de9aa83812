"""Cost-aware lookups: load from kvtier only what is cheaper to load than to compute.

A file-tier hit is read before the request runs (an asynchronous load), so it pays off only when
reading its chunks takes less time than computing their tokens; on a slow disk it can make the
request several times slower than recomputing (docs/benchmarks.md). L1 hits are loaded layer by
layer inside the step and cost little. For a prompt of n tokens whose first `local` tokens vLLM
has, whose chunks up to `memory` are in kvtier's L1 and up to `hits` in kvtier at all, the
connector can hand vLLM a prefix ending at any of those points, and compares the predicted
time to first token of each:

    load the whole hit:   read(file-tier chunks) + compute(hits .. n)
    load L1's part only:  compute(memory .. n)         (its copy overlaps the compute)
    load nothing:         compute(local .. n)

compute(a .. b) comes from a table of whole-prompt prefill times (tokens, seconds), measured on
the machine beforehand (the recompute arm of kvtier's TTFT benchmark, say): the time of the
tokens [a, b) with [0, a) cached is P(b) - P(a), P the table interpolated. Attention makes P
convex, so a prefix shorter than the whole hit is never better than both ends when the reads
and the compute run one after the other: the choice is between the three points above.

Without a table, P comes from the model's shape: the multiply-adds of a prefill, linear in the
tokens (the weights) plus quadratic (attention), in units of an assumed throughput. Only the
ratio between lengths is trusted: until the workers have timed a prefill, the unknown scale
makes every hit load (as with cost-aware lookups off), and from the first timed prefill on the
scale is what the engine took.

The table is kept current from what the engine actually takes: the workers time every step
that prefills (on the GPU's own clock: CUDA events around the forward pass), the scheduler had
predicted that step's compute from the table, and the ratio of the two sums, decayed like the
read rate below, scales every compute() the model predicts. A table measured on another machine,
or before a change of settings, corrects itself within a few prefills.

read() uses the file tier's read rate as the connector measures it on real loads (bytes per
second of the loads' wall time), decayed with a half-life towards a prior (the rate measured
beforehand with `kvtier bench storage`, kvtier.file_read_gbps, or else an optimistic guess), so
that a tier judged slow is tried again after a while and a wrong estimate corrects itself within
a few loads. A floor on that rate (kvtier.min_file_read_gbps) turns file-tier hits off below it.
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from dataclasses import dataclass


class PrefillCost:
    """P(tokens): seconds vLLM takes to prefill a prompt of that many tokens from scratch, from a
    table of (tokens, seconds) pairs; linear between the points, through the origin below the
    first, and along the last segment's slope beyond the last."""

    def __init__(self, table: list[tuple[int, float]]):
        points = sorted((int(t), float(s)) for t, s in table)
        if not points:
            raise ValueError("the prefill table is empty")
        for (t0, s0), (t1, s1) in zip(points, points[1:]):
            if t1 == t0 or s1 < s0:
                raise ValueError(f"the prefill table must grow with the tokens: {t0} tokens in "
                                 f"{s0} s, {t1} in {s1} s")
        if points[0][0] <= 0 or points[0][1] <= 0:
            raise ValueError("the prefill table's entries must be positive")
        self._tokens = [0] + [t for t, _ in points]
        self._seconds = [0.0] + [s for _, s in points]

    def total(self, tokens: int) -> float:
        t, s = self._tokens, self._seconds
        i = min(max(bisect.bisect_right(t, tokens), 1), len(t) - 1)
        slope = (s[i] - s[i - 1]) / (t[i] - t[i - 1])
        return s[i - 1] + (tokens - t[i - 1]) * slope

    def compute(self, start: int, end: int) -> float:
        """Seconds to compute tokens [start, end) with [0, start) cached."""
        return max(0.0, self.total(end) - self.total(start))


class ModelShapeCost(PrefillCost):
    """P(tokens) from the model's shape: the floating-point operations of prefilling a prompt
    of that many tokens, at NOMINAL_FLOPS. Linear in the tokens for the weights' matrix
    products, quadratic for causal attention (each token's query against the keys before it).
    The absolute scale is a guess that the cost model never uses before it has measured the
    engine (CostModel.scale_known): the shape alone is trusted, and it agrees with measured
    prefills (Qwen3-8B on an H200: P(32k) / P(4k) 12.5 from the shape, 12.0 measured)."""

    NOMINAL_FLOPS = 1e15

    def __init__(self, linear_flops_per_token: float, attention_flops_per_token_pair: float):
        if linear_flops_per_token <= 0 or attention_flops_per_token_pair < 0:
            raise ValueError("a model shape needs positive sizes")
        self.linear = linear_flops_per_token
        self.attention = attention_flops_per_token_pair

    def total(self, tokens: int) -> float:
        pairs = tokens * tokens / 2  # causal: each token attends to those before it
        return (self.linear * tokens + self.attention * pairs) / self.NOMINAL_FLOPS

    @classmethod
    def from_hf_config(cls, c) -> ModelShapeCost | None:
        """From a Hugging Face text model's config (attributes as in config.json); None where
        the config lacks the sizes."""
        def size(name: str) -> int | None:  # a positive integer, or None (absent, a list...)
            v = getattr(c, name, None)
            return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None

        hidden, layers, heads = (size("hidden_size"), size("num_hidden_layers"),
                                 size("num_attention_heads"))
        if not (hidden and layers and heads):
            return None
        kv_heads = size("num_key_value_heads") or heads
        head_dim = size("head_dim") or hidden // heads
        # The feed-forward width a token passes through: a mixture of experts' active experts.
        experts, expert_width = size("num_experts_per_tok"), size("moe_intermediate_size")
        if experts and expert_width:
            ffn = experts * expert_width
        else:
            ffn = size("intermediate_size") or size("ffn_dim") or 4 * hidden
        gated = 3 if getattr(c, "hidden_act", "") in ("silu", "swiglu") else 2
        weights = (2 * hidden * heads * head_dim  # q and o projections
                   + 2 * hidden * kv_heads * head_dim  # k and v
                   + gated * hidden * ffn)
        linear = 2.0 * layers * weights  # a multiply-add is two operations
        attention = 2.0 * 2 * layers * heads * head_dim  # q.k and the weighted sum of v
        return cls(linear, attention)


def parse_prefill_table(value) -> list[tuple[int, float]]:
    """[[tokens, seconds], ...] or "TOKENS:S,..." (kvtier plan --prefill-table's form)."""
    if isinstance(value, str):
        pairs = []
        for item in value.split(","):
            tokens, _, seconds = item.strip().partition(":")
            pairs.append((int(tokens), float(seconds)))
        return pairs
    return [(int(t), float(s)) for t, s in value]


class DecayedRatio:
    """A ratio of two sums (bytes over seconds, measured over predicted seconds), each observation
    weighted by exp(-age / half-life * ln 2), plus a prior worth `prior_den` of the denominator
    that never decays: with no recent observations the ratio returns to the prior."""

    # With no prior (prior_den 0), the sums decay no lower than this: the ratio is kept.
    MIN_WEIGHT = 1e-12

    def __init__(self, prior: float, prior_den: float, half_life_s: float = 60.0):
        self._prior_num, self._prior_den = prior * prior_den, prior_den
        self._half_life = half_life_s
        self._num = self._den = 0.0
        self._at: float | None = None  # the clock of the last decay (callers may pass theirs)
        self._lock = threading.Lock()

    def _decay(self, now: float) -> None:
        if self._at is None or now <= self._at:  # the first call, or no time passed since
            self._at = now if self._at is None else self._at
            return
        factor = math.exp(-(now - self._at) / self._half_life * math.log(2))
        if self._prior_den == 0 and self._den > 0 and self._den * factor < self.MIN_WEIGHT:
            factor = self.MIN_WEIGHT / self._den
        self._num *= factor
        self._den *= factor
        self._at = now

    def observe(self, num: float, den: float, now: float | None = None) -> None:
        if num <= 0 or den <= 0:
            return
        with self._lock:
            self._decay(time.monotonic() if now is None else now)
            self._num += num
            self._den += den

    def value(self, now: float | None = None) -> float:
        with self._lock:
            self._decay(time.monotonic() if now is None else now)
            if self._den + self._prior_den == 0:
                return 1.0  # nothing known
            return (self._num + self._prior_num) / (self._den + self._prior_den)

    def observed(self) -> bool:
        """Something was observed (it may have decayed since)."""
        with self._lock:
            return self._den > 0


class ReadRate(DecayedRatio):
    """A tier's read rate in bytes per second, from loads' bytes and wall time; the prior is
    worth `prior_s` seconds of reading."""

    def __init__(self, prior_bps: float, prior_s: float = 0.02, half_life_s: float = 60.0):
        super().__init__(prior_bps, prior_s, half_life_s)

    def bytes_per_s(self, now: float | None = None) -> float:
        return self.value(now)


@dataclass
class Choice:
    chunks: int  # leading chunks to take from kvtier (0: none)
    predicted_s: float  # predicted time to the first token of the chosen option
    read_s: float  # of which reading the file tier


class CostModel:
    """Chooses how much of a hit to load (module docstring)."""

    # Without a measured rate, the file tier is assumed this fast until a load is measured:
    # tried, then measured.
    PRIOR_READ_BPS = 4e9
    # The table's own word weighs as this many seconds of measured prefill: one long prefill
    # outweighs it.
    PRIOR_COMPUTE_S = 0.05
    # Steps that prefill fewer tokens than this are not timed: their time is the model's fixed
    # cost per step (weights read once), which the table, measured on long prompts, does not hold.
    MIN_TIMED_TOKENS = 512

    def __init__(self, prefill: PrefillCost | None, chunk_tokens: int, chunk_bytes: int,
                 min_file_read_bps: float = 0.0, file_read_bps: float = 0.0):
        self.prefill = prefill
        self.chunk_tokens, self.chunk_bytes = chunk_tokens, chunk_bytes
        self.min_file_read_bps = min_file_read_bps
        # The prior weighs as one chunk read at its rate: any real load outweighs it at once
        # (weighed as a fixed time instead, an optimistic prior's bytes outweighed the loads of a
        # slow tier with small chunks: 80 MB of prior against 7 MB read in a second).
        prior = file_read_bps or self.PRIOR_READ_BPS
        self.file_rate = ReadRate(prior, prior_s=chunk_bytes / prior)
        # Measured step time over the table's prediction for it. A model's shape has no word of
        # its own on the scale: it is learned from the engine before any decision rests on it.
        self.shape_only = isinstance(prefill, ModelShapeCost)
        self.compute_scale = DecayedRatio(1.0, 0.0 if self.shape_only else self.PRIOR_COMPUTE_S)

    def scale_known(self) -> bool:
        """compute() predicts seconds: a measured table, or a shape the engine has been timed
        against."""
        return self.prefill is not None and (not self.shape_only or
                                             self.compute_scale.observed())

    def step_prediction(self, work: list[tuple[int, int]]) -> float:
        """The table's (unscaled) seconds for a step that computes tokens [a, b) of each request
        in `work`; 0 when the step is not worth timing (no table, or too little prefill)."""
        prefill = [(a, b) for a, b in work if b - a > 1]  # decodes ride along
        if self.prefill is None or sum(b - a for a, b in prefill) < self.MIN_TIMED_TOKENS:
            return 0.0
        return sum(self.prefill.compute(a, b) for a, b in prefill)

    def compute(self, start: int, end: int) -> float:
        """Predicted seconds to compute tokens [start, end): the table, scaled by what the engine
        took lately."""
        return self.prefill.compute(start, end) * self.compute_scale.value()

    def choose(self, n_tokens: int, local: int, memory: int, hits: int) -> Choice:
        """local: tokens vLLM has; memory and hits: leading chunks in L1 and in kvtier (memory
        <= hits). The chunks to take: hits, memory, or 0 (vLLM computes the rest)."""
        ct = self.chunk_tokens
        end = lambda chunks: min(chunks * ct, n_tokens - 1)  # noqa: E731 (vLLM computes the last)
        disk = max(0, hits - max(memory, local // ct))
        rate = self.file_rate.bytes_per_s()
        read_s = disk * self.chunk_bytes / rate
        if disk == 0:
            return Choice(hits, 0.0, 0.0)
        if rate < self.min_file_read_bps:
            fallback = memory if end(memory) > local else 0
            return Choice(fallback, 0.0, 0.0)
        if not self.scale_known():
            return Choice(hits, read_s, read_s)
        options = [Choice(hits, read_s + self.compute(end(hits), n_tokens), read_s)]
        if end(memory) > local:
            options.append(Choice(memory, self.compute(end(memory), n_tokens), 0.0))
        options.append(Choice(0, self.compute(local, n_tokens), 0.0))
        return min(options, key=lambda c: c.predicted_s)
