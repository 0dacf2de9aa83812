"""KvtierTier driven by vLLM's own native-offloading code.

vLLM's TieringOffloadingSpec builds the tier through its secondary-tier factory from the
configuration in docs/vllm.md, over vLLM's CPU primary (its shared-memory offload region), and
its TieringOffloadingManager drives it exactly as its scheduler does: prepare_store /
complete_store cascade chunks to the tier with vLLM's TransferJob objects, lookups that miss the
primary promote chunks from the tier, get_finished_jobs completes them. No GPU is needed for the
scheduler side (vLLM refuses to start its offloading workers without one, docs/vllm.md).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

pytest.importorskip("vllm")

from kvtier.vllm import compat  # noqa: E402

try:
    compat.require_secondary_tier()
except compat.UnsupportedVllmError as e:  # test_compat checks the message on such versions
    pytest.skip(f"no out-of-tree tier in this vLLM: {e}", allow_module_level=True)

from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext  # noqa: E402
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec  # noqa: E402

from kvtier.vllm.bench_tiering import offload_keys, offloading_config  # noqa: E402
from kvtier.vllm.tiering import KvtierTier, KvtierTierMetrics  # noqa: E402

BYTES_PER_TOKEN = 1024  # 256 KiB chunks of 256 tokens
CHUNK_BYTES = BYTES_PER_TOKEN * 256


def issue_config(path, **l2) -> dict:
    """The configuration docs/vllm.md gives, on a small primary."""
    return {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 64 * CHUNK_BYTES,
            "block_size": 256,
            "secondary_tiers": [{"type": "KvtierTier", "module_path": "kvtier.vllm.tiering",
                                 "l2": {"type": "fs", "path": str(path), **l2}}]}


class Driver:
    """vLLM's manager over a fresh spec, stepped like its scheduler."""

    def __init__(self, extra: dict):
        self.spec = TieringOffloadingSpec(offloading_config(extra,
                                                            bytes_per_token=BYTES_PER_TOKEN))
        self.manager = self.spec.get_manager()
        self.tier = self.manager.secondary_tiers[0]
        mv = self.manager.primary_tier.get_kv_memoryview()
        self.primary = np.frombuffer(mv.cast("B"), dtype=np.uint8).reshape(mv.shape[0], -1)
        self.requests = 0

    def step(self):
        self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))

    def settle(self):
        """Lets the jobs in flight finish and vLLM collect them."""
        assert self.tier.wait_idle(30)
        self.step()
        self.manager.lookup(b"\0" * 36, ReqContext(req_id="poll"))  # processes finished jobs
        self.step()

    def request(self) -> ReqContext:
        self.requests += 1
        ctx = ReqContext(req_id=f"req-{self.requests}")
        self.manager.on_new_request(ctx)
        return ctx

    def store(self, keys, chunks: np.ndarray):
        """GPU -> primary (the bytes written into the slots vLLM gives), then vLLM cascades."""
        ctx = self.request()
        out = self.manager.prepare_store(keys, ctx)
        assert list(out.keys_to_store) == list(keys)
        for slot, chunk in zip(compat.chunk_ids(out.store_spec), chunks):
            self.primary[slot] = chunk
        self.manager.complete_store(keys, ctx)
        self.manager.on_request_finished(ctx)
        self.settle()

    def load(self, keys) -> tuple[list[LookupResult], np.ndarray | None]:
        """What a new request's lookups find after the tier's promotions, and the bytes of the
        hit prefix in the primary (as the GPU would read them)."""
        ctx = self.request()
        for k in keys:
            self.manager.lookup(k, ctx)  # a primary miss found in the tier starts a promotion
        self.step()  # submits the promotions
        self.settle()
        results = [self.manager.lookup(k, ctx) for k in keys]
        hits = 0
        while hits < len(keys) and results[hits] is LookupResult.HIT:
            hits += 1
        data = None
        if hits:
            spec = self.manager.prepare_load(keys[:hits], ctx)
            data = self.primary[np.asarray(compat.chunk_ids(spec))].copy()
            self.manager.complete_load(keys[:hits], ctx)
        self.manager.on_request_finished(ctx)
        return results, data

    def drop_primary(self):
        self.manager.reset_cache()

    def close(self):
        del self.primary
        self.manager.shutdown()


