"""Time to first token: recomputing a prompt vs loading its prefix from kvtier.

    python -m kvtier.bench.ttft [--model qwen3-8b] [--contexts 4k,8k,16k,24k,32k] [--json] [--plot F]

On a CUDA machine this builds a model from a Hugging Face config.json with random weights (bf16,
on the GPU; see ``kvtier.bench.model``) and, for each context length L (prefix = L - suffix
tokens, chunk-aligned), measures with warm-ups and repeats, the arms interleaved in every repeat:

* ``recompute``: prefill of all L tokens (the prefill table ``kvtier plan --prefill-table`` takes);
* ``gpu``: the prefix's KV already in the GPU's cache, prefill of the suffix only (vLLM's own
  prefix-cache hit; the suffix-compute term of the floors below);
* ``l1``: the prefix's chunks looked up and pinned in an in-process kvtier engine's memory tier,
  scattered layer by layer into the paged KV cache by the CUDA copier on a copy stream, while the
  suffix is computed: layer i's attention waits only for layer i's KV;
* ``l1-serial``: the same load, all of it before the suffix's forward pass (no overlap);
* ``server``: as ``l1``, through a ``kvtier serve`` daemon's shared-memory pool;
* ``file``: from chunk files on local disk through the engine's file tier, cold: a fresh engine
  each repeat (empty L1), page cache dropped where permitted, reads with O_DIRECT; the prefix is
  pinned in waves (``--load-wave``) and each wave is scattered as it arrives, then the suffix;
* ``save``: a prefill at 0 % hits that saves every layer's KV into reserved L1 slots as soon as
  the layer has written it (gathers on a copy stream), against ``recompute`` for the overhead.

The hit arms run the suffix's forward pass as CUDA graphs (``--suffix-pass graphs``, the default
on CUDA; ``model.SuffixGraphs``: two graphs per layer, captured per context outside the timing),
as a serving engine runs a short prefill. Launched kernel by kernel from Python (``--suffix-pass
eager``) a 256-token pass is bound by the launching thread, and that thread's speed was seen to
vary 1.6-2.4x for stretches of a second or more on the H200 machine (``kvtier.bench.ttft_probe``
shows it), which moved every hit with it. Every arm's samples are kept in the JSON and printed
(p50 and max) with the ratios to the floors.

Every hit is verified: the prefix KV in the cache must equal the recompute's bit for bit, and the
first token's logits must match the recompute's. The host->GPU copy bandwidth is measured in the
same run (the copy floor). The disk is measured per context, since the H200 machine's virtual
disk was seen to read anywhere from 1.0 to 2.0 GB/s from minute to minute: ``kvtier bench
storage`` on the file tier's directory right before that context's repeats (chunk-sized files,
1, ``--read-threads`` and 16 readers, 1.2 GB read per reader count at 36 MiB). Its figure at
``--read-threads`` readers, what a user measures for the tier's concurrency, sets that context's
file floor (``prefix bytes / disk + GPU hit``); the best reader count and every count's figure are
kept beside it. Then ``kvtier bench tier`` on the same directory measures the file tier itself:
chunks of the run's chunk size (in whole MiB) written and read, cold, through a file tier with
``--read-threads`` read threads and the tier's queue depth (8), and plain O_DIRECT reads of the
same files in the same run. Its tier read figure is the ``--tier disk:`` bandwidth given to
``kvtier plan`` for that context: on the H200 machine's disk the probe's plain reads (one 1 MiB
request in flight per reader) read 9 % faster than the tier on average and moved from context to
context while the tier's own rate held. Before every timed file hit the same bytes of chunk files
are also read raw (O_DIRECT, as many requests in flight as the tier keeps): the disk as it is when
the hit runs. A probe or tier benchmark that fails ends the run.

``kvtier plan --fast`` predicts each hit from this run's prefill table (the suffix's own prefill
first, measured at the end of the run), PCIe and that context's ``bench tier`` read figure, and
the file hit a second time with the probe's figure instead, for comparison; the comparison is
rewritten after every context with the table so far and the suffix's prefill measured at the start
(``"prefill_table_complete": false``), and once more at the end with the whole table.
On a machine without CUDA it runs on the CPU (float32, host copier): for tests, not for figures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch

import kvtier
from kvtier.bench import model as model_mod
from kvtier.bench.model import DecoderModel, ModelConfig, PagedKvCache, SuffixGraphs, blocks_for

ALL_ARMS = ("recompute", "gpu", "l1", "l1-serial", "server", "file", "save")
HIT_ARMS = ("l1", "l1-serial", "server", "file")
GiB = 1 << 30


def parse_tokens(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        mult = 1024 if part.endswith("k") else 1
        try:
            n = int(part.rstrip("k")) * mult
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad token count {part!r} (e.g. 4096 or 4k)")
        if n <= 0:
            raise argparse.ArgumentTypeError(f"token count must be positive: {part!r}")
        out.append(n)
    if not out:
        raise argparse.ArgumentTypeError("no token counts given")
    return out


def parse_arms(text: str) -> list[str]:
    arms = [a.strip() for a in text.split(",") if a.strip()]
    bad = [a for a in arms if a not in ALL_ARMS]
    if bad or not arms:
        raise argparse.ArgumentTypeError(
            f"unknown arm(s) {bad or text!r}; choose from {','.join(ALL_ARMS)}")
    if "recompute" not in arms:
        arms.insert(0, "recompute")  # the reference every other arm is checked against
    return arms


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m kvtier.bench.ttft",
        description="Time to first token on the GPU: recompute vs a prefix loaded from kvtier "
        "(memory tier in-process and through kvtier serve, file tier cold from local disk), "
        "and the overhead of saving KV during the forward pass. Prints a table; --json for "
        "one JSON object.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="qwen3-8b",
                   help="shipped config (qwen3-8b, qwen3-0.6b) or a Hugging Face config.json")
    p.add_argument("--contexts", type=parse_tokens, default=parse_tokens("4k,8k,16k,24k,32k"),
                   help="prompt lengths in tokens (k = x1024)")
    p.add_argument("--suffix", type=int, default=256,
                   help="uncached tokens at the end of each prompt")
    p.add_argument("--chunk-tokens", type=int, default=256, help="kvtier chunk size, tokens")
    p.add_argument("--block-tokens", type=int, default=16, help="KV cache block (page), tokens")
    p.add_argument("--arms", type=parse_arms, default=list(ALL_ARMS),
                   help="comma list of " + ",".join(ALL_ARMS))
    p.add_argument("--warmup", type=int, default=2, help="untimed repeats per context")
    p.add_argument("--repeats", type=int, default=6,
                   help="timed repeats per context (median; odd ones run the arms in reverse)")
    p.add_argument("--dir", default=None,
                   help="directory for the file tier's chunks, on the disk to measure "
                   "(default: a new folder under /var/tmp, removed at the end)")
    p.add_argument("--read-threads", type=int, default=4, help="file tier read threads")
    p.add_argument("--load-wave", type=int, default=24,
                   help="chunks per prepare_load from the file tier (two in flight)")
    p.add_argument("--mechanism", default=None,
                   help="copier mechanism: dma (the default on CUDA: the copy engines, leaving "
                   "every SM to the model's kernels), auto, kernel or staged")
    p.add_argument("--suffix-pass", choices=("graphs", "eager"), default=None,
                   help="how the hit arms (and the suffix-length prefill) run the suffix's forward "
                   "pass: graphs (the default on CUDA: CUDA graphs captured per context, two per "
                   "layer, as a serving engine runs a short prefill) or eager (every kernel "
                   "launched from Python: bound by the launching thread, whose speed varies)")
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    p.add_argument("--dtype", default=None, help="bfloat16 (default on CUDA) or float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kvtier-bin", default=None,
                   help="the kvtier command (for `serve`, `bench storage`, `bench tier` and "
                   "`plan`); default: "
                   "$KVTIER_BIN, then PATH, then this Python's bin folder")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--output", default=None, metavar="FILE.json",
                   help="also write the JSON to FILE, rewritten after every context (with "
                        "\"complete\": false until the run ends), so a run cut short keeps "
                        "the contexts it measured")
    p.add_argument("--plot", default=None, metavar="FILE.svg",
                   help="also draw TTFT against context with the copy floor")
    return p


# ------------------------------------------------------------------------------------------------
# Environment: device, streams, pinned memory, the kvtier binary


@dataclass
class Env:
    device: torch.device
    dtype: torch.dtype
    cuda: bool

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def new_stream(self):
        return torch.cuda.Stream(self.device) if self.cuda else None

    def pin(self, store) -> None:
        """Registers a store's L1 pool with CUDA so copies to and from it are DMA at full speed."""
        if not self.cuda:
            return
        # cudaHostRegisterPortable | cudaHostRegisterMapped
        err = torch.cuda.cudart().cudaHostRegister(store.pool_base, store.pool_bytes, 0x1 | 0x2)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of kvtier's pool failed ({err})")

    def unpin(self, store) -> None:
        if self.cuda:
            torch.cuda.cudart().cudaHostUnregister(store.pool_base)


