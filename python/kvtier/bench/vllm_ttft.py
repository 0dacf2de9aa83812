"""Time to first token through vLLM's own API: kvtier against vLLM's prefix cache and native offloading.

    python -m kvtier.bench.vllm_ttft --model DIR [--contexts 8k,16k,24k,32k] [--arms ...]
        [--repeats 3] [--json FILE] [--plot FILE]
    python -m kvtier.bench.vllm_ttft --make-model DIR [--model-config qwen3-8b]

One `vllm serve` per arm, all started at once and kept up for the whole run (each with a fixed
KV cache, `--kv-cache-memory-bytes`, so that they fit one GPU side by side); requests go to one
server at a time, and every repeat visits every arm in turn, so a slow minute of the machine
spreads over all of them. Prompts are token ids. For each context L: a prefix of L - suffix
tokens (whole chunks) and a new suffix of --suffix tokens, and per repeat and arm:

* ``cold``: a prompt of L new tokens (recompute; in an arm with a connector it also saves, so its
  cold TTFT against the ``gpu`` arm's is the save overhead at 0 % hits);
* ``hit``: a new prefix is sent (1 token generated), the connector's saves are given time to land,
  vLLM's GPU prefix cache is reset (/reset_prefix_cache, asked again until vLLM agrees: it
  refuses while a request's blocks wait for its saves), then prefix + suffix is sent: the
  prefix comes back from the arm's offload tier. In the ``gpu`` arm the cache is not reset:
  vLLM's own prefix-cache hit. On the arms `kvtier serve` serves, the chunks of a hit cut at
  the server's load deadline are counted and printed (the hit is then partly a recompute).

Arms: ``gpu`` (no connector), ``native`` (vLLM's OffloadingConnector, CPU tier of --cpu-gb),
``tiering`` (TieringOffloadingSpec, CPU tier of --tiering-cpu-gb and its ``fs`` tier in a fresh
directory on --disk-dir; before each hit, new prompts of more than the CPU tier's size push the
prefix out of it and the page cache is dropped, so the hit reads the ``fs`` tier, cold), ``kvtier`` (in-process, L1 of --cpu-gb), ``server`` (``kvtier serve``,
L1 of --cpu-gb, file tier on --disk-dir) and ``file`` (the server arm's file tier, cold: kvtier
serve restarted with an empty L1 and the page cache dropped before each hit; the file tier reads
with O_DIRECT; the server arm's connector loads every hit, kvtier.cost_aware off),
``costfile`` (the same cold file-tier hits through a vLLM of its own on the same kvtier serve,
its connector's cost-aware lookups as a user gets them, plus --cost-extra: a prefill table, the
disk's read rate measured beforehand; a hit the disk would make slower than recomputing is
declined) and ``lmcache`` (LMCache in process, vLLM's LMCacheConnectorV1 with its
``local_cpu`` tier of --cpu-gb and 256-token chunks; LMCache from --lmcache-site or the
environment; an arm that does not start is left out with its error). Every hit is checked: its first --check-tokens greedy tokens must equal those of
the ``gpu`` arm's hit of the same prompt (the same weights in every server: a model directory
with a fixed seed's random weights, written by --make-model), and a different prefix must give
different tokens somewhere in the run (a check that cannot pass on a constant model). The
host->GPU copy bandwidth is measured in the same run and printed with each hit as the copy
floor: prefix KV bytes / bandwidth.

On vLLM's CPU build (no CUDA device: no copy floor; `--dtype float32` where the CPU lacks
bf16) the GPU memory flags are left out and each vLLM's KV cache is sized through
VLLM_CPU_KVCACHE_SPACE; vLLM's native offloading refuses to run there, so its arms fail and are
left out. The test command runs the kvtier arms that way (python/tests/vllm/test_vllm_ttft.py).

Results go to --out as one JSON file per context as it finishes, so a run cut short keeps what
it measured, and `--json`/`--plot` write the whole table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
import signal
import socket as socket_module
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

CONFIGS = Path(__file__).parent / "configs"
ALL_ARMS = ("gpu", "native", "tiering", "kvtier", "server", "file", "costfile", "lmcache")
OPT_IN_ARMS = ("costfile", "lmcache")  # not in the default --arms


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def parse_tokens(text: str) -> int:
    text = text.strip().lower()
    return int(float(text[:-1]) * 1024) if text.endswith("k") else int(text)


def http(port: int, path: str, body=None, timeout: float = 600) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data,
                                 {"Content-Type": "application/json"})
    text = urllib.request.urlopen(req, timeout=timeout).read().decode()
    return json.loads(text) if text.strip() else {}


# --- the model ---------------------------------------------------------------------------------

def make_model(out: Path, config_name: str, seed: int = 0, std: float = 0.02,
               weights: bool = True) -> None:
    """A model directory vLLM loads: the config, a byte-level BPE tokenizer trained here (prompts
    are token ids; the tokenizer only has to exist) and random weights from a fixed seed, written
    as safetensors, so that every server of a run computes the same function and its answers
    depend on the prompt (vLLM's dummy weights give nearly the same answer to every prompt).
    Without `weights`, only the config and the tokenizer, for `--load-format dummy` (16 GB less
    disk where the answers do not matter)."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    cfg = json.loads((CONFIGS / f"{config_name}.json").read_text()) \
        if not config_name.endswith(".json") else json.loads(Path(config_name).read_text())
    if cfg.get("model_type") != "qwen3":
        raise SystemExit(f"--make-model writes Qwen3-shaped weights; {config_name} is "
                         f"{cfg.get('model_type')}")
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([Path(__file__).read_text()] * 4, trainer)
    tok.save(str(out / "tokenizer.json"))
    # The vocabulary is the tokenizer's (vLLM detokenizes every answer); it sizes only the
    # embedding and the LM head, not the KV cache or the attention this benchmark is about.
    cfg["vocab_size"] = tok.get_vocab_size()
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "pad_token": "<pad>", "model_max_length": cfg["max_position_embeddings"]}))
    cfg = dict(cfg, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 0,
                                                            "eos_token_id": 1}))
    if not weights:
        log(f"model config and tokenizer written to {out} (no weights: --load-format dummy)")
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(seed)
    h, hd = cfg["hidden_size"], cfg["head_dim"]
    q, kv, inter = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd, \
        cfg["intermediate_size"]

    def rand(*shape):
        return (torch.randn(*shape, generator=gen, device=device, dtype=torch.float32)
                * std).to(torch.bfloat16).cpu()

    ones = lambda n: torch.ones(n, dtype=torch.bfloat16)  # noqa: E731
    shard = {"model.embed_tokens.weight": rand(cfg["vocab_size"], h),
             "model.norm.weight": ones(h), "lm_head.weight": rand(cfg["vocab_size"], h)}
    files = {}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shard.update({p + "input_layernorm.weight": ones(h),
                      p + "post_attention_layernorm.weight": ones(h),
                      p + "self_attn.q_proj.weight": rand(q, h),
                      p + "self_attn.k_proj.weight": rand(kv, h),
                      p + "self_attn.v_proj.weight": rand(kv, h),
                      p + "self_attn.o_proj.weight": rand(h, q),
                      p + "self_attn.q_norm.weight": ones(hd),
                      p + "self_attn.k_norm.weight": ones(hd),
                      p + "mlp.gate_proj.weight": rand(inter, h),
                      p + "mlp.up_proj.weight": rand(inter, h),
                      p + "mlp.down_proj.weight": rand(h, inter)})
        if i % 6 == 5 or i == cfg["num_hidden_layers"] - 1:
            name = f"model-{len(files):05d}.safetensors"
            save_file(shard, str(out / name), metadata={"format": "pt"})
            files.update({k: name for k in shard})
            shard = {}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {},
                                                                 "weight_map": files}))
    log(f"model written to {out}: {cfg['num_hidden_layers']} layers, seed {seed}")