@pytest.fixture
def driver(tmp_path):
    drivers = []

    def make(extra=None, **l2):
        d = Driver(extra or issue_config(tmp_path / "kv", **l2))
        drivers.append(d)
        return d

    yield make
    for d in drivers:
        if not d.tier.file_tier.closed:
            d.close()


def random_chunks(n, seed):
    return np.random.default_rng(seed).integers(0, 256, (n, CHUNK_BYTES), dtype=np.uint8)


def test_factory_builds_the_tier_from_the_documented_config(driver, tmp_path):
    d = driver()
    assert type(d.tier) is KvtierTier and d.tier.tier_type == "KvtierTier"
    assert d.tier.block_size_bytes == CHUNK_BYTES
    assert d.tier.file_tier.namespace_dir.startswith(str(tmp_path / "kv"))
    metrics = TieringOffloadingSpec.build_metric_definitions(issue_config(tmp_path / "kv"))
    assert KvtierTierMetrics.CHUNKS in metrics and KvtierTierMetrics.CORRUPT in metrics


def test_chunks_stored_and_loaded_back_byte_for_byte(driver):
    d = driver()
    keys = offload_keys("round-trip", 12)
    chunks = random_chunks(12, 1)
    d.store(keys, chunks)
    st = d.tier.file_tier.stats()
    assert st["chunks"] == 12 and st["bytes_written"] == 12 * CHUNK_BYTES
    d.drop_primary()  # only kvtier has them now
    results, data = d.load(keys)
    assert results == [LookupResult.HIT] * 12
    assert np.array_equal(data, chunks)
    # The promotion went through the tier's files, and vLLM's metrics say so.
    assert d.tier.file_tier.stats()["bytes_read"] == 12 * CHUNK_BYTES
    stats = d.manager.get_stats().data["data"]
    assert sum(stats["vllm:kv_offload_tiering_read_bytes"].values()) == 12 * CHUNK_BYTES
    assert stats[KvtierTierMetrics.CHUNKS][()] == 12


def test_a_restarted_vllm_finds_the_chunks(driver, tmp_path):
    keys = offload_keys("restart", 4)
    chunks = random_chunks(4, 2)
    first = driver()
    first.store(keys, chunks)
    first.close()
    second = driver()  # a new spec, primary and tier over the same directory
    results, data = second.load(keys)
    assert results == [LookupResult.HIT] * 4 and np.array_equal(data, chunks)


def corrupt_payload(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x5A]))


