"""vLLM's own Scheduler with KvtierConnector's scheduler side, and no model.

vLLM's scheduler is plain Python: it runs on any release, without a GPU or a CPU build. This
module builds the installed release's real `Scheduler` (with KvtierConnector against a running
`kvtier serve`, or with no connector) and stands in for what is missing: the model runner (a
sampled token once a request's prompt is computed, then one per step) and kvtier's workers
(each step's saves stored through a kvtier client, with bytes derived from each chunk's key;
each step's loads read back and their bytes checked). It serves the connector's contract tests
on every release (python/tests/vllm/test_scheduler_contract.py) and the measurement of the
scheduler side's cost per step (kvtier.bench.scheduler_cost).
"""

from __future__ import annotations

import hashlib
import pickle
import time
from pathlib import Path
from typing import Callable

import torch
from vllm import SamplingParams
from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig,
                         SchedulerConfig, VllmConfig)
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

import kvtier

from .compat import known_fields

SAMPLED_TOKEN = 7  # what the stand-in model runner samples, every time


def _block_hash(obj) -> bytes:
    return hashlib.sha256(pickle.dumps(obj)).digest()


init_none_hash(_block_hash)


def payload(key: bytes, size: int) -> bytes:
    """A chunk's bytes as the stand-in workers store them: derived from its key, so a load that
    returns another chunk's bytes (a wrong key, a wrong order) is caught."""
    seed = hashlib.sha256(key).digest()
    return (seed * (size // len(seed) + 1))[:size]


class ModelFreeEngine:
    """The installed vLLM's Scheduler, stepped by hand (the module's docstring).

    `model_dir` holds a Hugging Face config.json (no weights, no tokenizer needed). With
    `socket`, KvtierConnector in server mode is the scheduler's connector (`extra`: more of its
    kv_connector_extra_config); without, the scheduler has no connector."""

    def __init__(self, model_dir: str | Path, socket: str | None = None,
                 extra: dict | None = None, num_blocks: int = 400,
                 max_batched_tokens: int = 2048, max_model_len: int = 4096,
                 max_num_seqs: int = 8, block_size: int = 16):
        model = ModelConfig(**known_fields(ModelConfig, model=str(model_dir), dtype="float32",
                                       seed=0, max_model_len=max_model_len,
                                       skip_tokenizer_init=True))
        sched = SchedulerConfig(**known_fields(
            SchedulerConfig, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_batched_tokens, max_model_len=max_model_len,
            is_encoder_decoder=False, async_scheduling=False, enable_chunked_prefill=True))
        cache = CacheConfig(block_size=block_size, enable_prefix_caching=True)
        transfer = None
        if socket is not None:
            transfer = KVTransferConfig(
                kv_connector="KvtierConnector", kv_connector_module_path="kvtier.vllm",
                kv_role="kv_both",
                kv_connector_extra_config={"kvtier.socket": socket, **(extra or {})})
        config = VllmConfig(model_config=model, scheduler_config=sched, cache_config=cache,
                            kv_transfer_config=transfer, device_config=DeviceConfig("cpu"))
        config.cache_config.num_gpu_blocks = num_blocks
        hf = model.hf_text_config
        heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
        head_size = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        spec = FullAttentionSpec(**known_fields(FullAttentionSpec, block_size=block_size,
                                            num_kv_heads=heads, head_size=head_size,
                                            dtype=torch.float32, use_mla=False))
        layers = [f"model.layers.{i}.self_attn.attn" for i in range(hf.num_hidden_layers)]
        kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                        kv_cache_groups=[KVCacheGroupSpec(layers, spec)])
        self.block_size = block_size
        self.eos = getattr(hf, "eos_token_id", None)
        if not isinstance(self.eos, int):
            self.eos = None
        self.scheduler = Scheduler(**known_fields(
            Scheduler, vllm_config=config, kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(config),
            block_size=block_size, log_stats=True))
        self.connector = self.scheduler.get_kv_connector() if socket is not None else None
        self.side = self.connector._scheduler if self.connector is not None else None
        self.socket = socket
        self._client = None
        self.loads: list = []  # every load job handed out, in order
        self.saves: list = []  # every save job handed out, in order
        self.schedule_s: list[float] = []  # each schedule()'s duration
        self.update_s: list[float] = []  # each update_from_output()'s duration
        self.fail_loads = False  # report every block of the next loads as failed
        # Loads under way: their end is reported once release_loads() is called (a slow read),
        # not on the output of the step that handed them out.
        self.hold_loads = False
        self._held_recving: set[str] = set()
        self._released_recving: set[str] = set()
        self._sending: set[str] = set()  # requests with saves: reported once finished
        self._report_sending: set[str] = set()
        self.finished_ids: list[str] = []  # in the order they finished
        self.connector_counters: dict[str, float] = {}  # the scheduler side's, summed

    def client(self):
        """The workers' connection (the server's chunk size, the connector's namespace)."""
        if self._client is None:
            self._client = kvtier.connect(self.side.ns.store(0), 0, socket_path=self.socket)
        return self._client

    def add(self, req_id: str, tokens: list[int], max_tokens: int = 2) -> Request:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        params.update_from_generation_config({}, self.eos)
        request = Request(**known_fields(
            Request, request_id=req_id, prompt_token_ids=list(tokens),
            sampling_params=params, pooling_params=None, eos_token_id=self.eos,
            block_hasher=get_request_block_hasher(self.block_size, _block_hash)))
        self.scheduler.add_request(request)
        return request

    def _work(self, meta) -> tuple[set[str], set[int]]:
        """The workers' part of a step: its saves stored, its loads read and checked."""
        recving, invalid = set(), set()
        if meta is None or self.side is None:
            return recving, invalid
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
            assert blocks, "a load with no blocks to fill"
            loaded, out = 0, []
            if not self.fail_loads:
                try:
                    size = self.client().chunk_bytes
                    out = [bytearray(size) for _ in job.keys]
                    loaded = self.client().load(job.keys, out).wait().chunks
                except kvtier.KvtierError:
                    self._client = None
                    loaded = 0
                for key, got in zip(job.keys[:loaded], out):
                    assert bytes(got) == payload(key, size), "a load returned other bytes"
            if loaded < len(job.keys):
                invalid |= {b for chunk in job.block_ids[loaded:] for b in chunk[0] if b >= 0}
            (self._held_recving if self.hold_loads else recving).add(job.req_id)
        recving |= self._released_recving
        self._released_recving = set()
        return recving, invalid

    def release_loads(self) -> None:
        """The loads held under way end: reported on the next step's output."""
        self._released_recving |= self._held_recving
        self._held_recving = set()

    def step(self):
        """One engine step: schedule, the workers' part, the model runner's output."""
        started = time.perf_counter()
        out = self.scheduler.schedule()
        self.schedule_s.append(time.perf_counter() - started)
        recving, invalid = self._work(getattr(out, "kv_connector_metadata", None))
        req_ids, sampled = [], []
        for req_id in out.num_scheduled_tokens:
            request = self.scheduler.requests[req_id]
            req_ids.append(req_id)
            # num_computed_tokens already counts this step's tokens (schedule() advanced it).
            done = request.num_computed_tokens >= request.num_tokens
            sampled.append([SAMPLED_TOKEN] if done else [])
        sending, self._report_sending = self._report_sending, set()
        kv_output = None
        if self.side is not None:
            kv_output = KVConnectorOutput(**known_fields(
                KVConnectorOutput, finished_sending=sending or None,
                finished_recving=recving or None, invalid_block_ids=invalid))
        output = ModelRunnerOutput(**known_fields(
            ModelRunnerOutput, req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)}, sampled_token_ids=sampled,
            logprobs=None, prompt_logprobs_dict={}, pooler_output=[None] * len(req_ids),
            kv_connector_output=kv_output))
        started = time.perf_counter()
        outputs = self.scheduler.update_from_output(out, output)
        self.update_s.append(time.perf_counter() - started)
        self._count(outputs)
        # vLLM frees a finished request's blocks once its saves are reported done: the workers
        # report them on the next step's output.
        for req_id in out.finished_req_ids:
            self.finished_ids.append(req_id)
            if req_id in self._sending:
                self._sending.discard(req_id)
                self._report_sending.add(req_id)
        return out

    def _count(self, outputs) -> None:
        """Adds the step's connector counters (vLLM collects them into its scheduler stats)."""
        for core_outputs in (outputs or {}).values():
            stats = getattr(getattr(core_outputs, "scheduler_stats", None),
                            "kv_connector_stats", None)
            for name, value in (stats or {}).items():
                if isinstance(value, (int, float)):
                    self.connector_counters[name] = self.connector_counters.get(name, 0) + value

    def run(self, until: Callable[[], bool], max_steps: int = 200) -> None:
        for _ in range(max_steps):
            if until():
                return
            self.step()
        raise AssertionError(f"not done within {max_steps} steps")

    def finished(self, req_id: str) -> bool:
        return req_id in self.finished_ids

    def idle(self) -> bool:
        """Every request finished and every block back in vLLM's free pool."""
        pool = self.scheduler.kv_cache_manager.block_pool
        return (not self.scheduler.requests and not self._report_sending
                and pool.get_num_free_blocks() == pool.num_gpu_blocks - 1)

    def drain(self, max_steps: int = 200) -> None:
        self.run(self.idle, max_steps)

    def reset_prefix_cache(self) -> None:
        assert self.scheduler.reset_prefix_cache(), "vLLM kept blocks after every request ended"

    def close(self) -> None:
        if self.connector is not None:
            self.connector.shutdown()
        if self._client is not None:
            self._client.close()
            self._client = None

