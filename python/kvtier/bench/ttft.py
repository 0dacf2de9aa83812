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

This module holds the command line, the device, the chunk mover, the arms (``ContextRun``) and the
run; the storage, tier and copy probes are in ``kvtier.bench.ttft_storage``, the comparison with
``kvtier plan`` in ``kvtier.bench.ttft_plan`` and the rows, table, plot and JSON in
``kvtier.bench.ttft_report``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch

import kvtier
from kvtier.bench import model as model_mod
from kvtier.bench.model import DecoderModel, ModelConfig, PagedKvCache, SuffixGraphs, blocks_for
from kvtier.bench.ttft_common import ALL_ARMS, GiB, log
from kvtier.bench.ttft_plan import compare_with_plan, set_prefill_table, short_prefill
from kvtier.bench.ttft_report import (format_row, print_table, save_partial, summarize, targets,
                                      write_plot)
from kvtier.bench.ttft_storage import (DISK_PROBE_FILES_PER_READER, DISK_PROBE_MAX_READERS,
                                       FILE_TIER_QUEUE_DEPTH, TIER_PROBE_CHUNKS,
                                       TIER_PROBE_REPEATS, ServeProcess, chunk_files,
                                       copy_bandwidth, drop_page_cache, raw_read,
                                       storage_bandwidth, tier_bandwidth, tier_chunk_mib)

HIT_ARMS = ("l1", "l1-serial", "server", "file")


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


# ------------------------------------------------------------------------------------------------
# The run: checked and set up once, then each context measured in turn


@dataclass
class Bench:
    """What every context of a run shares: the arguments, the device, the model with its paged
    KV cache and chunk mover, and the kvtier stores the arms load from (None where no arm needs
    one; ``open_stores`` opens them, ``close_stores`` closes what was opened)."""
    args: argparse.Namespace
    env: Env
    cfg: ModelConfig
    suffix_pass: str  # "graphs" or "eager"
    kvtier_bin: str | None
    model: DecoderModel
    cache: PagedKvCache
    mover: ChunkMover
    mechanism: str
    ns: object
    file_dir: str = None  # the file tier's directory
    l2: dict = None  # the file tier's options, for each fresh file engine
    engine: object = None
    save_engine: object = None
    server: ServeProcess = None
    client: object = None

    @property
    def chunk_bytes(self) -> int:
        return self.mover.chunk_bytes


def check_args(args) -> tuple[Env, ModelConfig, str, str | None]:
    """The device, the model's config, the suffix pass and the kvtier command for a run; exits
    with a message on arguments that cannot run."""
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
    kvtier_bin = find_kvtier_bin(args.kvtier_bin)
    if kvtier_bin is None and ("server" in args.arms or "file" in args.arms):
        raise SystemExit("error: the server and file arms need the kvtier command: pass "
                         "--kvtier-bin, set KVTIER_BIN or put it on PATH (or leave those arms out)")
    return env, cfg, suffix_pass, kvtier_bin


def set_up(args) -> Bench:
    """Checks the arguments, then builds the model (random weights), a paged KV cache for the
    longest context and the chunk mover over it. No store is opened yet."""
    env, cfg, suffix_pass, kvtier_bin = check_args(args)
    dtype = env.dtype
    torch.manual_seed(args.seed)
    log(f"building {cfg.name} ({cfg.num_parameters() / 1e9:.2f} B parameters, {dtype}) on "
        f"{env.device}")
    model = DecoderModel(cfg, env.device, dtype, seed=args.seed)
    cache = PagedKvCache(cfg, blocks_for(max(args.contexts), args.block_tokens),
                         args.block_tokens, dtype, env.device)
    mechanism = args.mechanism or ("dma" if env.cuda else "auto")
    mover = ChunkMover(env, cache, args.chunk_tokens, mechanism)
    ns = kvtier.KeyNamespace(f"ttft-bench/{cfg.name}", chunk_tokens=args.chunk_tokens)
    return Bench(args, env, cfg, suffix_pass, kvtier_bin, model, cache, mover, mechanism, ns)


