"""The connector's scheduler side inside the installed vLLM's own Scheduler, with no model.

test_connector.py runs the whole connector in vLLM's CPU build, which is published only up to
0.32. These tests need nothing but vLLM's Python sources: the installed release's real
Scheduler (vllm.v1.core.sched.scheduler) schedules requests with KvtierConnector's scheduler
side against a real `kvtier serve`. So they also run on the releases that cannot serve a model
here (0.33 and 0.34: docs/vllm.md, "Supported vLLM versions"). The test plays vLLM's model
runner and kvtier's workers: each step it stores the chunks the step hands out to save (through
a kvtier client, with bytes derived from each chunk's key, as a worker stores them from the
KV cache), loads the chunks it hands out to load and checks their bytes, and reports back what
vLLM's model runner reports (a sampled token per finished prompt, finished loads and saves,
blocks that failed to load). What is checked is the contract between the two schedulers: what
vLLM asks and when, what kvtier answers, and that vLLM's books balance after every fault.
"""

from __future__ import annotations

import hashlib
import inspect
import pickle
import signal
import time
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig,  # noqa: E402
                         SchedulerConfig, VllmConfig)
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig,  # noqa: E402
                                        KVCacheGroupSpec)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

import kvtier  # noqa: E402

from conftest import KvtierServer, random_prompt  # noqa: E402

BLOCK = 16
CHUNK = 256  # kvtier's default chunk_tokens
EOS = 1  # the tiny model's
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(4)]


def accepted(target, **values):
    """`values` less those `target` takes no parameter for: vLLM's classes grew fields across
    releases, and what an older one lacks it neither reads nor needs here."""
    names = inspect.signature(target).parameters
    return {k: v for k, v in values.items() if k in names}


def _hash(obj) -> bytes:
    return hashlib.sha256(pickle.dumps(obj)).digest()


init_none_hash(_hash)


