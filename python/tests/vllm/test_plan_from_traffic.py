"""`kvtier plan --from-log` and `--from-metrics` against vLLM's CPU build: `kvtier bench qa` runs a
multi-round workload, and the planner reads it back three ways (bench qa's CSV, vLLM's own
request log, vLLM's live /metrics). Each must recover the users, rounds and context bench qa
ran, within 5 %, and the regime the server's hit rates show. Nothing is mocked."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from conftest import VLLM_PYTHON, START_TIMEOUT, free_port

USERS, ROUNDS, QPS, SECONDS = 4, 3, 1.0, 45


def kvtier_binary() -> str | None:
    found = os.environ.get("KVTIER_BINARY") or shutil.which("kvtier")
    if found:
        return found
    beside = Path(sys.executable).parent / "kvtier"
    return str(beside) if beside.exists() else None


def scrape(url: str) -> dict:
    """name -> value summed over every series of that name."""
    out: dict = {}
    for line in urllib.request.urlopen(url, timeout=10).read().decode().splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        name = key.partition("{")[0]
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            pass
    return out


def plan_json(kvtier: str, args: list[str]) -> dict:
    p = subprocess.run([kvtier, "plan", "--json", *args], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout)


def within(measured: float, expected: float, rel: float = 0.05) -> bool:
    return abs(measured - expected) <= rel * expected


@pytest.fixture()
def logged_vllm(workdir, tmp_path):
    """vLLM with request logging at DEBUG (the level that carries each prompt's token ids)."""
    port = free_port()
    log_path = tmp_path / "vllm.log"
    args = [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(workdir / "model"), "--enforce-eager", "--dtype", "float32",
            "--served-model-name", "tiny", "--max-model-len", "4096", "--port", str(port),
            "--host", "127.0.0.1", "--enable-log-requests"]
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_LOGGING_LEVEL="DEBUG")
    log = open(log_path, "w")
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError("vLLM exited:\n" + log_path.read_text()[-3000:])
            try:
                urllib.request.urlopen(url + "/health", timeout=2).read()
                break
            except (urllib.error.URLError, OSError):
                if time.monotonic() > deadline:
                    raise RuntimeError("vLLM did not start:\n" + log_path.read_text()[-3000:])
                time.sleep(1)
        yield url, log_path
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()


def test_plan_recovers_the_workload_bench_qa_ran(logged_vllm, workdir, tmp_path):
    kvtier = kvtier_binary()
    if kvtier is None:
        pytest.skip("no kvtier CLI (set KVTIER_BINARY or put it on PATH)")
    url, vllm_log = logged_vllm
    # The tiny model as the planner sees it: its config, float32 KV, vLLM's 1 GiB of CPU KV.
    model = ["--model", str(workdir / "model" / "config.json"), "--dtype", "float32",
             "--gpu-kv-gb", "1GiB", "--fast", "--no-sensitivity"]
    before = scrape(url + "/metrics")
    # A watch over most of the run, beside it.
    watch = subprocess.Popen([kvtier, "plan", "--json", "--from-metrics", url, "--watch", "20s",
                              "--users", str(USERS), "--rounds", str(ROUNDS), *model],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    csv_path = tmp_path / "qa.csv"
    bench = subprocess.run(
        [kvtier, "bench", "qa", "--base-url", url + "/v1", "--model", "tiny",
         "--num-users", str(USERS), "--num-rounds", str(ROUNDS), "--qps", str(QPS),
         "--shared-system-prompt", "100", "--user-history-prompt", "300", "--answer-len", "16",
         "--ignore-eos", "--time", str(SECONDS), "--warmup-requests", "0",
         "--log-interval", "1000", "--output", str(csv_path)],
        capture_output=True, text=True, timeout=SECONDS + 300)
    assert bench.returncode == 0, bench.stdout[-2000:] + bench.stderr[-2000:]
    watched_out, watched_err = watch.communicate(timeout=120)
    assert watch.returncode == 0, watched_err[-2000:]
    after = scrape(url + "/metrics")

    # What bench qa sent, from its own CSV: round-1 prompts and the mean prompt.
    import csv
    rows = list(csv.DictReader(open(csv_path)))
    assert len(rows) > 3 * USERS
    first_prompts = sorted(int(r["prompt_tokens"]) for r in rows if r["question_id"] == "1")
    first_prompt = first_prompts[len(first_prompts) // 2]
    mean_prompt = sum(int(r["prompt_tokens"]) for r in rows) / len(rows)

    # 1. --from-log on bench qa's CSV.
    from_csv = plan_json(kvtier, ["--from-log", str(csv_path), *model])
    t = from_csv["traffic"]
    assert t["derived"]["rounds"] == ROUNDS, t["rounds"]
    assert within(t["time"]["active_busiest"], USERS), t["time"]
    assert t["derived"]["users"] == USERS
    assert within(t["first_round_prompt"]["median"], first_prompt), t["first_round_prompt"]
    assert within(t["prompt_tokens"]["mean"], mean_prompt)
    assert t["derived"]["answer_tokens"] == 16

    # 2. --from-log on vLLM's own log: no user ids there, conversations are found by their
    # prompts, each round's starting with the one before.
    from_vllm = plan_json(kvtier, ["--from-log", str(vllm_log), *model])
    v = from_vllm["traffic"]
    assert from_vllm["read"]["records"] >= len(rows), from_vllm["read"]
    assert v["derived"]["rounds"] == ROUNDS, v["rounds"]
    assert within(v["time"]["active_busiest"], USERS), v["time"]
    assert within(v["first_round_prompt"]["median"], first_prompt), v["first_round_prompt"]
    assert within(v["prompt_tokens"]["mean"], mean_prompt)

    # 3. --from-metrics, one scrape after the run and the watched window during it.
    live = plan_json(kvtier, ["--from-metrics", url, "--users", str(USERS), "--rounds",
                              str(ROUNDS), *model])
    measured_prompt = ((after["vllm:request_prompt_tokens_sum"]
                        - before.get("vllm:request_prompt_tokens_sum", 0))
                       / (after["vllm:request_prompt_tokens_count"]
                          - before.get("vllm:request_prompt_tokens_count", 0)))
    assert within(measured_prompt, mean_prompt)
    assert within(live["vllm"]["mean_prompt_tokens"], mean_prompt)
    # The regime the hit rates show: the GPU's prefix cache served each later round's history,
    # nothing came from a connector, nothing was preempted: regime 1.
    hits = after["vllm:prefix_cache_hits_total"] / after["vllm:prefix_cache_queries_total"]
    assert hits > 0.3, hits
    assert after.get("vllm:num_preemptions_total", 0) == 0
    assert live["hit_shares"]["gpu"] == pytest.approx(
        after["vllm:prefix_cache_hits_total"] / max(after["vllm:prompt_tokens_total"],
                                                    after["vllm:prefix_cache_queries_total"]),
        rel=1e-6)
    assert live["measured_regime"] == 1, live["measured_regime_why"]
    assert live["predicted"]["now"]["regime"] == 1  # the planner agrees for this KV memory
    for point in from_csv["points"]:
        assert point["regime"] == 1
    watched = json.loads(watched_out)
    assert watched["window_s"] == pytest.approx(20, abs=3)
    assert watched["vllm"]["requests"] > 0
    assert within(watched["vllm"]["mean_prompt_tokens"], mean_prompt, 0.25)