def describe_run(b: Bench) -> dict:
    """The result's header: the run's settings, the PCIe copy bandwidth, the suffix's own prefill
    at the start and, with a file arm, how the disk and the tier are probed."""
    args, env, cfg, mover, mechanism = b.args, b.env, b.cfg, b.mover, b.mechanism
    dtype, chunk_bytes = env.dtype, b.chunk_bytes
    result = {
        "model": cfg.name, "parameters": cfg.num_parameters(), "dtype": str(dtype).split(".")[-1],
        "device": torch.cuda.get_device_name(env.device) if env.cuda else "cpu",
        "kv_bytes_per_token": cfg.kv_bytes_per_token(dtype), "suffix_tokens": args.suffix,
        "chunk_tokens": args.chunk_tokens, "block_tokens": args.block_tokens,
        "chunk_bytes": chunk_bytes, "num_layers": cfg.num_layers,
        "copy_mechanism": mover.whole.auto_mechanism if mechanism == "auto" else mechanism,
        "layer_copy_mechanism": mover.per_layer[0].auto_mechanism
        if mechanism == "auto" else mechanism,
        "warmup": args.warmup, "repeats": args.repeats, "arms": args.arms, "rows": [],
        "suffix_pass": b.suffix_pass,
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
    result["suffix_prefill_start_s"] = short_prefill(env, b.model, b.cache, cfg, args,
                                                     b.suffix_pass)
    result["suffix_prefill_s"] = result["suffix_prefill_start_s"]
    if "file" in args.arms:
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
    return result


def open_stores(b: Bench, workdir: str) -> None:
    """Opens the stores the arms need, each pinned for the copier: the in-process engine (always),
    the save arm's, a `kvtier serve` daemon under `workdir` and its client; and sets the file
    tier's options. Whatever it opened before a failure is on `b` for ``close_stores``."""
    args, env, cfg = b.args, b.env, b.cfg
    arms, chunk_bytes, ns = args.arms, b.chunk_bytes, b.ns
    max_ctx = max(args.contexts)
    prefix_gib_max = (max_ctx - args.suffix) * cfg.kv_bytes_per_token(env.dtype) / GiB
    # twice the largest prefix: kvtier lets one client hold at most half the pool reserved or pinned
    l1_gib = 2 * (prefix_gib_max * 1.1 + chunk_bytes / GiB * 4)
    if "file" in arms:
        os.makedirs(b.file_dir, exist_ok=True)
    b.engine = kvtier.open_engine(ns, chunk_bytes, l1_size_gb=l1_gib, l2=None)
    env.pin(b.engine)
    if "save" in arms:
        save_gib = max_ctx * cfg.kv_bytes_per_token(env.dtype) / GiB * 3
        b.save_engine = kvtier.open_engine(ns, chunk_bytes, l1_size_gb=save_gib, l2=None)
        env.pin(b.save_engine)
    if "server" in arms:
        b.server = ServeProcess(b.kvtier_bin, chunk_bytes, l1_gib, workdir)
        b.client = kvtier.connect(ns, chunk_bytes, socket_path=b.server.socket,
                                  client_name="ttft-bench", rpc_timeout_ms=60_000)
        env.pin(b.client)
    b.l2 = {"type": "fs", "path": b.file_dir, "max_size_gb": max(1.0, prefix_gib_max * 2.5),
            "read_threads": args.read_threads, "write_threads": 4}  # queue depth: the default


def close_stores(b: Bench) -> None:
    for s in (b.client, b.engine, b.save_engine):
        if s is not None:
            b.env.unpin(s)
            s.close()
    if b.server is not None:
        b.server.stop()


def open_file_store(b: Bench, l1_gib: float, write_policy: str = "write_back"):
    """A fresh engine over the file tier's directory, its L1 pinned for the copier."""
    s = kvtier.open_engine(b.ns, b.chunk_bytes, l1_size_gb=l1_gib, l2=b.l2,
                           write_policy=write_policy, load_deadline_ms=600_000)
    b.env.pin(s)
    return s


def new_context_run(b: Bench, ctx: int) -> ContextRun:
    """A context's random prompt, its references (full prefill, then the suffix over the prefix)
    and, with ``--suffix-pass graphs``, the suffix's pass captured as CUDA graphs; a capture that
    fails is recorded and the context measured eagerly."""
    args, env, model = b.args, b.env, b.model
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + ctx)
    tokens_cpu = torch.randint(0, b.cfg.vocab_size, (ctx,), generator=g)
    run = ContextRun(env, model, b.cache, b.mover, b.ns, ctx, args.suffix,
                     tokens_cpu.to(env.device), tokens_cpu)
    log(f"context {ctx}: reference prefill")
    run.make_references()
    if b.suffix_pass == "graphs":
        t_cap = time.perf_counter()
        try:
            run.graphs = SuffixGraphs(model, b.cache, run.prefix, args.suffix)
        except RuntimeError as e:  # recorded, and the context measured eagerly
            run.errors.append(f"capturing the suffix pass as CUDA graphs failed: {e}")
            log(f"ERROR context {ctx}: graph capture failed, eager pass: {e}")
            torch.cuda.synchronize()
        else:
            log(f"context {ctx}: suffix pass captured as CUDA graphs "
                f"({time.perf_counter() - t_cap:.1f} s)")
    return run


