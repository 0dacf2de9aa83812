"""KvtierConnector inside real vLLM (CPU build): answers, reuse, faults and preemption.

Every vLLM here serves the same tiny model with the same dummy weights (vLLM seeds them), so a
prefix cached by one instance is valid in another, and greedy answers can be compared with a
vLLM that runs without any connector.
"""

from __future__ import annotations

import json
import re
import signal
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import (EventStream, KvtierServer, Vllm, assert_kvtier_names_vllms_blocks,
                      connector_config, kvtier_has_kv_events, random_prompt)

LONG = random_prompt(1, 2000)
PROMPTS = [random_prompt(100 + i, n) for i, n in enumerate((300, 700, 1030, 1500, 260, 2100))]


def transfer_metric(vllm: Vllm, name: str, timeout: float = 25.0, at_least: int = 1) -> int:
    """Sum of a connector counter over vLLM's periodic "KV Transfer metrics" log lines, waited
    for until it reaches `at_least` (or `timeout` passes)."""
    deadline = time.monotonic() + timeout
    while True:
        total = sum(int(m) for m in re.findall(rf"KV Transfer metrics:.*?\b{name}=(\d+)",
                                                vllm.log()))
        if total >= at_least or time.monotonic() > deadline:
            return total
        time.sleep(1)


def kvtier_counter(vllm: Vllm, name: str) -> float:
    """A connector counter as vLLM's Prometheus /metrics has it now."""
    metrics = urllib.request.urlopen(vllm.url + "/metrics", timeout=10).read().decode()
    return sum(float(v) for v in re.findall(rf"^vllm:kvtier_{name}_total{{[^}}]*}} (\S+)$",
                                            metrics, re.M))


def wait_for_counter(vllm: Vllm, name: str, at_least: float, timeout: float = 30) -> float:
    deadline = time.monotonic() + timeout
    while (value := kvtier_counter(vllm, name)) < at_least and time.monotonic() < deadline:
        time.sleep(0.5)
    return value


def reconnect(vllm: Vllm, server: KvtierServer) -> None:
    """After a server restart: the connector notices the lost connection on its next use (that
    request is a miss) and reconnects in the background."""
    deadline = time.monotonic() + 30
    seed = 1000
    while len(server.stats().get("clients", [])) < 2:
        assert time.monotonic() < deadline, "the connector did not reconnect"
        vllm.complete(random_prompt(seed, 300), max_tokens=2)
        seed += 1
        time.sleep(1)


def kvtier_hits(server: KvtierServer, tier: str | None = None) -> int:
    """Chunks kvtier serve delivered to loads, from one tier or from all."""
    tiers = server.stats()["tiers"]
    return sum(t.get("served", 0) for name, t in tiers.items() if tier in (None, name))


@pytest.fixture(scope="module")
def expected(baseline):
    answers = {i: baseline.complete(p) for i, p in enumerate(PROMPTS)}
    answers["batch"] = baseline.complete_batch(PROMPTS)
    answers["long"] = baseline.complete(LONG)
    answers["long2"] = baseline.complete(LONG[:1500] + random_prompt(7, 400))
    answers["first_block"] = baseline.complete(LONG[:128] + random_prompt(11, 300))
    return answers


