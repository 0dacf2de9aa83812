"""The multi-round chat experiment, every arm against `kvtier plan`, resumable across commands.

    python -m kvtier.bench.multiround --state DIR [--contexts 8k,16k,24k,28k]
        [--arms none,native,tiering,kvtier,server,prefetch] [--budget-s 540] [shortening knobs]

The workload is LMCache's multi-round QA as `kvtier bench qa` sends it: 8 users, 20 rounds, a
1,000-token system prompt shared by every user, 100-token answers, and per-user contexts of 8k,
16k, 24k and 28k tokens (filler words, converted to tokens with the served tokenizer). The engine
is one vLLM at a time, the Qwen3-8B shape with dummy weights (`--model-config qwen3-8b`, or the
tests' tiny Llama on vLLM's CPU build: `--model-config tiny`), its GPU KV cache capped at
--kv-cache-bytes (19 GB: what an H200 leaves Qwen3-8B's KV in the published setup). Arms, from
vllm_ttft.transfer_config (one place for every arm's connector settings):

* ``none``: no connector;
* ``native``: vLLM's OffloadingConnector, a CPU tier of --cpu-gb;
* ``tiering``: vLLM's TieringOffloadingSpec, a CPU tier of --tiering-cpu-gb and its ``fs`` tier
  on --disk-dir;
* ``kvtier``: kvtier's connector in process, L1 of --cpu-gb and a file tier on --disk-dir;
* ``server``: kvtier's connector with ``kvtier serve``, L1 of --cpu-gb and a file tier on
  --disk-dir;
* ``prefetch``: the server arm with ``kvtier.prefetch`` on (docs/prefetch.md).

kvtier's two arms run the connector's defaults (cost-aware lookups, the prefill time learned
from the engine) given the disk's read rate the harness measured (``kvtier.file_read_gbps``),
as a user is told to; `kvtier plan` predicts them cost-aware, vLLM's arms loading every hit.

Per arm the idle engine is measured first as planner_check measures it (the prefill table, the
per-request overhead, decode steps; the KV budget vLLM made), then per context, each from cold
caches and emptied directories (vLLM restarted where the arm's cache lives inside it):

1. ``capacity``: `kvtier bench qa --find-capacity` (paced stages of --stage-time, --qps doubling
   until the server falls behind);
2. ``run``: `kvtier bench qa` at the recommended --qps (65 % of that capacity) for --time s: mean
   and median TTFT, where the prompt tokens came from (vLLM's prefix cache from its /metrics;
   kvtier's L1 and file tier from the engine's or `kvtier serve`'s /metrics; vLLM's own
   offloading from vLLM's per-source counters where this vLLM has them, else its external hits
   as one figure), bytes written to and read from storage;
3. ``plan``: `kvtier plan` given only what a user measures beforehand (the idle engine, the KV
   budget, the tiers' bandwidths from `kvtier bench storage` and the host->GPU copy, the
   workload's flags), at the run's --qps and at --load 0.65, with its token shares per tier.

State: every finished phase is a JSON file under DIR/phases, written when it completes; a rerun
with the same DIR skips what is done (the run's settings are kept in DIR/config.json, and a
rerun that gives different ones is refused). With --budget-s the command stops before a phase
that its estimate (the longest of the same kind so far, else a prior) says cannot finish, and
stops a phase that runs into the deadline; it then exits with status 3 (more to do). Results:
DIR/results.json and a table, printed at the end of every command.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import re
import shutil
import signal
import socket as socket_module
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvtier.bench import planner_check as pc
from kvtier.bench import vllm_ttft
from kvtier.vllm.config import parse_config

log = pc.log

# The published experiment's arms; kvtier's prefetch arm is not one of them.
EXPERIMENT_ARMS = ("none", "native", "tiering", "kvtier", "server")
ARMS = EXPERIMENT_ARMS + ("prefetch",)
KVTIER_ARMS = ("kvtier", "server", "prefetch")
# The arm's name in vllm_ttft.transfer_config.
TRANSFER_ARM = {"none": "gpu", "native": "native", "tiering": "tiering", "kvtier": "kvtier",
                "server": "server", "prefetch": "server"}
# Arms whose cache lives inside vLLM's processes: only a restart empties it.
CACHE_IN_VLLM = {"native", "tiering", "kvtier"}
EXIT_MORE_TO_DO = 3
# Seconds kept back before the deadline for stopping vLLM and writing the results.
STOP_MARGIN_S = 30.0
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")

# The experiment's settings: the full (published) one. Every key is kept in DIR/config.json.
SETTINGS = {
    "model_config": "qwen3-8b", "model": None, "tokenizer": None,
    "users": 8, "rounds": 20, "system_prompt": 1000, "answer_tokens": 100,
    "stage_time": 60.0, "capacity_max_stages": 6, "start_qps": 0.0, "time": 120.0,
    "kv_cache_bytes": 19_000_000_000, "cpu_gb": 8.0, "tiering_cpu_gb": 8.0, "disk_gb": 32.0,
    "disk_dir": None, "chunk_tokens": 256, "block_tokens": 16, "max_batched_tokens": 8192,
    "max_model_len": 40960, "enforce_eager": True, "dtype": "bfloat16",
    "prefill_lengths": "1024,4096,8192,16384,32768", "idle_repeats": 3,
    "engine_table": "per-arm", "vllm_args": "", "kvtier_extra": "",
    # kvtier's file tier with its reads capped (its "read_limit_gbps"): a stand-in for a storage
    # slower than recompute, where the machine's own disk is faster. 0: not capped.
    "disk_read_limit_gbps": 0.0,
}
FULL_CONTEXTS = "8k,16k,24k,28k"
# What a shortened run states it changed, against the full experiment.
SHORTENING = ("users", "rounds", "system_prompt", "answer_tokens", "stage_time",
              "capacity_max_stages", "time", "kv_cache_bytes", "cpu_gb", "tiering_cpu_gb",
              "idle_repeats", "disk_read_limit_gbps")


def free_port() -> int:
    with socket_module.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_json(path: Path, value) -> None:
    """Whole or not at all: a command killed mid-write leaves the previous file or none."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=1))
    os.replace(tmp, path)


# --- the phases and the state ------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Phase:
    kind: str  # tiers, engine, capacity, run
    arm: str | None = None
    context: int | None = None

    @property
    def key(self) -> str:
        if self.kind == "tiers":
            return "tiers"
        if self.kind == "engine":
            return f"engine-{self.arm}"
        return f"c{self.context}-{self.arm}-{self.kind}"