def find_kvtier_bin(explicit: str | None) -> str | None:
    for cand in (explicit, os.environ.get("KVTIER_BIN"), shutil.which("kvtier"),
                 os.path.join(os.path.dirname(sys.executable), "kvtier")):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# ------------------------------------------------------------------------------------------------
# Moving a prefix between the paged cache and kvtier, layer by layer


class ChunkMover:
    """Copies chunks between the model's paged KV cache and host memory in kvtier's canonical
    layout. A chunk holds every layer (layer-major, then K/V, then token), so layer i of a chunk
    is the contiguous range ``[i * layer_bytes, (i + 1) * layer_bytes)``; one copier per layer
    moves just that range, which is what lets layer i's copy overlap layer i-1's compute."""

    def __init__(self, env: Env, cache: PagedKvCache, chunk_tokens: int, mechanism: str):
        self.env = env
        self.cache = cache
        self.chunk_tokens = chunk_tokens
        self.blocks_per_chunk = chunk_tokens // cache.tokens_per_block
        device = (env.device.index or 0) if env.cuda else -1
        bt = cache.tokens_per_block

        def tensor(layer_tensor):
            return kvtier.KvPageTensor.split_kv(layer_tensor.data_ptr(), cache.num_blocks, bt,
                                                cache.token_bytes)

        self.per_layer = [kvtier.KvCopier([tensor(t)], bt, device=device, mechanism=mechanism)
                          for t in cache.layers]
        self.whole = kvtier.KvCopier([tensor(t) for t in cache.layers], bt, device=device,
                                     mechanism=mechanism)
        self.layer_bytes = self.per_layer[0].chunk_bytes(chunk_tokens)
        self.chunk_bytes = self.whole.chunk_bytes(chunk_tokens)
        assert self.chunk_bytes == self.layer_bytes * len(cache.layers)
        self._id_lists = {}

    def block_ids(self, chunk: int) -> list[int]:
        ids = self._id_lists.get(chunk)
        if ids is None:
            b = chunk * self.blocks_per_chunk
            ids = self._id_lists[chunk] = list(range(b, b + self.blocks_per_chunk))
        return ids

    def _ids(self, first_chunk: int, n: int) -> list[list[int]]:
        return [self.block_ids(first_chunk + c) for c in range(n)]

    def scatter_layer(self, layer: int, addrs: list[int], stream) -> None:
        """Layer ``layer`` of chunks 0, 1, ... from host addresses ``addrs``: one batched call."""
        off = layer * self.layer_bytes
        self.per_layer[layer].scatter_chunks(
            self._ids(0, len(addrs)), self.chunk_tokens, [a + off for a in addrs],
            self.layer_bytes, stream=stream.cuda_stream if stream is not None else 0)

    def gather_layer(self, layer: int, addrs: list[int], stream) -> None:
        off = layer * self.layer_bytes
        self.per_layer[layer].gather_chunks(
            self._ids(0, len(addrs)), self.chunk_tokens, [a + off for a in addrs],
            self.layer_bytes, stream=stream.cuda_stream if stream is not None else 0)

    def scatter_all(self, addrs: list[int], stream, first_chunk: int = 0) -> None:
        self.whole.scatter_chunks(self._ids(first_chunk, len(addrs)), self.chunk_tokens, addrs,
                                  self.chunk_bytes,
                                  stream=stream.cuda_stream if stream is not None else 0)

    def gather_chunks(self, chunks: list[int], addrs: list[int], stream):
        return self.whole.gather_chunks([self.block_ids(c) for c in chunks], self.chunk_tokens,
                                        addrs, self.chunk_bytes,
                                        stream=stream.cuda_stream if stream is not None else 0)


def store_prefix(store, keys: list[bytes], mover: ChunkMover, env: Env) -> None:
    """Gathers the cache's first len(keys) chunks into reserved slots and commits them."""
    slots = store.reserve_slots(keys)
    if len(slots) != len(keys):
        store.abort_slots(slots)
        try:
            stats = json.dumps(store.stats())[:3000]
        except Exception as e:  # noqa: BLE001 - only for the message
            stats = f"(stats failed: {e})"
        raise RuntimeError(f"{store!r}: kvtier reserved {len(slots)} of {len(keys)} slots; "
                           f"stats: {stats}")
    todo = [(k, s) for k, s in zip(keys, slots) if s >= 0]
    if not todo:
        return
    stream = env.new_stream()
    mover.gather_chunks([i for i, s in enumerate(slots) if s >= 0],
                        [store.slot_address(s) for _, s in todo], stream)
    if stream is not None:
        stream.synchronize()
    store.commit_slots([k for k, _ in todo], [s for _, s in todo])


# ------------------------------------------------------------------------------------------------
# One context length


