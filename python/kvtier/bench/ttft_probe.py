"""Where a TTFT hit's time goes, repeat by repeat: a diagnostic beside ``kvtier.bench.ttft``.

    python -m kvtier.bench.ttft_probe [--contexts 8k,16k] [--repeats 12] [--output probe.json]

Runs the TTFT benchmark's arms on the same model, cache and in-process engine (recompute, GPU
prefix hit, L1 hit overlapped layer by layer, L1 load-then-compute; odd repeats in reverse, as the
benchmark does) and records, for every timed GPU-hit and L1-hit repeat:

* the host's timeline: when each layer's kernels and copies were issued (``time.perf_counter``);
* the GPU's timeline, with timing events: when each layer started on the compute stream, how long
  its attention waited for the layer's KV, and when each layer's copy started and ended on the
  copy stream (all relative to an event recorded at the host's t0);
* what else ran: Python garbage collections (``gc.callbacks``), the issuing thread's voluntary and
  involuntary context switches, run-queue wait (``/proc/thread-self/schedstat``) and page faults,
  the machine's steal time, the CUDA caching allocator's device allocations and frees;
* the GPU's SM clock and clock-event reasons, from a separate process sampling NVML every few
  milliseconds (no sampling inside the measured thread).

Besides the benchmark's own sequence, every repeat runs variants of the hit that each test one
explanation of a slow repeat: ``l1-plain`` (the benchmark's untraced arm, to show the tracing
changes nothing), ``*-idle`` (the GPU left idle for 100 ms first), ``*-warm`` (the GPU kept busy
until just before the clock starts), ``l1-nogc`` (the garbage collector off while timed).
The raw records go to ``--output``; a per-arm summary and one line per traced sample are printed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import kvtier
from kvtier.bench import ttft
from kvtier.bench.model import DecoderModel, ModelConfig, PagedKvCache, SuffixGraphs, blocks_for

BENCH_ARMS = ("recompute", "gpu", "l1", "l1-serial")
EXTRA_ARMS = ("l1-plain", "l1-idle", "l1-warm", "l1-nogc", "gpu-idle", "gpu-warm",
              "gpu-graph", "l1-graph")

_SAMPLER = r"""
import json, signal, sys, time
import pynvml
pynvml.nvmlInit()
h = pynvml.nvmlDeviceGetHandleByIndex(int(sys.argv[2]))
reasons = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
    pynvml.nvmlDeviceGetCurrentClocksThrottleReasons
period = float(sys.argv[3])
stop = []
signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
rows = []
nxt = time.monotonic()
while not stop:
    t = time.monotonic()
    try:
        rows.append((round(t, 6), pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
                     int(reasons(h))))
    except pynvml.NVMLError as e:
        rows.append((round(t, 6), -1, str(e)))
    nxt += period
    d = nxt - time.monotonic()
    if d > 0:
        time.sleep(d)
    else:
        nxt = time.monotonic()
with open(sys.argv[1], "w") as f:
    json.dump(rows, f)
"""


class ClockSampler:
    """NVML's SM clock every ``period`` s in a child process (CLOCK_MONOTONIC timestamps)."""

    def __init__(self, path: str, device: int, period: float = 0.005):
        self.path = path
        self.proc = subprocess.Popen([sys.executable, "-c", _SAMPLER, path, str(device),
                                      str(period)], stdin=subprocess.DEVNULL)

    def stop(self) -> list:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        try:
            with open(self.path) as f:
                return json.load(f)
        except (OSError, ValueError):
            return []


def _read_steal_ticks() -> int:
    try:
        with open("/proc/stat") as f:
            return int(f.readline().split()[8])
    except (OSError, IndexError, ValueError):
        return -1


def counters() -> dict:
    ru = resource.getrusage(getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF))
    c = {"t": time.monotonic(), "nvcsw": ru.ru_nvcsw, "nivcsw": ru.ru_nivcsw,
         "minflt": ru.ru_minflt, "majflt": ru.ru_majflt, "utime": ru.ru_utime,
         "stime": ru.ru_stime, "steal_ticks": _read_steal_ticks()}
    try:
        with open("/proc/thread-self/schedstat") as f:
            run_ns, wait_ns, slices = (int(x) for x in f.read().split()[:3])
        c.update(run_ns=run_ns, wait_ns=wait_ns, slices=slices)
    except (OSError, ValueError):
        pass
    if torch.cuda.is_available():
        st = torch.cuda.memory_stats()
        for k in ("num_device_alloc", "num_device_free", "num_alloc_retries",
                  "num_sync_all_streams"):
            if k in st:
                c[k] = st[k]
    return c


