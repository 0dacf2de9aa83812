"""The TTFT benchmark's model and arms, on the CPU (float32, host copier).

The figures come from a GPU (docs/benchmarks.md); here every arm runs end to end on a tiny model so
that its bookkeeping is tested where CI runs: the model against Hugging Face's implementation of the
same architecture, each hit verified against the recompute, the JSON and the plot written, and bad
inputs refused.
"""

import json
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from kvtier.bench import ttft  # noqa: E402
from kvtier.bench.model import DecoderModel, ModelConfig, PagedKvCache  # noqa: E402

TINY = {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "intermediate_size": 96, "vocab_size": 500, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "tie_word_embeddings": False}


@pytest.fixture
def tiny_config(tmp_path):
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(TINY))
    return str(path)


def kvtier_bin():
    return ttft.find_kvtier_bin(None)


def test_shipped_configs_load():
    q = ModelConfig.load("qwen3-8b")
    assert (q.num_layers, q.num_kv_heads, q.head_dim, q.qk_norm) == (36, 8, 128, True)
    assert q.kv_bytes_per_token(torch.bfloat16) == 147456  # docs/gpu-data-path.md
    assert 8.1e9 < q.num_parameters() < 8.3e9
    assert ModelConfig.load("qwen3-0.6b").tie_word_embeddings
    with pytest.raises(ValueError, match="qwen3-8b"):
        ModelConfig.load("no-such-model")


@pytest.mark.parametrize("model_type", ["qwen3", "llama"])
def test_model_matches_transformers(model_type):
    """Same weights, same logits as Hugging Face's implementation of the architecture."""
    transformers = pytest.importorskip("transformers")
    c = dict(TINY, model_type=model_type, max_position_embeddings=512, hidden_act="silu",
             attention_bias=False)
    hf_cfg = transformers.AutoConfig.for_model(
        model_type, **{k: v for k, v in c.items() if k != "model_type"})
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(
        hf_cfg, attn_implementation="eager").float().eval()
    cfg = ModelConfig.from_dict(c)
    m = DecoderModel(cfg, torch.device("cpu"), torch.float32)
    sd = hf.state_dict()
    # Random norms: a constant 1 would hide a missing or misplaced norm.
    for k in sd:
        if "norm" in k:
            sd[k].uniform_(0.5, 1.5)
    m.embed_tokens = sd["model.embed_tokens.weight"]
    m.lm_head = sd["lm_head.weight"]
    m.norm = sd["model.norm.weight"]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        m.wqkv[i] = torch.cat([sd[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
        m.wo[i] = sd[p + "self_attn.o_proj.weight"]
        m.w_gate_up[i] = torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]])
        m.w_down[i] = sd[p + "mlp.down_proj.weight"]
        m.ln1[i] = sd[p + "input_layernorm.weight"]
        m.ln2[i] = sd[p + "post_attention_layernorm.weight"]
        if cfg.qk_norm:
            m.q_norm[i] = sd[p + "self_attn.q_norm.weight"]
            m.k_norm[i] = sd[p + "self_attn.k_norm.weight"]
    tokens = torch.randint(0, cfg.vocab_size, (80,))
    with torch.no_grad():
        ref = hf(tokens[None]).logits[0, -1]
        cache = PagedKvCache(cfg, 8, 16, torch.float32, torch.device("cpu"))
        full = m.prefill(tokens, cache)
        # The last 16 tokens over the cached first 64: the lower-right causal mask.
        part = m.prefill(tokens[64:], cache, start=64)
    assert torch.allclose(full, ref, rtol=1e-4, atol=1e-4), (full - ref).abs().max()
    assert torch.allclose(part, ref, rtol=1e-4, atol=1e-4), (part - ref).abs().max()


