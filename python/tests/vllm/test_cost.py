"""The cost model of cost-aware lookups (kvtier.vllm.cost): the prefill table, the read rate's
estimate and decay, and the choice on both sides of the break-even."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvtier.vllm.config import ConfigError, parse_config
from kvtier.vllm.cost import CostModel, ModelShapeCost, PrefillCost, ReadRate, parse_prefill_table

MB = 1 << 20
# A machine where prefill is quadratic-ish: 8k in 0.25 s, 16k in 0.6 s, 32k in 1.6 s.
TABLE = [(8192, 0.25), (16384, 0.6), (32768, 1.6)]


def test_prefill_table_interpolates_and_extrapolates():
    p = PrefillCost(TABLE)
    assert p.total(0) == 0
    assert p.total(4096) == pytest.approx(0.125)  # through the origin below the first point
    assert p.total(12288) == pytest.approx(0.425)
    assert p.total(49152) == pytest.approx(2.6)  # the last segment's slope beyond
    assert p.compute(16384, 32768) == pytest.approx(1.0)
    assert p.compute(100, 100) == 0
    assert parse_prefill_table("8192:0.25,16384:0.6") == [(8192, 0.25), (16384, 0.6)]
    for bad in ([], [(8192, 0.5), (16384, 0.2)], [(0, 0.1)], [(8192, 0.1), (8192, 0.2)]):
        with pytest.raises(ValueError):
            PrefillCost(bad)


def test_config_takes_and_checks_the_table():
    cfg = parse_config({"kvtier.prefill_table": "8192:0.25,16384:0.6",
                        "kvtier.min_file_read_gbps": 1.5})
    assert cfg.prefill_table == ((8192, 0.25), (16384, 0.6)) and cfg.cost_aware
    assert parse_config({"kvtier.prefill_table": [[8192, 0.25]]}).prefill_table == ((8192, 0.25),)
    with pytest.raises(ConfigError, match="prefill_table"):
        parse_config({"kvtier.prefill_table": "8192:0.5,16384:0.1"})
    with pytest.raises(ConfigError, match="prefill_table"):
        parse_config({"kvtier.prefill_table": "lots"})
    with pytest.raises(ConfigError, match="min_file_read_gbps"):
        parse_config({"kvtier.min_file_read_gbps": -1})
    with pytest.raises(ConfigError, match="file_read_gbps"):
        parse_config({"kvtier.file_read_gbps": -0.5})
    assert parse_config({"kvtier.save_mechanism": "dma"}).save_mechanism == "dma"
    with pytest.raises(ConfigError, match="save_mechanism"):
        parse_config({"kvtier.save_mechanism": "fast"})
    cfg = parse_config({"kvtier.prefetch": "on", "kvtier.prefetch_fraction": 0.75})
    assert cfg.prefetch and cfg.prefetch_fraction == 0.75
    assert not parse_config({}).prefetch
    for bad in (0, 1.5, "half"):
        with pytest.raises(ConfigError, match="prefetch_fraction"):
            parse_config({"kvtier.prefetch_fraction": bad})


def test_read_rate_corrects_itself_within_a_few_loads_and_decays_back():
    rate = ReadRate(prior_bps=4e9, prior_s=0.02, half_life_s=60)
    assert rate.bytes_per_s(now=0) == pytest.approx(4e9)
    for i in range(3):  # a disk at 1 GB/s: three loads of 512 MB
        rate.observe(512e6, 0.512, now=i)
    assert rate.bytes_per_s(now=3) < 1.1e9
    assert rate.bytes_per_s(now=3 + 3600) > 3.9e9  # an hour later: back to the prior, tried again


def choose(read_bps: float, n: int, local: int, memory: int, hits: int, floor: float = 0):
    model = CostModel(PrefillCost(TABLE), 256, 36 * MB, floor)
    model.file_rate = ReadRate(prior_bps=read_bps, prior_s=1.0)
    return model.choose(n, local, memory, hits)


def test_choice_on_both_sides_of_the_break_even():
    # 16k prompt, 63 chunks on disk only (2.3 GB). Recomputing them takes about 0.59 s.
    n, hits = 16384, 63
    assert choose(10e9, n, 0, 0, hits).chunks == hits  # 0.23 s of reading: load
    assert choose(1e9, n, 0, 0, hits).chunks == 0  # 2.3 s of reading: recompute
    # Half of it in L1: at 1 GB/s the L1 part is still worth taking, the disk part is not.
    c = choose(1e9, n, 0, 32, hits)
    assert c.chunks == 32 and c.read_s == 0
    # Everything in L1: nothing to decide.
    assert choose(1e6, n, 0, hits, hits).chunks == hits
    # vLLM already has the first 40 chunks: only the rest counts.
    assert choose(1e9, n, 40 * 256, 0, hits).chunks == 0
    assert choose(50e9, n, 40 * 256, 0, hits).chunks == hits


def test_floor_turns_file_tier_hits_off():
    model = CostModel(None, 256, 36 * MB, min_file_read_bps=2e9)
    model.file_rate = ReadRate(prior_bps=1e9, prior_s=1.0)
    assert model.choose(16384, 0, 10, 63).chunks == 10  # L1's part only
    assert model.choose(16384, 0, 0, 63).chunks == 0
    model.file_rate = ReadRate(prior_bps=3e9, prior_s=1.0)
    assert model.choose(16384, 0, 0, 63).chunks == 63  # no table: above the floor, load


def test_a_measured_read_rate_decides_the_first_load_and_is_what_the_estimate_returns_to():
    # A 1.2 GB/s disk measured beforehand: the very first 32k disk-only hit is declined (without
    # the figure the optimistic prior would load it, and the request would wait 4 s on the disk).
    cfg = parse_config({"kvtier.file_read_gbps": 1.2})
    measured = CostModel(PrefillCost(TABLE), 256, 36 * MB, file_read_bps=cfg.file_read_gbps * 1e9)
    assert measured.choose(32768, 0, 0, 127).chunks == 0
    assert CostModel(PrefillCost(TABLE), 256, 36 * MB).choose(32768, 0, 0, 127).chunks == 127
    # Loads that ran at 10 GB/s (the data was in the page cache, say) move it to loading...
    for _ in range(3):
        measured.file_rate.observe(2e9, 0.2)
    assert measured.choose(32768, 0, 0, 127).chunks == 127
    # ...and it decays back to the measured 1.2 GB/s, not to the optimistic guess.
    assert measured.file_rate.bytes_per_s(now=time.monotonic() + 3600) == pytest.approx(1.2e9, rel=0.01)


def test_a_wrong_prefill_table_corrects_itself_within_a_few_prefills():
    # A table measured on a machine twice as fast as this one: a 16k disk-only hit at 3 GB/s
    # (0.77 s of reading) looks dearer than recomputing it (0.59 s by the table)...
    model = CostModel(PrefillCost(TABLE), 256, 36 * MB, file_read_bps=3e9)
    assert model.choose(16384, 0, 0, 63).chunks == 0
    # ...until the workers' timings of three 8k prefills (0.5 s each, the table said 0.25 s)
    # have scaled the table: recomputing is now predicted at 1.18 s, and the hit is loaded.
    assert model.step_prediction([(0, 8192)]) == pytest.approx(0.25)
    for _ in range(3):
        model.compute_scale.observe(0.5, model.step_prediction([(0, 8192)]))
    assert model.compute_scale.value() == pytest.approx(2.0, rel=0.05)
    assert model.choose(16384, 0, 0, 63).chunks == 63
    # Decodes ride along in a step and are not predicted; a step with little prefill is not
    # timed at all (its time is the step's fixed cost, which the table does not hold).
    assert model.step_prediction([(0, 8192), (9000, 9001)]) == pytest.approx(0.25)
    assert model.step_prediction([(0, 300), (9000, 9001)]) == 0
    assert CostModel(None, 256, 36 * MB).step_prediction([(0, 8192)]) == 0
    # Without timings for a while, the table's own word comes back.
    assert model.compute_scale.value(now=time.monotonic() + 3600) == pytest.approx(1.0, rel=0.01)


def qwen3_8b() -> SimpleNamespace:
    configs = Path(__file__).resolve().parents[2] / "kvtier" / "bench" / "configs"
    return SimpleNamespace(**json.loads((configs / "qwen3-8b.json").read_text()))


def test_the_models_shape_predicts_how_prefill_grows_with_the_prompt():
    # Qwen3-8B's prefill on an H200 (docs/benchmarks.md, run H, no connector): the measured
    # times are the same multiple of the shape's at every length, within 6 %.
    shape = ModelShapeCost.from_hf_config(qwen3_8b())
    measured = {4096: 0.110, 8192: 0.231, 16384: 0.521, 24576: 0.868, 32768: 1.315}
    scales = [s / shape.total(n) for n, s in measured.items()]
    assert max(scales) / min(scales) < 1.07, scales
    # Both terms count: the weights' (linear) and attention's (quadratic).
    assert shape.compute(0, 8192) < shape.compute(8192, 16384) < 2.2 * shape.compute(0, 8192)
    # A mixture of experts is costed by its active experts; a config without the sizes has no
    # shape.
    moe = SimpleNamespace(**{**vars(qwen3_8b()), "num_experts_per_tok": 2,
                             "moe_intermediate_size": 768})
    assert ModelShapeCost.from_hf_config(moe).linear < shape.linear / 2
    assert ModelShapeCost.from_hf_config(SimpleNamespace(hidden_size=64)) is None
    # Sizes that are not plain integers (per-layer lists, None) fall back or give no shape.
    odd = SimpleNamespace(**{**vars(qwen3_8b()), "intermediate_size": [1024, 2048],
                             "head_dim": None})
    assert ModelShapeCost.from_hf_config(odd).linear > 0
    assert ModelShapeCost.from_hf_config(SimpleNamespace(
        hidden_size=64, num_hidden_layers=[2], num_attention_heads=4)) is None
    assert ModelShapeCost.from_hf_config(None) is None


def test_without_a_table_every_hit_loads_until_a_prefill_is_timed_then_the_shape_decides():
    model = CostModel(ModelShapeCost.from_hf_config(qwen3_8b()), 256, 36 * MB,
                      file_read_bps=1.2e9)
    # The shape's absolute scale is a guess: nothing is declined on it.
    assert not model.scale_known()
    assert model.choose(32768, 0, 0, 127).chunks == 127
    # The workers timed a 16k prefill at 0.52 s: a 32k disk-only hit (4.6 GB at 1.2 GB/s,
    # 3.8 s) is declined for a 1.3 s recompute, and one on a 20 GB/s tier is loaded.
    model.compute_scale.observe(0.521, model.step_prediction([(0, 16384)]))
    assert model.scale_known()
    assert model.compute(0, 32768) == pytest.approx(1.315, rel=0.06)
    assert model.choose(32768, 0, 0, 127).chunks == 0
    for _ in range(3):
        model.file_rate.observe(20e9, 1.0)
    assert model.choose(32768, 0, 0, 127).chunks == 127
    # The learned scale is kept when nothing is timed for hours: there is no guess to return to.
    assert model.compute(0, 32768) == pytest.approx(1.315, rel=0.06)
    later = time.monotonic() + 24 * 3600
    assert model.compute_scale.value(now=later) == pytest.approx(model.compute_scale.value())
    assert model.scale_known()