def delta(a: dict, b: dict) -> dict:
    return {k: b[k] - a[k] for k in a if k in b and k != "t"}


class GcLog:
    def __init__(self):
        self.events = []
        self._start = None
        gc.callbacks.append(self._cb)

    def _cb(self, phase, info):
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.events.append((info.get("generation"), self._start, time.perf_counter(),
                                info.get("collected")))
            self._start = None

    def since(self, t0: float, t1: float) -> list:
        return [e for e in self.events if e[2] >= t0 and e[1] <= t1]


class Tracer:
    """Timing events and host timestamps of one traced hit."""

    def __init__(self, layers: int, cuda: bool):
        self.cuda = cuda
        n = layers

        def ev():
            return torch.cuda.Event(enable_timing=True) if cuda else None

        self.origin = ev()
        self.g_layer = [ev() for _ in range(n)]
        self.g_pre_wait = [ev() for _ in range(n)]
        self.g_post_wait = [ev() for _ in range(n)]
        self.c_start = [ev() for _ in range(n)]
        self.c_end = [ev() for _ in range(n)]
        self.g_end = ev()
        self.h_layer = [0.0] * n
        self.h_issue = [(0.0, 0.0)] * n

    def rec(self, e, stream=None):
        if e is not None:
            e.record(stream) if stream is not None else e.record()

    def gpu_times(self, copies: bool) -> dict:
        """Milliseconds after the origin event, per layer (after a synchronize)."""
        if not self.cuda:
            return {}
        o = self.origin

        def t(e):
            return round(o.elapsed_time(e), 4)

        out = {"layer": [t(e) for e in self.g_layer], "pre_wait": [t(e) for e in self.g_pre_wait],
               "post_wait": [t(e) for e in self.g_post_wait], "end": t(self.g_end)}
        if copies:
            out["copy_start"] = [t(e) for e in self.c_start]
            out["copy_end"] = [t(e) for e in self.c_end]
        return out


_yard_tensor = None


def yardsticks(env) -> dict:
    """The host's speed just before an arm, on fixed work that touches nothing of the benchmark:
    a pure-Python loop, and 200 tiny CUDA kernel launches (host time only)."""
    global _yard_tensor
    t = time.perf_counter()
    acc = 0
    for i in range(20000):
        acc += i * i
    py = time.perf_counter() - t
    out = {"py_ms": py * 1e3}
    if env.cuda:
        if _yard_tensor is None:
            _yard_tensor = torch.zeros(16, device=env.device)
        env.sync()
        t = time.perf_counter()
        for _ in range(200):
            _yard_tensor.add_(1.0)
        out["launch_us"] = (time.perf_counter() - t) / 200 * 1e6
        env.sync()
    return out


