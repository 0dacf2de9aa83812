"""A TTFT run's figures: each context's row (medians, floors, ratios), the targets, the table, the
SVG plot and the JSON written as the run goes.

Part of ``python -m kvtier.bench.ttft``, which re-exports these names.
"""

from __future__ import annotations

import json
import math
import os
from typing import TYPE_CHECKING

from kvtier.bench.model import ModelConfig
from kvtier.bench.ttft_common import ALL_ARMS, median

if TYPE_CHECKING:
    from kvtier.bench.ttft import ContextRun


def summarize(run: ContextRun, result: dict, cfg: ModelConfig, dtype) -> dict:
    s = run.samples
    prefix_bytes = run.prefix * cfg.kv_bytes_per_token(dtype)
    row = {"context": run.context, "prefix_tokens": run.prefix, "prefix_bytes": prefix_bytes,
           "errors": run.errors}
    for arm in ALL_ARMS:
        if arm in s:
            key = arm.replace("-", "_")
            row[f"{key}_s"] = median(s[arm])
            row[f"{key}_max_s"] = max(s[arm])
            row[f"{key}_samples"] = s[arm]
    for k in ("l1:pin_s", "server:pin_s", "file:pin_s", "l1:host_s", "server:host_s",
              "file:host_s", "save:done_s", "l1:issue_s", "server:issue_s", "file:open_s",
              "file:close_s"):
        if k in s:
            row[k.replace(":", "_").replace("-", "_")] = median(s[k])
    if "file:page_cache_dropped" in s:
        row["file_page_cache_dropped"] = all(s["file:page_cache_dropped"])
    if "file_stats" in run.extra:
        row["file_o_direct"] = _find(run.extra["file_stats"], "o_direct")
    row["logit_rel_err"] = run.extra.get("logit_rel_err", {})
    copy_s = prefix_bytes / (result["h2d_GBps"] * 1e9) if result["h2d_GBps"] > 0 else float("nan")
    row["copy_floor_s"] = copy_s
    rec = row.get("recompute_s")
    gpu = row.get("gpu_s")
    if gpu is not None:
        # the first layer's copy cannot overlap anything; the rest hides behind the compute
        row["l1_floor_s"] = max(copy_s, gpu) + copy_s / cfg.num_layers
    disk = run.extra.get("disk")
    if disk is not None:
        row["disk"] = disk
    if "tier" in run.extra:
        row["tier"] = run.extra["tier"]
    if gpu is not None and disk is not None:
        # `kvtier bench storage` right before this context's repeats: at the tier's reader count
        # (the floor of the issue; the plan takes bench tier's figure), and at the best of its
        # reader counts (a lower floor, so a stricter ratio).
        row["file_floor_s"] = prefix_bytes / (disk["read_GBps"] * 1e9) + gpu
        row["file_floor_best_s"] = prefix_bytes / (disk["read_GBps_max"] * 1e9) + gpu
    if "file_raw" in s:
        # The same bytes read raw, interleaved with the hits (run_file): whether the tier keeps
        # up with the disk of that minute, which can drift far from the probe's.
        row["file_raw_s"] = median(s["file_raw"])
        row["file_raw_samples"] = s["file_raw"]
        row["file_raw_GBps"] = prefix_bytes / row["file_raw_s"] / 1e9
        if "file_s" in row and gpu is not None:
            row["file_vs_raw"] = row["file_s"] / (row["file_raw_s"] + gpu)
    for arm in ("gpu", "l1", "l1_serial", "server", "file"):
        if f"{arm}_s" in row and rec:
            row[f"{arm}_speedup"] = rec / row[f"{arm}_s"]
    if "file_s" in row and "file_floor_best_s" in row:
        row["file_vs_best_floor"] = row["file_s"] / row["file_floor_best_s"]
    for arm, floor in (("l1", "l1_floor_s"), ("server", "l1_floor_s"), ("file", "file_floor_s")):
        if f"{arm}_s" in row and floor in row:
            row[f"{arm}_vs_floor"] = row[f"{arm}_s"] / row[floor]
            row[f"{arm}_vs_floor_max"] = row[f"{arm}_max_s"] / row[floor]
    if "save_s" in row and rec:
        row["save_overhead"] = row["save_s"] / rec - 1
    return row