class State:
    """DIR/phases/KEY.json per finished phase; DIR/config.json, the run's settings."""

    def __init__(self, root: Path):
        self.root = root
        self.phases = root / "phases"
        self.logs = root / "logs"
        self.phases.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(exist_ok=True)

    def get(self, key: str) -> dict | None:
        path = self.phases / f"{key}.json"
        return json.loads(path.read_text()) if path.exists() else None

    def done(self, key: str) -> bool:
        return (self.phases / f"{key}.json").exists()

    def put(self, key: str, value: dict) -> None:
        write_json(self.phases / f"{key}.json", value)

    def durations(self, kind: str) -> list[float]:
        """Seconds each finished phase of a kind took; kind vllm_start: each start of vLLM."""
        if kind == "vllm_start":
            return (self.get("vllm-starts") or {}).get("seconds", [])
        out = []
        for path in self.phases.glob("*.json"):
            value = json.loads(path.read_text())
            if value.get("kind") == kind and "seconds" in value:
                out.append(value["seconds"])
        return out

    def add_start(self, seconds: float) -> None:
        starts = self.get("vllm-starts") or {"seconds": []}
        starts["seconds"].append(seconds)
        self.put("vllm-starts", starts)


def engine_key(arm: str, engine_table: str) -> str:
    return "engine-shared" if engine_table == "once" else f"engine-{arm}"


def selection(state: State, contexts: str | None, arms: str | None) -> tuple[str, str]:
    """The command's points and arms: as given, else the previous command's on this state
    (so that "the same command again" without them goes on with them instead of turning into
    the whole experiment), else all of them. Kept for the next command."""
    path = state.root / "selection.json"
    last = json.loads(path.read_text()) if path.exists() else {}
    chosen = (contexts or last.get("contexts") or FULL_CONTEXTS,
              arms or last.get("arms") or ",".join(ARMS))
    write_json(path, {"contexts": chosen[0], "arms": chosen[1]})
    return chosen


def pending(state: State, arms, contexts, engine_table: str) -> list[Phase]:
    """The phases still to run, in order: the tiers, then arm by arm the idle engine (per arm,
    or once for all with engine_table "once") and, context by context, capacity and run.
    Done phases and skipped arms are left out."""
    todo = [] if state.done("tiers") else [Phase("tiers")]
    engine_planned = False
    for arm in arms:
        if state.done(f"skip-{arm}"):
            continue
        arm_todo = [Phase(kind, arm, c) for c in contexts for kind in ("capacity", "run")
                    if not state.done(Phase(kind, arm, c).key)]
        key = engine_key(arm, engine_table)
        need_engine = not state.done(key) and not (engine_table == "once" and engine_planned)
        # The engine's figures are needed by this arm's plans even where its runs are done.
        if need_engine and (arm_todo or any(state.done(Phase("run", arm, c).key)
                                            for c in contexts)):
            todo.append(Phase("engine", arm))
            engine_planned = True
        todo += arm_todo
    return todo


class Budget:
    """Whether a phase can finish before the deadline: its estimate is the longest phase of the
    same kind done so far (this command or an earlier one), else a prior from the settings; a
    phase that needs vLLM (re)started adds the longest start seen."""

    def __init__(self, seconds: float | None, state: State, cfg: dict, clock=time.monotonic):
        self.clock = clock
        self.deadline = None if seconds is None else clock() + seconds
        self.state, self.cfg = state, cfg

    def prior(self, kind: str) -> float:
        c = self.cfg
        return {"tiers": 120.0, "vllm_start": 240.0, "engine": 180.0,
                # paced stages stop when the server falls behind, mostly by the fourth
                "capacity": min(4, c["capacity_max_stages"]) * (c["stage_time"] + 15) + 30,
                "run": c["time"] + 60.0}[kind]

    def estimate(self, kind: str) -> float:
        seen = self.state.durations(kind)
        return max(seen) if seen else self.prior(kind)

    def left(self) -> float:
        return float("inf") if self.deadline is None else self.deadline - self.clock()

    def allows(self, phase: Phase, needs_start: bool) -> tuple[bool, float]:
        need = self.estimate(phase.kind) + (self.estimate("vllm_start") if needs_start else 0)
        return need + STOP_MARGIN_S <= self.left(), need

    def timeout(self) -> float | None:
        """Seconds a child may run before the deadline (its stop included)."""
        return None if self.deadline is None else max(1.0, self.left() - STOP_MARGIN_S)


class OutOfTime(Exception):
    """A phase ran into the deadline: it is not recorded, the command stops."""


class ArmFailed(Exception):
    """The arm cannot run on this vLLM or machine; the reason is recorded and the arm skipped."""


