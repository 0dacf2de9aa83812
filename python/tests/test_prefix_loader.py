"""kvtier.vllm.prefix_loader against a real `kvtier serve` whose file tier reads slower than a
long prefix fits in its load deadline: one prepare_load loses the prefix's tail, the batched
loader delivers all of it, in order, and learns the tier's rate; a missing chunk ends the load
at the gap, and a failing copy gives back the pins of the batches still in flight."""

import time

import numpy as np
import pytest

import kvtier
from kvtier.vllm.prefix_loader import PrefixLoader

from test_server import CHUNK, Serve, chunks, keys_for

CHUNK_S = 0.05  # the throttled tier reads one chunk in this
N = 40  # chunks of a prefix: 2 s of reading
DEADLINE_MS = 1000


@pytest.fixture
def ns():
    return kvtier.KeyNamespace("test/prefix-loader-model", 7, chunk_tokens=16)


@pytest.fixture
def slow_tier(tmp_path, ns):
    """(server, client, {name: (keys, data)}): prefixes stored on the file tier, then served by
    a restarted server (empty L1) whose tier reads a chunk in CHUNK_S."""
    prefixes = {name: (keys_for(ns, N, seed), chunks(N, seed))
                for seed, name in enumerate(("whole", "batched", "gap", "failing"))}
    l2 = f'{{"type":"fs","path":"{tmp_path / "l2"}","read_limit_gbps":{CHUNK / CHUNK_S / 1e9}}}'
    writer = Serve("--l2", l2, "--write-policy", "write_through")
    with kvtier.connect(ns, socket_path=writer.socket) as c:
        for name, (keys, data) in prefixes.items():
            if name == "gap":
                keys, data = keys[:10] + keys[11:], data[:10] + data[11:]
            assert c.store(keys, data).wait().ok
    writer.stop()
    server = Serve("--l2", l2, "--load-deadline-ms", str(DEADLINE_MS))
    client = kvtier.connect(ns, socket_path=server.socket, client_name="pytest-loader")
    yield server, client, prefixes
    client.close()
    server.stop()


def no_pins_left(client, timeout=10.0) -> bool:
    """Pins of ops dropped unwaited go back once their replies arrive."""
    deadline = time.monotonic() + timeout
    while client.stats()["pool"]["pinned"] and time.monotonic() < deadline:
        time.sleep(0.05)
    return client.stats()["pool"]["pinned"] == 0


def test_batches_deliver_a_prefix_one_request_loses_to_the_deadline(slow_tier):
    _, client, prefixes = slow_tier
    # The failure the loader exists for: one request for the whole prefix ends at the deadline.
    keys, _ = prefixes["whole"]
    result = client.prepare_load(keys).wait()
    assert not result.ok and result.chunks < N * 0.75, result
    client.unpin(list(result.slots))
    # Its reads go on past the deadline (into L1): wait for them, they would delay the next.
    deadline = time.monotonic() + 10
    while client.lookup(keys)[1] < N and time.monotonic() < deadline:
        time.sleep(0.05)

    keys, data = prefixes["batched"]
    loader = PrefixLoader(CHUNK)
    batches = []
    same = []

    def deliver(start, slots):
        batches.append((start, len(slots)))
        for i, slot in enumerate(slots):
            same.append(np.array_equal(np.frombuffer(client.slot_view(slot), np.uint8),
                                       data[start + i]))
        client.unpin(slots)

    start = time.monotonic()
    out = loader.load(client, keys, N, deliver)
    took = time.monotonic() - start
    assert out.chunks == N and out.message == "", out
    assert all(same) and len(same) == N
    # In order and contiguous; small while the rate is unknown, then sized to it.
    assert [b[0] for b in batches] == [sum(n for _, n in batches[:i]) for i in range(len(batches))]
    assert batches[0][1] == 1 and max(n for _, n in batches) > 2
    assert out.file_bytes == N * CHUNK and 0 < out.file_s <= took
    # The rate learned is the tier's (CHUNK / CHUNK_S), within what a loaded machine adds.
    assert 0.4 < loader.rate_gbps / (CHUNK / CHUNK_S / 1e9) < 1.3, loader.rate_gbps
    assert took >= N * CHUNK_S * 0.9
    assert no_pins_left(client)
    # Now in L1 (promoted as they were read): the L1 part of a prefix goes in one request.
    sizes = []
    loader.load(client, keys, 0, lambda _, slots: (sizes.append(len(slots)), client.unpin(slots)))
    assert sizes == [N]


def test_a_missing_chunk_ends_the_load_at_the_gap(slow_tier):
    _, client, prefixes = slow_tier
    keys, _ = prefixes["gap"]  # chunk 10 was never stored
    got = []

    def deliver(start, slots):
        got.extend(range(start, start + len(slots)))
        client.unpin(slots)

    out = PrefixLoader(CHUNK, read_gbps=CHUNK / CHUNK_S / 1e9).load(client, keys, N, deliver)
    assert out.chunks == 10 and got == list(range(10)) and out.message
    assert no_pins_left(client)


def test_a_failing_copy_gives_back_the_pins_in_flight(slow_tier):
    _, client, prefixes = slow_tier
    keys, _ = prefixes["failing"]

    def deliver(start, slots):
        client.unpin(slots)
        if start > 0:
            raise RuntimeError("copy failed")

    with pytest.raises(RuntimeError, match="copy failed"):
        PrefixLoader(CHUNK).load(client, keys, N, deliver)
    assert no_pins_left(client)


def test_a_server_killed_mid_load_ends_it_at_what_was_delivered(slow_tier):
    server, client, prefixes = slow_tier
    keys, data = prefixes["failing"]
    got = []

    def deliver(start, slots):
        got.extend(np.array_equal(np.frombuffer(client.slot_view(s), np.uint8), data[start + i])
                   for i, s in enumerate(slots))
        if start == 0:
            server.proc.kill()  # while the next batch is being read

    start = time.monotonic()
    try:
        out = PrefixLoader(CHUNK).load(client, keys, N, deliver)
        assert out.chunks == len(got) < N and out.message
    except kvtier.KvtierError:
        pass  # asking for the next batch on the broken connection: the same outcome
    assert time.monotonic() - start < 5
    assert got and all(got)  # what was delivered before the kill is the stored data
    assert not client.connected