def test_server_mode_two_instances_and_faults(workdir: Path, expected, tmp_path):
    """Also: the connector describes its saves and the first server publishes KV-cache events
    (kvtier serve --kv-events, where kvtier was built with them): kvtier's CPU BlockStored name
    the prompt's full chunks by vLLM's own hashes, as vLLM's events publish them."""
    import zmq

    l2 = workdir / "server-l2"
    events = kvtier_has_kv_events(tmp_path)
    ipc = f"ipc://{tmp_path}"
    server = KvtierServer(workdir, l2, extra_args=[
        "--kv-events", "--kv-events-endpoint", f"{ipc}/kvtier", "--kv-events-replay-endpoint",
        f"{ipc}/kvtier-replay", "--kv-events-batch-ms", "5"] if events else [])
    # The later servers (restarts) run without --kv-events: they take descriptors and ignore them.
    cfg = connector_config(**{"kvtier.socket": server.socket, "kvtier.rpc_timeout_ms": 2000,
                              "kvtier.kv_events": "describe"})
    a = Vllm(workdir, "server-a", cfg, extra_args=["--kv-events-config", json.dumps(
        {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"{ipc}/vllm",
         "replay_endpoint": f"{ipc}/vllm-replay"})] if events else [])
    b = None
    ctx = zmq.Context()
    streams = ()
    try:
        if events:
            streams = (EventStream(ctx, f"{ipc}/kvtier", f"{ipc}/kvtier-replay"),
                       EventStream(ctx, f"{ipc}/vllm", f"{ipc}/vllm-replay"))
        # Identical greedy answers with the connector, for a batch sent at once...
        assert a.complete_batch(PROMPTS) == expected["batch"]
        # ...and now that kvtier holds their prefixes, one at a time from kvtier.
        a.reset_prefix_cache()
        for i, p in enumerate(PROMPTS):
            assert a.complete(p) == expected[i]

        # Same prompt after vLLM dropped its own prefix cache: the prefix comes from kvtier.
        assert a.complete(LONG) == expected["long"]
        a.reset_prefix_cache()
        hits_before = kvtier_hits(server)
        assert a.complete(LONG) == expected["long"]
        assert kvtier_hits(server) >= hits_before + 1999 // 256
        assert transfer_metric(a, "tokens_loaded") >= 1792
        # Every saved chunk described, from the scheduler's background thread, none dropped.
        assert transfer_metric(a, "chunks_described", at_least=1999 // 256) >= 1999 // 256
        assert transfer_metric(a, "describes_dropped", timeout=0) == 0
        if streams:
            assert_kvtier_names_vllms_blocks(*streams, [LONG] + PROMPTS, 256)
            for stream in streams:
                stream.close()
            streams = ()

        # vLLM holds the prompt's first 128-token block itself (a prompt sharing only that): the
        # first chunk loads around it, leaving the block vLLM shares with that request untouched.
        a.reset_prefix_cache()
        assert a.complete(LONG[:128] + random_prompt(11, 300)) == expected["first_block"]
        assert a.complete(LONG) == expected["long"]

        # A second instance on the same server reuses the first one's prefix.
        b = Vllm(workdir, "server-b", cfg)
        hits_before = kvtier_hits(server)
        assert b.complete(LONG) == expected["long"]
        assert kvtier_hits(server) >= hits_before + 1999 // 256
        assert transfer_metric(b, "tokens_loaded") >= 1792
        b.stop()
        b = None

        # Restart the server (write-back: it flushes L1 on the way out): its L1 is empty, the
        # chunks come from the file tier...
        server.stop()
        server = KvtierServer(workdir, l2)
        reconnect(a, server)
        a.reset_prefix_cache()
        assert a.complete(LONG) == expected["long"]
        assert kvtier_hits(server, "file") >= 1999 // 256
        # ...and once every chunk file is corrupt, loads fail their checksum and vLLM recomputes.
        server.stop()
        corrupted = 0
        for f in l2.rglob("*"):
            if f.is_file() and f.stat().st_size > 8192:
                with open(f, "r+b") as fh:
                    fh.seek(f.stat().st_size - 100)
                    fh.write(b"\xff" * 64)
                corrupted += 1
        assert corrupted > 0
        server = KvtierServer(workdir, l2)
        reconnect(a, server)
        a.reset_prefix_cache()
        assert a.complete(LONG) == expected["long"]
        assert a.alive()
        assert server.stats()["tiers"]["file"]["detail"]["corrupt"] > 0

        # The server stalls (stopped, not dead): the client's deadline turns it into misses.
        server.proc.send_signal(signal.SIGSTOP)
        a.reset_prefix_cache()
        t0 = time.monotonic()
        assert a.complete(LONG) == expected["long"]
        assert time.monotonic() - t0 < 30
        server.proc.send_signal(signal.SIGCONT)

        # The server dies mid-run: vLLM keeps answering, correctly, by recomputing.
        server.kill()
        a.reset_prefix_cache()
        assert a.complete(LONG) == expected["long"]
        assert a.complete(PROMPTS[2]) == expected[2]
        assert a.alive()
        assert "Traceback" not in a.log()
    finally:
        for stream in streams:
            stream.close()
        ctx.term()
        if b is not None:
            b.stop()
        a.stop()
        server.stop()


def test_in_process_mode_survives_restart(workdir: Path, expected, tmp_path):
    """Also: the embedded engine publishes kvtier's KV-cache events (docs/kv-events.md) beside
    vLLM's own, on ipc:// endpoints; a subscriber using only vLLM's schema finds that kvtier's
    CPU BlockStored name the prompt's full chunks by vLLM's own hashes of the same blocks (where
    kvtier was built with KV-cache events: libzmq and msgpack-cxx, scripts/install-deps.sh)."""
    import zmq

    l2 = workdir / "in-process-l2"
    cfg = connector_config(**{"kvtier.l1_size_gb": 0.25, "kvtier.l2": {"type": "fs",
                                                                     "path": str(l2)}})
    first_cfg, extra_args, streams = cfg, [], None
    if kvtier_has_kv_events(tmp_path):
        kv_events = {"endpoint": f"ipc://{tmp_path}/kvtier", "replay_endpoint":
                     f"ipc://{tmp_path}/kvtier-replay", "batch_ms": 5}
        vllm_events = {"enable_kv_cache_events": True, "publisher": "zmq",
                       "endpoint": f"ipc://{tmp_path}/vllm", "replay_endpoint":
                       f"ipc://{tmp_path}/vllm-replay"}
        first_cfg = connector_config(**cfg["kv_connector_extra_config"],
                                     **{"kvtier.kv_events": kv_events})
        extra_args = ["--kv-events-config", json.dumps(vllm_events)]
    c = Vllm(workdir, "in-process-1", first_cfg, extra_args=extra_args)
    ctx = zmq.Context()
    try:
        if extra_args:
            streams = (EventStream(ctx, kv_events["endpoint"], kv_events["replay_endpoint"]),
                       EventStream(ctx, vllm_events["endpoint"], vllm_events["replay_endpoint"]))
        assert c.complete(LONG) == expected["long"]
        if streams:
            assert_kvtier_names_vllms_blocks(*streams, [LONG], 256)
        c.reset_prefix_cache()
        assert c.complete(LONG) == expected["long"]
        assert transfer_metric(c, "tokens_loaded") >= 1792
        if streams:
            assert transfer_metric(c, "chunks_described", at_least=1999 // 256) >= 1999 // 256
    finally:
        for stream in streams or ():
            stream.close()
        ctx.term()
        c.stop()  # write-back: the engine flushes its chunks to the file tier on shutdown
    assert any(f.is_file() for f in l2.rglob("*"))
    c = Vllm(workdir, "in-process-2", cfg)
    try:
        assert c.complete(LONG) == expected["long"]
        assert transfer_metric(c, "tokens_loaded") >= 1792
        # A prompt sharing 1,500 tokens: the shared full chunks come back, the rest is computed.
        assert c.complete(LONG[:1500] + random_prompt(7, 400)) == expected["long2"]
        assert "Traceback" not in c.log()
    finally:
        c.stop()


def test_preempted_requests_resume_from_kvtier(workdir: Path, baseline):
    # 48 blocks of 128 tokens. Every version admits all eight prompts (5 blocks each, 40 in
    # all), and their answers then need twice that: decoding runs out of blocks whatever the
    # step timing, so vLLM preempts. (Six 1,100-token prompts with 200-token answers were
    # preempted once per run on vLLM 0.32, and not at all on 0.26.)
    prompts = [random_prompt(300 + i, 600) for i in range(8)]
    want = [baseline.complete(p, max_tokens=600) for p in prompts]
    server = KvtierServer(workdir, None, l1_size_gb=0.5)
    d = Vllm(workdir, "preempt", connector_config(**{"kvtier.socket": server.socket}),
             extra_args=["--num-gpu-blocks-override", "48", "--block-size", "128",
                         "--max-num-seqs", "8"])
    try:
        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(lambda p: d.complete(p, max_tokens=600), prompts))
        log = d.log()
        preemptions = len(re.findall(r"preempt", log, re.IGNORECASE))
        resumed = re.findall(r"preempted request \S+ resumes with (\d+) tokens from kvtier", log)
        assert got == want
        assert resumed, f"no preempted request resumed from kvtier ({preemptions} preemption " \
                        f"mentions in the log)"
    finally:
        d.stop()
        server.stop()


def scheduler_pins(server: KvtierServer) -> int:
    return sum(c["pins"] for c in server.stats()["clients"] if c["name"] == "vllm-scheduler")


def assert_pins_released(vllm: Vllm, server: KvtierServer, seed: int) -> None:
    """The scheduler's pins go once later steps have run (a few short requests make them)."""
    deadline = time.monotonic() + 30
    while scheduler_pins(server) > 0:
        assert time.monotonic() < deadline, "the scheduler's pins were never released"
        vllm.complete(random_prompt(seed, 20), max_tokens=4)
        seed += 1


class Thrasher:
    """Another client of the same server storing new chunks as fast as it can, so that L1 evicts
    all the time (between a lookup and its load, too)."""

    def __init__(self, socket: str):
        import threading

        import kvtier

        ns = kvtier.KeyNamespace("thrasher")
        self._client = kvtier.connect(ns, 0, socket_path=socket)
        self._root = ns.root()
        self._stop = threading.Event()
        self.stored = 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import kvtier

        i = 0
        while not self._stop.is_set():
            keys = [kvtier.chain_chunk_key(self._root, [i, j]) for j in range(4)]
            i += 1
            slots = self._client.reserve_slots(keys)
            self._client.commit_slots(keys[:len(slots)], list(slots))
            self.stored += sum(1 for s in slots if s >= 0)

    def stop(self) -> None:
        if not self._stop.is_set():
            self._stop.set()
            self._thread.join(30)
            self._client.close()


def test_layerwise_loads_within_the_step(workdir: Path, expected):
    """The layer-wise path (the default for L1 hits on a CUDA KV cache), forced on vLLM's CPU
    build (which schedules synchronously; vLLM's asynchronous scheduling on a GPU is exercised
    by kvtier.bench.vllm_ttft): hits are pinned by the scheduler's lookup and copied
    layer by layer inside the step that schedules them (no wait between steps), answers
    unchanged, even while another client makes L1 evict all the time (a pinned chunk cannot go
    between the lookup and the copy: no load error); the pins are released once the step has
    run; kvtier serve killed between store and hit: vLLM recomputes and keeps serving."""
    server = KvtierServer(workdir, None, l1_size_gb=0.25)
    cfg = connector_config(**{"kvtier.socket": server.socket, "kvtier.load_mode": "layerwise"})
    c = Vllm(workdir, "layerwise", cfg)
    thrasher = None
    try:
        assert c.complete(LONG) == expected["long"]
        c.reset_prefix_cache()
        assert c.complete(LONG) == expected["long"]
        assert transfer_metric(c, "layerwise_loads") >= 1
        assert transfer_metric(c, "tokens_loaded") >= 1792
        assert_pins_released(c, server, 3000)
        thrasher = Thrasher(server.socket)
        for _ in range(3):
            c.reset_prefix_cache()
            assert c.complete(LONG[:1500] + random_prompt(7, 400)) == expected["long2"]
            c.complete(LONG[:1500] + random_prompt(7, 400))  # stored again if evicted
        thrasher.stop()
        assert thrasher.stored > 0
        assert transfer_metric(c, "load_errors", timeout=2) == 0
        assert "Traceback" not in c.log()
        server.kill()
        c.reset_prefix_cache()
        assert c.complete(LONG) == expected["long"]
        assert "Traceback" not in c.log()
    finally:
        if thrasher is not None:
            thrasher.stop()
        c.stop()
        server.stop()


def send_and_abandon(vllm: Vllm, prompt: list[int], after_s: float) -> None:
    """A completion request whose client goes away after `after_s`: vLLM aborts it."""
    import http.client
    import json

    conn = http.client.HTTPConnection("127.0.0.1", vllm.port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps(
        {"model": "tiny", "prompt": prompt, "max_tokens": 64, "temperature": 0,
         "ignore_eos": True, "stream": True}), {"Content-Type": "application/json"})
    time.sleep(after_s)
    conn.sock.close()
    conn.close()


@pytest.mark.parametrize("load_mode", ["async", "layerwise"])
def test_requests_aborted_during_their_load(workdir: Path, expected, load_mode):
    """Requests whose client goes away while kvtier is looking their prefix up or loading it
    (the server stalled meanwhile, so that the lookup or the load is still under way at the
    abort, at one of several moments): vLLM keeps serving, every pin is released, and the same
    prefix is loaded right afterwards with the right answer."""
    server = KvtierServer(workdir, workdir / f"l2-abort-{load_mode}")
    cfg = connector_config(**{"kvtier.socket": server.socket, "kvtier.load_mode": load_mode})
    c = Vllm(workdir, f"abort-{load_mode}", cfg)
    try:
        assert c.complete(LONG) == expected["long"]
        for delay in (0.0, 0.02, 0.1, 0.3):
            c.reset_prefix_cache()
            send_and_abandon(c, LONG, delay)
            server.proc.send_signal(signal.SIGSTOP)
            time.sleep(0.5)
            server.proc.send_signal(signal.SIGCONT)
        time.sleep(1)
        assert c.alive()
        c.reset_prefix_cache()
        assert c.complete(LONG) == expected["long"]
        assert c.complete(PROMPTS[0]) == expected[0]
        assert_pins_released(c, server, 5000)  # aborted requests' pins too
        assert c.alive() and "EngineDeadError" not in c.log()
    finally:
        server.proc.send_signal(signal.SIGCONT)
        c.stop()
        server.stop()


def store_on_the_file_tier(workdir: Path, l2: Path, expected) -> None:
    """LONG's prefix stored through a vLLM into kvtier serve's file tier in `l2` (write-back:
    the server's stop drains L1 to it)."""
    server = KvtierServer(workdir, l2)
    try:
        plain = Vllm(workdir, "file-store", connector_config(**{"kvtier.socket": server.socket}))
        try:
            assert plain.complete(LONG) == expected["long"]
        finally:
            plain.stop()
    finally:
        server.stop()


def test_cost_aware_lookups_load_only_what_pays(workdir: Path, expected):
    """A prefix only on the file tier (kvtier serve restarted with an empty L1): with a prefill
    table that makes computing it dearer than reading it, it is loaded, and the file tier's
    reads are predicted and measured; with one that makes computing it almost free, it is
    declined (counted) and recomputed. The answers are vLLM's own either way."""
    l2 = workdir / "l2-cost"
    store_on_the_file_tier(workdir, l2, expected)
    for table, loads in (("4096:1000", True), ("4096:0.000001", False)):
        server = KvtierServer(workdir, l2)  # an empty L1: the prefix is on the file tier only
        cfg = connector_config(**{"kvtier.socket": server.socket, "kvtier.prefill_table": table})
        c = Vllm(workdir, f"cost-{'load' if loads else 'decline'}", cfg)
        try:
            assert c.complete(LONG) == expected["long"]
            if loads:
                assert transfer_metric(c, "tokens_loaded") >= 1792
                assert transfer_metric(c, "file_read_us") > 0
                assert transfer_metric(c, "file_read_predicted_us") > 0
            else:
                assert transfer_metric(c, "tokens_declined") >= 1792
                assert transfer_metric(c, "tokens_loaded", timeout=2) == 0
        finally:
            c.stop()
            server.stop()


def test_cost_aware_lookups_learn_a_slowed_tier_and_decline_it(workdir: Path, expected):
    """The same prefix on the file tier only, read by one vLLM three times, kvtier serve
    restarted with an empty L1 before each: from the disk as it is (fast: loaded); then capped
    at 8 MB/s ("read_limit_gbps"), which the estimate learned from the fast disk does not know:
    loaded, slowly, and measured; then, still capped, declined (recomputing ~2,000 tokens is
    predicted at 0.3 s, reading 7 MiB at the rate measured at about 0.5 s). One slow load
    corrects the estimate; the answers are vLLM's own every time. The capped servers' load
    deadline (0.6 s) is shorter than the slow load's 0.9 s of reading: one request for the
    prefix would lose its tail to it, the connector's batches (prefix_loader) lose nothing."""
    l2 = workdir / "l2-slowed"
    store_on_the_file_tier(workdir, l2, expected)
    server = KvtierServer(workdir, l2)
    cfg = connector_config(**{"kvtier.socket": server.socket, "kvtier.prefill_table": "4096:0.6"})
    c = Vllm(workdir, "slowed", cfg)
    try:
        loaded = declined = 0
        for cap, loads in ((None, True), (0.008, True), (0.008, False)):
            if cap is not None:  # a new server on the same directory: an empty L1
                server.stop()
                server = KvtierServer(workdir, l2, l2_extra={"read_limit_gbps": cap},
                                      extra_args=["--load-deadline-ms", "600"])
                reconnect(c, server)
            c.reset_prefix_cache()
            assert c.complete(LONG) == expected["long"]
            if loads:
                loaded += 1792
                assert transfer_metric(c, "tokens_loaded", 30, at_least=loaded) >= loaded
                assert transfer_metric(c, "load_errors", timeout=0) == 0
                assert server.stats()["engine"]["deadline_misses"] == 0
            else:
                declined += 1792
                assert transfer_metric(c, "tokens_declined", 30, at_least=declined) >= declined
        assert transfer_metric(c, "tokens_loaded", timeout=0) < loaded + 1792  # no third load
        assert "Traceback" not in c.log()
    finally:
        c.stop()
        server.stop()


def test_cost_aware_lookups_learn_the_engines_prefill_time(workdir: Path, expected):
    """A prefill table 1,000x too slow for this machine ("4096:1000": recomputing LONG's prefix
    would take some 440 s) would load a prefix from a tier capped at 8 MB/s (7 MiB: about 0.9
    s), as test_cost_aware_lookups_load_only_what_pays shows. The workers time the prefills
    vLLM runs (three new prompts of 1,500 tokens), the table is scaled to what they took, and
    the capped file tier's hit is declined and recomputed; the recompute puts its chunks back
    into L1, so the same prefix next time is a memory hit. The decision and the timings are on
    vLLM's Prometheus /metrics too."""
    l2 = workdir / "l2-learn"
    store_on_the_file_tier(workdir, l2, expected)
    server = KvtierServer(workdir, l2, l2_extra={"read_limit_gbps": 0.008})
    cfg = connector_config(**{"kvtier.socket": server.socket, "kvtier.prefill_table": "4096:1000",
                              "kvtier.file_read_gbps": 0.008})
    c = Vllm(workdir, "learn", cfg)
    try:
        for seed in range(3):
            c.complete(random_prompt(300 + seed, 1500), max_tokens=1)
        steps = transfer_metric(c, "prefill_steps", 30, at_least=3)
        assert steps >= 3
        measured = transfer_metric(c, "prefill_measured_us", timeout=0)
        predicted = transfer_metric(c, "prefill_predicted_us", timeout=0)
        # Each timed step is a real forward pass of >= 512 tokens: milliseconds, not the
        # microseconds of a timer that missed it.
        assert 2000 * steps < measured < predicted / 100, (steps, measured, predicted)
        assert c.complete(LONG) == expected["long"]
        assert transfer_metric(c, "tokens_declined", 30, at_least=1792) >= 1792
        assert transfer_metric(c, "tokens_loaded", timeout=0) == 0
        # The recompute saved the declined chunks into L1 (the store had them on disk only):
        # the conversation's next turn is a memory hit, loaded.
        served_from_memory = kvtier_hits(server, "memory")
        c.reset_prefix_cache()
        assert c.complete(LONG) == expected["long"]
        assert transfer_metric(c, "tokens_loaded", 30, at_least=1792) >= 1792
        assert kvtier_hits(server, "memory") >= served_from_memory + 7
        assert kvtier_counter(c, "tokens_declined") >= 1792
        assert kvtier_counter(c, "prefill_steps") > 0
        assert "Traceback" not in c.log()
    finally:
        c.stop()
        server.stop()


def test_vllms_own_prefix_hit_is_not_saved_again(workdir: Path, expected):
    """vLLM hands the connector a request's whole prefix to save, its own cache's hit included.
    Where kvtier holds that prefix, even on the file tier only (kvtier serve restarted: an empty
    L1), nothing of it is copied out of vLLM again: a returning conversation saves only its new
    chunks, and L1 is not filled with what the file tier has."""
    l2 = workdir / "l2-own-hit"
    server = KvtierServer(workdir, l2)
    c = Vllm(workdir, "own-hit", connector_config(**{"kvtier.socket": server.socket}))
    try:
        assert c.complete(LONG) == expected["long"]
        assert wait_for_counter(c, "chunks_saved", 1999 // 256) >= 1999 // 256
        server.stop()  # write-back: L1 goes to the file tier
        server = KvtierServer(workdir, l2)
        reconnect(c, server)
        time.sleep(2)  # the reconnecting requests' saves
        saved, resident = kvtier_counter(c, "chunks_saved"), server.stats()["pool"]["resident"]
        skipped = kvtier_counter(c, "saves_skipped")
        # vLLM's own cache has LONG: kvtier's file tier has it too, nothing is saved.
        assert c.complete(LONG) == expected["long"]
        # The next turn: LONG and 300 new tokens, one new full chunk, saved; LONG's are not.
        c.complete(LONG + random_prompt(13, 300), max_tokens=2)
        assert wait_for_counter(c, "chunks_saved", saved + 1) >= saved + 1
        time.sleep(2)
        assert kvtier_counter(c, "chunks_saved") == saved + 1
        assert server.stats()["pool"]["resident"] == resident + 1
        assert kvtier_counter(c, "saves_skipped") >= skipped + 2 * (1999 // 256)
        assert kvtier_hits(server) == 0  # vLLM's own hits: no loads
        assert "Traceback" not in c.log()
    finally:
        c.stop()
        server.stop()


def test_without_a_table_the_models_shape_is_scaled_by_timed_prefills(workdir: Path, expected):
    """The defaults, no prefill table and no read rate: before the workers have timed a
    prefill, the prefill cost's scale is unknown and a hit on a tier capped at 2 MB/s is loaded
    (and its slow read measured); after three timed prefills of 1,500 tokens the model's shape,
    scaled to them, puts recomputing the prefix far below reading it, and the same hit, from an
    empty L1 again, is declined and recomputed. The answers are vLLM's own every time. Reading
    the prefix at 2 MB/s takes about 3.7 s, some 50x a quiet machine's recompute: the margin
    that a loaded machine's slower prefills (timed as they are) do not use up (at 8 MB/s a
    loaded run once found loading cheaper)."""
    l2 = workdir / "l2-shape"
    store_on_the_file_tier(workdir, l2, expected)
    server = KvtierServer(workdir, l2, l2_extra={"read_limit_gbps": 0.002})
    c = Vllm(workdir, "shape", connector_config(**{"kvtier.socket": server.socket}))
    try:
        assert transfer_metric(c, "prefill_steps", timeout=0) == 0
        assert c.complete(LONG) == expected["long"]
        assert transfer_metric(c, "tokens_loaded", 30, at_least=1792) >= 1792
        assert transfer_metric(c, "tokens_declined", timeout=0) == 0
        for seed in range(3):
            c.complete(random_prompt(400 + seed, 1500), max_tokens=1)
        assert transfer_metric(c, "prefill_steps", 30, at_least=3) >= 3
        server.stop()
        server = KvtierServer(workdir, l2, l2_extra={"read_limit_gbps": 0.002})
        reconnect(c, server)
        c.reset_prefix_cache()
        assert c.complete(LONG) == expected["long"]
        declined = transfer_metric(c, "tokens_declined", 30, at_least=1792)
        assert declined >= 1792, {name: transfer_metric(c, name, timeout=0) for name in (
            "prefill_steps", "prefill_measured_us", "prefill_predicted_us", "file_read_bytes",
            "file_read_us", "tokens_loaded")}
        assert transfer_metric(c, "tokens_loaded", timeout=0) < 2 * 1792
        assert "Traceback" not in c.log()
    finally:
        c.stop()
        server.stop()


def test_a_lost_servers_pool_stays_mapped_a_while(workdir: Path, monkeypatch):
    """The worker's connection keeps a lost server's pool mapped (slots pinned before the loss
    are still read by the step that follows), found by the server's start stamp, and closes it
    once KEEP_LOST_S has passed (the mapping holds the lost pool's memory)."""
    import kvtier
    from kvtier.vllm import store
    from kvtier.vllm.config import ConnectorConfig

    monkeypatch.setattr(store, "KEEP_LOST_S", 0.5)
    server = KvtierServer(workdir, None)
    closed = []
    conn = store.ServerConnection(ConnectorConfig(socket=server.socket), server.socket,
                                  kvtier.KeyNamespace("kept"), 0, "kept-test", 1000,
                                  keep_mappings=True, on_close=closed.append)
    try:
        conn.connect_now()
        client = conn.get()
        stamp = conn.started
        assert client is not None and stamp > 0
        assert conn.client_of_server(stamp) is client
        assert conn.client_of_server(stamp - 5) is None  # another server's stamp
        server.kill()
        deadline = time.monotonic() + 10
        while conn.get() is not None:
            assert time.monotonic() < deadline, "the lost server was not noticed"
            try:
                client.ping()  # a call finds the connection broken
            except kvtier.KvtierError:
                pass
            time.sleep(0.05)
        assert conn.client_of_server(stamp) is client and not client.closed
        assert bytes(client.slot_view(0)[:1]) is not None  # still mapped
        time.sleep(0.6)
        conn.get()  # closes it on a thread of its own (unregistering a pool takes a while)
        assert conn.client_of_server(stamp) is None
        deadline = time.monotonic() + 10
        while closed != [client]:
            assert time.monotonic() < deadline, closed
            time.sleep(0.05)
    finally:
        conn.close()
        server.stop()


def test_a_new_servers_pool_is_prepared_before_the_client_is_handed_out(workdir: Path):
    """on_connect (the worker registers the pool for the GPU's DMA there) runs on the connecting
    thread before get() hands the client out; a client it refuses is dropped, closed and tried
    again later, and get() meanwhile answers None (recompute), never a client half set up."""
    import kvtier
    from kvtier.vllm import store
    from kvtier.vllm.config import ConnectorConfig

    server = KvtierServer(workdir, None)
    seen, closed, refuse = [], [], [True]

    def on_connect(client):
        seen.append(client)
        if refuse[0]:
            raise kvtier.KvtierError("not this one")

    conn = store.ServerConnection(ConnectorConfig(socket=server.socket), server.socket,
                                  kvtier.KeyNamespace("prepared"), 0, "prepared-test", 1000,
                                  on_close=closed.append, on_connect=on_connect)
    try:
        conn.connect_now()
        assert conn.get() is None and len(seen) == 1 and closed == seen
        refuse[0] = False
        deadline = time.monotonic() + 10
        while (client := conn.get()) is None:  # retried in the background
            assert time.monotonic() < deadline, "never connected again"
            time.sleep(0.05)
        assert client is seen[-1] and len(seen) >= 2 and client not in closed
    finally:
        conn.close()
        server.stop()


def test_a_restarted_server_is_connected_to_before_the_next_use(workdir: Path):
    """An idle connection finds a restarted server by itself (a ping every RETRY_SECONDS):
    the first request after a restart is served, not a miss while it reconnects, and on_connect
    (the GPU's pool registration) has already run."""
    import kvtier
    from kvtier.vllm import store
    from kvtier.vllm.config import ConnectorConfig

    server = KvtierServer(workdir, None)
    prepared = []
    conn = store.ServerConnection(ConnectorConfig(socket=server.socket), server.socket,
                                  kvtier.KeyNamespace("watched"), 0, "watched-test", 1000,
                                  on_connect=prepared.append)
    try:
        conn.connect_now()
        first = conn.get()
        assert first is not None and prepared == [first]
        server.kill()
        server = KvtierServer(workdir, None)  # the same socket, a new pool
        deadline = time.monotonic() + 4 * store.RETRY_SECONDS + 5
        while len(prepared) < 2:  # nobody calls get() meanwhile
            assert time.monotonic() < deadline, "the restarted server was not found"
            time.sleep(0.1)
        client = conn.get()
        assert client is prepared[1] and client is not first and client.connected
        client.ping()
    finally:
        conn.close()
        server.stop()


def test_prefetch_holds_the_conversations_expected_back(workdir: Path):
    """kvtier.prefetch under vLLM: three conversations take turns, five rounds each, vLLM's own
    prefix cache emptied before every request so that each return is kvtier's to serve. The
    scheduler learns the finish-to-return gaps from the requests themselves; once eight returns
    have come at a steady pace, it pins the conversations expected back soonest in L1 while
    vLLM runs the others, and the next returns find their prefix held (prefetched_returns)."""
    server = KvtierServer(workdir, workdir / "l2-prefetch")
    cfg = connector_config(**{"kvtier.socket": server.socket, "kvtier.prefetch": True})
    c = Vllm(workdir, "prefetch", cfg)
    try:
        prompts = [random_prompt(500 + i, 700) for i in range(3)]
        for r in range(5):
            for i in range(3):
                c.reset_prefix_cache()
                answer = c.complete(prompts[i], max_tokens=8)
                prompts[i] = prompts[i] + list(answer) + random_prompt(600 + 10 * r + i, 30)
        assert transfer_metric(c, "chunks_prefetched", 30) > 0
        assert transfer_metric(c, "prefetched_returns", 30) >= 1
        assert transfer_metric(c, "tokens_loaded", timeout=0) > 0
        assert "Traceback" not in c.log()
    finally:
        c.stop()
        server.stop()