def failure_reason(log_text: str) -> str:
    """The line of a failed vLLM's log that says why: its last exception message."""
    generic = ("Engine core initialization failed", "See root cause above")
    lines = [ln.strip() for ln in log_text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        m = re.search(r"\b(\w*(?:Error|Exception)): (.+)$", ln)
        if m and not any(g in ln for g in generic):
            return f"{m.group(1)}: {m.group(2)}"[:2000]
    return lines[-1][:2000] if lines else "no output"


# --- what a run measured -------------------------------------------------------------------------

def delta(before: dict, after: dict) -> dict:
    """Counters' growth over a run; a series present only after counts from 0."""
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def has_series(m: dict, name: str) -> bool:
    return any(k.partition("{")[0] == name for k in m)


def labels(m: dict, name: str) -> dict:
    """The labels of the first series of `name` (an info metric's values are its labels)."""
    for key in m:
        base, _, rest = key.partition("{")
        if base == name:
            return dict(re.findall(r'(\w+)="([^"]*)"', rest))
    return {}


def token_shares(arm: str, prompt_tokens: int, vllm_delta: dict, kvtier_delta: dict | None,
                 kv_bytes_per_token: int) -> dict:
    """Shares of the run's prompt tokens by where they came from: gpu (vLLM's prefix cache),
    cpu, disk, recompute; None where this vLLM does not tell. kvtier's arms are read from its
    engine's counters (a file-tier hit passes through L1: counted by both, so L1's own is the
    difference); vLLM's own offloading from its per-source counters where it has them, else its
    external hits: all of them for native (one CPU tier), unsplit for tiering."""
    p = max(prompt_tokens, 1)
    gpu = pc.metric(vllm_delta, "vllm:prefix_cache_hits_total")
    cpu = disk = 0.0
    external = None
    how = "no offload"
    by_tier = ("vllm:kvtier_tokens_hit_memory_total", "vllm:kvtier_tokens_hit_file_total")
    if kvtier_delta is not None and any(has_series(vllm_delta, n) for n in by_tier):
        # The connector's own count of what each load took from where: the engine's byte
        # counters also count what the prefetch read into L1 and the pins it gave back unread.
        cpu, disk = (pc.metric(vllm_delta, n) for n in by_tier)
        how = "kvtier's connector counters"
    elif kvtier_delta is not None:
        read = lambda tier: pc.metric(kvtier_delta, "kvtier_bytes_read_total",  # noqa: E731
                                      tier=tier) / kv_bytes_per_token
        disk = read("file")
        cpu = max(0.0, read("memory") - disk)
        how = "kvtier's counters"
    elif arm != "none":
        by_source = "vllm:prompt_tokens_cached_by_source_total"
        external = pc.metric(vllm_delta, "vllm:external_prefix_cache_hits_total")
        if has_series(vllm_delta, by_source):
            cpu = pc.metric(vllm_delta, by_source, source="host")
            disk = pc.metric(vllm_delta, by_source, source="disk")
            how = "vLLM's prompt tokens by source"
        elif arm == "native":
            cpu, how = external, "vLLM's external hits (one CPU tier)"
        else:
            cpu = disk = None
            how = "vLLM's external hits, not split by tier (this vLLM has no per-source counter)"
    shares = {"gpu": gpu / p, "cpu": None if cpu is None else cpu / p,
              "disk": None if disk is None else disk / p}
    served = (cpu + disk) if cpu is not None else external
    shares["recompute"] = 1 - (gpu + served) / p
    if cpu is None:
        shares["offload_unsplit"] = external / p
    return {"token_share": shares, "source": how}


def storage_bytes(arm: str, vllm_delta: dict, kvtier_delta: dict | None) -> dict:
    """Bytes the arm's storage tier wrote and read over the run; None where not measured."""
    if kvtier_delta is not None:
        return {"written": pc.metric(kvtier_delta, "kvtier_bytes_written_total", tier="file"),
                "read": pc.metric(kvtier_delta, "kvtier_bytes_read_total", tier="file"),
                "source": "kvtier's file tier counters"}
    if arm in ("none", "native"):
        return {"written": 0.0, "read": 0.0, "source": "no storage tier"}
    w, r = "vllm:kv_offload_tiering_write_bytes_total", "vllm:kv_offload_tiering_read_bytes_total"
    if has_series(vllm_delta, w) or has_series(vllm_delta, r):
        return {"written": pc.metric(vllm_delta, w), "read": pc.metric(vllm_delta, r),
                "source": "vLLM's tiering counters"}
    return {"written": None, "read": None, "source": "not measured (no counter in this vLLM)"}


def process_io(sid: int, pids=()) -> dict:
    """read_bytes / write_bytes of every process in session `sid` (vLLM and its workers) and of
    `pids` (kvtier serve): what reached the block devices, page-cache hits not included."""
    total = {"read_bytes": 0, "write_bytes": 0}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fields = (proc / "stat").read_text().rpartition(")")[2].split()
            # after the name: state, ppid, pgrp, session
            if int(fields[3]) != sid and int(proc.name) not in pids:
                continue
            for line in (proc / "io").read_text().splitlines():
                k, _, v = line.partition(":")
                if k in total:
                    total[k] += int(v)
        except (OSError, ValueError, IndexError):
            continue
    return total


def interpolate(table: dict, n: float) -> float:
    """The prefill table at n tokens: linear between its points, through (0, 0), and past the
    last along the last segment."""
    pts = [(0, 0.0)] + sorted((int(k), v) for k, v in table.items())
    for (a, ta), (b, tb) in zip(pts, pts[1:]):
        if n <= b:
            return ta + (tb - ta) * (n - a) / (b - a)
    (a, ta), (b, tb) = pts[-2], pts[-1]
    return tb + (tb - ta) * (n - b) / (b - a)


def auto_start_qps(engine: dict, mean_prompt: float, cfg: dict) -> float:
    """The first capacity stage's --qps, as `kvtier plan` chooses it: a fifth of what the idle
    engine finishes back to back (a cold prompt of the mean length and its answer), and at least
    two questions per user in a stage."""
    step = statistics.median(engine["decode_step_s"].values())
    back_to_back = 1 / (interpolate(engine["prefill_table"], mean_prompt)
                        + cfg["answer_tokens"] * step)
    return round(max(back_to_back / 5, 2 * cfg["users"] / cfg["stage_time"]), 4)


def shortened(cfg: dict, contexts: list[str], arms: list[str]) -> list[str]:
    """What this run changed from the full experiment, one phrase each."""
    out = []
    for k in SHORTENING:
        if cfg[k] != SETTINGS[k]:
            out.append(f"{k.replace('_', '-')} {SETTINGS[k]} -> {cfg[k]}")
    if ",".join(contexts) != FULL_CONTEXTS:
        out.append(f"contexts {FULL_CONTEXTS} -> {','.join(contexts)}")
    if not set(EXPERIMENT_ARMS) <= set(arms):
        out.append(f"arms {','.join(EXPERIMENT_ARMS)} -> {','.join(arms)}")
    if cfg["model_config"] != SETTINGS["model_config"]:
        out.append(f"model {SETTINGS['model_config']} -> {cfg['model_config']}")
    return out


# --- the harness -------------------------------------------------------------------------------

class Children:
    """The processes this harness started, by pid and start time, in DIR/children.json: a
    command killed at its time limit leaves its vLLM running, and the next command stops it
    (that pid, only while it is the same process) before it needs the GPU."""

    def __init__(self, path: Path):
        self.path = path

    def _read(self) -> list:
        return json.loads(self.path.read_text()) if self.path.exists() else []

    @staticmethod
    def _started(pid: int) -> str | None:
        """The process's start time, None when it is gone (or dead and not yet reaped)."""
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
            return None if fields[0] == "Z" else fields[19]
        except (OSError, IndexError):
            return None

    def add(self, pid: int, group: bool) -> None:
        write_json(self.path, self._read() + [{"pid": pid, "group": group,
                                               "started": self._started(pid)}])

    def remove(self, pid: int) -> None:
        write_json(self.path, [c for c in self._read() if c["pid"] != pid])

    def stop_leftovers(self) -> None:
        for c in self._read():
            if c["started"] is None or self._started(c["pid"]) != c["started"]:
                continue
            log(f"stopping pid {c['pid']}, left running by an earlier command")
            try:
                (os.killpg if c["group"] else os.kill)(c["pid"], signal.SIGTERM)
                for _ in range(60):
                    if self._started(c["pid"]) is None:
                        break
                    time.sleep(1)
                else:
                    (os.killpg if c["group"] else os.kill)(c["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
        write_json(self.path, [])


class Harness:
    def __init__(self, cfg: dict, state: State, budget: Budget, kvtier: str):
        self.cfg, self.state, self.budget, self.kvtier = cfg, state, budget, kvtier
        self.children = Children(state.root / "children.json")
        self.model = Path(cfg["model"]) if cfg["model"] else state.root / "model"
        self.bpt = vllm_ttft.kv_bytes_per_token(self.model, cfg["dtype"])
        self.disk = Path(cfg["disk_dir"]) if cfg["disk_dir"] else state.root / "disk"
        self.sockdir = Path(tempfile.mkdtemp(prefix="kvtier-mr-"))  # a socket path's limit
        self.vocab = json.loads((self.model / "config.json").read_text())["vocab_size"]

    def args(self, **more) -> argparse.Namespace:
        """The settings under the names vllm_ttft and planner_check take them."""
        c = self.cfg
        tiers = self.state.get("tiers") or {}
        return argparse.Namespace(**{
            **c, "model": self.model, "model_dir": self.model, "on_gpu": tiers.get("on_gpu"),
            "kv_cache_gb": c["kv_cache_bytes"] / (1 << 30),
            "gpu_memory_utilization": 0.9, "kvtier": self.kvtier, "cost_extra": "",
            **more})

    # --- tiers --------------------------------------------------------------------------------

    def tiers(self) -> dict:
        py = [sys.executable, "-c"]
        copy = subprocess.run(py + ["from kvtier.bench.vllm_ttft import copy_bandwidth; "
                                    "print(copy_bandwidth() or 0)"],
                              capture_output=True, text=True, timeout=self.budget.timeout())
        bw = float(copy.stdout.strip().splitlines()[-1]) if copy.returncode == 0 else 0.0
        on_gpu = bw > 0
        # vLLM's own check (vllm/v1/kv_offload/cpu/spec.py), asked before any vLLM is started
        # for an arm that would fail after its model loaded.
        platform = subprocess.run(py + [
            "import vllm; from vllm.platforms import current_platform as p; "
            "print(vllm.__version__, p.is_cuda_alike() or p.is_xpu(), p.device_name)"],
            capture_output=True, text=True, timeout=self.budget.timeout())
        # Where the check itself fails, the arms are tried: a vLLM that cannot run one exits.
        version, offload_ok, device = (platform.stdout.strip().splitlines()[-1].split(" ", 2)
                                       if platform.returncode == 0 else ("?", "?", "?"))
        probe = self.disk / "storage-probe"
        measured = pc.measure_tiers(self.kvtier, probe, self.cfg["chunk_tokens"] * self.bpt,
                                    engine=not on_gpu)
        shutil.rmtree(probe, ignore_errors=True)
        if on_gpu:
            measured["cpu_GBps"] = bw / 1e9
        limit = self.cfg["disk_read_limit_gbps"]
        if limit > 0:  # kvtier's file tier reads no faster than its cap: what a user sets
            measured["disk_read_GBps"] = min(measured["disk_read_GBps"], limit)
            measured["disk_read_limit_GBps"] = limit
        measured.update(on_gpu=on_gpu, cpu_source="host->GPU copy" if on_gpu else
                        "kvtier bench engine", vllm=version, device=device,
                        native_offload_supported={"True": True, "False": False}.get(offload_ok))
        return measured

    # --- one arm --------------------------------------------------------------------------------

    def run_arm(self, arm: str, phases: list[Phase]) -> bool:
        """Runs the arm's pending phases; False when the budget stopped it."""
        runner = ArmRunner(self, arm)
        try:
            for phase in phases:
                ok, need = self.budget.allows(phase, runner.needs_start(phase))
                if not ok:
                    log(f"stopping: {phase.key} needs about {need:.0f} s, "
                        f"{self.budget.left():.0f} s left; run the same command again to go on")
                    return False
                log(f"== {phase.key} (estimate {need:.0f} s, "
                    f"{self.budget.left():.0f} s left)")
                start = time.monotonic()
                try:
                    result = runner.run(phase)
                except (OSError, RuntimeError, KeyError, ValueError) as e:
                    # A vLLM that died or a bench qa that failed: the arm's other points would
                    # fail alike; the other arms go on.
                    raise ArmFailed(f"{phase.key} failed: {e!r}"[-2000:] + runner.log_reason())
                # The phase's own time: a vLLM start is estimated apart (State.add_start).
                result.update(kind=phase.kind, arm=arm, context=phase.context,
                              start_seconds=runner.start_seconds,
                              seconds=time.monotonic() - start - runner.start_seconds)
                self.state.put(engine_key(arm, self.cfg["engine_table"])
                               if phase.kind == "engine" else phase.key, result)
                log(f"   {phase.key} done in {time.monotonic() - start:.0f} s")
        except ArmFailed as e:
            log(f"the {arm} arm is skipped: {e}")
            self.state.put(f"skip-{arm}", {"reason": str(e)})
        finally:
            runner.close()
        return True

    def calibration(self, port: int) -> dict:
        """Tokens per filler word of bench qa's prompts on the served tokenizer: contexts are
        given in tokens, bench qa takes words."""
        got = self.state.get("calibration")
        if got:
            return got
        count = lambda n: len(json.loads(pc.http(port, "/tokenize", {  # noqa: E731
            "model": "bench", "prompt": " ".join(["hi"] * n), "add_special_tokens": False}))
            ["tokens"])
        per_word = (count(2000) - count(1000)) / 1000
        got = {"tokens_per_word": per_word}
        self.state.put("calibration", got)
        log(f"   the tokenizer makes {per_word:.3f} tokens of a filler word")
        return got

    def words(self, tokens: int) -> int:
        return max(1, round(tokens / self.state.get("calibration")["tokens_per_word"]))

    def close(self) -> None:
        shutil.rmtree(self.sockdir, ignore_errors=True)


class ArmRunner:
    """One arm's vLLM (and kvtier serve), started when a phase needs it and restarted where a
    phase needs its caches cold and only a restart empties them."""

    def __init__(self, h: Harness, arm: str):
        self.h, self.arm = h, arm
        self.vllm = None
        self.serve = None
        self.used = False
        self.start_seconds = 0.0  # of the vLLM start in the current phase
        self.kvtier_port = -1
        self.socket = str(h.sockdir / "kvtier.sock")
        self.serve_dir = h.disk / "kvtier-serve-l2"

    def needs_start(self, phase: Phase) -> bool:
        if phase.kind == "tiers":
            return False
        return self.vllm is None or (phase.kind != "engine" and self.used
                                     and self.arm in CACHE_IN_VLLM)

    def run(self, phase: Phase) -> dict:
        h = self.h
        self.start_seconds = 0.0
        if self.needs_start(phase):
            self.start()
        elif phase.kind != "engine":  # cold again without a restart
            if self.serve is not None:
                self.restart_serve()
            pc.reset_prefix_cache(self.vllm.port)
        h.calibration(self.vllm.port)
        self.used = True
        if phase.kind == "engine":
            return self.engine()
        if phase.kind == "capacity":
            return self.capacity(phase.context)
        return self.measured_run(phase.context)

    # --- processes ----------------------------------------------------------------------------

    def start(self) -> None:
        h, cfg = self.h, self.h.cfg
        self.stop_vllm()
        args = h.args()
        if self.arm in ("native", "tiering") and h.state.get("tiers")[
                "native_offload_supported"] is False:
            raise ArmFailed("vLLM's OffloadingConnector needs a CUDA-alike or XPU device "
                            f"(vLLM's own check); this is {h.state.get('tiers')['device']}")
        if TRANSFER_ARM[self.arm] == "server" and self.serve is None:
            self.restart_serve(connected=False)
        self.kvtier_port = free_port() if self.arm == "kvtier" else -1
        h.disk.mkdir(parents=True, exist_ok=True)
        # kvtier's cost-aware lookups start from the disk's read rate measured beforehand, as a
        # user is told to give it (docs/vllm.md), and learn the prefill time from the engine.
        disk_gbps = h.state.get("tiers").get("disk_read_GBps")
        keys = {"kvtier.file_read_gbps": round(disk_gbps, 3)} if disk_gbps else {}
        if self.arm == "prefetch":
            keys["kvtier.prefetch"] = True
        transfer = vllm_ttft.transfer_config(
            args, TRANSFER_ARM[self.arm], h.disk, self.socket, kvtier_file_tier=True,
            kvtier_http_port=self.kvtier_port, kvtier_keys=keys or None)
        extra = ["--load-format", "dummy", "--block-size", str(cfg["block_tokens"]),
                 "--max-num-batched-tokens", str(cfg["max_batched_tokens"]),
                 "--chat-template", CHAT_TEMPLATE]
        if not args.on_gpu:  # the CPU build sizes its cache in GiB: the cap as a block count
            extra += ["--num-gpu-blocks-override",
                      str(cfg["kv_cache_bytes"] // (cfg["block_tokens"] * h.bpt))]
        start = time.monotonic()
        self.vllm = vllm_ttft.Vllm(args, self.arm, free_port(), transfer, h.state.logs,
                                   eager=cfg["enforce_eager"], log_stats=True, extra_args=extra)
        h.children.add(self.vllm.proc.pid, group=True)
        timeout = h.budget.timeout()
        try:
            self.vllm.wait_up(time.monotonic() + (timeout if timeout is not None else 900))
        except RuntimeError:
            exited = self.vllm.proc.poll() is not None
            text = self.vllm.log_path.read_text(errors="replace")
            self.stop_vllm()
            if not exited:
                raise OutOfTime(f"vLLM of the {self.arm} arm was not up by the deadline")
            raise ArmFailed(failure_reason(text)) from None
        self.start_seconds = time.monotonic() - start
        h.state.add_start(self.start_seconds)
        log(f"   vLLM ({self.arm}) up in {self.start_seconds:.0f} s")
        self.used = False

    def restart_serve(self, connected: bool = True) -> None:
        """kvtier serve on an emptied directory; the connector reconnects by itself (its idle
        check, every RETRY_SECONDS)."""
        if self.serve is not None:
            self.serve.stop()
            self.h.children.remove(self.serve.proc.pid)
        shutil.rmtree(self.serve_dir, ignore_errors=True)
        self.serve_dir.mkdir(parents=True)
        args = self.h.args()
        self.serve = vllm_ttft.Serve(args, self.socket, self.serve_dir,
                                     self.h.state.logs / "serve.log")
        self.h.children.add(self.serve.proc.pid, group=False)
        if connected:  # its scheduler and its worker
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and len(self.serve.stats().get("clients", [])) < 2:
                time.sleep(0.5)

    def log_reason(self) -> str:
        if self.vllm is None or not self.vllm.log_path.exists():
            return ""
        return "; vLLM's log: " + failure_reason(self.vllm.log_path.read_text(errors="replace"))

    def stop_vllm(self) -> None:
        if self.vllm is not None:
            self.vllm.stop()
            self.h.children.remove(self.vllm.proc.pid)
            self.vllm = None

    def close(self) -> None:
        """Stops the arm's processes and removes its chunks (tens of GB at long contexts: the
        next arm needs the room)."""
        self.stop_vllm()
        if self.serve is not None:
            self.serve.stop()
            self.h.children.remove(self.serve.proc.pid)
            self.serve = None
        if self.cache_dir() is not None:
            shutil.rmtree(self.cache_dir(), ignore_errors=True)

    def kvtier_metrics(self) -> dict | None:
        if self.serve is not None:
            return pc.prometheus(self.serve.http_port)
        if self.kvtier_port >= 0:
            return pc.prometheus(self.kvtier_port)
        return None

    def cache_dir(self) -> Path | None:
        return {"tiering": self.h.disk / "tiering-fs", "kvtier": self.h.disk / "kvtier-inproc-l2",
                "server": self.serve_dir}.get(TRANSFER_ARM[self.arm])

    # --- phases -------------------------------------------------------------------------------

    def engine(self) -> dict:
        h, cfg = self.h, self.h.cfg
        lengths = sorted(n for n in map(int, cfg["prefill_lengths"].split(","))
                         if n + pc.DECODE_STEPS + 2 <= cfg["max_model_len"])
        engine = pc.measure_engine(self.vllm, lengths, cfg["idle_repeats"], cfg["users"],
                                   cfg["block_tokens"], vocab=h.vocab)
        info = labels(pc.prometheus(self.vllm.port), "vllm:cache_config_info")
        blocks = int(info.get("num_gpu_blocks") or 0)
        block = int(info.get("block_size") or cfg["block_tokens"])
        engine["kv_cache"] = {"blocks": blocks, "block_tokens": block,
                              "bytes": blocks * block * h.bpt,
                              "asked_bytes": cfg["kv_cache_bytes"]}
        log(f"   vLLM's KV cache: {blocks} blocks of {block} tokens, "
            f"{blocks * block * h.bpt / 1e9:.2f} GB (asked {cfg['kv_cache_bytes'] / 1e9:.2f})")
        return engine

    def workload(self, context: int) -> tuple[int, int]:
        return self.h.words(context), self.h.words(self.h.cfg["system_prompt"])

    def bench_qa(self, context: int, extra: list[str], name: str) -> dict:
        h = self.h
        context_words, system_words = self.workload(context)
        args = h.args(port=self.vllm.port, system_prompt=system_words)
        guard = self.cache_dir()
        if guard is not None:  # refuses to measure a warm cache directory
            extra = extra + ["--cache-dir", str(guard)]
        try:
            return pc.bench_qa(h.kvtier, args, context_words,
                               extra + ["--drain-timeout", "60"], name, h.state.logs,
                               timeout=h.budget.timeout())
        except subprocess.TimeoutExpired:
            raise OutOfTime(f"{name} ran into the deadline") from None

    def capacity(self, context: int) -> dict:
        h, cfg = self.h, self.h.cfg
        start_qps = cfg["start_qps"]
        if not start_qps:
            engine = h.state.get(engine_key(self.arm, cfg["engine_table"]))
            mean_prompt = (cfg["system_prompt"] + context
                           + cfg["rounds"] / 2 * (cfg["answer_tokens"] + 20))
            start_qps = auto_start_qps(engine, mean_prompt, cfg)
        name = f"c{context}-{self.arm}-capacity"
        cap = self.bench_qa(context, ["--find-capacity", "--capacity-stage-time",
                                      str(cfg["stage_time"]), "--capacity-max-stages",
                                      str(cfg["capacity_max_stages"]), "--qps",
                                      f"{start_qps:.4f}"], name)["capacity"]
        log(f"   service rate {cap['service_rate_rps']:.3f} req/s; runs at --qps "
            f"{cap['recommended_qps']:.3f}")
        return {"start_qps": start_qps, "capacity": cap}

    def measured_run(self, context: int) -> dict:
        h, cfg = self.h, self.h.cfg
        cap = h.state.get(Phase("capacity", self.arm, context).key)
        qps = cap["capacity"]["recommended_qps"]
        name = f"c{context}-{self.arm}"
        before, kv_before = pc.prometheus(self.vllm.port), self.kvtier_metrics()
        serve_pid = [self.serve.proc.pid] if self.serve is not None else []
        io_before = process_io(self.vllm.proc.pid, serve_pid)
        run = self.bench_qa(context, ["--qps", f"{qps:.4f}", "--time", str(cfg["time"])], name)
        io_after = process_io(self.vllm.proc.pid, serve_pid)
        vd = delta(before, pc.prometheus(self.vllm.port))
        kv_after = self.kvtier_metrics()
        kd = delta(kv_before, kv_after) if kv_after is not None else None
        rows = list(csv.DictReader(open(h.state.logs / f"{name}.csv")))
        ttft = [float(r["ttft"]) for r in rows]
        prompt = sum(int(r["prompt_tokens"]) for r in rows)
        # The time per token after the first: what every engine step costs, decodes included
        # (an arm's step overhead shows here before it shows in TTFT).
        decode = [float(r["generation_time"]) / (int(r["generation_tokens"]) - 1)
                  for r in rows if int(r["generation_tokens"]) > 1]
        context_words, system_words = self.workload(context)
        args = h.args(port=self.vllm.port, system_prompt=system_words)
        shape = pc.prompt_shape(h.state.logs / f"{name}.csv", args)
        shape["shared"] = pc.shared_prefix(self.vllm.port, args, context_words,
                                           shape["first_prompt"])
        measured = {"qps": qps, "service_rate_rps": cap["capacity"]["service_rate_rps"],
                    "requests": len(rows), "prompt_tokens": prompt,
                    "mean_ttft_s": statistics.mean(ttft), "median_ttft_s": statistics.median(ttft),
                    **token_shares(self.arm, prompt, vd, kd, h.bpt),
                    "storage_bytes": storage_bytes(self.arm, vd, kd),
                    "process_io": {k: io_after[k] - io_before[k] for k in io_after},
                    "preemptions": pc.metric(vd, "vllm:num_preemptions_total"),
                    "decode_s_per_token": statistics.median(decode) if decode else None,
                    **connector_costs(vd, len(rows))}
        s = measured["token_share"]
        saved = measured["saved_tokens_per_request"]
        wait = measured["lookup_wait_s_per_request"]
        log(f"   mean TTFT {measured['mean_ttft_s'] * 1e3:.0f} ms, median "
            f"{measured['median_ttft_s'] * 1e3:.0f} ms over {len(rows)} requests; shares "
            + " ".join(f"{k} {pct(v)}" for k, v in s.items())
            + (f"; decode {measured['decode_s_per_token'] * 1e3:.1f} ms a token"
               if decode else "")
            + (f"; {saved:.0f} tokens saved a request" if saved is not None else "")
            + (f"; lookups held the scheduler {wait * 1e3:.2f} ms a request, "
               f"{measured['lookups_deferred']:.0f} deferred" if wait is not None else ""))
        return {"measured": measured, "prompt_shape": shape,
                "words": {"context": context_words, "system": system_words},
                "bench_qa": run.get("summary")}


def connector_costs(vd: dict, requests: int) -> dict:
    """What kvtier's connector cost over the run, from its counters: the tokens it saved per
    request (about a turn's new tokens, unless chunks kvtier holds already are copied out of the
    GPU again), the scheduler loop's wait on lookups per request (every running request's step
    waits with it) and the steps requests sat out because their lookup was not answered in time
    (each such request waits a step). None for an arm without the connector; vLLM shows a
    counter only once it is non-zero, so a connector that saved nothing has no saved series."""
    saved = "vllm:kvtier_tokens_saved_total"
    lookups = has_series(vd, "vllm:kvtier_lookups_total") and requests > 0
    return {"saved_tokens_per_request": (pc.metric(vd, saved) / requests
                                         if has_series(vd, saved) and requests else None),
            "lookup_wait_s_per_request": (pc.metric(vd, "vllm:kvtier_lookup_wait_us_total")
                                          / 1e6 / requests if lookups else None),
            "lookups_deferred": (pc.metric(vd, "vllm:kvtier_lookups_deferred_total")
                                 if lookups else None)}


def pct(v) -> str:
    return "n/m" if v is None else f"{v * 100:.0f}%"


# --- predictions and results ---------------------------------------------------------------------

def arm_tiers(arm: str, cfg: dict, tiers: dict) -> tuple[list[str], str | None]:
    """`kvtier plan --tier` values and eviction policy of an arm's tiers, as measured."""
    cpu = lambda gb: f"cpu:{int(gb * 1e9)}B:{tiers['cpu_GBps']:.3f}GB/s"  # noqa: E731
    disk = (f"disk:{int(cfg['disk_gb'] * 1e9)}B:{tiers['disk_read_GBps']:.3f}GB/s:"
            f"{tiers['disk_write_GBps']:.3f}GB/s")
    if arm == "native":  # vLLM's CPU tier evicts least recently used blocks
        return [cpu(cfg["cpu_gb"])], "lru"
    if arm == "tiering":
        return [cpu(cfg["tiering_cpu_gb"]), disk], "lru"
    return [cpu(cfg["cpu_gb"]), disk], None


def predict(h: Harness, arm: str, context: int) -> dict:
    cfg = h.cfg
    engine = h.state.get(engine_key(arm, cfg["engine_table"]))
    cap = h.state.get(Phase("capacity", arm, context).key)
    run = h.state.get(Phase("run", arm, context).key)
    kv = engine["kv_cache"]
    blocks = kv["blocks"] or cfg["kv_cache_bytes"] // (kv["block_tokens"] * h.bpt)
    args = h.args(vllm_blocks=blocks, block_tokens=kv["block_tokens"],
                  write_policy="write_through", start_qps=cap["start_qps"],
                  system_prompt=run["words"]["system"])
    tiers, eviction = arm_tiers(arm, cfg, h.state.get("tiers"))
    # kvtier's connector loads only what pays unless told otherwise (read as the connector
    # reads the key); vLLM's loads every hit.
    extra = json.loads(cfg["kvtier_extra"]) if cfg["kvtier_extra"] else {}
    connector = parse_config({k: v for k, v in extra.items() if k in (
        "kvtier.cost_aware", "kvtier.prefetch", "kvtier.prefetch_fraction")})
    cost_aware = arm in KVTIER_ARMS and connector.cost_aware
    prefetch = (connector.prefetch_fraction
                if arm in KVTIER_ARMS and (connector.prefetch or arm == "prefetch") else None)
    out = {}
    for name, qps in (("at_qps", run["measured"]["qps"]), ("at_load", None)):
        try:
            out[name] = pc.plan(h.kvtier, args, engine, tiers, run["words"]["context"],
                                run["prompt_shape"], qps, arm != "none", eviction, cost_aware,
                                prefetch)
        except RuntimeError as e:
            out[name] = {"error": str(e)[-2000:]}
    return out


def assemble(h: Harness, arms, contexts) -> dict:
    rows = []
    for arm in arms:
        for c in contexts:
            cap = h.state.get(Phase("capacity", arm, c).key)
            run = h.state.get(Phase("run", arm, c).key)
            if not cap:
                continue
            row = {"context_tokens": c, "arm": arm, "capacity": cap["capacity"],
                   "start_qps": cap["start_qps"]}
            if run:
                pred = h.state.get(f"c{c}-{arm}-plan")
                if pred is None and h.state.get(engine_key(arm, h.cfg["engine_table"])):
                    pred = predict(h, arm, c)
                    h.state.put(f"c{c}-{arm}-plan", pred)
                pred = pred or {}
                row.update(measured=run["measured"], prompt_shape=run["prompt_shape"],
                           words=run["words"], predicted=pred,
                           errors=errors(run["measured"], pred))
            if run and arm != "none" and h.state.get(Phase("run", "none", c).key):
                row["paired_vs_none"] = paired(h.state.logs / f"c{c}-none.csv",
                                               h.state.logs / f"c{c}-{arm}.csv")
            rows.append(row)
    return {"rows": rows, "skipped": {a: h.state.get(f"skip-{a}")["reason"] for a in arms
                                      if h.state.get(f"skip-{a}")}}


def paired(baseline_csv: Path, arm_csv: Path) -> dict | None:
    """An arm's TTFT against the baseline's, turn by turn: the same users send the same turns in
    both runs, so the difference of each (user, question) pair cancels what the turns differ in
    (context length, vLLM's own hits), and its spread gives the mean difference a standard error
    (a few percent between two runs of one arm is noise, not a cost). None without two pairs."""
    def ttfts(path: Path) -> dict:
        with open(path) as f:
            return {(r["user_id"], r["question_id"]): float(r["ttft"]) for r in csv.DictReader(f)}
    try:
        base, arm = ttfts(baseline_csv), ttfts(arm_csv)
    except (OSError, KeyError, ValueError):
        return None
    pairs = sorted(base.keys() & arm.keys())
    if len(pairs) < 2:
        return None
    diffs = [arm[k] - base[k] for k in pairs]
    base_mean = statistics.fmean(base[k] for k in pairs)
    return {"pairs": len(pairs), "mean_diff_s": statistics.fmean(diffs),
            "stderr_s": statistics.stdev(diffs) / len(diffs) ** 0.5,
            "ratio": statistics.fmean(arm[k] for k in pairs) / base_mean if base_mean else None}


def errors(measured: dict, predictions: dict | None) -> dict | None:
    """Predicted against measured: mean TTFT and capacity as a ratio less 1, token shares in
    points (None where either side has no figure)."""
    predicted = (predictions or {}).get("at_qps")
    if not predicted or "error" in predicted:
        return None
    at_load = predictions.get("at_load") or {}
    out = {"mean_ttft": predicted["mean_ttft_s"] / measured["mean_ttft_s"] - 1,
           "service_rate": at_load["service_rate_rps"] / measured["service_rate_rps"] - 1
           if "service_rate_rps" in at_load else None}
    for k, v in measured["token_share"].items():
        if k in ("gpu", "cpu", "disk", "recompute"):
            p = predicted.get("token_share", {}).get(k, 0.0)
            out[f"{k}_share_points"] = None if v is None else (p - v) * 100
    return out


def print_table(result: dict) -> None:
    print(f"\n{'context':>8} {'arm':>8} {'cap r/s':>8} {'qps':>7} {'TTFT mean':>10} "
          f"{'median':>7} {'pred':>7} {'err':>6} {'gpu m/p':>9} {'cpu m/p':>9} {'disk m/p':>9} "
          f"{'recomp m/p':>10} {'written':>9} {'read':>9} {'dec/tok':>8} {'saved/req':>9}")
    for r in result["rows"]:
        if "measured" not in r:
            print(f"{r['context_tokens']:>8} {r['arm']:>8} "
                  f"{r['capacity']['service_rate_rps']:>8.3f} (run not done yet)")
            continue
        m, p = r["measured"], r["predicted"].get("at_qps") or {}
        ps = p.get("token_share", {})
        share = lambda k: (f"{pct(m['token_share'][k])}/"  # noqa: E731
                           f"{pct(ps.get(k, 0.0)) if ps else '-'}")
        gb = lambda v: "n/m" if v is None else f"{v / 1e9:.2f}GB"  # noqa: E731
        pred = f"{p['mean_ttft_s'] * 1e3:.0f}ms" if "mean_ttft_s" in p else "-"
        err = f"{r['errors']['mean_ttft']:+.0%}" if r.get("errors") else "-"
        # Rows measured before these two were recorded have neither.
        dec = (f"{m['decode_s_per_token'] * 1e3:.1f}ms"
               if m.get("decode_s_per_token") is not None else "-")
        saved = (f"{m['saved_tokens_per_request']:.0f}"
                 if m.get("saved_tokens_per_request") is not None else "-")
        print(f"{r['context_tokens']:>8} {r['arm']:>8} {m['service_rate_rps']:>8.3f} "
              f"{m['qps']:>7.3f} {m['mean_ttft_s'] * 1e3:>8.0f}ms "
              f"{m['median_ttft_s'] * 1e3:>5.0f}ms {pred:>7} {err:>6} {share('gpu'):>9} "
              f"{share('cpu'):>9} {share('disk'):>9} {share('recompute'):>10} "
              f"{gb(m['storage_bytes']['written']):>9} {gb(m['storage_bytes']['read']):>9} "
              f"{dec:>8} {saved:>9}")
    for r in result["rows"]:
        pv = r.get("paired_vs_none")
        if pv:
            ratio = f" ({pv['ratio'] - 1:+.1%})" if pv["ratio"] is not None else ""
            print(f"{r['context_tokens']:>8} {r['arm']:>8}: {pv['mean_diff_s'] * 1e3:+.1f} ms "
                  f"+- {pv['stderr_s'] * 1e3:.1f} ms a turn against no offload{ratio}, paired "
                  f"over {pv['pairs']} turns")
    for arm, reason in result["skipped"].items():
        print(f"{arm}: skipped: {reason}")
    print("m/p: measured / predicted share of prompt tokens; n/m: not measured (this vLLM does "
          "not tell); written/read: the arm's storage tier over the run; dec/tok: median time per "
          "token after the first; saved/req: tokens the connector saved per request")


# --- the command ---------------------------------------------------------------------------------

def settings(args, state: State, parser) -> dict:
    """The run's settings: those stored by the first command on this state, else the flags and
    the defaults. A flag that differs from what is stored is refused: the results of one state
    must come from one setup. Contexts and arms may change between commands (they choose the
    work, and the results are kept per context and arm)."""
    path = state.root / "config.json"
    stored = json.loads(path.read_text()) if path.exists() else None
    cfg = {}
    for k, default in SETTINGS.items():
        given = getattr(args, k)
        if stored is not None and given is not None and given != stored.get(k):
            parser.error(f"--{k.replace('_', '-')} {given}: the state in {state.root} was "
                         f"started with {stored.get(k)}; give a new --state to change it")
        # A setting newer than the state is the default it ran with.
        cfg[k] = stored.get(k, default) if stored is not None else (
            given if given is not None else default)
    if stored is None:
        write_json(path, cfg)
    return cfg


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvtier.bench.multiround",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--state", type=Path, required=True,
                   help="the run's directory: settings, finished phases, logs, results")
    p.add_argument("--budget-s", type=float, default=None,
                   help="stop before a phase that cannot finish within this many seconds of "
                   "the command's start (exit status 3: run the same command again)")
    p.add_argument("--contexts", default=None, help="per-user context, tokens (default: the "
                   f"previous command's on this state, else {FULL_CONTEXTS})")
    p.add_argument("--arms", default=None, help=f"of {', '.join(ARMS)} (default: the previous "
                   "command's on this state, else all)")
    p.add_argument("--retry-skipped", action="store_true",
                   help="try again the arms an earlier command recorded as skipped")
    p.add_argument("--kvtier", default=os.environ.get("KVTIER_BINARY")
                   or shutil.which("kvtier") or "kvtier")
    s = p.add_argument_group("settings (kept in STATE/config.json by the first command; a rerun "
                             "may leave them out)")
    kinds = {bool: None, type(None): str}
    for k, default in SETTINGS.items():
        flag = "--" + k.replace("_", "-")
        if isinstance(default, bool):
            s.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                           help=f"default {default}")
        else:
            s.add_argument(flag, type=kinds.get(type(default), type(default)), default=None,
                           help=f"default {default}")
    args = p.parse_args(argv)
    state = State(args.state.resolve())
    cfg = settings(args, state, p)
    args.contexts, args.arms = selection(state, args.contexts, args.arms)
    contexts = [vllm_ttft.parse_tokens(c) for c in args.contexts.split(",")]
    arms = [a for a in args.arms.split(",") if a]
    if any(a not in ARMS for a in arms):
        p.error(f"--arms takes {', '.join(ARMS)}")
    if cfg["engine_table"] not in ("per-arm", "once"):
        p.error("--engine-table takes per-arm or once")
    if args.retry_skipped:
        for a in arms:
            (state.phases / f"skip-{a}.json").unlink(missing_ok=True)

    model = Path(cfg["model"]) if cfg["model"] else state.root / "model"
    if not (model / "config.json").exists():
        if cfg["model_config"] == "tiny":
            tokenizer = Path(cfg["tokenizer"] or os.environ.get("KVTIER_VLLM_MODEL",
                                                                "/tmp/kvtier-tiny-model"))
            model.mkdir(parents=True, exist_ok=True)
            for f in tokenizer.glob("tokenizer*"):
                shutil.copy(f, model)
            (model / "config.json").write_text(json.dumps(pc.MODEL_CONFIG))
        else:
            vllm_ttft.make_model(model, cfg["model_config"], weights=False)

    budget = Budget(args.budget_s, state, cfg)
    h = Harness(cfg, state, budget, args.kvtier)
    cut = shortened(cfg, args.contexts.split(","), arms)
    log("workload: " + ", ".join(f"{k} {cfg[k]}" for k in ("users", "rounds", "system_prompt",
                                                           "answer_tokens"))
        + f", contexts {args.contexts} tokens; GPU KV cache capped at {cfg['kv_cache_bytes']:,} "
        f"bytes; CPU tiers {cfg['cpu_gb']} GB; "
        + ("--enforce-eager" if cfg["enforce_eager"] else "CUDA graphs (no --enforce-eager)"))
    log("shortened from the full experiment: " + ("; ".join(cut) if cut else "nothing"))

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    h.children.stop_leftovers()
    complete = True
    rc = 0
    try:
        todo = pending(state, arms, contexts, cfg["engine_table"])
        log(f"{len(todo)} phases to run" + (f" within {args.budget_s:.0f} s"
                                            if args.budget_s else ""))
        if todo and todo[0].kind == "tiers" and not budget.allows(todo[0], False)[0]:
            log(f"stopping: the tiers' measurement needs about {budget.estimate('tiers'):.0f} s, "
                f"{budget.left():.0f} s left")
            todo, complete = [], False
        if todo and todo[0].kind == "tiers":
            start = time.monotonic()
            tiers = h.tiers()
            tiers.update(kind="tiers", seconds=time.monotonic() - start)
            state.put("tiers", tiers)
            log(f"tiers: cpu {tiers['cpu_GBps']:.2f} GB/s ({tiers['cpu_source']}), disk read "
                f"{tiers['disk_read_GBps']:.2f} write {tiers['disk_write_GBps']:.2f} GB/s; vLLM "
                f"{tiers['vllm']} on {tiers['device']}")
            todo = todo[1:]
        for arm in arms:
            phases = [ph for ph in todo if ph.arm == arm]
            if phases and not h.run_arm(arm, phases):
                complete = False
                break
    except OutOfTime as e:
        log(f"stopped: {e}; the phase is not recorded, run the same command again")
        complete = False
    finally:
        result = assemble(h, arms, contexts)
        result.update(settings=cfg, contexts=contexts, arms=arms, shortened=cut,
                      tiers=state.get("tiers"), calibration=state.get("calibration"),
                      engines={a: state.get(engine_key(a, cfg["engine_table"])) for a in arms})
        write_json(state.root / "results.json", result)
        h.close()
    print_table(result)
    left = pending(state, arms, contexts, cfg["engine_table"])
    if left or not complete:
        log(f"{len(left)} phases left: {', '.join(ph.key for ph in left)}")
        rc = EXIT_MORE_TO_DO
    else:
        log(f"all done; results in {state.root / 'results.json'}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