def run_traced(run: ttft.ContextRun, arm: str, store, gclog: GcLog, pre: str | None,
               nogc: bool, graphs=None) -> dict:
    """One GPU-prefix hit (store None) or L1 hit (layer-wise overlap), as the benchmark runs them,
    with a timeline. ``pre``: None, "idle" (100 ms with the GPU idle before the clock starts) or
    "warm" (the GPU busy with matrix products until just before). ``graphs``: the suffix's pass
    as CUDA graphs (None: eager)."""
    env, model, mover = run.env, run.model, run.mover
    layers = model.cfg.num_layers
    tr = Tracer(layers, env.cuda)
    run.graphs = graphs
    if store is None:
        run.restore_prefix()
    else:
        run.cache.poison(run.prefix)
    env.sync()
    if pre == "idle":
        time.sleep(0.1)
    elif pre == "warm" and env.cuda:
        a = torch.randn(4096, 4096, device=env.device, dtype=env.dtype)
        t_end = time.perf_counter() + 0.03
        while time.perf_counter() < t_end:
            for _ in range(8):
                a @ a
            env.sync()
    yard = yardsticks(env)
    if nogc:
        gc.collect()
        gc.disable()
    c0 = counters()
    env.sync()
    t0 = time.perf_counter()
    m0 = time.monotonic()
    tr.rec(tr.origin)
    rec = {"arm": arm, "m0": m0, "yard": yard}
    res = None
    try:
        if store is None:
            t_pinned = t0

            def before_layer(i):
                tr.h_layer[i] = time.perf_counter() - t0
                tr.rec(tr.g_layer[i])

            def before_attention(i):
                tr.rec(tr.g_pre_wait[i])
                tr.rec(tr.g_post_wait[i])

            logits = run.suffix_pass(before_layer, before_attention)
        else:
            keys = run.keys()
            total, _ = store.lookup(keys)
            if total != len(keys):
                run.errors.append(f"{arm}: lookup found {total} of {len(keys)} chunks")
                return {}
            op = store.prepare_load(keys)
            res = op.wait()
            if res is None or not res.ok or len(res.slots) != len(keys):
                run.errors.append(f"{arm}: prepare_load failed ({res})")
                if res is not None and res.slots:
                    store.unpin(res.slots)
                return {}
            t_pinned = time.perf_counter()
            addrs = [store.slot_address(s) for s in res.slots]
            stream = env.new_stream()
            events = []

            def issue(layer: int) -> None:
                t = time.perf_counter()
                tr.rec(tr.c_start[layer], stream)
                mover.scatter_layer(layer, addrs, stream)
                if stream is not None:
                    ev = torch.cuda.Event()
                    ev.record(stream)
                    events.append(ev)
                tr.rec(tr.c_end[layer], stream)
                tr.h_issue[layer] = (t - t0, time.perf_counter() - t0)

            def before_layer(i):
                tr.h_layer[i] = time.perf_counter() - t0
                if i + 1 < layers:
                    issue(i + 1)
                tr.rec(tr.g_layer[i])

            def before_attention(i):
                tr.rec(tr.g_pre_wait[i])
                if stream is not None:
                    torch.cuda.current_stream().wait_event(events[i])
                tr.rec(tr.g_post_wait[i])

            issue(0)
            logits = run.suffix_pass(before_layer, before_attention)
        tr.rec(tr.g_end)
        t_issued = time.perf_counter()
        logits.argmax().item()
        t = time.perf_counter() - t0
    finally:
        if nogc:
            gc.enable()
        run.graphs = None
    c1 = counters()
    if store is not None:
        store.unpin(res.slots)
        run.check_hit(arm, logits)
    else:
        run.check_logits(arm, logits, run.logits_suffix_ref, 1e-3)
    env.sync()
    rec.update(total=t, pin=t_pinned - t0, issued=t_issued - t0,
               h_layer=[round(v * 1e3, 4) for v in tr.h_layer],
               gpu=tr.gpu_times(store is not None), counters=delta(c0, c1),
               gc=[(g, round((s - t0) * 1e3, 3), round((e - s) * 1e3, 3), n)
                   for g, s, e, n in gclog.since(t0, t0 + t)])
    if store is not None:
        rec["h_issue"] = [(round(a * 1e3, 4), round(b * 1e3, 4)) for a, b in tr.h_issue]
    return rec


def run_plain(run: ttft.ContextRun, arm: str, store, gclog: GcLog) -> dict:
    """The benchmark's own arm, untraced, with the host-side counters around it."""
    c0 = counters()
    m0 = time.monotonic()
    t0 = time.perf_counter()
    n_before = len(run.samples.get(arm, []))
    if arm == "recompute":
        run.run_recompute(True)
    elif arm == "l1-serial":
        run.run_hit(arm, store, True, serial=True)
    else:
        run.run_hit(arm, store, True)
    t1 = time.perf_counter()
    c1 = counters()
    s = run.samples.get(arm, [])
    if len(s) == n_before:
        return {}
    return {"arm": arm, "m0": m0, "total": s[-1], "counters": delta(c0, c1),
            "gc": [(g, round((a - t0) * 1e3, 3), round((b - a) * 1e3, 3), n)
                   for g, a, b, n in gclog.since(t0, t1)]}