def payload(key: bytes, size: int) -> bytes:
    """A chunk's bytes as the test's workers store them: derived from its key, so a load that
    returns another chunk's bytes (a wrong key, a wrong order) is caught."""
    seed = hashlib.sha256(key).digest()
    return (seed * (size // len(seed) + 1))[:size]


class Engine:
    """vLLM's Scheduler with KvtierConnector, the test standing in for the model runner and
    kvtier's workers (the module's docstring)."""

    def __init__(self, workdir: Path, server: KvtierServer, num_blocks: int = 400,
                 max_batched_tokens: int = 2048):
        model = ModelConfig(**accepted(ModelConfig, model=str(workdir / "model"),
                                           dtype="float32", seed=0, max_model_len=4096))
        sched = SchedulerConfig(**accepted(
            SchedulerConfig, max_num_seqs=8, max_num_batched_tokens=max_batched_tokens,
            max_model_len=4096, is_encoder_decoder=False, async_scheduling=False,
            enable_chunked_prefill=True))
        cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=True)
        transfer = KVTransferConfig(
            kv_connector="KvtierConnector", kv_connector_module_path="kvtier.vllm",
            kv_role="kv_both", kv_connector_extra_config={"kvtier.socket": server.socket,
                                                          "kvtier.load_mode": "async"})
        config = VllmConfig(model_config=model, scheduler_config=sched, cache_config=cache,
                            kv_transfer_config=transfer, device_config=DeviceConfig("cpu"))
        config.cache_config.num_gpu_blocks = num_blocks
        spec = FullAttentionSpec(**accepted(FullAttentionSpec, block_size=BLOCK,
                                                num_kv_heads=2, head_size=64,
                                                dtype=torch.float32, use_mla=False))
        kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                        kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)])
        self.num_blocks = num_blocks
        self.scheduler = Scheduler(**accepted(
            Scheduler, vllm_config=config, kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(config), block_size=BLOCK,
            log_stats=True))
        self.connector = self.scheduler.get_kv_connector()
        self.side = self.connector._scheduler
        self.server = server
        self._client = None
        self.loads: list = []  # every load job handed out, in order
        self.saves: list = []  # every save job handed out, in order
        self.schedule_s: list[float] = []  # each schedule()'s duration
        self.fail_loads = False  # report every block of the next loads as failed
        self._sending: set[str] = set()  # requests with saves: reported once finished
        self._report_sending: set[str] = set()
        self._finished: set[str] = set()

    def client(self):
        """The test's worker connection (the server's chunk size, the connector's namespace)."""
        if self._client is None:
            self._client = kvtier.connect(self.side.ns.store(0), 0,
                                          socket_path=self.server.socket)
        return self._client

    def add(self, req_id: str, tokens: list[int], max_tokens: int = 2) -> Request:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        params.update_from_generation_config({}, EOS)
        request = Request(**accepted(
            Request, request_id=req_id, prompt_token_ids=list(tokens),
            sampling_params=params, pooling_params=None, eos_token_id=EOS,
            block_hasher=get_request_block_hasher(BLOCK, _hash)))
        self.scheduler.add_request(request)
        return request

    def _work(self, meta) -> tuple[set[str], set[int]]:
        """The workers' part of a step: its saves stored, its loads read and checked."""
        recving, invalid = set(), set()
        for job in meta.saves:
            self.saves.append(job)
            self._sending.add(job.req_id)
            try:
                size = self.client().chunk_bytes
                self.client().store(job.keys, [payload(k, size) for k in job.keys]).wait()
            except kvtier.KvtierError:
                self._client = None  # a dead server: the save is lost, as a worker's would be
        for job in meta.loads:
            self.loads.append(job)
            blocks = {b for chunk in job.block_ids for b in chunk[0] if b >= 0}
            loaded = 0
            if not self.fail_loads:
                size = self.client().chunk_bytes
                out = [bytearray(size) for _ in job.keys]
                loaded = self.client().load(job.keys, out).wait().chunks
                for key, got in zip(job.keys[:loaded], out):
                    assert bytes(got) == payload(key, size), "a load returned other bytes"
            if loaded < len(job.keys):
                invalid |= {b for chunk in job.block_ids[loaded:] for b in chunk[0] if b >= 0}
            assert blocks, "a load with no blocks to fill"
            recving.add(job.req_id)
        return recving, invalid

    def step(self):
        """One engine step: schedule, the workers' part, the model runner's output."""
        started = time.perf_counter()
        out = self.scheduler.schedule()
        self.schedule_s.append(time.perf_counter() - started)
        recving, invalid = self._work(out.kv_connector_metadata)
        req_ids, sampled = [], []
        for req_id in out.num_scheduled_tokens:
            request = self.scheduler.requests[req_id]
            req_ids.append(req_id)
            # num_computed_tokens already counts this step's tokens (schedule() advanced it).
            sampled.append([7] if request.num_computed_tokens >= request.num_tokens else [])
        sending, self._report_sending = self._report_sending, set()
        kv_output = KVConnectorOutput(**accepted(
            KVConnectorOutput, finished_sending=sending or None,
            finished_recving=recving or None, invalid_block_ids=invalid))
        output = ModelRunnerOutput(**accepted(
            ModelRunnerOutput, req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)}, sampled_token_ids=sampled,
            logprobs=None, prompt_logprobs_dict={}, pooler_output=[None] * len(req_ids),
            kv_connector_output=kv_output))
        self.scheduler.update_from_output(out, output)
        # vLLM frees a finished request's blocks once its saves are reported done: the workers
        # report them on the next step's output.
        for req_id in out.finished_req_ids:
            self._finished.add(req_id)
            if req_id in self._sending:
                self._sending.discard(req_id)
                self._report_sending.add(req_id)
        return out

    def run(self, until, max_steps: int = 200) -> None:
        for _ in range(max_steps):
            if until():
                return
            self.step()
        raise AssertionError(f"not done within {max_steps} steps")

    def finished(self, req_id: str) -> bool:
        return req_id in self._finished

    def idle(self) -> bool:
        """Every request finished and every block back in vLLM's free pool."""
        pool = self.scheduler.kv_cache_manager.block_pool
        return (not self.scheduler.requests and not self._report_sending
                and pool.get_num_free_blocks() == pool.num_gpu_blocks - 1)

    def drain(self) -> None:
        self.run(self.idle)

    def reset_prefix_cache(self) -> None:
        assert self.scheduler.reset_prefix_cache(), "vLLM kept blocks after every request ended"

    def close(self) -> None:
        self.connector.shutdown()
        if self._client is not None:
            self._client.close()


@pytest.fixture
def server(workdir: Path, tmp_path: Path):
    work = tmp_path / "serve"
    work.mkdir()
    (work / "model").symlink_to(workdir / "model")
    s = KvtierServer(work, None)
    yield s
    s.proc.send_signal(signal.SIGCONT)
    s.stop()


@pytest.fixture
def engine(workdir: Path, server):
    e = Engine(workdir, server)
    yield e
    e.close()


def computed_when_scheduled(engine: Engine, req_id: str) -> int:
    """Steps until the request is scheduled (for at most 30 s: a lookup vLLM is told to ask
    again about takes steps, not a fixed number); then the tokens it starts from."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        out = engine.step()
        if req_id in out.num_scheduled_tokens:
            request = engine.scheduler.requests[req_id]
            return request.num_computed_tokens - out.num_scheduled_tokens[req_id]
    raise AssertionError(f"{req_id} was never scheduled")


PREFIX = random_prompt(7, 2 * CHUNK)


def stored_prefix(engine: Engine) -> list[bytes]:
    """Serves PREFIX + 100 tokens once, so that kvtier holds its two chunks; then empties
    vLLM's own prefix cache, so that a later hit can only come from kvtier."""
    engine.add("first", PREFIX + random_prompt(8, 100))
    engine.drain()
    keys = saved_by(engine, "first")
    assert len(keys) == 2, "the first request's two full chunks are saved"
    engine.reset_prefix_cache()
    return keys


