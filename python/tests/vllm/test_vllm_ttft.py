"""kvtier's TTFT benchmark through vLLM's API (python -m kvtier.bench.vllm_ttft) on vLLM's CPU
build: every kvtier arm (in process, kvtier serve, its file tier read cold) starts, stores and
hits through real vLLM servers, each hit's answer equals vLLM's own prefix-cache hit, and kvtier
serve SIGKILLed mid-load leaves vLLM answering. The GPU runs of the same program are in
docs/benchmarks.md; here it is the program that is tested, not the figures."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

from conftest import VLLM_PYTHON


def test_the_ttft_benchmark_runs_every_kvtier_arm_and_checks_every_hit(workdir: Path, tmp_path):
    out = tmp_path / "out"
    kvtier = os.environ.get("KVTIER_BINARY") or shutil.which("kvtier")
    cmd = [VLLM_PYTHON, "-m", "kvtier.bench.vllm_ttft", "--model", str(workdir / "model"),
           "--dtype", "float32", "--contexts", "1k,2k", "--repeats", "1", "--suffix", "128",
           "--arms", "gpu,kvtier,server,file,costfile", "--max-model-len", "4096",
           "--kv-cache-gb", "1", "--cost-extra", '{"kvtier.prefill_table": "4096:1000"}',
           "--cpu-gb", "0.25", "--disk-gb", "1", "--kvtier", kvtier, "--out", str(out),
           "--json", str(out / "ttft.json")]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = json.loads((out / "ttft.json").read_text())
    assert results["failed_arms"] == {}
    assert results["output_depends_on_prompt"]  # the answer check can tell a wrong KV cache
    for context in ("1024", "2048"):
        row = results["contexts"][context]
        assert row["mismatches"] == []
        assert set(row["checks"]) == {"kvtier", "server", "file", "costfile"}
        for arm in ("gpu", "kvtier", "server", "file", "costfile"):
            assert len(row["samples"][arm]["hit"]) == 1 and row["samples"][arm]["hit"][0] > 0
        # The file tier's hits read the whole prefix from disk (a "hit" that found nothing there
        # would measure a recompute); the costfile arm's table makes the load pay, so it loads.
        for arm in ("file", "costfile"):
            assert row["samples"][arm]["disk_chunks"] == [row["prefix_chunks"]], (arm, row)
    assert results["server_killed_mid_load"]["ok"], results["server_killed_mid_load"]
    assert "TTFT, median of repeats" in run.stdout
