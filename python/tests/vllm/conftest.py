"""Real processes for the connector tests: vLLM's CPU build serving a tiny local model, and
`kvtier serve`. Nothing is mocked: requests go over HTTP to vLLM, which runs the connector.

The model is scripts/vllm-cpu-server.sh's tiny Llama with seeded random weights written here
(std 0.2): vLLM's own dummy weights are so small that every prompt gets the same answer, which
would let a wrong KV cache pass unnoticed; with these, changing one prompt token changes the
answer. It is served in float32: in bfloat16, vLLM's batch-dependent rounding sometimes flipped
a near-tied greedy choice between two servers given the same batch at slightly different times.

Environment:
  KVTIER_VLLM_PYTHON  the Python of the virtualenv vLLM is installed in (default: this one)
  KVTIER_VLLM_MODEL   the tiny model directory (scripts/vllm-cpu-server.sh model writes it)
  KVTIER_BINARY       the `kvtier` CLI (default: the one on PATH)
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from kvtier.bench.planner_check import reset_prefix_cache

VLLM_PYTHON = os.environ.get("KVTIER_VLLM_PYTHON", sys.executable)
MODEL_DIR = os.environ.get("KVTIER_VLLM_MODEL", "/tmp/kvtier-tiny-model")
START_TIMEOUT = float(os.environ.get("KVTIER_VLLM_START_TIMEOUT", "600"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(url: str, body: dict | None = None, timeout: float = 300) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST" if body is not None else "GET",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        text = r.read().decode()
    return json.loads(text) if text.strip() else {}


def random_prompt(seed: int, n_tokens: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 4096) for _ in range(n_tokens)]


class Vllm:
    """One `vllm serve` process; its log is kept for assertions and failure reports."""

    def __init__(self, workdir: Path, name: str, kv_transfer_config: dict | None,
                 extra_args: list[str] = (), env: dict | None = None):
        model_dir = str(workdir / "model")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / f"vllm-{name}.log"
        args = [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
                "--enforce-eager", "--dtype", "float32", "--served-model-name", "tiny",
                "--max-model-len", "4096", "--port", str(self.port), "--host", "127.0.0.1",
                "--disable-log-stats" if kv_transfer_config is None else "--enable-log-requests",
                *extra_args]
        if kv_transfer_config is not None:
            args += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
        full_env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1",
                        VLLM_LOGGING_LEVEL="INFO", KVTIER_LOG_LEVEL="info",
                        **(env or {}))
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=full_env, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM {name} exited with {self.proc.returncode}:\n"
                                   + self.log_tail())
            try:
                urllib.request.urlopen(self.url + "/health", timeout=2).read()
                return
            except (urllib.error.URLError, OSError):
                time.sleep(1)
        self.stop()
        raise RuntimeError(f"vLLM {name} did not start in {START_TIMEOUT} s:\n" + self.log_tail())

    def complete(self, prompt: list[int], max_tokens: int = 12) -> list[int]:
        """Greedy completion; returns the generated token ids."""
        out = http_json(self.url + "/v1/completions",
                        {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                         "temperature": 0, "ignore_eos": True, "return_token_ids": True})
        choice = out["choices"][0]
        return choice.get("token_ids") or choice["text"]

    def complete_batch(self, prompts: list[list[int]], max_tokens: int = 12) -> list[list[int]]:
        """One request for several prompts: vLLM schedules them together, in the same way on
        every run, so batched numerics are comparable between two servers."""
        out = http_json(self.url + "/v1/completions",
                        {"model": "tiny", "prompt": prompts, "max_tokens": max_tokens,
                         "temperature": 0, "ignore_eos": True, "return_token_ids": True})
        return [c.get("token_ids") or c["text"]
                for c in sorted(out["choices"], key=lambda c: c["index"])]

    def reset_prefix_cache(self) -> None:
        reset_prefix_cache(self.port)  # asked again while vLLM refuses (blocks still held)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


class KvtierServer:
    """`kvtier serve` with its own socket, HTTP port and file tier."""

    def __init__(self, workdir: Path, l2_dir: Path | None, l1_size_gb: float = 0.25,
                 extra_args: list[str] = (), l2_extra: dict | None = None):
        binary = os.environ.get("KVTIER_BINARY") or shutil.which("kvtier")
        assert binary, "the kvtier CLI is not on PATH (pip install . puts it there)"
        self.socket = str(workdir / "kvtier.sock")
        self.http_port = free_port()
        self.l2_dir = l2_dir
        self.log_path = workdir / "kvtier-serve.log"
        args = [binary, "serve", "--socket", self.socket, "--http-port", str(self.http_port),
                "--l1-size-gb", str(l1_size_gb), "--model", str(workdir / "model" / "config.json"),
                "--kv-dtype", "float32",
                *extra_args]
        if l2_dir is None:
            args.append("--no-l2")
        else:
            args += ["--l2", json.dumps({"type": "fs", "path": str(l2_dir), "max_size_gb": 1,
                                         **(l2_extra or {})})]
        self._log = open(self.log_path, "a")
        log_start = self._log.tell()
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT)
        # Started once it logs "listening on" (after its socket and HTTP port are set up): a
        # killed server's socket file is still there, so the file says nothing.
        deadline = time.monotonic() + 30
        while "listening on " not in self.log_path.read_text(errors="replace")[log_start:]:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("kvtier serve did not start:\n" + self.log_path.read_text())
            time.sleep(0.05)

    def stats(self) -> dict:
        return http_json(f"http://127.0.0.1:{self.http_port}/stats")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def connector_config(**extra) -> dict:
    return {"kv_connector": "KvtierConnector", "kv_connector_module_path": "kvtier.vllm",
            "kv_role": "kv_both", "kv_connector_extra_config": extra}


WRITE_WEIGHTS = """
import json, sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
config = json.load(open(sys.argv[1] + "/config.json"))
config["initializer_range"] = 0.2
torch.manual_seed(0)
LlamaForCausalLM(LlamaConfig(**config)).to(torch.bfloat16).save_pretrained(sys.argv[1])
"""


@pytest.fixture(scope="session")
def workdir(tmp_path_factory) -> Path:
    if not (Path(MODEL_DIR) / "config.json").exists():
        pytest.fail(f"no model in {MODEL_DIR}: run scripts/vllm-cpu-server.sh model")
    work = tmp_path_factory.mktemp("vllm")
    shutil.copytree(MODEL_DIR, work / "model")
    subprocess.run([VLLM_PYTHON, "-c", WRITE_WEIGHTS, str(work / "model")], check=True,
                   capture_output=True)
    return work


@pytest.fixture(scope="session")
def baseline(workdir):
    """vLLM without a connector: the reference answers."""
    server = Vllm(workdir, "baseline", None)
    yield server
    server.stop()


END_SEQ = b"\xff" * 8


def kvtier_has_kv_events(tmp_dir: Path) -> bool:
    """This kvtier was built with KV-cache events (libzmq and msgpack-cxx were found)."""
    import kvtier

    settings = {"chunk_bytes": 65536, "chunk_size": 256, "l1_size_gb": 0.01, "no_l2": True,
                "socket": str(tmp_dir / "probe.sock"),
                "kv_events": {"endpoint": f"ipc://{tmp_dir}/probe-events"}}
    try:
        server = kvtier.start_server(json.dumps(settings))
    except kvtier.KvtierError as e:
        if getattr(e, "code", "") == "unimplemented":
            return False
        raise
    server.stop()
    return True


class EventStream:
    """A KV-cache event subscriber written against vLLM's published schema only (its
    KVEventBatch, decoded strictly), following a stream as docs/kv-events.md tells subscribers
    to: SUB first, a replay from 0 over DEALER, then the live batches past the last replayed.
    Keeps every BlockStored per medium, hash by hash: (parent, token ids)."""

    def __init__(self, ctx, endpoint: str, replay_endpoint: str):
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self._decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self._sub = ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(endpoint)
        self._dealer = ctx.socket(zmq.DEALER)
        self._dealer.connect(replay_endpoint)
        self.last_seq = -1
        self.blocks: dict[str, dict] = {}  # medium -> hash -> (parent, token ids)

    def close(self) -> None:
        self._sub.close(linger=0)
        self._dealer.close(linger=0)

    def _apply(self, seq: int, payload: bytes) -> None:
        from vllm.distributed.kv_events import BlockStored

        self.last_seq = max(self.last_seq, seq)
        for ev in self._decoder.decode(payload).events:
            if not isinstance(ev, BlockStored):
                continue
            blocks = self.blocks.setdefault(ev.medium, {})
            parent, size = ev.parent_block_hash, ev.block_size
            for i, h in enumerate(ev.block_hashes):
                blocks[h] = (parent, tuple(ev.token_ids[i * size:(i + 1) * size]) or None)
                parent = h

    def follow(self, timeout_s: float = 30) -> None:
        """A replay from 0 (vLLM's ring, or kvtier's ring or snapshot), then what arrived live
        past it."""
        self._dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        while True:
            assert self._dealer.poll(int(timeout_s * 1000)), "no answer to a replay request"
            _, _, seq, payload = self._dealer.recv_multipart()
            if seq == END_SEQ:
                break
            self._apply(int.from_bytes(seq, "big"), payload)
        while self._sub.poll(0):
            _, seq, payload = self._sub.recv_multipart()
            if int.from_bytes(seq, "big") > self.last_seq:
                self._apply(int.from_bytes(seq, "big"), payload)


def vllm_block_hashes(gpu: dict, prompt: list[int], block_size: int) -> list:
    """The prompt's full blocks' hashes as vLLM's own events name them, found by chaining
    (parent, tokens) through its GPU BlockStored events."""
    by_content = {content: h for h, content in gpu.items()}
    hashes, parent = [], None
    for j in range(len(prompt) // block_size):
        h = by_content.get((parent, tuple(prompt[j * block_size:(j + 1) * block_size])))
        if h is None:
            break
        hashes.append(h)
        parent = h
    return hashes


def assert_kvtier_names_vllms_blocks(ours: EventStream, theirs: EventStream,
                                     prompts: list[list[int]], chunk_tokens: int,
                                     timeout_s: float = 60) -> None:
    """For every full chunk of each prompt, kvtier's CPU BlockStored events carry the hashes of
    vLLM's own GPU BlockStored events for the same blocks, parents chained across chunks, with
    the same tokens; nothing of a partial chunk (kvtier stores full chunks only)."""
    deadline = time.monotonic() + timeout_s
    while True:
        ours.follow()
        theirs.follow()
        gpu, cpu = theirs.blocks.get("GPU", {}), ours.blocks.get("CPU", {})
        sizes = {len(tokens) for _, tokens in gpu.values() if tokens}
        if len(sizes) == 1:
            block_size = next(iter(sizes))
            n = chunk_tokens // block_size
            want = [vllm_block_hashes(gpu, p, block_size)[:len(p) // chunk_tokens * n]
                    for p in prompts]
            if (all(len(w) == len(p) // chunk_tokens * n for w, p in zip(want, prompts))
                    and all(h in cpu for w in want for h in w)):
                break
        assert time.monotonic() < deadline, (
            f"after {timeout_s} s kvtier announced {len(cpu)} CPU blocks, vLLM {len(gpu)} GPU "
            f"blocks (block sizes {sizes})")
    assert any(len(w) >= 2 * n for w in want), "no prompt spans two chunks (parents across)"
    for p, w in zip(prompts, want):
        for j, h in enumerate(w):
            parent, tokens = cpu[h]
            assert parent == (w[j - 1] if j else None), f"block {j}: parent not chained"
            assert tokens == tuple(p[j * block_size:(j + 1) * block_size]), f"block {j} tokens"
        partial = vllm_block_hashes(gpu, p, block_size)[len(w):]
        assert not set(partial) & set(cpu), "a block of a partial chunk announced"