@dataclass
class ContextRun:
    env: Env
    model: DecoderModel
    cache: PagedKvCache
    mover: ChunkMover
    ns: object
    context: int
    suffix: int
    tokens: torch.Tensor  # on the model's device
    tokens_cpu: torch.Tensor
    graphs: SuffixGraphs = None  # the suffix's pass as CUDA graphs; None: eager
    logits_ref: torch.Tensor = None
    logits_suffix_ref: torch.Tensor = None
    kv_ref: list = None
    samples: dict = field(default_factory=dict)
    errors: list = field(default_factory=list)
    extra: dict = field(default_factory=dict)

    @property
    def prefix(self) -> int:
        return self.context - self.suffix

    @property
    def prefix_chunks(self) -> int:
        return self.prefix // self.mover.chunk_tokens

    def keys(self) -> list[bytes]:
        return kvtier.chunk_keys(self.ns, self.tokens_cpu[:self.prefix])

    def suffix_pass(self, before_layer=None, before_attention=None) -> torch.Tensor:
        """The suffix's forward pass over the cached prefix, as graphs or eagerly; the hooks run
        on the host before layer i is launched and before its attention reads the cache."""
        tokens = self.tokens[self.prefix:]
        if self.graphs is not None:
            return self.graphs.run(tokens, before_layer, before_attention)
        model = self.model
        x = model.embed(tokens)
        for i in range(model.cfg.num_layers):
            if before_layer is not None:
                before_layer(i)
            wait = (lambda i=i: before_attention(i)) if before_attention is not None else None
            x = model.forward_layer(i, x, self.cache, self.prefix, before_attention=wait)
        return model.first_token(x)

    def record(self, arm: str, seconds: float, timed: bool, **extra) -> None:
        if timed:
            self.samples.setdefault(arm, []).append(seconds)
            for k, v in extra.items():
                self.samples.setdefault(f"{arm}:{k}", []).append(v)

    def check_hit(self, arm: str, logits: torch.Tensor) -> None:
        if not self.cache.equals(self.kv_ref, self.prefix):
            self.errors.append(f"{arm}: prefix KV in the cache differs from the recompute's")
        self.check_logits(arm, logits, self.logits_suffix_ref, 1e-3)

    def check_logits(self, arm: str, logits: torch.Tensor, ref: torch.Tensor,
                     tol: float) -> None:
        """A hit computes exactly what the GPU-prefix-hit reference computes (same kernels on the
        same KV), so it must match that closely; the reference itself is checked against the full
        prefill once, more loosely (a different kernel split rounds differently in bf16)."""
        ref = ref.float()
        rel = float((logits.float() - ref).norm() / ref.norm())
        errs = self.extra.setdefault("logit_rel_err", {})
        errs[arm] = max(rel, errs.get(arm, 0.0))
        if not rel <= tol:
            self.errors.append(f"{arm}: first-token logits differ from the reference "
                               f"(relative error {rel:.2e} > {tol:.0e})")

    def make_references(self) -> None:
        """The full prefill's logits and prefix KV, then the suffix-only logits over that KV."""
        logits = self.model.prefill(self.tokens, self.cache)
        self.logits_ref = logits.clone()
        self.kv_ref = self.cache.snapshot(self.prefix)
        self.logits_suffix_ref = self.model.prefill(self.tokens[self.prefix:], self.cache,
                                                    start=self.prefix).clone()
        # bf16 through every layer: a few percent; a misaligned causal mask gives O(1)
        tol = 1e-4 if self.env.dtype == torch.float32 else 0.1
        self.check_logits("suffix-vs-full", self.logits_suffix_ref, self.logits_ref, tol)

    # -- arms ---------------------------------------------------------------------------------

    def run_recompute(self, timed: bool) -> None:
        self.env.sync()
        t0 = time.perf_counter()
        logits = self.model.prefill(self.tokens, self.cache)
        logits.argmax().item()
        t = time.perf_counter() - t0
        self.check_logits("recompute", logits, self.logits_ref, 1e-3)
        self.record("recompute", t, timed)

    def restore_prefix(self) -> None:
        for i, s in enumerate(self.kv_ref):
            self.cache.flat(i, 0)[:self.prefix] = s[0]
            self.cache.flat(i, 1)[:self.prefix] = s[1]

    def run_gpu_hit(self, timed: bool) -> None:
        self.restore_prefix()
        self.env.sync()
        t0 = time.perf_counter()
        logits = self.suffix_pass()
        logits.argmax().item()
        t = time.perf_counter() - t0
        self.check_logits("gpu", logits, self.logits_suffix_ref, 1e-3)
        self.record("gpu", t, timed)

    def start_hit(self, arm: str, store):
        """What every hit does first: poisons the prefix's blocks, starts the clock, derives the
        keys and looks them up. (t0, keys), or None (an error recorded) if any chunk is missing."""
        self.cache.poison(self.prefix)
        self.env.sync()
        t0 = time.perf_counter()
        keys = self.keys()
        total, _ = store.lookup(keys)
        if total != len(keys):
            self.errors.append(f"{arm}: lookup found {total} of {len(keys)} chunks")
            return None
        return t0, keys

    def run_hit(self, arm: str, store, timed: bool, serial: bool = False) -> None:
        """Lookup, pin, scatter (layer-wise, overlapped with the suffix's compute) and the first
        token. Timed from before the key derivation to the first token on the host."""
        env, model, mover = self.env, self.model, self.mover
        started = self.start_hit(arm, store)
        if started is None:
            return
        t0, keys = started
        op = store.prepare_load(keys)
        res = op.wait()
        if res is None or not res.ok or len(res.slots) != len(keys):
            self.errors.append(f"{arm}: prepare_load failed ({res})")
            if res is not None and res.slots:
                store.unpin(res.slots)
            return
        t_pinned = time.perf_counter()
        addrs = [store.slot_address(s) for s in res.slots]
        stream = env.new_stream()
        if serial:
            mover.scatter_all(addrs, stream)
            if stream is not None:
                stream.synchronize()
            logits = self.suffix_pass()
        else:
            events = []
            issue_s = 0.0  # host time spent starting the layer loads
            layers = model.cfg.num_layers

            def issue(layer: int) -> None:
                nonlocal issue_s
                t = time.perf_counter()
                mover.scatter_layer(layer, addrs, stream)
                if stream is not None:
                    ev = torch.cuda.Event()
                    ev.record(stream)
                    events.append(ev)
                issue_s += time.perf_counter() - t

            def next_layer(i: int) -> None:
                if i + 1 < layers:
                    issue(i + 1)  # queue the next layer's copy before this layer's kernels

            def wait(i: int) -> None:
                torch.cuda.current_stream().wait_event(events[i])

            issue(0)
            logits = self.suffix_pass(next_layer, wait if stream is not None else None)
        t_issued = time.perf_counter()  # the host has queued every copy and kernel
        logits.argmax().item()
        t = time.perf_counter() - t0
        store.unpin(res.slots)
        self.check_hit(arm, logits)
        extra = {} if serial else {"issue_s": issue_s}
        self.record(arm, t, timed, pin_s=t_pinned - t0, host_s=t_issued - t0, **extra)

    def run_save(self, store, timed: bool, rep: int) -> None:
        """A 0 %-hit prefill of fresh tokens that saves each layer's KV as soon as it is written."""
        env, model, mover = self.env, self.model, self.mover
        g = torch.Generator().manual_seed(10_000 + rep)
        tokens_cpu = torch.randint(0, model.cfg.vocab_size, (self.context,), generator=g)
        tokens = tokens_cpu.to(env.device)
        n_chunks = self.context // mover.chunk_tokens
        env.sync()
        t0 = time.perf_counter()
        keys = kvtier.chunk_keys(self.ns, tokens_cpu[:n_chunks * mover.chunk_tokens])
        slots = store.reserve_slots(keys)
        if len(slots) != len(keys) or min(slots, default=0) < 0:
            self.errors.append(f"save: reserved {len(slots)} of {len(keys)} fresh slots")
            store.abort_slots(slots)
            return
        addrs = [store.slot_address(s) for s in slots]
        stream = env.new_stream()
        x = model.embed(tokens)
        for i in range(model.cfg.num_layers):
            x = model.forward_layer(i, x, self.cache, 0)
            if stream is not None:
                stream.wait_event(torch.cuda.current_stream().record_event())
            mover.gather_layer(i, addrs, stream)
        logits = model.first_token(x)
        logits.argmax().item()
        t = time.perf_counter() - t0
        if stream is not None:
            stream.synchronize()
        t_saved = time.perf_counter() - t0
        store.commit_slots(keys, slots)
        self.record("save", t, timed, done_s=t_saved)

    def run_streamed_hit(self, arm: str, store, timed: bool, wave: int) -> None:
        """A prefix that must come from storage: pinned in waves of ``wave`` chunks, two waves in
        flight, each wave scattered (all layers) as soon as it is in L1, so the disk reads, the
        PCIe copies and the next wave's reads overlap; then the suffix's forward pass. Layer-wise
        overlap buys nothing here: a chunk file holds every layer, and the disk is ~50x slower
        than the copy."""
        env, mover = self.env, self.mover
        started = self.start_hit(arm, store)
        if started is None:
            return
        t0, keys = started
        starts = list(range(0, len(keys), wave))
        stream = env.new_stream()
        in_flight, pins, failed = [], [], None
        for start in starts[:2]:
            in_flight.append((start, store.prepare_load(keys[start:start + wave])))
        next_wave = 2
        while in_flight:
            start, op = in_flight.pop(0)
            res = op.wait()
            want = len(keys[start:start + wave])
            if res is None or not res.ok or len(res.slots) != want:
                failed = failed or f"{arm}: prepare_load of chunks {start}.. failed ({res})"
                if res is not None and res.slots:
                    pins.append(res.slots)
                continue
            pins.append(res.slots)
            if next_wave < len(starts):
                s0 = starts[next_wave]
                in_flight.append((s0, store.prepare_load(keys[s0:s0 + wave])))
                next_wave += 1
            mover.scatter_all([store.slot_address(s) for s in res.slots], stream, start)
        if failed:
            for p in pins:
                store.unpin(p)
            self.errors.append(failed)
            return
        t_pinned = time.perf_counter()
        if stream is not None:
            torch.cuda.current_stream().wait_stream(stream)
        logits = self.suffix_pass()
        logits.argmax().item()
        t = time.perf_counter() - t0
        for p in pins:
            store.unpin(p)
        self.check_hit(arm, logits)
        self.record(arm, t, timed, pin_s=t_pinned - t0)

    def run_file(self, make_store, timed: bool, wave: int, raw_files=None,
                 read_threads: int = 1) -> None:
        if raw_files:
            # The disk's own speed for this repeat: as many bytes of chunk files read raw (cold,
            # O_DIRECT, as many 4 MiB requests in flight as the tier keeps) just before the tier's
            # hit, so that the floor and the hit see the same disk state (this disk varies from
            # 0.9 to 2.0 GB/s from minute to minute).
            drop_page_cache()
            raw_s = raw_read(raw_files, read_threads * FILE_TIER_QUEUE_DEPTH)
            if timed:
                self.samples.setdefault("file_raw", []).append(raw_s)
        t_open = time.perf_counter()
        store = make_store()  # a fresh engine: populates and pins its L1, outside the timing
        open_s = time.perf_counter() - t_open
        cold = drop_page_cache()
        try:
            self.run_streamed_hit("file", store, timed, wave)
        finally:
            st = store.stats()
            t_close = time.perf_counter()
            self.env.unpin(store)
            store.close()
            close_s = time.perf_counter() - t_close
        if timed:
            self.samples.setdefault("file:page_cache_dropped", []).append(float(cold))
            self.samples.setdefault("file:open_s", []).append(open_s)
            self.samples.setdefault("file:close_s", []).append(close_s)
            self.extra["file_stats"] = st


# The file tier's requests in flight per chunk (FileTierOptions::io_queue_depth) and their size
# (the io engine's max_request_bytes): the raw reference keeps as many in flight.
FILE_TIER_QUEUE_DEPTH = 8
FILE_TIER_REQUEST_BYTES = 4 << 20


def raw_read(paths, threads: int) -> float:
    """Seconds to read `paths` whole with O_DIRECT on `threads` threads (one 4 MiB request in
    flight per thread): the raw disk path the file tier's reads are compared with."""
    import concurrent.futures
    import mmap
    block = FILE_TIER_REQUEST_BYTES

    def read_files(mine):
        buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT needs
        try:
            for path in mine:
                fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
                try:
                    off = 0
                    while True:
                        n = os.preadv(fd, [buf], off)
                        if n <= 0:
                            break
                        off += n
                finally:
                    os.close(fd)
        finally:
            buf.close()

    threads = max(1, min(threads, len(paths)))
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(read_files, [paths[i::threads] for i in range(threads)]))
    return time.perf_counter() - t0


