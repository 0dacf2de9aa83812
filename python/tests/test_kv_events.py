"""`kvtier serve --kv-events` against vLLM's own schema: a real server on ipc:// endpoints, chunks
stored and described through the Python client, some evicted from a small L1 while the file
tier keeps them, and the stream decoded with msgspec.msgpack.Decoder(KVEventBatch) imported
from the installed vLLM (strict types), so what vLLM's subscribers accept is what is checked."""

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time

import numpy as np
import pytest

import kvtier

from cli import kvtier_binary

zmq = pytest.importorskip("zmq", reason="pyzmq is not installed (it comes with vLLM)")
msgspec = pytest.importorskip("msgspec", reason="msgspec is not installed (it comes with vLLM)")
kv_events = pytest.importorskip(
    "vllm.distributed.kv_events", reason="vLLM is not installed in this interpreter")

CHUNK = 4 << 20  # 4 MiB chunks: an 8-slot L1 of 32 MiB
TOKENS = 32      # per chunk: two 16-token vLLM blocks
N = 12           # chunks stored: 4 more than L1 holds
END_SEQ = b"\xff" * 8


def block_hash(i, j):
    """A made-up vLLM block hash (uint64, most above 2^63: msgpack's widest form)."""
    return ((i * 2 + j + 1) * 0x9E3779B97F4A7C15) & (2**64 - 1)


def descriptor(i, tokens):
    return msgspec.msgpack.encode({
        "index": i,
        "block_size": 16,
        "group_idx": 0,
        "block_hashes": [block_hash(i, 0), block_hash(i, 1)],
        "parent_block_hash": None if i == 0 else block_hash(i - 1, 1),
        "token_ids": np.asarray(tokens, dtype="<u4").tobytes(),
        "lora_id": None,
        "lora_name": None,
    })


@pytest.fixture
def server():
    d = tempfile.mkdtemp(prefix="kvt-ev-")
    log = open(os.path.join(d, "serve.log"), "w")
    sock = os.path.join(d, "s.sock")
    pub, replay = f"ipc://{d}/pub", f"ipc://{d}/replay"
    args = [kvtier_binary(), "serve", "--socket", sock, "--http-port", "-1",
            "--l1-size-gb", str(32 / 1024), "--chunk-bytes", str(CHUNK), "--chunk-size",
            str(TOKENS), "--write-policy", "write_through",
            "--l2", json.dumps({"type": "fs", "path": os.path.join(d, "l2")}),
            "--kv-events", "--kv-events-endpoint", pub, "--kv-events-replay-endpoint", replay,
            "--kv-events-pod", "testpod", "--kv-events-buffer-steps", "2", "--log-level", "warn"]
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while not os.path.exists(sock):
        if proc.poll() is not None or time.monotonic() > deadline:
            log.flush()
            text = open(log.name).read()
            if "built with libzmq and msgpack-cxx" in text:
                pytest.skip("this kvtier was built without KV-cache events (libzmq, msgpack-cxx)")
            pytest.fail(f"kvtier serve did not start: {text}")
        time.sleep(0.02)
    yield {"socket": sock, "pub": pub, "replay": replay}
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    log.close()
    shutil.rmtree(d, ignore_errors=True)


