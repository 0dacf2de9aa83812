"""The compatibility module's decisions, for the installed vLLM and for the interface of each
supported version as read from its sources (the shapes below are those versions' own)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import types

import pytest

from kvtier.vllm import compat


def _base_module(transfer_results_fields: list[str] | None, sleep_hooks: bool):
    class Base:
        pass

    if sleep_hooks:
        Base.unregister_kv_caches = lambda self: None
        Base.restore_kv_caches = lambda self: None
    mod = types.SimpleNamespace(KVConnectorBase_V1=Base)
    if transfer_results_fields is not None:
        mod.KVConnectorTransferResults = dataclasses.make_dataclass(
            "KVConnectorTransferResults",
            [(f, set, dataclasses.field(default_factory=set)) for f in transfer_results_fields])
    return mod


HIT_SOURCE = types.SimpleNamespace(CacheHitSource=object())

# (version, KVConnectorTransferResults fields or None, cache_hit_source module, sleep hooks)
INTERFACES = [
    ("0.26", None, None, False),
    ("0.29", None, None, False),
    ("0.30", ["finished_sending", "finished_recving", "failed_recving"], None, False),
    ("0.32", ["finished_sending", "finished_recving", "failed_recving"], HIT_SOURCE, False),
    ("0.34", ["finished_sending", "finished_recving", "failed_recving"], HIT_SOURCE, True),
]


@pytest.mark.parametrize("version,fields,hit_source,sleep", INTERFACES,
                         ids=[i[0] for i in INTERFACES])
def test_decisions_for_each_supported_interface(version, fields, hit_source, sleep):
    f = compat.detect(_base_module(fields, sleep), hit_source)
    assert (f.transfer_results is not None) == (fields is not None)
    assert f.failed_recving == (fields is not None and "failed_recving" in fields)
    # Before 0.30 a failed load with several KV cache groups cannot be reported.
    assert f.reports_failed_requests == (version >= "0.30")
    assert (f.cache_hit_source is not None) == (version >= "0.32")
    assert f.sleep_mode_hooks == (version >= "0.34")


def test_transfer_results_without_failed_recving_is_not_taken_for_it():
    f = compat.detect(_base_module(["finished_sending", "finished_recving"], False), None)
    assert f.transfer_results is not None and not f.reports_failed_requests


def test_installed_vllm_is_detected_from_its_modules():
    import vllm
    from vllm.distributed.kv_transfer.kv_connector.v1 import base

    f = compat.features()
    assert (f.transfer_results is not None) == hasattr(base, "KVConnectorTransferResults")
    assert compat.in_tested_range(vllm.__version__), vllm.__version__
    # The connector class imports and exposes what this vLLM calls.
    from kvtier.vllm import KvtierConnector

    assert hasattr(KvtierConnector, "get_transfer_results") == (f.transfer_results is not None)


@pytest.mark.parametrize("version,inside", [
    ("0.26.0", True), ("0.34.2", True), ("0.32.0+cpu", True), ("0.30.1rc1", True),
    ("0.25.1", False), ("0.35.0", False), ("1.0.0", False), ("unknown", False)])
def test_tested_range(version, inside):
    assert compat.in_tested_range(version) == inside


def test_a_missing_interface_names_the_range():
    with pytest.raises(compat.UnsupportedVllmError, match=r"supports vLLM 0\.26 to 0\.34.*lacks "
                       r"NoSuchClass"):
        compat.require("vllm.distributed.kv_transfer.kv_connector.v1.base", "NoSuchClass")
    with pytest.raises(compat.UnsupportedVllmError, match="vllm.no_such_module"):
        compat.require("vllm.no_such_module")


def test_requests_that_skip_cached_kv():
    assert not compat.skips_external_kv(types.SimpleNamespace())
    assert compat.skips_external_kv(types.SimpleNamespace(skip_reading_prefix_cache=True))
    assert compat.skips_external_kv(types.SimpleNamespace(skip_reading_external_kv=True))


def _output(new=(), cached=(), resumed=None, preempted=()):
    """A scheduler output: new = [(req_id, groups)], cached = [(req_id, groups or None)]."""
    c = types.SimpleNamespace(req_ids=[r for r, _ in cached],
                              new_block_ids=[g for _, g in cached])
    if resumed is not None:
        c.resumed_req_ids = set(resumed)
    return types.SimpleNamespace(
        scheduled_new_reqs=[types.SimpleNamespace(req_id=r, block_ids=g) for r, g in new],
        scheduled_cached_reqs=c, preempted_req_ids=set(preempted))


def test_block_tables_up_to_0_33_resumed_requests_among_the_cached():
    t = compat.BlockTables()
    t.update(_output(new=[("a", ([1, 2],))], resumed=()))
    t.update(_output(cached=[("a", ([3],))], resumed=()))
    t.update(_output(cached=[("a", None)], resumed=()))
    assert t.get("a") == [[1, 2, 3]]
    t.update(_output(preempted=["a"], resumed=()))
    assert t.get("a") is None
    t.update(_output(cached=[("a", ([7, 8, 9],))], resumed=["a"]))  # the whole table again
    assert t.get("a") == [[7, 8, 9]]


def test_block_tables_from_0_34_resumed_requests_among_the_new():
    t = compat.BlockTables()
    t.update(_output(new=[("a", ([1], [5]))]))
    t.update(_output(cached=[("a", ([2], []))]))
    assert t.get("a") == [[1, 2], [5]]
    t.update(_output(preempted=["a"]))
    t.update(_output(new=[("a", ([4, 6], [9]))]))
    assert t.get("a") == [[4, 6], [9]]
    t.forget("a")
    assert t.get("a") is None


def _config_with_cudagraph_mode(mode):
    return types.SimpleNamespace(compilation_config=types.SimpleNamespace(cudagraph_mode=mode))


def test_full_cuda_graphs_turn_layerwise_loads_off():
    """A full CUDA graph's replay skips wait_for_layer_load. vLLM drops full graphs for a
    connector that asks (requires_piecewise_for_cudagraph, in every supported version read);
    where a version kept them, the connector must notice and load between steps."""
    from vllm.config import CUDAGraphMode

    from kvtier.vllm.connector import KvtierConnector

    assert compat.full_cuda_graphs(_config_with_cudagraph_mode(CUDAGraphMode.FULL_AND_PIECEWISE))
    assert compat.full_cuda_graphs(_config_with_cudagraph_mode(CUDAGraphMode.FULL_DECODE_ONLY))
    assert not compat.full_cuda_graphs(_config_with_cudagraph_mode(CUDAGraphMode.PIECEWISE))
    assert not compat.full_cuda_graphs(_config_with_cudagraph_mode(CUDAGraphMode.NONE))
    assert not compat.full_cuda_graphs(types.SimpleNamespace())  # a version without the mode
    assert KvtierConnector.requires_piecewise_for_cudagraph({})
    assert KvtierConnector.requires_piecewise_for_cudagraph({"kvtier.load_mode": "layerwise"})
    assert not KvtierConnector.requires_piecewise_for_cudagraph({"kvtier.load_mode": "async"})


def test_tiering_fields_that_came_later_are_passed_only_where_vllm_takes_them():
    """vLLM 0.28's tiering classes lack fields 0.32 added (JobResult.transfer_bytes, the
    manager's backpressure_detector) and name a job's chunk ids block_ids: what the installed
    vLLM takes is what is passed, whichever it is."""
    @dataclasses.dataclass
    class OldJobResult:  # 0.28's shape
        job_id: int
        success: bool
        transfer_time: float | None = None

    kept = compat.known_fields(OldJobResult, job_id=1, success=True, transfer_time=0.5,
                               transfer_bytes=4096)
    assert OldJobResult(**kept) == OldJobResult(1, True, 0.5)

    def old_init(self, spec, view, tier_type):  # 0.28's SecondaryTierManager.__init__
        pass

    assert compat.known_fields(old_init, backpressure_detector=None) == {}
    assert compat.known_fields(lambda a, backpressure_detector=None: a,
                               backpressure_detector=7) == {"backpressure_detector": 7}
    assert compat.chunk_ids(types.SimpleNamespace(block_ids=[3, 4])) == [3, 4]
    assert compat.chunk_ids(types.SimpleNamespace(chunk_ids=[5])) == [5]


def test_the_secondary_tier_needs_vllm_028_and_says_so_where_it_is_missing():
    """KvtierTier and its benchmark on the installed vLLM: they import (0.28 and later), or they
    stop with a message naming 0.28 and the connector to use instead, never an ImportError from
    inside vLLM; the benchmark's command line prints it without a traceback."""
    pytest.importorskip("vllm")
    try:
        compat.require_secondary_tier()
    except compat.UnsupportedVllmError as e:
        message = str(e)
        assert "0.28 or later" in message and "kvtier.vllm" in message, message
        for module in ("kvtier.vllm.tiering", "kvtier.vllm.bench_tiering"):
            with pytest.raises(compat.UnsupportedVllmError, match="0.28 or later"):
                __import__(module)
        run = subprocess.run([sys.executable, "-m", "kvtier.vllm.bench_tiering", "--help"],
                             capture_output=True, text=True, timeout=300)
        assert run.returncode != 0 and "0.28 or later" in run.stderr, run.stderr[-2000:]
        assert "Traceback" not in run.stderr, run.stderr[-2000:]
    else:
        for module in ("kvtier.vllm.tiering", "kvtier.vllm.bench_tiering"):
            __import__(module)