def chunk_files(directory: str, count: int, size: int):
    """`count` chunk files of `size` bytes or more under `directory` (any of them: they are
    alike on the disk), or None when there are fewer."""
    found = []
    for root, _, files in os.walk(directory):
        for f in files:
            path = os.path.join(root, f)
            try:
                if os.path.getsize(path) >= size:
                    found.append(path)
            except OSError:
                pass
    found.sort()
    return found[:count] if len(found) >= count else None


def drop_page_cache() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


# ------------------------------------------------------------------------------------------------
# Stores


class ServeProcess:
    """A `kvtier serve` daemon with an L1 pool only, on a private socket."""

    def __init__(self, kvtier_bin: str, chunk_bytes: int, l1_gib: float, workdir: str):
        self.socket = os.path.join(workdir, "kvtier.sock")
        cmd = [kvtier_bin, "serve", "--socket", self.socket, "--no-l2", "--chunk-bytes",
               str(chunk_bytes), "--l1-size-gb", f"{l1_gib:.3f}", "--http-port", "-1",
               "--log-level", "warn"]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while not os.path.exists(self.socket):
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvtier serve exited with {self.proc.returncode}: {cmd}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("kvtier serve did not create its socket within 60 s")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# The per-context probe's pool: 16 readers x 2 files of one chunk each, so every read phase reads
# 32 chunks (1.2 GB at Qwen3-8B's 36 MiB: as much as an 8k prefix), about a second per phase on
# a 1-2 GB/s disk; the whole probe (write, three read phases, control, buffered) takes seconds.
DISK_PROBE_MAX_READERS = 16
DISK_PROBE_FILES_PER_READER = 2


def run_json(cmd: list[str], what: str) -> tuple[dict, float]:
    """Runs a `kvtier` command that prints JSON: (its JSON, seconds it took). Raises RuntimeError
    if it fails or prints no JSON object."""
    log("+ " + " ".join(cmd))
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if out.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {out.returncode}): {out.stderr.strip()[-500:]}")
    try:
        j = json.loads(out.stdout)
    except ValueError as e:
        raise RuntimeError(f"{what} printed no usable JSON ({e}): {out.stdout.strip()[-300:]}")
    if not isinstance(j, dict):
        raise RuntimeError(f"{what} printed no usable JSON (not an object): {out.stdout[-300:]}")
    return j, seconds


def storage_bandwidth(kvtier_bin: str, directory: str, chunk_bytes: int, read_threads: int) -> dict:
    """`kvtier bench storage` on the file tier's directory: O_DIRECT reads of chunk-sized files
    with 1, `read_threads` and 16 readers. ``read_GBps`` is the figure at `read_threads` readers,
    the tier's own concurrency (what docs/planner.md tells a user to measure); ``read_GBps_max``
    the best reader count's. Raises RuntimeError if the probe fails or gives no usable figure."""
    reader_counts = sorted({1, read_threads, DISK_PROBE_MAX_READERS})
    cmd = [kvtier_bin, "bench", "storage", directory, "--file-size", str(chunk_bytes),
           "--readers", ",".join(map(str, reader_counts)),
           "--files-per-reader", str(DISK_PROBE_FILES_PER_READER), "--json"]
    j, probe_s = run_json(cmd, "kvtier bench storage")
    try:
        reads = {int(r["readers"]): float(r["read_GBps"]) for r in j["readers"]}
    except (ValueError, KeyError, TypeError) as e:
        raise RuntimeError(f"kvtier bench storage printed no usable JSON ({e}): {j}")
    if not reads.get(read_threads, 0) > 0:
        raise RuntimeError(f"kvtier bench storage gave no read figure at {read_threads} readers: "
                           f"{reads}")
    bytes_per_phase = next((int(r["bytes"]) for r in j["readers"] if "bytes" in r), None)
    return {"read_GBps": reads[read_threads], "readers": read_threads,
            "read_GBps_max": max(reads.values()), "read_GBps_by_readers": reads,
            "write_GBps": j.get("write_GBps"), "o_direct": j.get("o_direct"),
            "bytes_per_phase": bytes_per_phase, "probe_s": probe_s}


# The per-context file-tier benchmark: 24 chunks written and read per round, two rounds (raw and
# tier alternate going first), so 1.8 GB read through the tier at 36 MiB, as much as a 12k prefix;
# about 5 s on a 1-2 GB/s disk, write phases included.
TIER_PROBE_CHUNKS = 24
TIER_PROBE_REPEATS = 2


def tier_chunk_mib(chunk_bytes: int) -> int:
    """The run's chunk size in whole MiB (`kvtier bench tier --chunk-mib`), at least 1."""
    return max(1, round(chunk_bytes / (1 << 20)))


def tier_bandwidth(kvtier_bin: str, directory: str, chunk_bytes: int, read_threads: int) -> dict:
    """`kvtier bench tier` on the file tier's directory: chunks of the run's size written and read
    through a file tier with `read_threads` read threads and the tier's queue depth, the page cache
    dropped before the reads and checked empty after, and plain O_DIRECT reads of the same files in
    the same run. ``read_GBps`` is the tier's read figure, ``raw_read_GBps`` the plain reads'.
    Raises RuntimeError if it fails (a page cache that served the reads makes it exit 1), reports
    no cold reads or gives no usable figure."""
    chunk_mib = tier_chunk_mib(chunk_bytes)
    cmd = [kvtier_bin, "bench", "tier", "--dir", directory, "--chunk-mib", str(chunk_mib),
           "--chunks", str(TIER_PROBE_CHUNKS), "--readers", str(read_threads),
           "--io-depth", str(FILE_TIER_QUEUE_DEPTH), "--repeats", str(TIER_PROBE_REPEATS),
           "--json"]
    j, bench_s = run_json(cmd, "kvtier bench tier")
    try:
        read, raw = float(j["read_GBps"]), float(j["raw_read_GBps"])
        write, raw_write = float(j["write_GBps"]), float(j["raw_write_GBps"])
    except (ValueError, KeyError, TypeError) as e:
        raise RuntimeError(f"kvtier bench tier printed no usable JSON ({e}): {j}")
    if j.get("o_direct") is not True:
        raise RuntimeError(f"kvtier bench tier did not read cold (o_direct {j.get('o_direct')}, "
                           f"{j.get('page_cache_resident_bytes')} bytes left in the page cache): "
                           f"{j.get('warnings')}")
    if not (read > 0 and raw > 0):
        raise RuntimeError(f"kvtier bench tier gave no read figure: tier {read}, raw {raw}")
    return {"read_GBps": read, "raw_read_GBps": raw, "read_ratio": read / raw,
            "write_GBps": write, "raw_write_GBps": raw_write,
            "readers": read_threads, "io_depth": FILE_TIER_QUEUE_DEPTH, "chunk_mib": chunk_mib,
            "chunk_bytes_exact": chunk_mib << 20 == chunk_bytes,
            "chunks": TIER_PROBE_CHUNKS, "repeats": TIER_PROBE_REPEATS,
            "read_bytes": TIER_PROBE_CHUNKS * TIER_PROBE_REPEATS * (chunk_mib << 20),
            "io_engine": j.get("io_engine"), "o_direct": True,
            "page_cache_resident_bytes": j.get("page_cache_resident_bytes"), "bench_s": bench_s}


def copy_bandwidth(env: Env, nbytes: int = GiB, repeats: int = 5) -> dict:
    """Host->GPU and GPU->host over PCIe from pinned memory, median of repeats (GB/s). On a CPU
    "device" the KV cache is host memory and the copy is a memcpy: that is measured instead."""
    if not env.cuda:
        nbytes = min(nbytes, 256 << 20)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=env.cuda)
    host.random_(0, 255)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=env.device)
    res = {}
    for name, fn in (("h2d_GBps", lambda: dev.copy_(host, non_blocking=True)),
                     ("d2h_GBps", lambda: host.copy_(dev, non_blocking=True))):
        times = []
        for _ in range(repeats + 1):
            env.sync()
            t0 = time.perf_counter()
            fn()
            env.sync()
            times.append(time.perf_counter() - t0)
        res[name] = nbytes / median(times[1:]) / 1e9
    return res


# ------------------------------------------------------------------------------------------------
# Main