def damage_file(path, damage):
    """What a bad disk or, without the fdatasync (sync_data false, the default), a power loss
    can leave at a published chunk's name: a flipped bit, a file cut short or empty, blocks that
    never reached the disk (zeros: the preallocated size with no data), a payload torn half way,
    or no file at all."""
    size = os.path.getsize(path)
    if damage == "corrupt":
        corrupt_payload(path)
    elif damage == "missing":
        os.remove(path)
    elif damage in ("truncated", "empty"):
        os.truncate(path, size // 2 if damage == "truncated" else 0)
    else:
        start = {"zeroed": 0, "torn": 4096 + (size - 4096) // 2, "header-zeroed": 0}[damage]
        end = 4096 if damage == "header-zeroed" else size
        with open(path, "r+b") as f:
            f.seek(start)
            f.write(bytes(end - start))


DAMAGES = ["corrupt", "missing", "truncated", "empty", "zeroed", "torn", "header-zeroed"]


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_bad_chunk_fails_its_job_and_vllm_recomputes(driver, damage):
    d = driver()
    keys = offload_keys(damage, 6)
    chunks = random_chunks(6, 3)
    d.store(keys, chunks)
    damage_file(d.tier.file_tier.chunk_path(d.tier.kvtier_key(keys[3])), damage)
    d.drop_primary()
    results, data = d.load(keys)
    # The chunks before the bad one are delivered and right; from it on vLLM recomputes.
    assert results == [LookupResult.HIT] * 3 + [LookupResult.MISS] * 3
    assert np.array_equal(data, chunks[:3])
    failures = d.manager.get_stats().data["data"]["vllm:kv_offload_tiering_promotion_job_failures"]
    assert sum(failures.values()) == 1
    if damage != "missing":
        assert d.tier.file_tier.stats()["corrupt"] == 1  # detected, removed, never served
    # The bad chunk stays a miss (no promotion loop); storing it again heals it.
    results, _ = d.load(keys)
    assert results[3] is LookupResult.MISS
    d.drop_primary()
    d.store(keys[3:], chunks[3:])
    d.drop_primary()
    results, data = d.load(keys)
    assert results == [LookupResult.HIT] * 6 and np.array_equal(data, chunks)


def test_capacity_is_kvtiers(driver):
    # Room for about 6 chunk files (payload and a 4 KiB header each).
    d = driver(max_size_gb=6 * (CHUNK_BYTES + 4096) / 2**30)
    for i in range(3):
        d.store(offload_keys(f"cap{i}", 4), random_chunks(4, 10 + i))
    st = d.tier.file_tier.stats()
    assert st["chunks"] <= 6 and st["evictions"] >= 6 and st["bytes"] <= st["capacity_bytes"]
    d.drop_primary()
    results, data = d.load(offload_keys("cap2", 4))  # the newest survive
    assert results == [LookupResult.HIT] * 4 and np.array_equal(data, random_chunks(4, 12))
    stats = d.manager.get_stats().data["data"]
    assert sum(stats[KvtierTierMetrics.EVICTIONS].values()) >= 6


def test_shutdown_waits_for_jobs_in_flight(driver):
    d = driver()
    keys = offload_keys("shutdown", 8)
    ctx = d.request()
    out = d.manager.prepare_store(keys, ctx)
    for slot, chunk in zip(compat.chunk_ids(out.store_spec), random_chunks(8, 4)):
        d.primary[slot] = chunk
    d.manager.complete_store(keys, ctx)  # cascades: 8 writes now in flight
    tier = d.tier
    d.close()  # vLLM's shutdown: tiers first, then it unmaps the primary
    assert tier.file_tier.closed and tier.file_tier.in_flight == 0
    # Nothing was cut short: the one cascade job finished whole (vLLM no longer collects it).
    assert [r[1:3] for r in tier.file_tier.finished()] == [(True, 8)]


@pytest.mark.parametrize("sync_data", [False, True])
def test_sync_data_either_way_round_trips(driver, tmp_path, sync_data):
    extra = issue_config(tmp_path / "kv")
    extra["secondary_tiers"][0]["sync_data"] = sync_data
    d = driver(extra)
    keys = offload_keys(f"sync-{sync_data}", 4)
    chunks = random_chunks(4, 5)
    d.store(keys, chunks)
    d.drop_primary()
    results, data = d.load(keys)
    assert results == [LookupResult.HIT] * 4 and np.array_equal(data, chunks)


def test_bad_config_stops_vllm_at_start(tmp_path):
    extra = issue_config(tmp_path)
    extra["secondary_tiers"][0]["l2"]["sizee_gb"] = 1
    with pytest.raises(ValueError, match="sizee_gb"):
        Driver(extra)
    extra["secondary_tiers"][0].pop("l2")
    with pytest.raises(ValueError, match="needs 'l2'"):
        Driver(extra)
    extra = issue_config(tmp_path)
    extra["secondary_tiers"][0]["sync_data"] = "yes"
    with pytest.raises(ValueError, match="sync_data"):
        Driver(extra)
    extra = issue_config(tmp_path)
    extra["secondary_tiers"][0]["l2"]["sync_data"] = True  # one setting, one place
    with pytest.raises(ValueError, match="tier's own key"):
        Driver(extra)