def kv_bytes_per_token(model: Path, dtype: str = "bfloat16") -> int:
    cfg = json.loads((model / "config.json").read_text())
    element = 4 if dtype == "float32" else 2
    return cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * element


class Answer:
    """Greedy tokens with the TOP most likely at each step. Two answers agree when their tokens
    are equal, or when they first part at a near tie of the reference (the other answer's token
    among its TOP best, within NEAR_TIE nats of its choice: bf16 rounding in another batch shape
    can flip those; a model with random weights has flat distributions, with ties among more
    than two tokens); a wrong KV cache changes the answer from its first token, far from any
    tie."""

    TOP = 5

    NEAR_TIE = 0.05

    def __init__(self, tokens: list[str], top: list[dict]):
        self.tokens, self.top = tokens, top

    def agrees_with(self, reference: "Answer") -> tuple[bool, str]:
        for i, (mine, theirs) in enumerate(zip(self.tokens, reference.tokens)):
            if mine == theirs:
                continue
            top = reference.top[i] or {}
            if mine in top and theirs in top and abs(top[mine] - top[theirs]) < self.NEAR_TIE:
                return True, f"equal up to a near tie at token {i}"
            return False, f"differs at token {i}: {mine!r} where the reference has {theirs!r}"
        return True, "equal"

    def __eq__(self, other) -> bool:
        return isinstance(other, Answer) and self.tokens == other.tokens


# --- the servers -------------------------------------------------------------------------------