def measure(args) -> dict:
    cuda = torch.cuda.is_available() and args.device != "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but PyTorch sees no CUDA device")
    if cuda and not kvtier.cuda_built():
        raise SystemExit("error: this kvtier was built without CUDA; rebuild with "
                         "CMAKE_ARGS=-DKVTIER_WITH_CUDA=ON pip install .")
    suffix_pass = args.suffix_pass or ("graphs" if cuda else "eager")
    if suffix_pass == "graphs" and not cuda:
        raise SystemExit("error: --suffix-pass graphs needs a CUDA device")
    dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"), None)
    if not isinstance(dtype, torch.dtype):
        raise SystemExit(f"error: unknown dtype {args.dtype!r}")
    env = Env(torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu"),
              dtype, cuda)
    if args.chunk_tokens % args.block_tokens:
        raise SystemExit("error: --chunk-tokens must be a multiple of --block-tokens")
    if args.suffix <= 0:
        raise SystemExit("error: --suffix must be positive")
    for c in args.contexts:
        if c <= args.suffix or (c - args.suffix) % args.chunk_tokens:
            raise SystemExit(f"error: context {c}: the prefix (context - suffix = "
                             f"{c - args.suffix}) must be a positive multiple of --chunk-tokens")
    try:
        cfg = ModelConfig.load(args.model)
    except ValueError as e:
        raise SystemExit(f"error: {e}")
    arms = args.arms
    kvtier_bin = find_kvtier_bin(args.kvtier_bin)
    if kvtier_bin is None and ("server" in arms or "file" in arms):
        raise SystemExit("error: the server and file arms need the kvtier command: pass "
                         "--kvtier-bin, set KVTIER_BIN or put it on PATH (or leave those arms out)")

    max_ctx = max(args.contexts)
    torch.manual_seed(args.seed)
    log(f"building {cfg.name} ({cfg.num_parameters() / 1e9:.2f} B parameters, {dtype}) on "
        f"{env.device}")
    model = DecoderModel(cfg, env.device, dtype, seed=args.seed)
    cache = PagedKvCache(cfg, blocks_for(max_ctx, args.block_tokens), args.block_tokens, dtype,
                         env.device)
    mechanism = args.mechanism or ("dma" if cuda else "auto")
    mover = ChunkMover(env, cache, args.chunk_tokens, mechanism)
    chunk_bytes = mover.chunk_bytes
    ns = kvtier.KeyNamespace(f"ttft-bench/{cfg.name}", chunk_tokens=args.chunk_tokens)
    prefix_gib_max = (max_ctx - args.suffix) * cfg.kv_bytes_per_token(dtype) / GiB
    # twice the largest prefix: kvtier lets one client hold at most half the pool reserved or pinned
    l1_gib = 2 * (prefix_gib_max * 1.1 + chunk_bytes / GiB * 4)

    result = {
        "model": cfg.name, "parameters": cfg.num_parameters(), "dtype": str(dtype).split(".")[-1],
        "device": torch.cuda.get_device_name(env.device) if cuda else "cpu",
        "kv_bytes_per_token": cfg.kv_bytes_per_token(dtype), "suffix_tokens": args.suffix,
        "chunk_tokens": args.chunk_tokens, "block_tokens": args.block_tokens,
        "chunk_bytes": chunk_bytes, "num_layers": cfg.num_layers,
        "copy_mechanism": mover.whole.auto_mechanism if mechanism == "auto" else mechanism,
        "layer_copy_mechanism": mover.per_layer[0].auto_mechanism
        if mechanism == "auto" else mechanism,
        "warmup": args.warmup, "repeats": args.repeats, "arms": arms, "rows": [],
        "suffix_pass": suffix_pass,
    }
    result.update(copy_bandwidth(env))
    log(f"PCIe pinned copy: host->GPU {result['h2d_GBps']:.1f} GB/s, "
        f"GPU->host {result['d2h_GBps']:.1f} GB/s")

    # The suffix's length as a prefill of its own: the prefill table's shortest point, which
    # carries the fixed cost of one forward pass into `kvtier plan`'s hit prediction. Measured
    # here for the comparisons after every context (a run cut short keeps one), and again at the
    # end for the final table, as before: on the H200 the pass read 12.5 ms here where the end of
    # earlier runs read 15.2-15.4 (why is not known), and with the end's figure the planner's
    # suffix matched the measured GPU hit (17.3 against 17.5 ms at 8k).
    result["suffix_prefill_start_s"] = short_prefill(env, model, cache, cfg, args, suffix_pass)
    result["suffix_prefill_s"] = result["suffix_prefill_start_s"]
    compare_plan = kvtier_bin is not None and ("l1" in arms or "file" in arms)
    if "file" in arms:
        result["disk_probe"] = {
            "when": "before each context's repeats", "directory": "the file tier's",
            "file_bytes": chunk_bytes, "readers": sorted({1, args.read_threads,
                                                          DISK_PROBE_MAX_READERS}),
            "files_per_reader": DISK_PROBE_FILES_PER_READER,
            "used": f"read_GBps at {args.read_threads} readers (--read-threads), for the "
                    "file floor"}
        result["tier_probe"] = {
            "when": "before each context's repeats, after the disk probe",
            "command": "kvtier bench tier", "directory": "the file tier's",
            "chunk_mib": tier_chunk_mib(chunk_bytes), "chunks": TIER_PROBE_CHUNKS,
            "repeats": TIER_PROBE_REPEATS, "readers": args.read_threads,
            "io_depth": FILE_TIER_QUEUE_DEPTH,
            "used": "read_GBps (the tier's reads), for kvtier plan's --tier disk:"}

    workdir = tempfile.mkdtemp(prefix="kvtier-ttft-")
    file_dir = args.dir or tempfile.mkdtemp(prefix="kvtier-ttft-", dir="/var/tmp")
    own_file_dir = args.dir is None
    server = client = engine = save_engine = None
    try:
        if "file" in arms:
            os.makedirs(file_dir, exist_ok=True)
        engine = kvtier.open_engine(ns, chunk_bytes, l1_size_gb=l1_gib, l2=None)
        env.pin(engine)
        if "save" in arms:
            save_gib = max_ctx * cfg.kv_bytes_per_token(dtype) / GiB * 3
            save_engine = kvtier.open_engine(ns, chunk_bytes, l1_size_gb=save_gib, l2=None)
            env.pin(save_engine)
        if "server" in arms:
            server = ServeProcess(kvtier_bin, chunk_bytes, l1_gib, workdir)
            client = kvtier.connect(ns, chunk_bytes, socket_path=server.socket,
                                    client_name="ttft-bench", rpc_timeout_ms=60_000)
            env.pin(client)
        l2 = {"type": "fs", "path": file_dir, "max_size_gb": max(1.0, prefix_gib_max * 2.5),
              "read_threads": args.read_threads, "write_threads": 4}  # queue depth: the default

        for ctx in args.contexts:
            t_ctx = time.perf_counter()
            g = torch.Generator().manual_seed(args.seed * 1_000_003 + ctx)
            tokens_cpu = torch.randint(0, cfg.vocab_size, (ctx,), generator=g)
            run = ContextRun(env, model, cache, mover, ns, ctx, args.suffix,
                             tokens_cpu.to(env.device), tokens_cpu)
            log(f"context {ctx}: reference prefill")
            run.make_references()
            if suffix_pass == "graphs":
                t_cap = time.perf_counter()
                try:
                    run.graphs = SuffixGraphs(model, cache, run.prefix, args.suffix)
                except RuntimeError as e:  # recorded, and the context measured eagerly
                    run.errors.append(f"capturing the suffix pass as CUDA graphs failed: {e}")
                    log(f"ERROR context {ctx}: graph capture failed, eager pass: {e}")
                    torch.cuda.synchronize()
                else:
                    log(f"context {ctx}: suffix pass captured as CUDA graphs "
                        f"({time.perf_counter() - t_cap:.1f} s)")
            keys = run.keys()
            ctx_arms = list(arms)
            # The file arm's fresh engine (one per repeat) gets an L1 for this context's prefix,
            # not the largest one's: it populates and pins its whole pool at open, which on the
            # H200 machine took 0.65-0.8 s per GiB in every repeat (outside the timing, but the
            # run's length: 6.6 s a repeat at 32k).
            file_l1_gib = 2 * (run.prefix * cfg.kv_bytes_per_token(dtype) / GiB * 1.1
                               + chunk_bytes / GiB * 4)

            def open_file_store(write_policy="write_back", l1=file_l1_gib):
                s = kvtier.open_engine(ns, chunk_bytes, l1_size_gb=l1, l2=l2,
                                       write_policy=write_policy, load_deadline_ms=600_000)
                env.pin(s)
                return s

            def stored(store, names) -> None:
                # A store that cannot take the prefix fails its arms for this context, not the run.
                try:
                    store_prefix(store, keys, mover, env)
                except RuntimeError as e:
                    run.errors.append(f"{'/'.join(names)}: storing the prefix failed: {e}")
                    ctx_arms[:] = [a for a in ctx_arms if a not in names]

            stored(engine, ("l1", "l1-serial"))
            if client is not None:
                stored(client, ("server",))
            if "file" in arms:
                fs = open_file_store("write_through")
                stored(fs, ("file",))
                env.unpin(fs)
                fs.close()  # waits for every chunk file to be written
                raw_files = chunk_files(file_dir, len(keys), chunk_bytes)
                # The disk of this minute, as a user would measure it for the tier: the floor's
                # and the plan's figure for this context. No figure, no floor: the run stops.
                try:
                    run.extra["disk"] = storage_bandwidth(kvtier_bin, file_dir, chunk_bytes,
                                                          args.read_threads)
                except RuntimeError as e:
                    raise RuntimeError(f"context {ctx}: measuring the disk before the file "
                                       f"tier's repeats: {e}") from e
                d = run.extra["disk"]
                log(f"context {ctx}: disk O_DIRECT read {d['read_GBps']:.2f} GB/s at "
                    f"{d['readers']} readers, best {d['read_GBps_max']:.2f} ("
                    + ", ".join(f"{n}: {v:.2f}" for n, v in d["read_GBps_by_readers"].items())
                    + f"; probe {d['probe_s']:.1f} s)")
                # The tier itself, as a user would measure it for `kvtier plan`: the plan's
                # figure for this context. Measured last, right before the hits.
                try:
                    run.extra["tier"] = tier_bandwidth(kvtier_bin, file_dir, chunk_bytes,
                                                       args.read_threads)
                except RuntimeError as e:
                    raise RuntimeError(f"context {ctx}: measuring the file tier before its "
                                       f"repeats: {e}") from e
                tb = run.extra["tier"]
                log(f"context {ctx}: bench tier read {tb['read_GBps']:.2f} GB/s, raw O_DIRECT "
                    f"{tb['raw_read_GBps']:.2f} (ratio {tb['read_ratio']:.2f}); "
                    f"{tb['readers']} readers, {tb['chunks']} x {tb['chunk_mib']} MiB x "
                    f"{tb['repeats']}; {tb['bench_s']:.1f} s")
            for rep in range(args.warmup + args.repeats):
                timed = rep >= args.warmup
                # Every other repeat runs the arms in reverse: an arm that always follows the
                # idle file arm (a cool GPU boosts higher) or a busy one would otherwise carry
                # that order in its figures (seen: saves "faster" than plain prefills by 1-4 %).
                for arm in (ctx_arms if rep % 2 == 0 else ctx_arms[::-1]):
                    if arm == "recompute":
                        run.run_recompute(timed)
                    elif arm == "gpu":
                        run.run_gpu_hit(timed)
                    elif arm == "l1":
                        run.run_hit("l1", engine, timed)
                    elif arm == "l1-serial":
                        run.run_hit("l1-serial", engine, timed, serial=True)
                    elif arm == "server":
                        run.run_hit("server", client, timed)
                    elif arm == "file":
                        run.run_file(open_file_store, timed, args.load_wave, raw_files,
                                     args.read_threads)
                    elif arm == "save":
                        run.run_save(save_engine, timed, rep * 1_000_003 + ctx)
            row = summarize(run, result, cfg, dtype)
            row["wall_s"] = time.perf_counter() - t_ctx
            result["rows"].append(row)
            set_prefill_table(result, args.suffix)
            if compare_plan:
                compare_with_plan(kvtier_bin, result, args, dtype, complete=False)
            save_partial(args, result)
            log(format_row(row))
            if "file_vs_raw" in row:
                log(f"  file tier {row['file_s'] * 1e3:.1f} ms against the same bytes read raw in "
                    f"each repeat {row['file_raw_s'] * 1e3:.1f} ms "
                    f"({row['file_raw_GBps']:.2f} GB/s) + GPU hit: {row['file_vs_raw']:.2f}x")
            if run.errors:
                log("\n".join("  ERROR " + e for e in run.errors))
            del run
    finally:
        for s in (client, engine, save_engine):
            if s is not None:
                env.unpin(s)
                s.close()
        if server is not None:
            server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
        if own_file_dir:
            shutil.rmtree(file_dir, ignore_errors=True)
    result["suffix_prefill_s"] = short_prefill(env, model, cache, cfg, args, suffix_pass)
    result["h2d_GBps_end"] = copy_bandwidth(env)["h2d_GBps"]
    result["attention"] = {None: "not used", True: "SDPA, lower-right causal, grouped KV heads",
                           False: "SDPA, lower-right causal, KV heads expanded"}[
                               model_mod._LOWER_RIGHT_GQA_OK]
    result["torch"] = torch.__version__
    set_prefill_table(result, args.suffix)
    if compare_plan:
        compare_with_plan(kvtier_bin, result, args, dtype, complete=True)
    result["targets"] = targets(result)
    return result