def replay(ctx, endpoint, start):
    """A late joiner's replay over DEALER: (topic, seq, KVEventBatch) until the end marker."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, 30000)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    decoder = msgspec.msgpack.Decoder(kv_events.KVEventBatch)
    out = []
    while True:
        _, topic, seq, payload = dealer.recv_multipart()
        if seq == END_SEQ:
            assert topic == b"" and payload == b""
            break
        out.append((topic.decode(), int.from_bytes(seq, "big"), decoder.decode(payload)))
    dealer.close()
    return out


def wait_for(what, check, timeout=60):
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_stream_decodes_with_vllms_schema_and_a_late_joiner_gets_the_state(server):
    ns = kvtier.KeyNamespace("test/kv-events-model", 0x0123456789ABCDEF, chunk_tokens=TOKENS)
    tokens = np.arange(1000, 1000 + N * TOKENS, dtype=np.uint32)
    keys = kvtier.chunk_keys(ns, tokens)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(server["pub"])
    decoder = msgspec.msgpack.Decoder(kv_events.KVEventBatch)
    live = []

    def drain():
        while sub.poll(0):
            topic, seq, payload = sub.recv_multipart()
            live.append((topic.decode(), int.from_bytes(seq, "big"), decoder.decode(payload)))

    with kvtier.connect(ns, socket_path=server["socket"]) as c:
        c.describe(keys, [descriptor(i, tokens[i * TOKENS:(i + 1) * TOKENS]) for i in range(N)])
        rng = np.random.default_rng(0)
        # Four at a time, each batch on disk (write-through) before the next: L1 never has to
        # refuse a store, and evicts the oldest clean chunks once full.
        for at in range(0, N, 4):
            data = [rng.integers(0, 256, size=CHUNK, dtype=np.uint8) for _ in range(4)]
            r = c.store(keys[at:at + 4], data).wait(timeout=60)
            assert r.ok and r.chunks == 4, r
            wait_for("the file tier's writes",
                     lambda: c.stats()["kv_events"]["stored"]["storage"] >= at + 4)
            drain()
        ev = c.stats()["kv_events"]
        assert ev["stored"]["storage"] == N and ev["dropped_descriptors"] == 0, ev
        assert ev["removed"]["cpu"] >= N - 8, ev  # evicted from the 8-slot L1
        in_l1 = [c.lookup([k])[1] == 1 for k in keys]
        assert sum(in_l1) <= 8

    # The live stream: one topic, seq strictly increasing, every event of vLLM's types.
    time.sleep(0.1)
    drain()
    topic = "kv@testpod@test/kv-events-model"
    seqs = [s for _, s, _ in live]
    assert all(t == topic for t, _, _ in live)
    assert seqs == sorted(set(seqs))
    for _, _, batch in live:
        assert batch.data_parallel_rank == 0
        for e in batch.events:
            assert isinstance(e, (kv_events.BlockStored, kv_events.BlockRemoved))
            assert e.medium in ("CPU", "STORAGE")

    # A late joiner asking from 0 (older than the 2-batch ring) gets a snapshot: AllBlocksCleared,
    # then every announced chunk, parents first, stamped with the last published seq.
    snap = replay(ctx, server["replay"], 0)
    assert snap, "no snapshot"
    stamp = snap[0][1]
    assert all(s == stamp for _, s, _ in snap)
    events = [e for _, _, b in snap for e in b.events]
    assert isinstance(events[0], kv_events.AllBlocksCleared)
    state = {"CPU": set(), "STORAGE": set()}
    for e in events[1:]:
        assert isinstance(e, kv_events.BlockStored)
        i = next(i for i in range(N) if block_hash(i, 0) == e.block_hashes[0])
        assert e.block_hashes == [block_hash(i, 0), block_hash(i, 1)]
        assert e.parent_block_hash == (None if i == 0 else block_hash(i - 1, 1))
        if i > 0:  # parents come first, in one medium or the other
            assert block_hash(i - 1, 1) in state["CPU"] | state["STORAGE"]
        assert e.token_ids == list(range(1000 + i * TOKENS, 1000 + (i + 1) * TOKENS))
        assert e.block_size == 16 and e.group_idx == 0 and e.lora_name is None
        state[e.medium].update(e.block_hashes)
    assert state["STORAGE"] == {block_hash(i, j) for i in range(N) for j in (0, 1)}
    assert state["CPU"] == {block_hash(i, j) for i in range(N) if in_l1[i] for j in (0, 1)}

    # From a seq still in the ring: the batches as published, then the end marker alone past it.
    ring = replay(ctx, server["replay"], stamp)
    assert [s for _, s, _ in ring] == [stamp]
    assert replay(ctx, server["replay"], stamp + 1) == []
    if live and live[-1][1] == stamp:
        assert live[-1][2] == ring[0][2]
    sub.close()
    ctx.term()