def test_every_arm_runs_and_verifies(tiny_config, tmp_path, capsys):
    if kvtier_bin() is None:
        pytest.skip("the kvtier command is not installed beside this Python")
    out_svg = tmp_path / "ttft.svg"
    rc = ttft.main(["--model", tiny_config, "--contexts", "384,640", "--suffix", "128",
                    "--chunk-tokens", "128", "--block-tokens", "16", "--warmup", "0",
                    "--repeats", "2", "--dir", str(tmp_path / "l2"), "--json",
                    "--plot", str(out_svg), "--output", str(tmp_path / "ttft.json")])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    result = json.loads(captured.out)
    assert [r["context"] for r in result["rows"]] == [384, 640]
    saved = json.loads((tmp_path / "ttft.json").read_text())
    assert saved["complete"] is True
    assert [r["context"] for r in saved["rows"]] == [384, 640]
    for r in result["rows"]:
        assert r["errors"] == []
        for arm in ("recompute", "gpu", "l1", "l1_serial", "server", "file", "save"):
            assert len(r[f"{arm}_samples"]) == 2 and r[f"{arm}_s"] > 0, arm
        # hits compute exactly what the GPU-prefix hit computes (float32 on the CPU: bit-exact)
        for arm in ("gpu", "l1", "l1-serial", "server", "file"):
            assert r["logit_rel_err"][arm] == 0.0, arm
        assert r["file_o_direct"] is True
    # The suffix's own prefill first, then one point per context.
    table = [p.split(":") for p in result["prefill_table"].split(",")]
    assert [int(t) for t, _ in table] == [128, 384, 640]
    assert abs(float(table[0][1]) - result["suffix_prefill_s"]) <= 0.51e-4  # the end's figure
    assert result["suffix_prefill_start_s"] > 0
    # kvtier plan predicted both hits of every context from this run's table and bandwidths.
    plan = result["plan"]["rows"]
    assert [p["context"] for p in plan] == [384, 640]
    for p in plan:
        assert p["plan_l1_s"] > 0 and p["plan_file_s"] > p["plan_suffix_s"] > 0
        assert p["l1_error"] == p["plan_l1_s"] / p["l1_s"] - 1
        assert p["layer_load_overhead_us"] > 0
    assert "plan_within_10pct" in result["targets"]
    assert result["targets"]["all_hits_verified"]
    assert result["plan"]["prefill_table_complete"] is True
    # The disk was probed before each context's repeats; that context's floor takes the probe's
    # figure at the tier's reader count (--read-threads, 4 by default).
    assert len(result["plan"]["commands"]) == len(result["plan"]["probe_commands"]) == 2
    for r, p, cmd, probe_cmd in zip(result["rows"], plan, result["plan"]["commands"],
                                    result["plan"]["probe_commands"]):
        d = r["disk"]
        assert d["readers"] == 4 and set(d["read_GBps_by_readers"]) == {"1", "4", "16"}
        assert d["read_GBps"] == d["read_GBps_by_readers"]["4"] > 0
        assert d["read_GBps_max"] == max(d["read_GBps_by_readers"].values())
        assert r["file_floor_s"] == r["prefix_bytes"] / (d["read_GBps"] * 1e9) + r["gpu_s"]
        assert r["file_floor_best_s"] <= r["file_floor_s"]
        assert len(r["file_raw_samples"]) == 2 and r["file_open_s"] > 0
        # Then `kvtier bench tier` measured the file tier itself, with the run's chunk size in
        # whole MiB (the tiny model's 96 KiB chunks: 1), the tier's read threads and queue depth,
        # cold: the plan's disk figure is its tier read.
        t = r["tier"]
        assert (t["readers"], t["io_depth"], t["chunk_mib"]) == (4, 8, 1)
        assert (t["chunks"], t["repeats"]) == (ttft.TIER_PROBE_CHUNKS, ttft.TIER_PROBE_REPEATS)
        assert t["chunk_bytes_exact"] is False
        assert t["o_direct"] is True and t["read_GBps"] > 0 and t["raw_read_GBps"] > 0
        assert t["read_ratio"] == t["read_GBps"] / t["raw_read_GBps"]
        assert p["disk_GBps"] == t["read_GBps"] and p["disk_source"] == "kvtier bench tier"
        assert f"--tier disk:1TiB:{t['read_GBps']:.3f}GB/s --context {r['context']} " in cmd
        assert p["file_error"] == p["plan_file_s"] / p["file_s"] - 1
        # The file hit predicted again from the probe's figure, for comparison.
        assert p["probe_GBps"] == d["read_GBps"]
        assert f"--tier disk:1TiB:{d['read_GBps']:.3f}GB/s --context {r['context']} " in probe_cmd
        assert p["file_error_probe"] == p["plan_file_probe_s"] / p["file_s"] - 1
        # Both are bytes / the figure given + the suffix.
        for key, gbps in (("plan_file_s", t["read_GBps"]), ("plan_file_probe_s", d["read_GBps"])):
            want = r["prefix_bytes"] / (float(f"{gbps:.3f}") * 1e9) + p["plan_suffix_s"]
            assert p[key] == pytest.approx(want, rel=1e-3), key
    assert {"plan_file_within_10pct", "plan_file_within_10pct_with_probe"} <= set(
        result["targets"])
    ttft.print_table(result)
    table_out = capsys.readouterr().out
    assert "file tier (kvtier bench tier" in table_out
    assert "(bench tier)  with the probe's" in table_out
    # Saved after every context, so a run cut short keeps its plan comparison too.
    assert saved["plan"]["prefill_table_complete"] is True
    svg = out_svg.read_text()
    assert svg.startswith("<svg") and "recompute" in svg and "kvtier file tier" in svg