def _find(d, key):
    if isinstance(d, dict):
        if key in d:
            return d[key]
        for v in d.values():
            r = _find(v, key)
            if r is not None:
                return r
    return None


def targets(result: dict) -> dict:
    rows = {r["context"]: r for r in result["rows"]}
    t = {}
    r24 = rows.get(24576)
    if r24 and "l1_speedup" in r24:
        t["l1_24k_speedup_ge_10x"] = r24["l1_speedup"] >= 10
    l1 = [r["l1_vs_floor"] for r in rows.values() if "l1_vs_floor" in r]
    if l1:
        t["l1_within_1.3x_floor"] = max(l1) <= 1.3
        t["l1_within_1.3x_floor_every_repeat"] = max(
            r["l1_vs_floor_max"] for r in rows.values() if "l1_vs_floor_max" in r) <= 1.3
    fl = [r["file_vs_floor"] for r in rows.values() if "file_vs_floor" in r]
    if fl:
        t["file_within_1.2x_floor"] = max(fl) <= 1.2
    fb = [r["file_vs_best_floor"] for r in rows.values() if "file_vs_best_floor" in r]
    if fb:
        t["file_within_1.2x_best_floor"] = max(fb) <= 1.2
    sv = [r["save_overhead"] for r in rows.values() if "save_overhead" in r]
    if sv:
        t["save_overhead_le_1pct"] = max(sv) <= 0.01
    errs = [abs(p[k]) for p in result.get("plan", {}).get("rows", [])
            for k in ("l1_error", "file_error") if k in p]
    if errs:
        t["plan_within_10pct"] = max(errs) <= 0.10
    for name, k in (("plan_file_within_10pct", "file_error"),
                    ("plan_file_within_10pct_with_probe", "file_error_probe")):
        fe = [abs(p[k]) for p in result.get("plan", {}).get("rows", []) if k in p]
        if fe:
            t[name] = max(fe) <= 0.10
    t["all_hits_verified"] = not any(r["errors"] for r in rows.values())
    return t


def format_row(r: dict) -> str:
    def ms(k):
        v = r.get(k)
        return f"{v * 1e3:9.1f}" if v is not None and not math.isnan(v) else f"{'-':>9}"

    return (f"{r['context']:>7} {ms('recompute_s')} {ms('gpu_s')} {ms('l1_s')} "
            f"{ms('l1_serial_s')} {ms('server_s')} {ms('file_s')} {ms('save_s')} "
            f"{ms('copy_floor_s')} {ms('l1_floor_s')} {ms('file_floor_s')}")