def set_prefill_table(result: dict, suffix: int) -> None:
    """The prefill table of the contexts measured so far, the suffix's own prefill first."""
    points = [(r["context"], r["recompute_s"]) for r in result["rows"] if "recompute_s" in r]
    if "suffix_prefill_s" in result:
        points.insert(0, (suffix, result["suffix_prefill_s"]))
    result["prefill_table"] = ",".join(f"{c}:{t:.4f}" for c, t in points)


def compare_with_plan(kvtier_bin: str, result: dict, args, dtype, complete: bool) -> None:
    try:
        result["plan"] = plan_comparison(kvtier_bin, result, args, dtype)
        result["plan"]["prefill_table_complete"] = complete
        result.pop("plan_error", None)
    except (RuntimeError, ValueError, KeyError) as e:
        result["plan_error"] = str(e)
        log(f"ERROR kvtier plan: {e}")


def short_prefill(env: Env, model, cache, cfg: ModelConfig, args, suffix_pass: str) -> float:
    """Median seconds of a full prefill of --suffix tokens from an empty cache, run the way the
    hit arms run their suffix (graphs or eager)."""
    g = torch.Generator().manual_seed(args.seed + 7)
    tokens = torch.randint(0, cfg.vocab_size, (args.suffix,), generator=g).to(env.device)
    graphs = SuffixGraphs(model, cache, 0, args.suffix) if suffix_pass == "graphs" else None
    times = []
    for rep in range(args.warmup + args.repeats):
        env.sync()
        t0 = time.perf_counter()
        if graphs is not None:
            graphs.run(tokens).argmax().item()
        else:
            model.prefill(tokens, cache).argmax().item()
        if rep >= args.warmup:
            times.append(time.perf_counter() - t0)
    return median(times)


def plan_comparison(kvtier_bin: str, result: dict, args, dtype) -> dict:
    """`kvtier plan`'s single-request hit prediction from this run's prefill table, PCIe and disk
    bandwidths, against the measured hits (the L1 arm for the host tier, the file arm for disk).
    The disk's figure is `kvtier bench tier`'s read through the file tier; the file hit is
    predicted a second time from `kvtier bench storage`'s figure (``plan_file_probe_s``)."""
    model_path = args.model if os.path.exists(args.model) else \
        os.path.join(model_mod.CONFIG_DIR, args.model + ".json")
    layers = result["num_layers"]
    # kvtier plan refuses a table whose time falls with length; on a noisy host a short point can
    # come out above a longer one: each point is taken as at least the one before it.
    points, floor = [], 0.0
    for p in result["prefill_table"].split(","):
        tokens, seconds = p.split(":")
        floor = max(floor, float(seconds))
        points.append(f"{tokens}:{floor:.4f}")
    common = [kvtier_bin, "plan", "--fast", "--json", "--model", model_path,
              "--dtype", str(dtype).split(".")[-1], "--prefill-table", ",".join(points),
              "--hit-suffix", str(args.suffix), "--step-overhead-ms", "0",
              "--tier", f"cpu:1TiB:{result['h2d_GBps']:.3f}GB/s"]
    rows, commands, probe_commands = [], [], []

    def plan(cmd: list[str]) -> dict | None:
        log("+ " + " ".join(cmd))
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"kvtier plan failed: {out.stderr.strip()[-500:]}")
        singles = json.loads(out.stdout)["single_request"]["rows"]
        return singles[0] if singles else None

    for r in result["rows"]:
        # The disk as a user measures it for the tier beforehand: `kvtier bench tier` (reads
        # through a file tier with the same read threads and queue depth), run right before this
        # context's repeats. `kvtier bench storage`'s plain reads at the tier's reader count, run
        # just before it, read 9 % faster than the tier on average on the H200 machine's disk and
        # moved from context to context while the tier's rate held: its prediction is kept
        # beside, for comparison.
        tier_GBps = r["tier"]["read_GBps"] if "tier" in r else None
        probe_GBps = r["disk"]["read_GBps"] if "disk" in r else None
        # The host time the L1 arm spent starting its layer loads, per layer, measured in the
        # same run. It lengthens the suffix only where the launching thread is the bottleneck:
        # the eager pass. With the suffix in CUDA graphs that thread queues each layer's copy and
        # two graph launches well ahead of the GPU, so the loads cost the GPU no time (0).
        measured_us = r.get("l1_issue_s", 0.0) / layers * 1e6
        issue_us = measured_us if result.get("suffix_pass", "eager") == "eager" else 0.0
        tail = ["--context", str(r["context"]), "--layer-load-overhead-us", f"{issue_us:.1f}"]

        def disk(gbps):
            return ["--tier", f"disk:1TiB:{gbps:.3f}GB/s"] if gbps is not None else []

        cmd = common + disk(tier_GBps) + tail
        commands.append(" ".join(cmd))
        p = plan(cmd)
        if p is None:
            continue
        row = {"context": r["context"], "plan_recompute_s": p["recompute_s"],
               "plan_suffix_s": p["suffix_s"], "layer_load_overhead_us": issue_us,
               "layer_issue_us_measured": measured_us}
        if tier_GBps is not None:
            row["disk_GBps"] = tier_GBps
            row["disk_source"] = "kvtier bench tier"
        for arm, tier in (("l1", "cpu"), ("file", "disk")):
            if f"{arm}_s" in r and tier in p["hit_ttft_s"]:
                row[f"plan_{arm}_s"] = p["hit_ttft_s"][tier]
                row[f"{arm}_s"] = r[f"{arm}_s"]
                row[f"{arm}_error"] = p["hit_ttft_s"][tier] / r[f"{arm}_s"] - 1
        if probe_GBps is not None and "file_s" in r:
            cmd = common + disk(probe_GBps) + tail
            probe_commands.append(" ".join(cmd))
            q = plan(cmd)
            if q is not None and "disk" in q["hit_ttft_s"]:
                row["probe_GBps"] = probe_GBps
                row["plan_file_probe_s"] = q["hit_ttft_s"]["disk"]
                row["file_error_probe"] = q["hit_ttft_s"]["disk"] / r["file_s"] - 1
        rows.append(row)
    return {"commands": commands, "probe_commands": probe_commands, "rows": rows}