def store_prefixes(b: Bench, run: ContextRun, keys: list[bytes], open_file) -> tuple[list, list]:
    """Puts the context's prefix into every store an arm loads from (the file tier's through a
    write-through engine, closed so every chunk file is written). Returns the arms left to run
    (a store that cannot take the prefix fails its arms for this context, not the run) and, with
    a file arm, the chunk files the raw reads take."""
    ctx_arms = list(b.args.arms)

    def stored(store, names) -> None:
        try:
            store_prefix(store, keys, b.mover, b.env)
        except RuntimeError as e:
            run.errors.append(f"{'/'.join(names)}: storing the prefix failed: {e}")
            ctx_arms[:] = [a for a in ctx_arms if a not in names]

    stored(b.engine, ("l1", "l1-serial"))
    if b.client is not None:
        stored(b.client, ("server",))
    raw_files = None
    if "file" in b.args.arms:
        fs = open_file("write_through")
        stored(fs, ("file",))
        b.env.unpin(fs)
        fs.close()  # waits for every chunk file to be written
        raw_files = chunk_files(b.file_dir, len(keys), b.chunk_bytes)
    return ctx_arms, raw_files


def measure_disk(b: Bench, run: ContextRun) -> None:
    """The disk of this minute, then the file tier itself, on the tier's directory, into
    ``run.extra`` ("disk", "tier"). No figure, no floor and no plan: a failure ends the run."""
    ctx, args = run.context, b.args
    # The disk as a user would measure it for the tier: the floor's and the plan's figure for
    # this context.
    try:
        run.extra["disk"] = storage_bandwidth(b.kvtier_bin, b.file_dir, b.chunk_bytes,
                                              args.read_threads)
    except RuntimeError as e:
        raise RuntimeError(f"context {ctx}: measuring the disk before the file "
                           f"tier's repeats: {e}") from e
    d = run.extra["disk"]
    log(f"context {ctx}: disk O_DIRECT read {d['read_GBps']:.2f} GB/s at "
        f"{d['readers']} readers, best {d['read_GBps_max']:.2f} ("
        + ", ".join(f"{n}: {v:.2f}" for n, v in d["read_GBps_by_readers"].items())
        + f"; probe {d['probe_s']:.1f} s)")
    # The tier itself, as a user would measure it for `kvtier plan`: the plan's figure for this
    # context. Measured last, right before the hits.
    try:
        run.extra["tier"] = tier_bandwidth(b.kvtier_bin, b.file_dir, b.chunk_bytes,
                                           args.read_threads)
    except RuntimeError as e:
        raise RuntimeError(f"context {ctx}: measuring the file tier before its "
                           f"repeats: {e}") from e
    tb = run.extra["tier"]
    log(f"context {ctx}: bench tier read {tb['read_GBps']:.2f} GB/s, raw O_DIRECT "
        f"{tb['raw_read_GBps']:.2f} (ratio {tb['read_ratio']:.2f}); "
        f"{tb['readers']} readers, {tb['chunks']} x {tb['chunk_mib']} MiB x "
        f"{tb['repeats']}; {tb['bench_s']:.1f} s")