def analyse(rec: dict, clocks: list) -> dict:
    """One traced sample's figures: where its time went."""
    out = {"total_ms": rec["total"] * 1e3}
    y = rec.get("yard") or {}
    out["yard_py_ms"] = y.get("py_ms")
    out["yard_launch_us"] = y.get("launch_us")
    m0, m1 = rec["m0"], rec["m0"] + rec["total"]
    cl = [c[1] for c in clocks if m0 <= c[0] <= m1 and c[1] >= 0]
    if cl:
        out["sm_mhz_min"], out["sm_mhz_med"], out["sm_mhz_max"] = \
            min(cl), statistics.median(cl), max(cl)
    before = [c for c in clocks if c[0] < m0 and c[1] >= 0]
    if before:
        out["sm_mhz_before"] = before[-1][1]
        out["reasons_before"] = before[-1][2]
    cnt = rec.get("counters", {})
    out["nivcsw"] = cnt.get("nivcsw")
    out["nvcsw"] = cnt.get("nvcsw")
    out["runq_wait_ms"] = cnt.get("wait_ns", 0) / 1e6
    out["steal_ticks"] = cnt.get("steal_ticks")
    out["minflt"] = cnt.get("minflt")
    out["dev_alloc"] = cnt.get("num_device_alloc", 0) + cnt.get("num_device_free", 0)
    out["gc_n"] = len(rec.get("gc", []))
    out["gc_ms"] = sum(g[2] for g in rec.get("gc", []))
    if "pin" in rec:
        out["pin_ms"] = rec["pin"] * 1e3
        out["issued_ms"] = rec["issued"] * 1e3
    hl = rec.get("h_layer")
    if hl:
        gaps = [b - a for a, b in zip(hl, hl[1:])]
        out["host_layer_ms_med"] = statistics.median(gaps) if gaps else 0.0
        out["host_gap_max_ms"] = max(gaps) if gaps else 0.0
    g = rec.get("gpu")
    if g:
        out["gpu_end_ms"] = g["end"]
        out["wait_ms"] = sum(b - a for a, b in zip(g["pre_wait"], g["post_wait"]))
        lag = [gl - h for gl, h in zip(g["layer"], hl)]
        out["gpu_lag_max_ms"] = max(lag)
        gl = g["layer"]
        out["gpu_layer_ms_med"] = statistics.median(b - a for a, b in zip(gl, gl[1:]))
        if "copy_end" in g:
            out["copy_end_ms"] = g["copy_end"][-1]
            durs = [e - max(s, pe) for s, e, pe in
                    zip(g["copy_start"], g["copy_end"], [0.0] + g["copy_end"][:-1])]
            out["copy_sum_ms"] = sum(durs)
    if "h_issue" in rec:
        out["issue_ms"] = sum(b - a for a, b in rec["h_issue"])
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvtier.bench.ttft_probe",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-8b")
    p.add_argument("--contexts", type=ttft.parse_tokens, default=ttft.parse_tokens("8k,16k"))
    p.add_argument("--suffix", type=int, default=256)
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--block-tokens", type=int, default=16)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=12)
    p.add_argument("--extras", default=",".join(EXTRA_ARMS),
                   help="variants run after the benchmark's arms in every repeat")
    p.add_argument("--sample-ms", type=float, default=5.0, help="NVML clock sampling period")
    p.add_argument("--device", default=None)
    p.add_argument("--output", default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    extras = [a for a in args.extras.split(",") if a]

    cuda = torch.cuda.is_available() and args.device != "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    env = ttft.Env(torch.device("cuda", torch.cuda.current_device()) if cuda
                   else torch.device("cpu"), dtype, cuda)
    cfg = ModelConfig.load(args.model)
    torch.manual_seed(args.seed)
    model = DecoderModel(cfg, env.device, dtype, seed=args.seed)
    max_ctx = max(args.contexts)
    cache = PagedKvCache(cfg, blocks_for(max_ctx, args.block_tokens), args.block_tokens, dtype,
                         env.device)
    mover = ttft.ChunkMover(env, cache, args.chunk_tokens, "dma" if cuda else "auto")
    ns = kvtier.KeyNamespace(f"ttft-bench/{cfg.name}", chunk_tokens=args.chunk_tokens)
    prefix_gib = (max_ctx - args.suffix) * cfg.kv_bytes_per_token(dtype) / ttft.GiB
    l1_gib = 2 * (prefix_gib * 1.1 + mover.chunk_bytes / ttft.GiB * 4)
    engine = kvtier.open_engine(ns, mover.chunk_bytes, l1_size_gb=l1_gib, l2=None)
    env.pin(engine)
    gclog = GcLog()
    tmp = tempfile.mkdtemp(prefix="ttft-probe-")
    sampler = ClockSampler(os.path.join(tmp, "clocks.json"), env.device.index or 0,
                           args.sample_ms / 1e3) if cuda else None
    result = {"model": cfg.name, "device": torch.cuda.get_device_name() if cuda else "cpu",
              "torch": torch.__version__, "python": sys.version.split()[0],
              "gc_threshold": gc.get_threshold(), "affinity": sorted(os.sched_getaffinity(0)),
              "contexts": {}}
    log = ttft.log
    try:
        for ctx in args.contexts:
            g = torch.Generator().manual_seed(args.seed * 1_000_003 + ctx)
            tokens_cpu = torch.randint(0, cfg.vocab_size, (ctx,), generator=g)
            run = ttft.ContextRun(env, model, cache, mover, ns, ctx, args.suffix,
                                  tokens_cpu.to(env.device), tokens_cpu)
            run.make_references()
            graphs = SuffixGraphs(model, cache, run.prefix, args.suffix) \
                if cuda and any(a.endswith("-graph") for a in extras) else None
            ttft.store_prefix(engine, run.keys(), mover, env)
            recs = []
            for rep in range(args.warmup + args.repeats):
                timed = rep >= args.warmup
                order = list(BENCH_ARMS) if rep % 2 == 0 else list(BENCH_ARMS)[::-1]
                k = rep % max(1, len(extras))
                order += extras[k:] + extras[:k]
                for arm in order:
                    base, _, variant = arm.partition("-")
                    g_arm = graphs if variant == "graph" else None
                    if arm in ("recompute", "l1-serial"):
                        r = run_plain(run, arm, engine, gclog)
                    elif arm == "l1-plain":
                        r = run_plain(run, "l1", engine, gclog)
                        r["arm"] = "l1-plain"
                    elif base in ("gpu", "l1") and variant in ("", "idle", "warm", "nogc",
                                                              "graph"):
                        r = run_traced(run, arm, engine if base == "l1" else None, gclog,
                                       variant if variant in ("idle", "warm") else None,
                                       variant == "nogc", g_arm)
                    else:
                        raise SystemExit(f"unknown arm {arm}")
                    if timed and r:
                        r["rep"] = rep
                        recs.append(r)
            result["contexts"][ctx] = {"records": recs, "errors": run.errors}
            log(f"context {ctx}: {len(recs)} records, errors: {run.errors}")
            if args.output:
                with open(args.output, "w") as f:
                    json.dump(result, f, default=str)
    finally:
        clocks = sampler.stop() if sampler else []
        env.unpin(engine)
        engine.close()
    result["clocks"] = clocks
    for ctx, c in result["contexts"].items():
        for r in c["records"]:
            r["analysis"] = analyse(r, clocks)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, default=str)
    report(result)
    return 0 if not any(c["errors"] for c in result["contexts"].values()) else 1