class Vllm:
    """One `vllm serve` of the model with one arm's connector; started without waiting."""

    def __init__(self, args, arm: str, port: int, transfer: dict | None, workdir: Path, *,
                 eager: bool = True, log_stats: bool = False, extra_args: list[str] = ()):
        """`log_stats`: vLLM's statistics on (its Prometheus /metrics counts prefix-cache hits
        only then); `extra_args` go before --vllm-args."""
        self.arm, self.port = arm, port
        self.cmd = cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
               str(args.model), "--served-model-name", "bench", "--dtype", args.dtype,
               "--max-model-len", str(args.max_model_len), "--port", str(port),
               "--host", "127.0.0.1", "--seed", "0"]
        if eager:
            cmd.append("--enforce-eager")
        # costfile: its decisions reach the log with the stats (connector_counters)
        if not log_stats and arm != "costfile":
            cmd.append("--disable-log-stats")
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")
        if args.on_gpu:
            cmd += ["--kv-cache-memory-bytes", str(round(args.kv_cache_gb * (1 << 30))),
                    "--gpu-memory-utilization", str(args.gpu_memory_utilization)]
        else:  # vLLM's CPU build sizes its KV cache from the environment, in GiB
            env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, math.ceil(args.kv_cache_gb)))
        if transfer is not None:
            cmd += ["--kv-transfer-config", json.dumps(transfer)]
        cmd += list(extra_args) + args.vllm_args.split()
        self.log_path = workdir / f"vllm-{arm}.log"
        if arm == "lmcache":
            env.update(LMCACHE_CHUNK_SIZE=str(args.chunk_tokens), LMCACHE_LOCAL_CPU="True",
                       LMCACHE_MAX_LOCAL_CPU_SIZE=str(args.cpu_gb))
            if args.lmcache_site:
                env["PYTHONPATH"] = os.pathsep.join(
                    p for p in (str(args.lmcache_site), env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(cmd, stdout=open(self.log_path, "w"),
                                     stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def wait_up(self, deadline: float) -> None:
        while True:
            try:
                http(self.port, "/health", timeout=5)
                return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log_path.read_text(errors="replace")[-4000:]
                raise RuntimeError(f"vLLM ({self.arm} arm) did not start:\n{tail}")
            time.sleep(1)

    def complete(self, prompt: list[int], max_tokens: int) -> tuple[float, "Answer"]:
        body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "logprobs": Answer.TOP}
        start = time.perf_counter()
        reply = http(self.port, "/v1/completions", body)
        elapsed = time.perf_counter() - start
        lp = reply["choices"][0]["logprobs"]
        return elapsed, Answer(list(lp["tokens"]), list(lp["top_logprobs"]))

    def ttft(self, prompt: list[int]) -> float:
        return self.complete(prompt, 1)[0]

    def phase_sums(self) -> dict[str, float] | None:
        """vLLM's own account of its requests so far (seconds summed over them: waiting in
        the queue, prefill), on the arms that keep statistics (costfile); else None."""
        from kvtier.bench.planner_check import metric, prometheus
        if "--disable-log-stats" in self.cmd:
            return None
        m = prometheus(self.port)
        return {p: metric(m, f"vllm:request_{p}_time_seconds_sum") for p in ("queue", "prefill")}

    def timed_ttft(self, prompt: list[int], into: dict, kind: str) -> float:
        """ttft(), with the request's queue and prefill time from vLLM's metrics (where kept)
        appended to into[kind + "_queue"] / into[kind + "_prefill"]: where a TTFT goes."""
        before = self.phase_sums()
        elapsed = self.ttft(prompt)
        after = self.phase_sums()
        if before is not None and after is not None:
            for phase in ("queue", "prefill"):
                into.setdefault(f"{kind}_{phase}", []).append(
                    after.get(phase, 0.0) - before.get(phase, 0.0))
        return elapsed

    def reset_gpu_cache(self) -> None:
        from kvtier.bench.planner_check import reset_prefix_cache

        reset_prefix_cache(self.port)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


class Serve:
    """`kvtier serve`: L1 of l1_gb, file tier in `directory` (kept across restarts)."""

    def __init__(self, args, socket: str, directory: Path, log_path: Path):
        self.socket, self.dir, self.log_path = socket, directory, log_path
        chunk_bytes = kv_bytes_per_token(args.model, args.dtype) * args.chunk_tokens
        with socket_module.socket() as probe:  # a free port for /stats (wait_on_disk)
            probe.bind(("127.0.0.1", 0))
            self.http_port = probe.getsockname()[1]
        self.cmd = [args.kvtier, "serve", "--socket", socket,
                    "--http-port", str(self.http_port),
                    "--chunk-size", str(args.chunk_tokens), "--chunk-bytes", str(chunk_bytes),
                    "--l1-size-gb", str(args.cpu_gb),
                    "--write-policy", "write_through",
                    # as the in-process connector's own server: the scheduler may pin a whole
                    # long prompt for a layer-wise load (the default limit is half the pool)
                    "--max-client-slots",
                    str(int(args.cpu_gb * 2**30 * 3 / 4 // chunk_bytes)),
                    "--l2", json.dumps(file_tier(args, directory))]
        self.proc = None
        self.restarted_at: float | None = None
        self.start()

    def start(self) -> None:
        if os.path.exists(self.socket):  # a killed server's: the wait below must see the new one
            os.unlink(self.socket)
        self.proc = subprocess.Popen(self.cmd, stdout=open(self.log_path, "a"),
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while not os.path.exists(self.socket):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"kvtier serve did not start: "
                                   f"{self.log_path.read_text()[-2000:]}")
            time.sleep(0.05)

    def stats(self) -> dict:
        return http(self.http_port, "/stats", timeout=10)

    def wait_on_disk(self, timeout: float = 60) -> bool:
        """Waits until what was stored is on the file tier: no store for half a second (the
        connector's saves have landed), no dirty chunk in L1 and no write queued. (A fixed
        pause was too short on a run where a long prefix's saves were still under way.)"""
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            st = self.stats()
            now = (st["engine"]["stores"], st["pool"]["dirty"],
                   st["tiers"]["file"]["detail"]["queued_writes"])
            if now == last and now[1:] == (0, 0):
                return True
            last = now
            time.sleep(0.5)
        log(f"kvtier serve's stores did not all reach the file tier in {timeout:.0f} s")
        return False

    def wait_reconnected(self, vllms: list, prompt, timeout: float = 60) -> bool:
        """Until every vLLM's connector is connected to this server again and its worker can
        use it: a connector finds a new server within its idle check (RETRY_SECONDS) or at its
        next use, and on a GPU its worker then registers the new pool for DMA (0.4 s for 8 GiB
        on an H200) before using it, so each is sent short requests until a round of them has
        its chunks saved. Otherwise the hit after a restart would measure the reconnect
        (lookups miss until it is done) or share the GPU with the registration."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            connected = len(self.stats().get("clients", [])) >= 2 * len(vllms)
            before = self.stats()["engine"]["stores"]
            for v in vllms:
                v.complete(prompt(), 1)  # its chunks are one store operation
            # A worker not ready yet skips its saves: those never land, and a round is sent again.
            landed = time.monotonic() + 5
            while connected and time.monotonic() < min(landed, deadline):
                if self.stats()["engine"]["stores"] - before >= len(vllms):
                    return True
                time.sleep(0.1)
            time.sleep(0.5)
        log(f"the connectors did not all reconnect to the restarted kvtier serve in "
            f"{timeout:.0f} s")
        return False

    def restart_empty(self) -> None:
        """A stop that drains (write_through: everything is on disk already), a start with an
        empty L1 (the connectors' reconnect: wait_reconnected)."""
        self.stop()
        self.start()
        self.restarted_at = time.monotonic()

    def wait_old_pool_released(self) -> None:
        """After a restart, until each connector has let the old server's pool go: a worker
        keeps it mapped KEEP_LOST_S (loads pinned in it may still read it) and then, at its
        idle check (every RETRY_SECONDS) or next use, unregisters it from the GPU
        (cudaHostUnregister of gigabytes, which holds up the worker's GPU work for a moment) on
        a thread of its own. Not in the time of the next measured request, which would bill
        the restart to whatever arm comes next."""
        from kvtier.vllm.store import KEEP_LOST_S, RETRY_SECONDS
        if self.restarted_at is None:
            return
        time.sleep(max(0.0, self.restarted_at + KEEP_LOST_S + RETRY_SECONDS + 2.0
                       - time.monotonic()))
        self.restarted_at = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(120)


def drop_page_cache() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def copy_bandwidth() -> float | None:
    """Host->GPU bandwidth from pinned memory, bytes/s (the copy engines' ceiling)."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    n = 1 << 30
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dev.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del host, dev
    torch.cuda.empty_cache()
    return n / statistics.median(times)


# --- the run -----------------------------------------------------------------------------------

def file_tier(args, directory: Path) -> dict:
    """kvtier's file tier in `directory`: --disk-gb of it, reads capped at
    args.disk_read_limit_gbps where a caller has one (0: not capped)."""
    tier = {"type": "fs", "path": str(directory), "max_size_gb": args.disk_gb}
    limit = getattr(args, "disk_read_limit_gbps", 0) or 0
    if limit > 0:
        tier["read_limit_gbps"] = limit
    return tier


def transfer_config(args, arm: str, disk: Path, socket: str, *, kvtier_file_tier: bool = False,
                    kvtier_http_port: int = -1, kvtier_keys: dict | None = None) -> dict | None:
    """vLLM's --kv-transfer-config of an arm (None: no connector). Every directory an arm keeps
    chunks in is emptied here, so an arm configured anew starts cold. The in-process kvtier arm
    gets a file tier on `disk` with `kvtier_file_tier` and serves its engine's /metrics on
    `kvtier_http_port` when that is 0 or more. `kvtier_keys`: more connector keys for the kvtier
    arms (--kvtier-extra's override them)."""
    cpu_bytes = int(args.cpu_gb * 1e9)
    if arm == "gpu":
        return None
    if arm == "native":
        return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"cpu_bytes_to_use": cpu_bytes,
                                              "block_size": args.chunk_tokens}}
    if arm == "tiering":
        fs_dir = disk / "tiering-fs"  # on the disk of kvtier's file tier
        shutil.rmtree(fs_dir, ignore_errors=True)
        fs_dir.mkdir(parents=True)
        return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {
                    "spec_name": "TieringOffloadingSpec",
                    "cpu_bytes_to_use": int(args.tiering_cpu_gb * 1e9),
                    "block_size": args.chunk_tokens,
                    "secondary_tiers": [{"type": "fs", "root_dir": str(fs_dir)}]}}
    if arm == "lmcache":
        return {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    kvtier = {"kv_connector": "KvtierConnector", "kv_connector_module_path": "kvtier.vllm",
              "kv_role": "kv_both"}
    extra = {**(kvtier_keys or {}), **(json.loads(args.kvtier_extra) if args.kvtier_extra
                                         else {})}
    if arm == "kvtier":
        settings = {"kvtier.l1_size_gb": args.cpu_gb, "kvtier.chunk_tokens": args.chunk_tokens}
        if kvtier_file_tier:
            l2 = disk / "kvtier-inproc-l2"
            shutil.rmtree(l2, ignore_errors=True)
            l2.mkdir(parents=True)
            settings["kvtier.l2"] = file_tier(args, l2)
        if kvtier_http_port >= 0:
            settings["kvtier.http_port"] = kvtier_http_port
        return dict(kvtier, kv_connector_extra_config={**settings, **extra})
    if arm == "server":
        return dict(kvtier, kv_connector_extra_config={
            "kvtier.socket": socket, "kvtier.chunk_tokens": args.chunk_tokens, **extra})
    if arm == "costfile":  # the same server again, through a vLLM deciding what pays
        cost = json.loads(args.cost_extra) if args.cost_extra else {}
        return dict(kvtier, kv_connector_extra_config={
            "kvtier.socket": socket, "kvtier.chunk_tokens": args.chunk_tokens,
            "kvtier.cost_aware": True, **extra, **cost})
    raise ValueError(arm)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvtier.bench.vllm_ttft",
                                 description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="model directory (written by --make-model)")
    ap.add_argument("--make-model", type=Path, metavar="DIR",
                    help="write a model directory with seeded random weights, then exit")
    ap.add_argument("--model-config", default="qwen3-8b",
                    help="config for --make-model: a name in kvtier/bench/configs or a path")
    ap.add_argument("--contexts", default="8k,16k,24k,32k")
    ap.add_argument("--arms", default=",".join(a for a in ALL_ARMS if a not in OPT_IN_ARMS),
                    help=f"comma-separated, of {', '.join(ALL_ARMS)} (file and costfile "
                         "need server)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--suffix", type=int, default=256, help="new tokens after the prefix")
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--check-tokens", type=int, default=16,
                    help="greedy tokens compared between each hit and the gpu arm's")
    ap.add_argument("--cpu-gb", type=float, default=8.0,
                    help="CPU tier of native, L1 of kvtier and server (GB)")
    ap.add_argument("--tiering-cpu-gb", type=float, default=2.0,
                    help="the tiering arm's CPU tier (GB); its fs tier is read past it")
    ap.add_argument("--disk-gb", type=float, default=16.0, help="kvtier's file tier capacity")
    ap.add_argument("--kv-cache-gb", type=float, default=5.5, help="each vLLM's GPU KV cache")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.15,
                    help="what each vLLM asks to be free at start (its KV is --kv-cache-gb)")
    ap.add_argument("--max-model-len", type=int, default=34000)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                    help="vLLM's --dtype (float32 for vLLM's CPU build on CPUs without bf16)")
    ap.add_argument("--settle", type=float, default=1.0,
                    help="seconds between a prefix's store and its hit (saves land)")
    ap.add_argument("--vllm-args", default="",
                    help="more arguments for every arm's vllm serve, e.g. --no-async-scheduling")
    ap.add_argument("--kvtier-extra", default="",
                    help='more connector keys for the kvtier arms, as JSON, e.g. '
                         '\'{"kvtier.load_mode": "async"}\'')
    ap.add_argument("--cost-extra", default="",
                    help='more connector keys for the costfile arm, as JSON, e.g. '
                         '\'{"kvtier.prefill_table": "8192:0.23,16384:0.52", '
                         '"kvtier.file_read_gbps": 1.2}\' (default: none, the prefill times '
                         'learned from the model\'s shape)')
    ap.add_argument("--gap", type=float, default=0.3,
                    help="seconds after each cold request before the next arm's")
    ap.add_argument("--disk-dir", type=Path, default=None,
                    help="file tiers' directory (default: a fresh one under --out)")
    ap.add_argument("--kvtier", default=shutil.which("kvtier") or "kvtier")
    ap.add_argument("--lmcache-site", type=Path, default=None,
                    help="a directory holding the lmcache package (pip install --target), put "
                         "on the lmcache arm's PYTHONPATH")
    ap.add_argument("--out", type=Path, default=Path("build/vllm-ttft"))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path)
    ap.add_argument("--start-timeout", type=float, default=420)
    ap.add_argument("--no-fault-check", dest="fault_check", action="store_false",
                    help="skip the last step: kvtier serve SIGKILLed while vLLM loads from it")
    args = ap.parse_args(argv)

    if args.make_model:
        make_model(args.make_model, args.model_config)
        return 0
    if args.model is None or not (args.model / "config.json").exists():
        ap.error("--model DIR with a config.json is required (--make-model DIR writes one)")
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    bad = [a for a in arms if a not in ALL_ARMS]
    if bad:
        ap.error(f"unknown arm(s) {', '.join(bad)}; arms are {', '.join(ALL_ARMS)}")
    for arm in ("file", "costfile"):
        if arm in arms and "server" not in arms:
            ap.error(f"the {arm} arm measures the server arm's file tier: add server to --arms")
    if "gpu" not in arms:
        ap.error("the gpu arm is every check's reference: keep it in --arms")
    try:
        contexts = [parse_tokens(c) for c in args.contexts.split(",")]
    except ValueError:
        ap.error(f"--contexts: expected token counts such as 8k,16k, got {args.contexts!r}")
    ct = args.chunk_tokens
    for c in contexts:
        if c - args.suffix < ct or c + args.suffix > args.max_model_len:
            ap.error(f"context {c}: needs a prefix of at least one {ct}-token chunk and to fit "
                     f"--max-model-len {args.max_model_len}")

    args.out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="run-", dir=args.out))
    disk = args.disk_dir or workdir
    disk.mkdir(parents=True, exist_ok=True)
    socket = str(workdir / "kvtier.sock")
    bpt = kv_bytes_per_token(args.model, args.dtype)
    bw = copy_bandwidth()
    args.on_gpu = bw is not None  # else vLLM's CPU build: no GPU memory flags
    log(f"host->GPU copy bandwidth {bw / 1e9:.1f} GB/s" if bw else "no GPU: no copy floor")
    serve = None
    if "server" in arms:
        serve_dir = disk / "kvtier-l2"
        shutil.rmtree(serve_dir, ignore_errors=True)
        serve = Serve(args, socket, serve_dir, workdir / "serve.log")
    servers: dict[str, Vllm] = {}
    results = {"args": {k: str(v) for k, v in vars(args).items()}, "copy_bytes_per_s": bw,
               "kv_bytes_per_token": bpt, "contexts": {}}
    try:
        t0 = time.monotonic()
        for i, arm in enumerate(a for a in arms if a != "file"):
            # The file arm measures the server arm's vLLM: it loads every hit.
            keys = {"kvtier.cost_aware": False} if arm == "server" else None
            servers[arm] = Vllm(args, arm, 8100 + i,
                                transfer_config(args, arm, disk, socket, kvtier_keys=keys),
                                workdir)
        results["failed_arms"] = {}
        for arm, vllm in list(servers.items()):
            try:
                vllm.wait_up(t0 + args.start_timeout)
            except RuntimeError as e:  # one arm's failure must not lose the others
                log(f"the {arm} arm is left out: {e}")
                results["failed_arms"][arm] = str(e)[-4000:]
                vllm.stop()
                del servers[arm]
        arms = [a for a in arms if (a if a != "file" else "server") in servers]
        if "gpu" not in servers:
            raise SystemExit("the gpu arm (the reference) did not start")
        log(f"{len(servers)} vLLM servers up in {time.monotonic() - t0:.0f} s: "
            f"{', '.join(servers)}")
        rng = random.Random(1)
        vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
        fresh = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
        tiering_fill = int(args.tiering_cpu_gb * 1e9 / bpt * 1.25)
        sensitive = False
        for context in contexts:
            prefix_len = (context - args.suffix) // ct * ct
            samples = {arm: {"cold": [], "hit": []} for arm in arms}
            mismatches, checks = [], {}
            for vllm in servers.values():  # the first prompt of a length builds its shapes
                prefix = fresh(prefix_len)
                vllm.ttft(prefix)
                vllm.reset_gpu_cache()
                vllm.ttft(prefix + fresh(args.suffix))
            for rep in range(args.repeats):
                # The cold requests' order turns by one arm each repeat. In a fixed order the
                # third of three arms ran 0-9 ms slower than the second whatever its settings
                # (a cold request pays for what the arm before it left running, its saves),
                # and that was billed as the arm's save overhead (docs/benchmarks.md, run N).
                turn = rep % len(arms)
                for arm in arms[turn:] + arms[:turn]:
                    with arm_guard(arm, arms, servers, results, context):
                        vllm = servers["server" if arm == "file" else arm]
                        samples[arm]["cold"].append(vllm.timed_ttft(
                            fresh(prefix_len + args.suffix), samples[arm], "cold"))
                        # The arm's saves land before another arm's request: an engine with
                        # transfers pending polls its workers, which would bill the next arm.
                        time.sleep(args.gap)
                prefix, suffix = fresh(prefix_len), fresh(args.suffix)
                reference = None
                for arm in list(arms):
                    with arm_guard(arm, arms, servers, results, context):
                        vllm = servers["server" if arm == "file" else arm]
                        if arm in ("file", "costfile"):
                            # The cold requests' chunks on disk first: under write-through a
                            # pool still full of them refuses part of the prefix's saves.
                            serve.wait_on_disk()
                        vllm.complete(prefix, 1)
                        time.sleep(args.settle)
                        if arm in ("file", "costfile"):
                            serve.wait_on_disk()
                        if arm == "tiering":  # out of its CPU tier, onto its fs tier only
                            for _ in range(-(-tiering_fill // 8192)):
                                vllm.ttft(fresh(8192))
                            time.sleep(args.settle)
                            drop_page_cache()
                        if arm != "gpu":
                            vllm.reset_gpu_cache()
                        if arm in ("file", "costfile"):
                            serve.restart_empty()
                            # Dropped before the reconnect's requests, so that they, not the
                            # hit, fault vLLM's own code and libraries back in.
                            drop_page_cache()
                            serve.wait_reconnected([servers[a] for a in ("server", "costfile")
                                                    if a in servers], lambda: fresh(2 * ct))
                        served = arm in ("server", "file", "costfile")
                        missed = serve.stats()["engine"]["deadline_misses"] if served else 0
                        samples[arm]["hit"].append(
                            vllm.timed_ttft(prefix + suffix, samples[arm], "hit"))
                        if served:  # chunks of the hit cut at the server's load deadline
                            samples[arm].setdefault("deadline_misses", []).append(
                                serve.stats()["engine"]["deadline_misses"] - missed)
                        if arm in ("file", "costfile"):  # what the hit read (a new server)
                            samples[arm].setdefault("disk_chunks", []).append(
                                serve.stats()["tiers"]["file"]["detail"]["hits"])
                        # The answer after the hit, with the prefix still cached as it is now.
                        tokens = vllm.complete(prefix + suffix, args.check_tokens)[1]
                        if arm == "gpu":
                            reference = tokens
                            other = vllm.complete(fresh(prefix_len) + suffix,
                                                  args.check_tokens)[1]
                            sensitive = sensitive or other != tokens
                            # The same prompt computed whole: the answer of a hit that loaded
                            # nothing (declined) or part (the rest recomputed) may follow this
                            # one where bf16 rounding in the other batch shape flips a token.
                            vllm.reset_gpu_cache()
                            recomputed = vllm.complete(prefix + suffix, args.check_tokens)[1]
                        else:
                            agree, how = tokens.agrees_with(reference)
                            if not agree:
                                agree_whole, how_whole = tokens.agrees_with(recomputed)
                                if agree_whole:
                                    agree, how = True, (f"{how_whole} with the recompute's "
                                                        f"answer (prefix hit's: {how})")
                            checks.setdefault(arm, []).append(how)
                            if not agree:
                                mismatches.append({"arm": arm, "repeat": rep, "how": how,
                                                   "tokens": tokens.tokens,
                                                   "reference": reference.tokens,
                                                   "reference_top": reference.top,
                                                   "recomputed": recomputed.tokens})
                if serve is not None:
                    serve.wait_old_pool_released()
                log(f"{context} tokens, repeat {rep + 1}/{args.repeats}: " + ", ".join(
                    f"{arm} {samples[arm]['hit'][-1] * 1e3:.0f} ms" for arm in arms
                    if samples[arm]["hit"]))
            samples = {arm: v for arm, v in samples.items() if arm in arms and v["hit"]}
            floor = prefix_len * bpt / bw if bw else None
            row = {"prefix_tokens": prefix_len, "prefix_chunks": prefix_len // ct,
                   "suffix_tokens": args.suffix,
                   "prefix_kv_bytes": prefix_len * bpt, "copy_floor_s": floor,
                   "samples": samples, "mismatches": mismatches, "checks": checks,
                   "median": {arm: {k: statistics.median(v) for k, v in s.items()}
                              for arm, s in samples.items()}}
            results["contexts"][context] = row
            (args.out / f"ttft-{context}.json").write_text(json.dumps(row, indent=1))
            for f in (disk / "tiering-fs").glob("*"):  # the disk is not large enough for all
                shutil.rmtree(f) if f.is_dir() else f.unlink()
        results["output_depends_on_prompt"] = sensitive
        if serve is not None and "server" in servers and args.fault_check:
            results["server_killed_mid_load"] = kill_mid_load(
                servers["gpu"], servers["server"], serve, fresh, max(contexts) - args.suffix,
                args)
        if "costfile" in servers:
            results["connector_counters"] = {"costfile": connector_counters(servers["costfile"])}
    finally:
        for vllm in servers.values():
            vllm.stop()
        if serve is not None:
            serve.stop()
    print_table(results, arms)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if args.plot:
        plot(results, arms, args.plot)
    failed = [m for row in results["contexts"].values() for m in row["mismatches"]]
    kill = results.get("server_killed_mid_load")
    if kill is not None and not kill["ok"]:
        failed.append(kill)
        log(f"CHECK FAILED: after kvtier serve was killed mid-load: {kill}")
    if failed:
        log(f"CHECK FAILED: {len(failed)} hits answered differently from vLLM's own prefix hit")
    if not results.get("output_depends_on_prompt"):
        log("CHECK FAILED: the model answers every prompt alike; the token check proves nothing")
    return 1 if failed or not results.get("output_depends_on_prompt") else 0


class arm_guard:
    """An arm whose server stops answering (an engine that died) is left out of the rest of the
    run, with the error and its log's tail in the results, instead of ending the run."""

    def __init__(self, arm, arms, servers, results, context):
        self.arm, self.arms, self.servers = arm, arms, servers
        self.results, self.context = results, context

    def __enter__(self):
        return self

    def __exit__(self, kind, error, tb):
        if kind is None or not issubclass(kind, (OSError, KeyError, RuntimeError)):
            return False
        name = "server" if self.arm == "file" else self.arm
        vllm = self.servers.get(name)
        tail = vllm.log_path.read_text(errors="replace")[-4000:] if vllm else ""
        log(f"the {self.arm} arm failed at {self.context} tokens and is left out: {error!r}")
        self.results.setdefault("failed_arms", {})[self.arm] = \
            f"at {self.context} tokens: {error!r}\n{tail}"
        for a in ([self.arm] if self.arm != "server" else ["server", "file"]):
            if a in self.arms:
                self.arms.remove(a)
        if name in self.servers and self.arm != "file":
            self.servers.pop(name).stop()
        if self.arm == "gpu":
            raise SystemExit("the gpu arm (every check's reference) failed")
        return True


def kill_mid_load(gpu: Vllm, vllm: Vllm, serve: Serve, fresh, prefix_len: int, args) -> dict:
    """kvtier serve is SIGKILLed while vLLM loads a prefix from it: the request must still be
    answered (vLLM recomputes what was not loaded) with the same tokens as vLLM's own hit, and
    vLLM must keep answering."""
    import threading

    prefix, suffix = fresh(prefix_len), fresh(args.suffix)
    reference = gpu.complete(prefix + suffix, args.check_tokens)[1]
    vllm.complete(prefix, 1)
    time.sleep(args.settle)
    vllm.reset_gpu_cache()
    answer: dict = {}

    def ask():
        try:
            answer["tokens"] = vllm.complete(prefix + suffix, args.check_tokens)[1]
        except (OSError, KeyError) as e:
            answer["error"] = repr(e)

    asker = threading.Thread(target=ask)
    asker.start()
    time.sleep(0.02)  # the lookup and the start of the load
    serve.proc.kill()
    serve.proc.wait()
    asker.join(300)
    after = None
    try:
        after = vllm.ttft(fresh(1024))
    except OSError as e:
        answer["after_error"] = repr(e)
    agree, how = answer["tokens"].agrees_with(reference) if "tokens" in answer else (False, "")
    ok = agree and after is not None
    serve.start()  # for whatever runs next; its L1 is empty
    return {"ok": ok, "answer_against_reference": how,
            "answered_after_s": after, **{k: v for k, v in answer.items() if k != "tokens"}}


def connector_counters(vllm: Vllm) -> dict[str, int]:
    """The kvtier connector's counters over the run, summed from vLLM's periodic "KV Transfer
    metrics" log lines (each line counts the interval since the one before)."""
    totals: dict[str, int] = {}
    for line in re.findall(r"KV Transfer metrics:(.*)", vllm.log_path.read_text(errors="replace")):
        for name, value in re.findall(r"\b(\w+)=(\d+)\b", line):
            totals[name] = totals.get(name, 0) + int(value)
    return totals


def print_table(results: dict, arms: list[str]) -> None:
    print("\nTTFT, median of repeats (ms); hit = prefix from the arm's tier + new suffix")
    header = f"{'context':>8} {'floor':>7} " + " ".join(f"{a + ' cold':>12} {a + ' hit':>11}"
                                                    for a in arms)
    print(header)
    for context, row in results["contexts"].items():
        med = row["median"]
        floor = row["copy_floor_s"]
        cells = " ".join(f"{med[a]['cold'] * 1e3:12.0f} {med[a]['hit'] * 1e3:11.0f}" for a in arms)
        print(f"{context:>8} {floor * 1e3 if floor else float('nan'):7.0f} {cells}")
    print("floor: prefix KV bytes / host->GPU bandwidth of this run; a hit can be no faster "
          "than the gpu arm's hit plus it (layer-wise overlap aside)")
    for context, row in results["contexts"].items():
        med = row["median"]
        ratios = []
        if "native" in med:
            for a in ("kvtier", "server", "lmcache"):
                if a in med:
                    ratios.append(f"{a}/native hit {med[a]['hit'] / med['native']['hit']:.2f}")
        for a in arms:
            if a not in ("gpu", "file"):
                ratios.append(f"{a} save overhead "
                              f"{(med[a]['cold'] / med['gpu']['cold'] - 1) * 100:+.1f} %")
        if "file" in med and "tiering" in med:
            ratios.append(f"file/tiering hit {med['file']['hit'] / med['tiering']['hit']:.2f}")
        for a, engine in (("file", "server"), ("costfile", "costfile")):
            if a in med:  # against recomputing the same length on the same engine
                ratios.append(f"{a} hit/recompute {med[a]['hit'] / med[engine]['cold']:.2f}")
                read = row["samples"][a].get("disk_chunks")
                if read is not None:  # a file hit that read nothing from disk measured a miss
                    ratios.append(f"{a} hits read {'/'.join(map(str, read))} of "
                                  f"{row['prefix_chunks']} chunks from disk")
        for a in arms:
            missed = row["samples"].get(a, {}).get("deadline_misses", [])
            if any(missed):  # the hit's time is then partly a recompute
                ratios.append(f"{a} hits cut at the load deadline: "
                              f"{'/'.join(map(str, missed))} chunks")
        for a in arms:  # where vLLM says the time went, on the arms that keep statistics
            if "hit_queue" in med.get(a, {}):
                ratios.append(f"{a} queue+prefill (ms) cold " + "+".join(
                    f"{med[a]['cold_' + p] * 1e3:.0f}" for p in ("queue", "prefill")) +
                    ", hit " + "+".join(f"{med[a]['hit_' + p] * 1e3:.0f}"
                                         for p in ("queue", "prefill")))
        print(f"{context:>8}: " + "; ".join(ratios))
    for arm, counters in results.get("connector_counters", {}).items():
        shown = {k: counters[k] for k in ("tokens_loaded", "tokens_declined", "layerwise_loads",
                                           "load_errors") if k in counters}
        print(f"{arm} connector over the run: " + ", ".join(f"{k} {v}" for k, v in shown.items()))


def plot(results: dict, arms: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [int(c) for c in results["contexts"]]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(xs, [r["median"]["gpu"]["cold"] for r in results["contexts"].values()],
            "k--", label="recompute")
    for a in arms:
        ax.plot(xs, [r["median"][a]["hit"] for r in results["contexts"].values()], "o-",
                label=f"{a} hit")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("TTFT (s)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    sys.exit(main())