def run_repeats(b: Bench, run: ContextRun, arms: list[str], open_file, raw_files) -> None:
    """The warm-ups, then the timed repeats, every arm once per repeat."""
    args, ctx = b.args, run.context
    for rep in range(args.warmup + args.repeats):
        timed = rep >= args.warmup
        # Every other repeat runs the arms in reverse: an arm that always follows the idle file
        # arm (a cool GPU boosts higher) or a busy one would otherwise carry that order in its
        # figures (seen: saves "faster" than plain prefills by 1-4 %).
        for arm in (arms if rep % 2 == 0 else arms[::-1]):
            if arm == "recompute":
                run.run_recompute(timed)
            elif arm == "gpu":
                run.run_gpu_hit(timed)
            elif arm == "l1":
                run.run_hit("l1", b.engine, timed)
            elif arm == "l1-serial":
                run.run_hit("l1-serial", b.engine, timed, serial=True)
            elif arm == "server":
                run.run_hit("server", b.client, timed)
            elif arm == "file":
                run.run_file(open_file, timed, args.load_wave, raw_files, args.read_threads)
            elif arm == "save":
                run.run_save(b.save_engine, timed, rep * 1_000_003 + ctx)


def measure_context(b: Bench, ctx: int, result: dict, compare_plan: bool) -> None:
    """One context: references, the prefix stored, the disk and tier probed (with a file arm),
    the repeats; then its row, the prefill table and plan so far, and the partial JSON."""
    t_ctx = time.perf_counter()
    run = new_context_run(b, ctx)
    keys = run.keys()
    # The file arm's fresh engine (one per repeat) gets an L1 for this context's prefix, not the
    # largest one's: it populates and pins its whole pool at open, which on the H200 machine took
    # 0.65-0.8 s per GiB in every repeat (outside the timing, but the run's length: 6.6 s a
    # repeat at 32k).
    file_l1_gib = 2 * (run.prefix * b.cfg.kv_bytes_per_token(b.env.dtype) / GiB * 1.1
                       + b.chunk_bytes / GiB * 4)
    open_file = functools.partial(open_file_store, b, file_l1_gib)
    arms, raw_files = store_prefixes(b, run, keys, open_file)
    if "file" in b.args.arms:
        measure_disk(b, run)
    run_repeats(b, run, arms, open_file, raw_files)
    row = summarize(run, result, b.cfg, b.env.dtype)
    row["wall_s"] = time.perf_counter() - t_ctx
    result["rows"].append(row)
    set_prefill_table(result, b.args.suffix)
    if compare_plan:
        compare_with_plan(b.kvtier_bin, result, b.args, b.env.dtype, complete=False)
    save_partial(b.args, result)
    log(format_row(row))
    if "file_vs_raw" in row:
        log(f"  file tier {row['file_s'] * 1e3:.1f} ms against the same bytes read raw in "
            f"each repeat {row['file_raw_s'] * 1e3:.1f} ms "
            f"({row['file_raw_GBps']:.2f} GB/s) + GPU hit: {row['file_vs_raw']:.2f}x")
    if run.errors:
        log("\n".join("  ERROR " + e for e in run.errors))


def measure(args) -> dict:
    b = set_up(args)
    result = describe_run(b)
    compare_plan = b.kvtier_bin is not None and ("l1" in args.arms or "file" in args.arms)
    workdir = tempfile.mkdtemp(prefix="kvtier-ttft-")
    b.file_dir = args.dir or tempfile.mkdtemp(prefix="kvtier-ttft-", dir="/var/tmp")
    try:
        open_stores(b, workdir)
        for ctx in args.contexts:
            measure_context(b, ctx, result, compare_plan)
    finally:
        close_stores(b)
        shutil.rmtree(workdir, ignore_errors=True)
        if args.dir is None:  # a folder of our own
            shutil.rmtree(b.file_dir, ignore_errors=True)
    # The end of the run: the suffix's prefill and PCIe again, the whole prefill table and plan.
    result["suffix_prefill_s"] = short_prefill(b.env, b.model, b.cache, b.cfg, args,
                                               b.suffix_pass)
    result["h2d_GBps_end"] = copy_bandwidth(b.env)["h2d_GBps"]
    result["attention"] = {None: "not used", True: "SDPA, lower-right causal, grouped KV heads",
                           False: "SDPA, lower-right causal, KV heads expanded"}[
                               model_mod._LOWER_RIGHT_GQA_OK]
    result["torch"] = torch.__version__
    set_prefill_table(result, args.suffix)
    if compare_plan:
        compare_with_plan(b.kvtier_bin, result, args, b.env.dtype, complete=True)
    result["targets"] = targets(result)
    return result


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
