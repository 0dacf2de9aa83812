"""`python -m kvtier.bench.planner_check`: the planner against a real vLLM, end to end, and the
pieces it reads measurements with. The end-to-end run is the harness on a tiny setup (short
stages and runs, a vLLM KV cache small enough to evict): it checks that every number is measured
and predicted and that kvtier really served prompt tokens, not how close the prediction is
(docs/planner.md records that, from full runs)."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess

import pytest

from kvtier.bench import planner_check as pc

from conftest import MODEL_DIR, VLLM_PYTHON, free_port


def test_prometheus_series_are_summed_by_name_and_labels():
    m = {'kvtier_bytes_read_total{tier="memory"}': 10.0,
         'kvtier_bytes_read_total{tier="file"}': 4.0,
         'vllm:prefix_cache_hits_total{engine="0",model_name="bench"}': 7.0}
    assert pc.metric(m, "kvtier_bytes_read_total") == 14.0
    assert pc.metric(m, "kvtier_bytes_read_total", tier="file") == 4.0
    assert pc.metric(m, "vllm:prefix_cache_hits_total") == 7.0
    assert pc.metric(m, "absent_total") == 0.0


def test_plan_inputs_are_consistent_when_noise_crosses_them():
    # Measured on a loaded machine: 128 tokens cold in 15.5 ms, a held prompt in 16.2 ms, and a
    # longer prompt faster than a shorter one. kvtier plan refuses both as given.
    engine = {"prefill_table": {"128": 0.0155, "512": 0.030, "256": 0.025},
              "request_overhead_s": 0.0162}
    table, overhead = pc.plan_inputs(engine)
    assert table == "128:0.015500,256:0.025000,512:0.030000"
    assert overhead == pytest.approx(0.9 * 0.0155)
    # On a quiet machine nothing changes.
    engine["request_overhead_s"] = 0.005
    assert pc.plan_inputs(engine)[1] == 0.005
    engine["prefill_table"] = {"128": 0.02, "256": 0.018}
    assert pc.plan_inputs(engine)[0] == "128:0.020000,256:0.020000"


def test_prompt_shape_comes_from_the_prompts_the_server_counted(tmp_path):
    path = tmp_path / "run.csv"
    rows = ["prompt_tokens,generation_tokens,ttft,generation_time,user_id,question_id,"
            "launch_time,finish_time"]
    for user in (1, 2):
        for r in range(3):  # each round adds a 32-token answer and a 20-token question
            rows.append(f"{1000 + 52 * r},32,0.1,0.2,{user},{r + 1},{100 + 10 * r + user},0")
    path.write_text("\n".join(rows) + "\n")
    args = type("A", (), {"answer_tokens": 32})()
    assert pc.prompt_shape(path, args) == {"first_prompt": 1000, "question": 20}


@pytest.mark.skipif(not os.path.exists(os.path.join(MODEL_DIR, "tokenizer.json")),
                    reason="no tiny model (scripts/vllm-cpu-server.sh model)")
def test_harness_measures_and_predicts_both_arms(tmp_path):
    if shutil.which("kvtier") is None:
        pytest.skip("no kvtier CLI on PATH")
    out = tmp_path / "check"
    # 24 blocks of 128 tokens: 8 users' conversations of ~900 tokens do not fit, so vLLM evicts
    # and kvtier's tiers have something to serve.
    cmd = [VLLM_PYTHON, "-m", "kvtier.bench.planner_check", "--out", str(out),
           "--contexts", "300", "--time", "12", "--stage-time", "6", "--start-qps", "2",
           "--repeats", "2", "--idle-repeats", "3",
           "--vllm-blocks", "24", "--max-model-len", "2048", "--prefill-lengths", "128,512,1024",
           "--tokenizer", MODEL_DIR,
           "--port", str(free_port()), "--serve-http-port", str(free_port())]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                       env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    result = json.loads((out / "planner_check.json").read_text())
    assert sorted((r["arm"], r["repeat"]) for r in result["rows"]) == [
        ("kvtier", 1), ("kvtier", 2), ("none", 1), ("none", 2)]
    rows = {r["arm"]: r for r in result["rows"]}
    for r in result["rows"]:
        assert r["engine"]["request_overhead_s"] > 0  # measured before each run
        together = r["engine"]["concurrent"]
        assert together["requests"] == 8 and together["held_wall_s"] > 0
        assert together["cold_wall_s"] > 0 and together["cold_tokens"] == 512
        m = r["measured"]
        assert m["requests"] > 0 and m["mean_ttft_s"] > 0 and m["service_rate_rps"] > 0
        assert abs(sum(m["token_share"].values()) - 1) < 1e-9
        for pred in (r["predicted_at_qps"], r["predicted_at_load"]):
            assert pred["mean_ttft_s"] > 0
            assert abs(sum(pred["token_share"].values()) - 1) < 1e-6
        assert r["predicted_at_qps"]["qps"] == pytest.approx(m["qps"], rel=1e-3)
    # kvtier can serve a prompt only to a conversation that comes back after vLLM evicted it.
    # The load is paced at a share of the capacity measured on this machine: a loaded machine
    # measures a low one, and a 12 s run may then hold only first rounds (each user once), with
    # nothing for kvtier to serve. Where a user came back, kvtier must have served.
    for repeat in (1, 2):
        kv_rows = list(csv.DictReader(open(out / f"c300-kvtier-r{repeat}.csv")))
        users = [r["user_id"] for r in kv_rows]
        returned = len(users) > len(set(users))
        share = next(r["measured"]["token_share"] for r in result["rows"]
                     if r["arm"] == "kvtier" and r["repeat"] == repeat)
        if returned:
            assert share["cpu"] + share["disk"] > 0, f"kvtier served no prompt token (r{repeat})"
    none = rows["none"]["measured"]["token_share"]
    assert none["cpu"] == 0 and none["disk"] == 0
    assert "context" in p.stdout and "TTFT meas" in p.stdout  # the table
    # The medians over the repeats, per point.
    points = {pt["arm"]: pt for pt in result["points"]}
    assert set(points) == {"none", "kvtier"}
    for arm, point in points.items():
        runs = [r for r in result["rows"] if r["arm"] == arm]
        assert point["runs"] == 2 and len(point["run_errors"]) == 2
        measured = sorted(r["measured"]["mean_ttft_s"] for r in runs)
        assert point["measured_mean_ttft_s"] == pytest.approx(sum(measured) / 2)
    assert "medians over repeats" in p.stdout
