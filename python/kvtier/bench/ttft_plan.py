"""The planner against the measured hits: ``kvtier plan``'s single-request prediction from a TTFT
run's own prefill table, PCIe and disk figures, set beside the hits the run measured.

Part of ``python -m kvtier.bench.ttft``, which re-exports these names.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from typing import TYPE_CHECKING

import torch

from kvtier.bench import model as model_mod
from kvtier.bench.model import ModelConfig, SuffixGraphs
from kvtier.bench.ttft_common import log, median

if TYPE_CHECKING:
    from kvtier.bench.ttft import Env


def set_prefill_table(result: dict, suffix: int) -> None:
    """The prefill table of the contexts measured so far, the suffix's own prefill first."""
    points = [(r["context"], r["recompute_s"]) for r in result["rows"] if "recompute_s" in r]
    if "suffix_prefill_s" in result:
        points.insert(0, (suffix, result["suffix_prefill_s"]))
    result["prefill_table"] = ",".join(f"{c}:{t:.4f}" for c, t in points)


def compare_with_plan(kvtier_bin: str, result: dict, args, dtype, complete: bool) -> None:
    try:
        result["plan"] = plan_comparison(kvtier_bin, result, args, dtype)
        result["plan"]["prefill_table_complete"] = complete
        result.pop("plan_error", None)
    except (RuntimeError, ValueError, KeyError) as e:
        result["plan_error"] = str(e)
        log(f"ERROR kvtier plan: {e}")


def short_prefill(env: Env, model, cache, cfg: ModelConfig, args, suffix_pass: str) -> float:
    """Median seconds of a full prefill of --suffix tokens from an empty cache, run the way the
    hit arms run their suffix (graphs or eager)."""
    g = torch.Generator().manual_seed(args.seed + 7)
    tokens = torch.randint(0, cfg.vocab_size, (args.suffix,), generator=g).to(env.device)
    graphs = SuffixGraphs(model, cache, 0, args.suffix) if suffix_pass == "graphs" else None
    times = []
    for rep in range(args.warmup + args.repeats):
        env.sync()
        t0 = time.perf_counter()
        if graphs is not None:
            graphs.run(tokens).argmax().item()
        else:
            model.prefill(tokens, cache).argmax().item()
        if rep >= args.warmup:
            times.append(time.perf_counter() - t0)
    return median(times)


def plan_comparison(kvtier_bin: str, result: dict, args, dtype) -> dict:
    """`kvtier plan`'s single-request hit prediction from this run's prefill table, PCIe and disk
    bandwidths, against the measured hits (the L1 arm for the host tier, the file arm for disk).
    The disk's figure is `kvtier bench tier`'s read through the file tier; the file hit is
    predicted a second time from `kvtier bench storage`'s figure (``plan_file_probe_s``)."""
    model_path = args.model if os.path.exists(args.model) else \
        os.path.join(model_mod.CONFIG_DIR, args.model + ".json")
    layers = result["num_layers"]
    # kvtier plan refuses a table whose time falls with length; on a noisy host a short point can
    # come out above a longer one: each point is taken as at least the one before it.
    points, floor = [], 0.0
    for p in result["prefill_table"].split(","):
        tokens, seconds = p.split(":")
        floor = max(floor, float(seconds))
        points.append(f"{tokens}:{floor:.4f}")
    common = [kvtier_bin, "plan", "--fast", "--json", "--model", model_path,
              "--dtype", str(dtype).split(".")[-1], "--prefill-table", ",".join(points),
              "--hit-suffix", str(args.suffix), "--step-overhead-ms", "0",
              "--tier", f"cpu:1TiB:{result['h2d_GBps']:.3f}GB/s"]
    rows, commands, probe_commands = [], [], []

    def plan(cmd: list[str]) -> dict | None:
        log("+ " + " ".join(cmd))
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"kvtier plan failed: {out.stderr.strip()[-500:]}")
        singles = json.loads(out.stdout)["single_request"]["rows"]
        return singles[0] if singles else None

    for r in result["rows"]:
        # The disk as a user measures it for the tier beforehand: `kvtier bench tier` (reads
        # through a file tier with the same read threads and queue depth), run right before this
        # context's repeats. `kvtier bench storage`'s plain reads at the tier's reader count, run
        # just before it, read 9 % faster than the tier on average on the H200 machine's disk and
        # moved from context to context while the tier's rate held: its prediction is kept
        # beside, for comparison.
        tier_GBps = r["tier"]["read_GBps"] if "tier" in r else None
        probe_GBps = r["disk"]["read_GBps"] if "disk" in r else None
        # The host time the L1 arm spent starting its layer loads, per layer, measured in the
        # same run. It lengthens the suffix only where the launching thread is the bottleneck:
        # the eager pass. With the suffix in CUDA graphs that thread queues each layer's copy and
        # two graph launches well ahead of the GPU, so the loads cost the GPU no time (0).
        measured_us = r.get("l1_issue_s", 0.0) / layers * 1e6
        issue_us = measured_us if result.get("suffix_pass", "eager") == "eager" else 0.0
        tail = ["--context", str(r["context"]), "--layer-load-overhead-us", f"{issue_us:.1f}"]

        def disk(gbps):
            return ["--tier", f"disk:1TiB:{gbps:.3f}GB/s"] if gbps is not None else []

        cmd = common + disk(tier_GBps) + tail
        commands.append(" ".join(cmd))
        p = plan(cmd)
        if p is None:
            continue
        row = {"context": r["context"], "plan_recompute_s": p["recompute_s"],
               "plan_suffix_s": p["suffix_s"], "layer_load_overhead_us": issue_us,
               "layer_issue_us_measured": measured_us}
        if tier_GBps is not None:
            row["disk_GBps"] = tier_GBps
            row["disk_source"] = "kvtier bench tier"
        for arm, tier in (("l1", "cpu"), ("file", "disk")):
            if f"{arm}_s" in r and tier in p["hit_ttft_s"]:
                row[f"plan_{arm}_s"] = p["hit_ttft_s"][tier]
                row[f"{arm}_s"] = r[f"{arm}_s"]
                row[f"{arm}_error"] = p["hit_ttft_s"][tier] / r[f"{arm}_s"] - 1
        if probe_GBps is not None and "file_s" in r:
            cmd = common + disk(probe_GBps) + tail
            probe_commands.append(" ".join(cmd))
            q = plan(cmd)
            if q is not None and "disk" in q["hit_ttft_s"]:
                row["probe_GBps"] = probe_GBps
                row["plan_file_probe_s"] = q["hit_ttft_s"]["disk"]
                row["file_error_probe"] = q["hit_ttft_s"]["disk"] / r["file_s"] - 1
        rows.append(row)
    return {"commands": commands, "probe_commands": probe_commands, "rows": rows}