def summarize(run: ContextRun, result: dict, cfg: ModelConfig, dtype) -> dict:
    s = run.samples
    prefix_bytes = run.prefix * cfg.kv_bytes_per_token(dtype)
    row = {"context": run.context, "prefix_tokens": run.prefix, "prefix_bytes": prefix_bytes,
           "errors": run.errors}
    for arm in ALL_ARMS:
        if arm in s:
            key = arm.replace("-", "_")
            row[f"{key}_s"] = median(s[arm])
            row[f"{key}_max_s"] = max(s[arm])
            row[f"{key}_samples"] = s[arm]
    for k in ("l1:pin_s", "server:pin_s", "file:pin_s", "l1:host_s", "server:host_s",
              "file:host_s", "save:done_s", "l1:issue_s", "server:issue_s", "file:open_s",
              "file:close_s"):
        if k in s:
            row[k.replace(":", "_").replace("-", "_")] = median(s[k])
    if "file:page_cache_dropped" in s:
        row["file_page_cache_dropped"] = all(s["file:page_cache_dropped"])
    if "file_stats" in run.extra:
        row["file_o_direct"] = _find(run.extra["file_stats"], "o_direct")
    row["logit_rel_err"] = run.extra.get("logit_rel_err", {})
    copy_s = prefix_bytes / (result["h2d_GBps"] * 1e9) if result["h2d_GBps"] > 0 else float("nan")
    row["copy_floor_s"] = copy_s
    rec = row.get("recompute_s")
    gpu = row.get("gpu_s")
    if gpu is not None:
        # the first layer's copy cannot overlap anything; the rest hides behind the compute
        row["l1_floor_s"] = max(copy_s, gpu) + copy_s / cfg.num_layers
    disk = run.extra.get("disk")
    if disk is not None:
        row["disk"] = disk
    if "tier" in run.extra:
        row["tier"] = run.extra["tier"]
    if gpu is not None and disk is not None:
        # `kvtier bench storage` right before this context's repeats: at the tier's reader count
        # (the floor of the issue; the plan takes bench tier's figure), and at the best of its
        # reader counts (a lower floor, so a stricter ratio).
        row["file_floor_s"] = prefix_bytes / (disk["read_GBps"] * 1e9) + gpu
        row["file_floor_best_s"] = prefix_bytes / (disk["read_GBps_max"] * 1e9) + gpu
    if "file_raw" in s:
        # The same bytes read raw, interleaved with the hits (run_file): whether the tier keeps
        # up with the disk of that minute, which can drift far from the probe's.
        row["file_raw_s"] = median(s["file_raw"])
        row["file_raw_samples"] = s["file_raw"]
        row["file_raw_GBps"] = prefix_bytes / row["file_raw_s"] / 1e9
        if "file_s" in row and gpu is not None:
            row["file_vs_raw"] = row["file_s"] / (row["file_raw_s"] + gpu)
    for arm in ("gpu", "l1", "l1_serial", "server", "file"):
        if f"{arm}_s" in row and rec:
            row[f"{arm}_speedup"] = rec / row[f"{arm}_s"]
    if "file_s" in row and "file_floor_best_s" in row:
        row["file_vs_best_floor"] = row["file_s"] / row["file_floor_best_s"]
    for arm, floor in (("l1", "l1_floor_s"), ("server", "l1_floor_s"), ("file", "file_floor_s")):
        if f"{arm}_s" in row and floor in row:
            row[f"{arm}_vs_floor"] = row[f"{arm}_s"] / row[floor]
            row[f"{arm}_vs_floor_max"] = row[f"{arm}_max_s"] / row[floor]
    if "save_s" in row and rec:
        row["save_overhead"] = row["save_s"] / rec - 1
    return row


def _find(d, key):
    if isinstance(d, dict):
        if key in d:
            return d[key]
        for v in d.values():
            r = _find(v, key)
            if r is not None:
                return r
    return None


def targets(result: dict) -> dict:
    rows = {r["context"]: r for r in result["rows"]}
    t = {}
    r24 = rows.get(24576)
    if r24 and "l1_speedup" in r24:
        t["l1_24k_speedup_ge_10x"] = r24["l1_speedup"] >= 10
    l1 = [r["l1_vs_floor"] for r in rows.values() if "l1_vs_floor" in r]
    if l1:
        t["l1_within_1.3x_floor"] = max(l1) <= 1.3
        t["l1_within_1.3x_floor_every_repeat"] = max(
            r["l1_vs_floor_max"] for r in rows.values() if "l1_vs_floor_max" in r) <= 1.3
    fl = [r["file_vs_floor"] for r in rows.values() if "file_vs_floor" in r]
    if fl:
        t["file_within_1.2x_floor"] = max(fl) <= 1.2
    fb = [r["file_vs_best_floor"] for r in rows.values() if "file_vs_best_floor" in r]
    if fb:
        t["file_within_1.2x_best_floor"] = max(fb) <= 1.2
    sv = [r["save_overhead"] for r in rows.values() if "save_overhead" in r]
    if sv:
        t["save_overhead_le_1pct"] = max(sv) <= 0.01
    errs = [abs(p[k]) for p in result.get("plan", {}).get("rows", [])
            for k in ("l1_error", "file_error") if k in p]
    if errs:
        t["plan_within_10pct"] = max(errs) <= 0.10
    for name, k in (("plan_file_within_10pct", "file_error"),
                    ("plan_file_within_10pct_with_probe", "file_error_probe")):
        fe = [abs(p[k]) for p in result.get("plan", {}).get("rows", []) if k in p]
        if fe:
            t[name] = max(fe) <= 0.10
    t["all_hits_verified"] = not any(r["errors"] for r in rows.values())
    return t


def format_row(r: dict) -> str:
    def ms(k):
        v = r.get(k)
        return f"{v * 1e3:9.1f}" if v is not None and not math.isnan(v) else f"{'-':>9}"

    return (f"{r['context']:>7} {ms('recompute_s')} {ms('gpu_s')} {ms('l1_s')} "
            f"{ms('l1_serial_s')} {ms('server_s')} {ms('file_s')} {ms('save_s')} "
            f"{ms('copy_floor_s')} {ms('l1_floor_s')} {ms('file_floor_s')}")


