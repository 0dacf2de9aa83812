"""`kvtier serve --kv-events` against vLLM's own schema: a real server on ipc:// endpoints, chunks
stored and described through the Python client, some evicted from a small L1 while the file
tier keeps them, and the stream decoded with msgspec.msgpack.Decoder(KVEventBatch) imported
from the installed vLLM (strict types), so what vLLM's subscribers accept is what is checked.
Then a restart: the new process announces the file tier's chunks from their headers."""

import json
import os
import shutil
import subprocess
import tempfile
import time

import numpy as np
import pytest

import kvtier

from cli import kvtier_binary, stop_process

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


class Server:
    """`kvtier serve --kv-events` on ipc:// endpoints in `d`, its file tier in d/l2."""

    def __init__(self, d):
        self.dir = d
        self.log = open(os.path.join(d, "serve.log"), "a")
        self.socket = os.path.join(d, "s.sock")
        self.pub, self.replay = f"ipc://{d}/pub", f"ipc://{d}/replay"
        args = [kvtier_binary(), "serve", "--socket", self.socket, "--http-port", "-1",
                "--l1-size-gb", str(32 / 1024), "--chunk-bytes", str(CHUNK), "--chunk-size",
                str(TOKENS), "--write-policy", "write_through",
                "--l2", json.dumps({"type": "fs", "path": os.path.join(d, "l2")}),
                "--kv-events", "--kv-events-endpoint", self.pub, "--kv-events-replay-endpoint",
                self.replay, "--kv-events-pod", "testpod", "--kv-events-buffer-steps", "2",
                "--log-level", "warn"]
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while not os.path.exists(self.socket):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.log.flush()
                text = open(self.log.name).read()
                self.stop()
                if "built with libzmq and msgpack-cxx" in text:
                    pytest.skip("this kvtier was built without KV-cache events (libzmq, "
                                "msgpack-cxx)")
                pytest.fail(f"kvtier serve did not start: {text}")
            time.sleep(0.02)

    def __getitem__(self, name):  # server.socket, as the tests had it
        return getattr(self, name)

    def stop(self):
        stop_process(self.proc)
        if not self.log.closed:
            self.log.close()


@pytest.fixture
def server_dir():
    d = tempfile.mkdtemp(prefix="kvt-ev-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def server(server_dir):
    s = Server(server_dir)
    yield s
    s.stop()


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
    sub.connect(server.pub)
    decoder = msgspec.msgpack.Decoder(kv_events.KVEventBatch)
    live = []

    def drain():
        while sub.poll(0):
            topic, seq, payload = sub.recv_multipart()
            live.append((topic.decode(), int.from_bytes(seq, "big"), decoder.decode(payload)))

    with kvtier.connect(ns, socket_path=server.socket) as c:
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
    snap = replay(ctx, server.replay, 0)
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
    ring = replay(ctx, server.replay, stamp)
    assert [s for _, s, _ in ring] == [stamp]
    assert replay(ctx, server.replay, stamp + 1) == []
    if live and live[-1][1] == stamp:
        assert live[-1][2] == ring[0][2]
    sub.close()
    ctx.term()


def test_a_restarted_server_announces_its_file_tier_from_the_chunk_headers(server_dir):
    """Chunks stored and described, then the server restarted on the same file tier: the new
    process was told nothing, finds the files at start, reads their descriptors from their
    headers (docs/file-format.md, "The descriptor") and a late joiner's replay names every
    chunk in STORAGE with its vLLM hashes, parents and tokens."""
    ns = kvtier.KeyNamespace("test/kv-events-restart", 0x0123456789ABCDEF, chunk_tokens=TOKENS)
    n = 4
    tokens = np.arange(5000, 5000 + n * TOKENS, dtype=np.uint32)
    keys = kvtier.chunk_keys(ns, tokens)
    first = Server(server_dir)
    try:
        with kvtier.connect(ns, socket_path=first.socket) as c:
            c.describe(keys, [descriptor(i, tokens[i * TOKENS:(i + 1) * TOKENS])
                              for i in range(n)])
            data = [np.full(CHUNK, i, dtype=np.uint8) for i in range(n)]
            assert c.store(keys, data).wait(timeout=60).ok
            wait_for("the file tier's writes",
                     lambda: c.stats()["kv_events"]["stored"]["storage"] >= n)
            assert c.stats()["kv_events"]["file_descriptors"]["written"] == n
    finally:
        first.stop()
    again = Server(server_dir)
    try:
        with kvtier.connect(ns, socket_path=again.socket) as c:
            wait_for("the headers' descriptors",
                     lambda: c.stats()["kv_events"]["file_descriptors"]["read"] >= n)
            ev = c.stats()["kv_events"]
            assert ev["file_descriptors"]["errors"] == 0, ev
            wait_for("the announcements",
                     lambda: c.stats()["kv_events"]["stored"]["storage"] >= n)
        # The batches since the start (the ring still reaches seq 0), or a snapshot if it has
        # rolled: either way every chunk, parents first, and nothing removed. The announcements
        # are counted as they are batched, and published up to a batch interval later: asked
        # again until the last is out.
        ctx = zmq.Context()
        events = []

        def replayed_all():
            nonlocal events
            events = [e for _, _, b in replay(ctx, again.replay, 0) for e in b.events]
            if events and isinstance(events[0], kv_events.AllBlocksCleared):
                events = events[1:]
            return len(events) >= n

        wait_for("every announcement in the replay", replayed_all, timeout=10)
        ctx.term()
        assert all(isinstance(e, kv_events.BlockStored) for e in events), events
        stored = events
        assert [e.block_hashes for e in stored] == \
            [[block_hash(i, 0), block_hash(i, 1)] for i in range(n)]  # parents first
        for i, e in enumerate(stored):
            assert e.medium == "STORAGE"
            assert e.parent_block_hash == (None if i == 0 else block_hash(i - 1, 1))
            assert e.token_ids == list(range(5000 + i * TOKENS, 5000 + (i + 1) * TOKENS))
    finally:
        again.stop()