def print_table(result: dict) -> None:
    print(f"kvtier TTFT benchmark: {result['model']} ({result['parameters'] / 1e9:.2f} B, "
          f"{result['dtype']}) on {result['device']}; suffix {result['suffix_tokens']} tokens, "
          f"chunks of {result['chunk_tokens']}, {result['block_tokens']}-token blocks, copier "
          f"{result['layer_copy_mechanism']}; suffix pass {result.get('suffix_pass', 'eager')}; "
          f"median of {result['repeats']} after {result['warmup']} warm-ups")
    print(f"PCIe pinned host->GPU {result['h2d_GBps']:.1f} GB/s (end of run "
          f"{result.get('h2d_GBps_end', float('nan')):.1f}), GPU->host {result['d2h_GBps']:.1f}")
    disks = [r for r in result["rows"] if "disk" in r]
    if disks:
        print("disk (kvtier bench storage before each context's repeats; the file floor takes "
              "the figure at the tier's reader count):")
        for r in disks:
            d = r["disk"]
            by = ", ".join(f"{n}: {v:.2f}" for n, v in d["read_GBps_by_readers"].items())
            write = d["write_GBps"]
            write = f"{write:.2f} GB/s" if isinstance(write, (int, float)) else "-"
            print(f"{r['context']:>7}: O_DIRECT {d['o_direct']}, read {d['read_GBps']:.2f} GB/s at "
                  f"{d['readers']} readers, best {d['read_GBps_max']:.2f} (readers {by}), "
                  f"write {write}; probe {d['probe_s']:.1f} s")
    tiers = [r for r in result["rows"] if "tier" in r]
    if tiers:
        print("file tier (kvtier bench tier before each context's repeats, after the probe; the "
              "plan takes its tier read figure):")
        for r in tiers:
            t = r["tier"]
            print(f"{r['context']:>7}: tier read {t['read_GBps']:.2f} GB/s, raw O_DIRECT "
                  f"{t['raw_read_GBps']:.2f} (tier / raw {t['read_ratio']:.2f}); write "
                  f"{t['write_GBps']:.2f}, raw {t['raw_write_GBps']:.2f}; {t['readers']} "
                  f"readers, io depth {t['io_depth']}, {t['chunks']} x {t['chunk_mib']} MiB x "
                  f"{t['repeats']}, o_direct {t['o_direct']}; {t['bench_s']:.1f} s")
    print("TTFT in ms:")
    print(f"{'context':>7} {'recompute':>9} {'gpu-hit':>9} {'l1':>9} {'l1-serial':>9} "
          f"{'server':>9} {'file':>9} {'save':>9} {'copy-flr':>9} {'l1-floor':>9} "
          f"{'file-flr':>9}")
    for r in result["rows"]:
        print(format_row(r))
    for r in result["rows"]:
        if "file_vs_raw" in r:
            print(f"{r['context']:>7}: file tier {r['file_s'] * 1e3:.1f} ms, the same bytes read "
                  f"raw (O_DIRECT, as many threads, interleaved) {r['file_raw_s'] * 1e3:.1f} ms "
                  f"= {r['file_raw_GBps']:.2f} GB/s; tier / (raw + GPU hit) "
                  f"{r['file_vs_raw']:.2f}x")
    for r in result["rows"]:
        if "file_samples" in r:
            xs = sorted(v * 1e3 for v in r["file_samples"])
            raw = " ".join(f"{v * 1e3:.0f}" for v in r.get("file_raw_samples", []))
            print(f"{r['context']:>7}: file hit samples " + " ".join(f"{v:.0f}" for v in xs)
                  + (f"; raw reads, in order: {raw}" if raw else ""))
    print("samples (ms): p50 / max, every sample")
    for r in result["rows"]:
        for arm in ("gpu", "l1", "l1_serial", "server"):
            if f"{arm}_samples" in r:
                xs = sorted(v * 1e3 for v in r[f"{arm}_samples"])
                print(f"{r['context']:>7} {arm:>9} {r[f'{arm}_s'] * 1e3:6.1f} / {xs[-1]:6.1f}  "
                      + " ".join(f"{v:.1f}" for v in xs))
    print("ratios:")
    for r in result["rows"]:
        parts = [f"{r['context']:>7}"]
        for k in ("l1_speedup", "server_speedup", "l1_vs_floor", "l1_vs_floor_max",
                  "server_vs_floor", "file_vs_floor", "file_vs_best_floor", "save_overhead"):
            if k in r:
                parts.append(f"{k} {r[k]:.3f}")
        print("  ".join(parts))
    print(f"prefill table (kvtier plan --prefill-table): {result['prefill_table']}")
    if "plan" in result:
        print("kvtier plan's single-request prediction against the measured hit, ms:")
        for p in result["plan"]["rows"]:
            parts = [f"{p['context']:>7}  suffix {p['plan_suffix_s'] * 1e3:.1f}, layer loads "
                     f"{p['layer_load_overhead_us']:.0f} us each"]
            for arm in ("l1", "file"):
                if f"plan_{arm}_s" in p:
                    parts.append(f"{arm} {p[f'plan_{arm}_s'] * 1e3:.1f} predicted, "
                                 f"{p[f'{arm}_s'] * 1e3:.1f} measured ({p[f'{arm}_error']:+.1%})"
                                 + (f" at {p['disk_GBps']:.3f} GB/s (bench tier)"
                                    if arm == "file" and "disk_GBps" in p else ""))
            if "plan_file_probe_s" in p:
                parts.append(f"with the probe's {p['probe_GBps']:.3f} GB/s "
                             f"{p['plan_file_probe_s'] * 1e3:.1f} ({p['file_error_probe']:+.1%})")
            print("  ".join(parts))
    for k, v in result["targets"].items():
        print(f"target {k}: {'met' if v else 'NOT MET'}")
    for r in result["rows"]:
        for e in r["errors"]:
            print(f"ERROR context {r['context']}: {e}")