def report(result: dict) -> None:
    cols = ("total_ms", "yard_py_ms", "yard_launch_us", "pin_ms", "issued_ms", "gpu_end_ms",
            "wait_ms", "copy_end_ms", "copy_sum_ms", "issue_ms", "host_layer_ms_med",
            "host_gap_max_ms",
            "gpu_layer_ms_med", "gpu_lag_max_ms", "sm_mhz_before", "sm_mhz_min", "sm_mhz_med",
            "gc_n", "gc_ms", "nivcsw", "nvcsw", "runq_wait_ms", "steal_ticks", "minflt",
            "dev_alloc")
    for ctx, c in result["contexts"].items():
        by_arm = {}
        for r in c["records"]:
            by_arm.setdefault(r["arm"], []).append(r)
        print(f"== context {ctx}: samples (ms), p50, max")
        for arm, rs in by_arm.items():
            t = sorted(r["total"] * 1e3 for r in rs)
            print(f"{arm:>10}  p50 {statistics.median(t):7.1f}  max {max(t):7.1f}  "
                  + " ".join(f"{v:.1f}" for v in t))
        print(f"== context {ctx}: per sample")
        print("arm rep " + " ".join(cols))
        for r in c["records"]:
            a = r["analysis"]
            vals = []
            for k in cols:
                v = a.get(k)
                vals.append("-" if v is None else (f"{v:.1f}" if isinstance(v, float) else str(v)))
            print(f"{r['arm']} {r['rep']} " + " ".join(vals))
        if c["errors"]:
            print("ERRORS:", c["errors"])


if __name__ == "__main__":
    sys.exit(main())