def test_a_lost_chunk_is_reported_not_served(tiny_config, tmp_path, capsys, monkeypatch):
    """A prefix chunk missing from the store is an error of that arm, never a silent pass."""
    real_store_prefix = ttft.store_prefix

    def store_all_but_last(store, keys, mover, env):
        real_store_prefix(store, keys[:-1], mover, env)

    monkeypatch.setattr(ttft, "store_prefix", store_all_but_last)
    rc = ttft.main(["--model", tiny_config, "--contexts", "384", "--suffix", "128",
                    "--chunk-tokens", "128", "--warmup", "0", "--repeats", "1",
                    "--arms", "recompute,l1"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "l1: lookup found 1 of 2 chunks" in out
    assert "all_hits_verified: NOT MET" in out


def test_a_failed_disk_probe_ends_the_run(tiny_config, tmp_path):
    """No figure for the disk of that minute, no file floor and no plan: the run stops."""
    fake = tmp_path / "kvtier"
    fake.write_text("#!/bin/sh\necho 'storage unreachable' >&2\nexit 3\n")
    fake.chmod(0o755)
    with pytest.raises(RuntimeError, match="context 384: measuring the disk .*exit 3.*unreachable"):
        ttft.main(["--model", tiny_config, "--contexts", "384", "--suffix", "128",
                   "--chunk-tokens", "128", "--warmup", "0", "--repeats", "1",
                   "--arms", "recompute,file", "--kvtier-bin", str(fake),
                   "--dir", str(tmp_path / "l2")])


STORAGE_JSON = ('{"readers": [{"readers": 1, "read_GBps": 1.0}, {"readers": 4, "read_GBps": 1.5}, '
                '{"readers": 16, "read_GBps": 1.2}], "write_GBps": 2.0, "o_direct": true}')


@pytest.mark.parametrize("tier_script,message", [
    ("echo 'tier read failed: no space' >&2\nexit 4\n", "exit 4.*no space"),
    # exit status 0 but the reads came from the page cache: refused all the same
    ("echo '{\"read_GBps\": 9.0, \"raw_read_GBps\": 9.0, \"write_GBps\": 3.0, "
     "\"raw_write_GBps\": 3.0, \"o_direct\": false, \"page_cache_resident_bytes\": 4096}'\n",
     "did not read cold .*4096 bytes"),
])
def test_a_failed_tier_benchmark_ends_the_run(tiny_config, tmp_path, tier_script, message):
    """The disk probe passes, `kvtier bench tier` does not: no figure for the plan, so the run
    stops."""
    fake = tmp_path / "kvtier"
    fake.write_text(f"#!/bin/sh\nif [ \"$2\" = storage ]; then echo '{STORAGE_JSON}'; exit 0; fi\n"
                    f"[ \"$2\" = tier ] || exit 9\n{tier_script}")
    fake.chmod(0o755)
    with pytest.raises(RuntimeError, match=f"context 384: measuring the file tier .*{message}"):
        ttft.main(["--model", tiny_config, "--contexts", "384", "--suffix", "128",
                   "--chunk-tokens", "128", "--warmup", "0", "--repeats", "1",
                   "--arms", "recompute,file", "--kvtier-bin", str(fake),
                   "--dir", str(tmp_path / "l2")])


@pytest.mark.parametrize("args,message", [
    (["--arms", "recompute,warp"], "unknown arm"),
    (["--contexts", "300"], "multiple of --chunk-tokens"),
    (["--contexts", "4k,x"], "bad token count"),
    (["--model", "/nonexistent/config.json"], "neither a config.json path"),
    (["--chunk-tokens", "100"], "multiple of --block-tokens"),
    (["--repeats", "0"], "--repeats"),
])
def test_bad_inputs_are_refused(tiny_config, args, message):
    cmd = [sys.executable, "-m", "kvtier.bench.ttft", "--model", tiny_config, "--contexts", "512",
           "--suffix", "128", "--chunk-tokens", "128"] + args
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert message in p.stderr, p.stderr
    assert "Traceback" not in p.stderr