def write_plot(result: dict, path: str) -> None:
    """TTFT against context, log scale, one line per arm and the copy floor, as SVG."""
    rows = result["rows"]
    series = [(k, label, color) for k, label, color in (
        ("recompute_s", "recompute", "#d62728"), ("l1_s", "kvtier L1 (in-process)", "#1f77b4"),
        ("server_s", "kvtier serve (shared pool)", "#17becf"),
        ("file_s", "kvtier file tier (cold)", "#ff7f0e"), ("gpu_s", "GPU prefix hit", "#2ca02c"),
        ("copy_floor_s", "copy floor: bytes / PCIe", "#7f7f7f")) if any(k in r for r in rows)]
    vals = [r[k] for r in rows for k, _, _ in series if r.get(k) and r[k] > 0]
    if not rows or not vals:
        return
    w, h, ml, mr, mt, mb = 760, 460, 70, 230, 30, 50
    xs = [r["context"] for r in rows]
    x0, x1 = 0, max(xs) * 1.05
    y0, y1 = math.floor(math.log10(min(vals))), math.ceil(math.log10(max(vals)))
    y1 = max(y1, y0 + 1)

    def px(x):
        return ml + (x - x0) / (x1 - x0) * (w - ml - mr)

    def py(y):
        return mt + (y1 - math.log10(y)) / (y1 - y0) * (h - mt - mb)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
           f'font-family="sans-serif" font-size="12">',
           f'<rect width="{w}" height="{h}" fill="white"/>',
           f'<text x="{ml}" y="18" font-size="14">TTFT, {result["model"]} on '
           f'{result["device"]} ({result["suffix_tokens"]}-token suffix)</text>']
    for e in range(y0, y1 + 1):
        y = py(10 ** e)
        out.append(f'<line x1="{ml}" y1="{y:.1f}" x2="{w - mr}" y2="{y:.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{ml - 6}" y="{y + 4:.1f}" text-anchor="end">'
                   f'{10 ** e * 1e3:g} ms</text>')
    for x in xs:
        out.append(f'<text x="{px(x):.1f}" y="{h - mb + 18}" text-anchor="middle">'
                   f'{x // 1024}k</text>')
    out.append(f'<text x="{(ml + w - mr) / 2}" y="{h - 10}" text-anchor="middle">'
               f'prompt tokens</text>')
    for i, (k, label, color) in enumerate(series):
        pts = [(px(r["context"]), py(r[k])) for r in rows if r.get(k) and r[k] > 0]
        dash = ' stroke-dasharray="6,4"' if k == "copy_floor_s" else ""
        out.append(f'<polyline fill="none" stroke="{color}" stroke-width="2"{dash} points="' +
                   " ".join(f"{x:.1f},{y:.1f}" for x, y in pts) + '"/>')
        for x, y in pts:
            out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{color}"/>')
        ly = mt + 20 + 20 * i
        out.append(f'<line x1="{w - mr + 15}" y1="{ly}" x2="{w - mr + 40}" y2="{ly}" '
                   f'stroke="{color}" stroke-width="2"{dash}/>')
        out.append(f'<text x="{w - mr + 46}" y="{ly + 4}">{label}</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def save_partial(args, result: dict, complete: bool = False) -> None:
    """Writes the result so far to --output (atomically: a reader never sees half a file)."""
    if not args.output:
        return
    tmp = args.output + ".tmp"
    with open(tmp, "w") as f:
        json.dump(dict(result, complete=complete), f, indent=1, default=str)
    os.replace(tmp, args.output)