def test_a_saved_prefix_comes_back_as_a_load(engine: Engine):
    keys = stored_prefix(engine)
    engine.add("again", PREFIX + random_prompt(9, 100))
    assert computed_when_scheduled(engine, "again") == 2 * CHUNK
    assert [job.keys for job in engine.loads] == [keys], "one load of the two stored chunks"
    engine.drain()
    # vLLM's own cache now holds the prefix: served by it, neither loaded nor saved again.
    engine.add("third", PREFIX + random_prompt(10, 100))
    assert computed_when_scheduled(engine, "third") == 2 * CHUNK
    engine.drain()
    assert len(engine.loads) == 1
    assert not set(saved_by(engine, "third")) & set(keys)


def saved_by(engine: Engine, req_id: str) -> list[bytes]:
    return [k for job in engine.saves if job.req_id == req_id for k in job.keys]


def test_a_request_aborted_during_its_load(engine: Engine):
    stored_prefix(engine)
    engine.add("aborted", PREFIX + random_prompt(9, 100))
    engine.run(lambda: len(engine.loads) == 1)
    # The load was handed out in the step just run and reported done on its output; the abort
    # comes before vLLM has seen that report (the next schedule()).
    engine.scheduler.finish_requests("aborted", RequestStatus.FINISHED_ABORTED)
    engine.drain()
    # A second request for the same prefix after the abort: served, vLLM's books balance.
    engine.reset_prefix_cache()
    engine.add("after", PREFIX + random_prompt(11, 100))
    engine.drain()
    assert engine.finished("after")


def test_an_abort_before_the_load_is_handed_out(engine: Engine):
    stored_prefix(engine)
    engine.add("aborted", PREFIX + random_prompt(9, 100))
    engine.scheduler.finish_requests("aborted", RequestStatus.FINISHED_ABORTED)
    engine.drain()
    assert not engine.loads


def test_a_failed_load_is_recomputed_once_and_saved_again(engine: Engine):
    keys = stored_prefix(engine)
    engine.fail_loads = True
    engine.add("failed", PREFIX + random_prompt(9, 100))
    start = computed_when_scheduled(engine, "failed")
    engine.fail_loads = False
    engine.drain()
    assert start == 0, "the failed chunks are recomputed"
    assert len(engine.loads) == 1, "a failed load is not tried again"
    # Recomputed chunks are saved again (the store had lost them, as far as vLLM knows).
    assert saved_by(engine, "failed")[:2] == keys


def test_a_stalled_server_defers_lookups_without_holding_the_loop(engine: Engine, server):
    stored_prefix(engine)
    server.proc.send_signal(signal.SIGSTOP)
    try:
        engine.schedule_s.clear()
        engine.add("stalled", PREFIX + random_prompt(9, 100))
        # The lookup cannot be answered: vLLM is told to ask again, then (the lookup's RPC
        # timeout) the request is computed without kvtier, never held up for good.
        start = computed_when_scheduled(engine, "stalled")
        assert start == 0
        engine.drain()
    finally:
        server.proc.send_signal(signal.SIGCONT)
    assert not engine.loads
    # Each step waits a few milliseconds for a lookup, not the RPC's 1-s timeout; a loaded
    # machine's scheduling noise is far below the difference.
    assert max(engine.schedule_s) < 0.5, engine.schedule_s


def test_a_dead_server_means_recompute(engine: Engine, server):
    stored_prefix(engine)
    server.kill()
    engine.add("dead", PREFIX + random_prompt(9, 100))
    assert computed_when_scheduled(engine, "dead") == 0
    engine.drain()
    assert not engine.loads


def test_a_preempted_request_resumes_through_a_load(workdir: Path, server):
    """Two requests whose prompts fit vLLM's KV cache together but whose answers do not: vLLM
    preempts one, the other's answer takes its blocks, and the preempted one resumes with its
    saved chunk loaded from kvtier rather than recomputed."""
    # 38 usable blocks of 16 tokens: two 288-token prompts (18 blocks each) fit, and either
    # answer alone grows to 37 blocks.
    engine = Engine(workdir, server, num_blocks=39)
    try:
        engine.add("a", random_prompt(20, 288), max_tokens=300)
        engine.add("b", random_prompt(21, 288), max_tokens=300)
        engine.run(lambda: engine.idle(), max_steps=2000)
        assert engine.finished("a") and engine.finished("b")
        assert engine.side.resumed_from_kvtier >= 1, engine.loads
        assert engine.loads and all(len(job.keys) >= 1 for job in engine.loads)
    finally:
        engine.close()