def print_table(result: dict) -> None:
    print(f"kvtier TTFT benchmark: {result['model']} ({result['parameters'] / 1e9:.2f} B, "
          f"{result['dtype']}) on {result['device']}; suffix {result['suffix_tokens']} tokens, "
          f"chunks of {result['chunk_tokens']}, {result['block_tokens']}-token blocks, copier "
          f"{result['layer_copy_mechanism']}; suffix pass {result.get('suffix_pass', 'eager')}; "
          f"median of {result['repeats']} after {result['warmup']} warm-ups")
    print(f"PCIe pinned host->GPU {result['h2d_GBps']:.1f} GB/s (end of run "
          f"{result.get('h2d_GBps_end', float('nan')):.1f}), GPU->host {result['d2h_GBps']:.1f}")
    disks = [r for r in result["rows"] if "disk" in r]
    if disks:
        print("disk (kvtier bench storage before each context's repeats; the file floor takes "
              "the figure at the tier's reader count):")
        for r in disks:
            d = r["disk"]
            by = ", ".join(f"{n}: {v:.2f}" for n, v in d["read_GBps_by_readers"].items())
            write = d["write_GBps"]
            write = f"{write:.2f} GB/s" if isinstance(write, (int, float)) else "-"
            print(f"{r['context']:>7}: O_DIRECT {d['o_direct']}, read {d['read_GBps']:.2f} GB/s at "
                  f"{d['readers']} readers, best {d['read_GBps_max']:.2f} (readers {by}), "
                  f"write {write}; probe {d['probe_s']:.1f} s")
    tiers = [r for r in result["rows"] if "tier" in r]
    if tiers:
        print("file tier (kvtier bench tier before each context's repeats, after the probe; the "
              "plan takes its tier read figure):")
        for r in tiers:
            t = r["tier"]
            print(f"{r['context']:>7}: tier read {t['read_GBps']:.2f} GB/s, raw O_DIRECT "
                  f"{t['raw_read_GBps']:.2f} (tier / raw {t['read_ratio']:.2f}); write "
                  f"{t['write_GBps']:.2f}, raw {t['raw_write_GBps']:.2f}; {t['readers']} "
                  f"readers, io depth {t['io_depth']}, {t['chunks']} x {t['chunk_mib']} MiB x "
                  f"{t['repeats']}, o_direct {t['o_direct']}; {t['bench_s']:.1f} s")
    print("TTFT in ms:")
    print(f"{'context':>7} {'recompute':>9} {'gpu-hit':>9} {'l1':>9} {'l1-serial':>9} "
          f"{'server':>9} {'file':>9} {'save':>9} {'copy-flr':>9} {'l1-floor':>9} "
          f"{'file-flr':>9}")
    for r in result["rows"]:
        print(format_row(r))
    for r in result["rows"]:
        if "file_vs_raw" in r:
            print(f"{r['context']:>7}: file tier {r['file_s'] * 1e3:.1f} ms, the same bytes read "
                  f"raw (O_DIRECT, as many threads, interleaved) {r['file_raw_s'] * 1e3:.1f} ms "
                  f"= {r['file_raw_GBps']:.2f} GB/s; tier / (raw + GPU hit) "
                  f"{r['file_vs_raw']:.2f}x")
    for r in result["rows"]:
        if "file_samples" in r:
            xs = sorted(v * 1e3 for v in r["file_samples"])
            raw = " ".join(f"{v * 1e3:.0f}" for v in r.get("file_raw_samples", []))
            print(f"{r['context']:>7}: file hit samples " + " ".join(f"{v:.0f}" for v in xs)
                  + (f"; raw reads, in order: {raw}" if raw else ""))
    print("samples (ms): p50 / max, every sample")
    for r in result["rows"]:
        for arm in ("gpu", "l1", "l1_serial", "server"):
            if f"{arm}_samples" in r:
                xs = sorted(v * 1e3 for v in r[f"{arm}_samples"])
                print(f"{r['context']:>7} {arm:>9} {r[f'{arm}_s'] * 1e3:6.1f} / {xs[-1]:6.1f}  "
                      + " ".join(f"{v:.1f}" for v in xs))
    print("ratios:")
    for r in result["rows"]:
        parts = [f"{r['context']:>7}"]
        for k in ("l1_speedup", "server_speedup", "l1_vs_floor", "l1_vs_floor_max",
                  "server_vs_floor", "file_vs_floor", "file_vs_best_floor", "save_overhead"):
            if k in r:
                parts.append(f"{k} {r[k]:.3f}")
        print("  ".join(parts))
    print(f"prefill table (kvtier plan --prefill-table): {result['prefill_table']}")
    if "plan" in result:
        print("kvtier plan's single-request prediction against the measured hit, ms:")
        for p in result["plan"]["rows"]:
            parts = [f"{p['context']:>7}  suffix {p['plan_suffix_s'] * 1e3:.1f}, layer loads "
                     f"{p['layer_load_overhead_us']:.0f} us each"]
            for arm in ("l1", "file"):
                if f"plan_{arm}_s" in p:
                    parts.append(f"{arm} {p[f'plan_{arm}_s'] * 1e3:.1f} predicted, "
                                 f"{p[f'{arm}_s'] * 1e3:.1f} measured ({p[f'{arm}_error']:+.1%})"
                                 + (f" at {p['disk_GBps']:.3f} GB/s (bench tier)"
                                    if arm == "file" and "disk_GBps" in p else ""))
            if "plan_file_probe_s" in p:
                parts.append(f"with the probe's {p['probe_GBps']:.3f} GB/s "
                             f"{p['plan_file_probe_s'] * 1e3:.1f} ({p['file_error_probe']:+.1%})")
            print("  ".join(parts))
    for k, v in result["targets"].items():
        print(f"target {k}: {'met' if v else 'NOT MET'}")
    for r in result["rows"]:
        for e in r["errors"]:
            print(f"ERROR context {r['context']}: {e}")


def write_plot(result: dict, path: str) -> None:
    """TTFT against context, log scale, one line per arm and the copy floor, as SVG."""
    rows = result["rows"]
    series = [(k, label, color) for k, label, color in (
        ("recompute_s", "recompute", "#d62728"), ("l1_s", "kvtier L1 (in-process)", "#1f77b4"),
        ("server_s", "kvtier serve (shared pool)", "#17becf"),
        ("file_s", "kvtier file tier (cold)", "#ff7f0e"), ("gpu_s", "GPU prefix hit", "#2ca02c"),
        ("copy_floor_s", "copy floor: bytes / PCIe", "#7f7f7f")) if any(k in r for r in rows)]
    vals = [r[k] for r in rows for k, _, _ in series if r.get(k) and r[k] > 0]
    if not rows or not vals:
        return
    w, h, ml, mr, mt, mb = 760, 460, 70, 230, 30, 50
    xs = [r["context"] for r in rows]
    x0, x1 = 0, max(xs) * 1.05
    y0, y1 = math.floor(math.log10(min(vals))), math.ceil(math.log10(max(vals)))
    y1 = max(y1, y0 + 1)

    def px(x):
        return ml + (x - x0) / (x1 - x0) * (w - ml - mr)

    def py(y):
        return mt + (y1 - math.log10(y)) / (y1 - y0) * (h - mt - mb)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
           f'font-family="sans-serif" font-size="12">',
           f'<rect width="{w}" height="{h}" fill="white"/>',
           f'<text x="{ml}" y="18" font-size="14">TTFT, {result["model"]} on '
           f'{result["device"]} ({result["suffix_tokens"]}-token suffix)</text>']
    for e in range(y0, y1 + 1):
        y = py(10 ** e)
        out.append(f'<line x1="{ml}" y1="{y:.1f}" x2="{w - mr}" y2="{y:.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{ml - 6}" y="{y + 4:.1f}" text-anchor="end">'
                   f'{10 ** e * 1e3:g} ms</text>')
    for x in xs:
        out.append(f'<text x="{px(x):.1f}" y="{h - mb + 18}" text-anchor="middle">'
                   f'{x // 1024}k</text>')
    out.append(f'<text x="{(ml + w - mr) / 2}" y="{h - 10}" text-anchor="middle">'
               f'prompt tokens</text>')
    for i, (k, label, color) in enumerate(series):
        pts = [(px(r["context"]), py(r[k])) for r in rows if r.get(k) and r[k] > 0]
        dash = ' stroke-dasharray="6,4"' if k == "copy_floor_s" else ""
        out.append(f'<polyline fill="none" stroke="{color}" stroke-width="2"{dash} points="' +
                   " ".join(f"{x:.1f},{y:.1f}" for x, y in pts) + '"/>')
        for x, y in pts:
            out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{color}"/>')
        ly = mt + 20 + 20 * i
        out.append(f'<line x1="{w - mr + 15}" y1="{ly}" x2="{w - mr + 40}" y2="{ly}" '
                   f'stroke="{color}" stroke-width="2"{dash}/>')
        out.append(f'<text x="{w - mr + 46}" y="{ly + 4}">{label}</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def save_partial(args, result: dict, complete: bool = False) -> None:
    """Writes the result so far to --output (atomically: a reader never sees half a file)."""
    if not args.output:
        return
    tmp = args.output + ".tmp"
    with open(tmp, "w") as f:
        json.dump(dict(result, complete=complete), f, indent=1, default=str)
    os.replace(tmp, args.output)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.warmup < 0 or args.repeats < 1:
        raise SystemExit("error: --warmup must be >= 0 and --repeats >= 1")
    if args.load_wave < 1 or args.read_threads < 1:
        raise SystemExit("error: --load-wave and --read-threads must be >= 1")
    if args.plot:
        d = os.path.dirname(os.path.abspath(args.plot))
        if not os.access(d, os.W_OK):
            raise SystemExit(f"error: cannot write the plot into {d}")
    if args.output:
        d = os.path.dirname(os.path.abspath(args.output))
        if not os.access(d, os.W_OK):
            raise SystemExit(f"error: cannot write the output into {d}")
    result = measure(args)
    save_partial(args, result, complete=True)
    if args.plot:
        write_plot(result, args.plot)
    if args.json:
        print(json.dumps(result, indent=1, default=str))
    else:
        print_table(result)
    return 0 if result["targets"]["all_hits_verified"] else 1


if __name__ == "__main__":
    sys.exit(main())
