"""`python -m kvtier.bench.multiround`: the multi-round experiment's harness. The pieces it decides
with (what is left to run, whether the budget allows a phase, where prompt tokens came from) are
tested alone; one small end-to-end run on vLLM's CPU build, interrupted once and run again,
checks that every number is measured or predicted and that a rerun goes on where the first
stopped. The figures themselves are the GPU run's business (docs/planner.md)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import time

import pytest

from kvtier.bench import multiround as mr
from kvtier.bench import vllm_ttft

from conftest import MODEL_DIR, VLLM_PYTHON


def test_pending_skips_what_is_done_and_arms_recorded_as_skipped(tmp_path):
    state = mr.State(tmp_path)
    keys = lambda: [p.key for p in mr.pending(state, ["none", "native", "server"],  # noqa: E731
                                               [8192, 16384], "per-arm")]
    assert keys() == ["tiers", "engine-none", "c8192-none-capacity", "c8192-none-run",
                      "c16384-none-capacity", "c16384-none-run", "engine-native",
                      "c8192-native-capacity", "c8192-native-run", "c16384-native-capacity",
                      "c16384-native-run", "engine-server", "c8192-server-capacity",
                      "c8192-server-run", "c16384-server-capacity", "c16384-server-run"]
    for key in ("tiers", "engine-none", "c8192-none-capacity", "c8192-none-run",
                "c16384-none-capacity", "engine-server"):
        state.put(key, {"kind": key.rpartition("-")[2]})
    state.put("skip-native", {"reason": "no GPU"})
    assert keys() == ["c16384-none-run", "c8192-server-capacity", "c8192-server-run",
                      "c16384-server-capacity", "c16384-server-run"]
    # An arm whose runs are all done needs no engine again, unless its plans lack one.
    for key in ("c16384-none-run", "c8192-server-capacity", "c8192-server-run",
                "c16384-server-capacity", "c16384-server-run"):
        state.put(key, {})
    assert keys() == []
    (state.phases / "engine-server.json").unlink()
    assert keys() == ["engine-server"]


def test_one_engine_table_for_every_arm(tmp_path):
    state = mr.State(tmp_path)
    state.put("tiers", {})
    keys = [p.key for p in mr.pending(state, ["none", "server"], [8192], "once")]
    assert keys == ["engine-none", "c8192-none-capacity", "c8192-none-run",
                    "c8192-server-capacity", "c8192-server-run"]
    assert mr.engine_key("server", "once") == mr.engine_key("none", "once") == "engine-shared"


def test_budget_stops_before_a_phase_its_estimate_says_cannot_finish(tmp_path):
    state = mr.State(tmp_path)
    cfg = dict(mr.SETTINGS, stage_time=20.0, capacity_max_stages=6, time=60.0)
    now = [1000.0]
    budget = mr.Budget(540, state, cfg, clock=lambda: now[0])
    run = mr.Phase("run", "none", 8192)
    capacity = mr.Phase("capacity", "none", 8192)
    # Nothing measured yet: the priors (a run: --time and a minute; a start: 240 s).
    assert budget.estimate("run") == 120 and budget.estimate("vllm_start") == 240
    assert budget.allows(run, needs_start=False) == (True, 120)
    assert budget.allows(run, needs_start=True) == (True, 360)
    assert budget.estimate("capacity") == 4 * 35 + 30
    # Measured phases replace the priors, the longest of a kind counting.
    state.put("c8192-none-run", {"kind": "run", "seconds": 75.0})
    state.put("c16384-none-run", {"kind": "run", "seconds": 95.0})
    state.add_start(50.0)
    state.add_start(70.0)
    assert budget.estimate("run") == 95 and budget.estimate("vllm_start") == 70
    now[0] += 540 - 95 - mr.STOP_MARGIN_S  # exactly enough left for a run
    assert budget.allows(run, needs_start=False) == (True, 95)
    assert not budget.allows(run, needs_start=True)[0]
    assert not budget.allows(capacity, needs_start=False)[0]
    assert budget.timeout() == pytest.approx(95)
    now[0] += 1000
    assert budget.timeout() == 1.0  # past the deadline a child still gets a second to stop
    assert mr.Budget(None, state, cfg).allows(capacity, True)[0]  # no budget: always


def test_token_shares_by_tier_from_each_arms_counters():
    bpt = 1000
    vllm = {'vllm:prefix_cache_hits_total{engine="0",model_name="bench"}': 300.0}
    # kvtier: L1 read 500 tokens' bytes, 200 of them on their way from the file tier.
    kv = {'kvtier_bytes_read_total{tier="memory"}': 500e3,
          'kvtier_bytes_read_total{tier="file"}': 200e3,
          'kvtier_bytes_written_total{tier="file"}': 900e3}
    got = mr.token_shares("server", 1000, vllm, kv, bpt)["token_share"]
    assert got == pytest.approx({"gpu": 0.3, "cpu": 0.3, "disk": 0.2, "recompute": 0.2})
    assert mr.storage_bytes("server", vllm, kv)["written"] == 900e3
    # vLLM's native offloading on a vLLM without per-source counters: external hits are its
    # one CPU tier's; the tiering spec's are not split and say so.
    ext = dict(vllm, **{'vllm:external_prefix_cache_hits_total{engine="0"}': 400.0})
    got = mr.token_shares("native", 1000, ext, None, bpt)["token_share"]
    assert got == pytest.approx({"gpu": 0.3, "cpu": 0.4, "disk": 0.0, "recompute": 0.3})
    got = mr.token_shares("tiering", 1000, ext, None, bpt)
    assert got["token_share"]["cpu"] is None and got["token_share"]["disk"] is None
    assert got["token_share"]["offload_unsplit"] == pytest.approx(0.4)
    assert got["token_share"]["recompute"] == pytest.approx(0.3)
    assert "not split" in got["source"]
    assert mr.storage_bytes("tiering", ext, None)["written"] is None
    # Where vLLM counts prompt tokens by source, they split the tiering arm.
    by = dict(ext, **{'vllm:prompt_tokens_cached_by_source_total{source="host"}': 150.0,
                      'vllm:prompt_tokens_cached_by_source_total{source="disk"}': 250.0,
                      'vllm:kv_offload_tiering_write_bytes_total{tier="fs"}': 7.0})
    got = mr.token_shares("tiering", 1000, by, None, bpt)["token_share"]
    assert got == pytest.approx({"gpu": 0.3, "cpu": 0.15, "disk": 0.25, "recompute": 0.3})
    assert mr.storage_bytes("tiering", by, None)["written"] == 7.0
    # With the connector's own counters (what each load took from where) they win: the engine's
    # also count what a prefetch read into L1 and pins given back unread.
    mine = dict(vllm, **{'vllm:kvtier_tokens_hit_memory_total{engine="0"}': 450.0,
                         'vllm:kvtier_tokens_hit_file_total{engine="0"}': 50.0})
    got = mr.token_shares("prefetch", 1000, mine, kv, bpt)
    assert got["token_share"] == pytest.approx(
        {"gpu": 0.3, "cpu": 0.45, "disk": 0.05, "recompute": 0.2})
    assert "connector" in got["source"]
    got = mr.token_shares("none", 1000, vllm, None, bpt)["token_share"]
    assert got == pytest.approx({"gpu": 0.3, "cpu": 0.0, "disk": 0.0, "recompute": 0.7})


def test_counter_deltas_and_info_labels():
    before = {"a_total": 5.0}
    assert mr.delta(before, {"a_total": 7.0, "b_total": 3.0}) == {"a_total": 2.0, "b_total": 3.0}
    m = {'vllm:cache_config_info{block_size="16",num_gpu_blocks="8101"}': 1.0}
    assert mr.labels(m, "vllm:cache_config_info") == {"block_size": "16",
                                                       "num_gpu_blocks": "8101"}
    assert mr.labels(m, "absent") == {}


def test_prediction_errors_are_ratios_and_share_points():
    measured = {"mean_ttft_s": 0.5, "service_rate_rps": 2.0,
                "token_share": {"gpu": 0.2, "cpu": None, "disk": 0.1, "recompute": 0.7}}
    pred = {"at_qps": {"mean_ttft_s": 0.6, "token_share": {"gpu": 0.25, "disk": 0.1,
                                                           "recompute": 0.65}},
            "at_load": {"service_rate_rps": 1.5}}
    e = mr.errors(measured, pred)
    assert e["mean_ttft"] == pytest.approx(0.2) and e["service_rate"] == pytest.approx(-0.25)
    assert e["gpu_share_points"] == pytest.approx(5) and e["cpu_share_points"] is None
    assert e["recompute_share_points"] == pytest.approx(-5)
    assert mr.errors(measured, {"at_qps": {"error": "refused"}}) is None


def test_an_arm_is_compared_with_no_offload_turn_by_turn(tmp_path):
    """The same users' turns paired: the mean difference and its standard error; turns only one
    run has are left out; too few pairs, or a missing log, give no comparison."""
    def write(name: str, ttfts: dict) -> object:
        path = tmp_path / name
        path.write_text("prompt_tokens,generation_tokens,ttft,generation_time,user_id,question_id,"
                        "launch_time,finish_time\n" + "".join(
                            f"100,10,{t},1.0,{u},{q},0,1\n" for (u, q), t in ttfts.items()))
        return path
    base = write("none.csv", {(0, 1): 0.100, (0, 2): 0.200, (1, 1): 0.300, (1, 2): 0.9})
    arm = write("server.csv", {(0, 1): 0.110, (0, 2): 0.230, (1, 1): 0.320})
    pv = mr.paired(base, arm)
    assert pv["pairs"] == 3  # (1, 2) only in the baseline
    assert pv["mean_diff_s"] == pytest.approx(0.020)
    assert pv["stderr_s"] == pytest.approx(0.01 / 3 ** 0.5)
    assert pv["ratio"] == pytest.approx(0.660 / 0.600)
    assert mr.paired(base, write("one.csv", {(0, 1): 0.1})) is None
    assert mr.paired(base, tmp_path / "missing.csv") is None


def test_why_a_vllm_did_not_start_is_its_last_specific_error():
    text = ("INFO starting\nValueError: To serve at least one request ...\n"
            "RuntimeError: Worker failed with error 'CPU Offloading is currently only supported "
            "on CUDA-alike and XPU GPUs', please check the stack trace above\n"
            "RuntimeError: Engine core initialization failed. See root cause above.\n")
    assert mr.failure_reason(text).startswith("RuntimeError: Worker failed with error 'CPU")


def test_the_first_capacity_stage_and_the_prefill_table():
    table = {"1024": 0.1, "4096": 0.4}
    assert mr.interpolate(table, 512) == pytest.approx(0.05)
    assert mr.interpolate(table, 8192) == pytest.approx(0.8)  # past the end, the last slope
    engine = {"prefill_table": table, "decode_step_s": {"1024": 0.01, "4096": 0.01}}
    cfg = dict(mr.SETTINGS, answer_tokens=100, users=8, stage_time=60.0)
    # back to back: 1 / (0.4 + 1.0) req/s; a fifth is 0.143; two questions per user: 0.267
    assert mr.auto_start_qps(engine, 4096, cfg) == pytest.approx(0.2667, abs=1e-4)
    assert mr.auto_start_qps(engine, 4096, dict(cfg, stage_time=600.0)) == pytest.approx(
        1 / 1.4 / 5, abs=1e-4)


def test_settings_are_kept_and_a_rerun_may_not_change_them(tmp_path):
    parser = argparse.ArgumentParser()
    state = mr.State(tmp_path)
    given = lambda **kw: argparse.Namespace(**{k: kw.get(k) for k in mr.SETTINGS})  # noqa
    cfg = mr.settings(given(rounds=6), state, parser)
    assert cfg["rounds"] == 6 and cfg["users"] == 8
    assert mr.settings(given(), state, parser)["rounds"] == 6  # a rerun needs no flags
    assert mr.settings(given(rounds=6, users=8), state, parser)["rounds"] == 6
    with pytest.raises(SystemExit):
        mr.settings(given(rounds=20), state, parser)
    assert mr.shortened(cfg, ["16k"], ["none", "server"]) == [
        "rounds 20 -> 6", "contexts 8k,16k,24k,28k -> 16k",
        "arms none,native,tiering,kvtier,server -> none,server"]
    assert mr.shortened(dict(mr.SETTINGS), mr.FULL_CONTEXTS.split(","), list(mr.ARMS)) == []
    # A state from before a setting existed resumes with that setting's default.
    old = json.loads((tmp_path / "config.json").read_text())
    del old["disk_read_limit_gbps"]
    (tmp_path / "config.json").write_text(json.dumps(old))
    assert mr.settings(given(), state, parser)["disk_read_limit_gbps"] == 0.0
    # A capped file tier is a change from the experiment, and reaches kvtier's file tier.
    capped = dict(cfg, disk_read_limit_gbps=0.05)
    assert "disk-read-limit-gbps 0.0 -> 0.05" in mr.shortened(capped, ["16k"], list(mr.ARMS))
    tier = vllm_ttft.file_tier(argparse.Namespace(**capped), tmp_path / "l2")
    assert tier["read_limit_gbps"] == 0.05 and tier["type"] == "fs"
    assert "read_limit_gbps" not in vllm_ttft.file_tier(argparse.Namespace(**cfg), tmp_path)


@pytest.mark.skipif(not os.path.exists(os.path.join(MODEL_DIR, "tokenizer.json")),
                    reason="no tiny model (scripts/vllm-cpu-server.sh model)")
def test_an_interrupted_run_goes_on_and_measures_every_number(tmp_path):
    kvtier = os.environ.get("KVTIER_BINARY") or shutil.which("kvtier")
    if kvtier is None:
        pytest.skip("no kvtier CLI")
    state = tmp_path / "state"
    # 4 users of 3 rounds, a 300-token context and a vLLM KV cache of 48 blocks of 128 tokens:
    # the conversations outgrow it, so kvtier's tiers serve. vLLM's CPU build has no native
    # offloading: that arm is recorded as skipped, with vLLM's reason.
    first = [VLLM_PYTHON, "-m", "kvtier.bench.multiround", "--state", str(state),
             "--kvtier", kvtier, "--contexts", "300", "--arms", "native,server",
             "--model-config", "tiny", "--tokenizer", MODEL_DIR, "--users", "4", "--rounds", "3",
             "--system-prompt", "200", "--answer-tokens", "16", "--stage-time", "5",
             "--capacity-max-stages", "3", "--start-qps", "1", "--time", "8",
             "--kv-cache-bytes", str(24 * 128 * 4096), "--block-tokens", "128",
             "--max-batched-tokens", "2048", "--max-model-len", "2048",
             "--prefill-lengths", "128,512", "--idle-repeats", "1", "--cpu-gb", "0.25",
             "--tiering-cpu-gb", "0.25", "--disk-gb", "1"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    log = open(tmp_path / "first.log", "w")
    proc = subprocess.Popen(first, stdout=log, stderr=subprocess.STDOUT, env=env)
    capacity = state / "phases" / "c300-server-capacity.json"
    deadline = time.monotonic() + 600
    while not capacity.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert capacity.exists(), (tmp_path / "first.log").read_text()[-3000:]
    time.sleep(1)  # into the run phase
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(120) == 128 + signal.SIGTERM
    assert json.loads((state / "children.json").read_text()) == []  # vLLM and serve stopped
    assert not (state / "phases" / "c300-server-run.json").exists()

    # Run again with only what chooses the work: the settings come from the state.
    again = subprocess.run([VLLM_PYTHON, "-m", "kvtier.bench.multiround", "--state", str(state),
                            "--kvtier", kvtier, "--contexts", "300", "--arms", "native,server",
                            "--budget-s", "500"], capture_output=True, text=True, env=env,
                           timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "1 phases to run" in again.stdout  # the run; tiers, engine and capacity were kept
    result = json.loads((state / "results.json").read_text())
    assert "CUDA" in result["skipped"]["native"]
    assert "model qwen3-8b -> tiny" in result["shortened"]
    (row,) = result["rows"]
    assert row["arm"] == "server" and row["capacity"]["service_rate_rps"] > 0
    m = row["measured"]
    assert m["requests"] > 0 and m["mean_ttft_s"] > 0 and m["median_ttft_s"] > 0
    assert all(v is not None for v in m["token_share"].values())
    assert abs(sum(m["token_share"].values()) - 1) < 1e-9
    assert m["storage_bytes"]["written"] > 0  # write-through: every saved chunk
    assert m["storage_bytes"]["read"] is not None
    assert 0 < m["decode_s_per_token"] < 1
    # The connector's own counter, through vLLM's /metrics: at least the first turns' prompts.
    assert m["saved_tokens_per_request"] > 0
    # The lookups' cost to the scheduler loop: measured (above zero), well under a second.
    assert 0 < m["lookup_wait_s_per_request"] < 1 and m["lookups_deferred"] >= 0
    for pred in row["predicted"].values():
        assert pred["mean_ttft_s"] > 0 and abs(sum(pred["token_share"].values()) - 1) < 1e-6
    assert row["errors"]["mean_ttft"] is not None and row["errors"]["service_rate"] is not None
    assert result["engines"]["server"]["kv_cache"]["blocks"] == 24
    assert "TTFT mean" in again.stdout and "server" in again.stdout


def test_a_process_left_by_a_killed_command_is_stopped_by_the_next(tmp_path):
    children = mr.Children(tmp_path / "children.json")
    # A session of its own whose parent is gone, as a vLLM left by a command killed at its limit.
    left = int(subprocess.run(["sh", "-c", "setsid sleep 300 >/dev/null 2>&1 & echo $!"],
                              capture_output=True, text=True).stdout)
    children.add(left, group=True)
    gone = subprocess.Popen(["true"])
    gone.wait()
    children.add(gone.pid, group=False)  # exited: its pid may be anyone's now, left alone
    mr.Children(tmp_path / "children.json").stop_leftovers()
    assert mr.Children._started(left) is None
    assert json.loads((tmp_path / "children.json").read_text()) == []


def test_a_resumed_command_keeps_the_previous_commands_points_and_arms(tmp_path):
    state = mr.State(tmp_path / "state")
    assert mr.selection(state, None, None) == (mr.FULL_CONTEXTS, ",".join(mr.ARMS))
    assert mr.selection(state, "16k", "none,server") == ("16k", "none,server")
    assert mr.selection(state, None, None) == ("16k", "none,server")  # the same command again
    assert mr.selection(state, "24k", None) == ("24k", "none,server")
