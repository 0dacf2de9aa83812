"""The connector's prefetch (kvtier.vllm.prefetch, docs/prefetch.md) against a real `kvtier serve`
with a file tier: what it keeps in L1 and in which order, that what it keeps survives a flood of
saves, the hand-over of its pins to a returning request's load, the gates (too few returns,
irregular returns, the horizon), and a server that dies under it."""

import logging
import time

import pytest

import kvtier
from kvtier.vllm.prefetch import (GAP_WINDOW, MIN_RETURNS, PLAN_EVERY_S, Prefetcher, horizon_s,
                                    predictable)

from test_server import CHUNK, Serve, chunks, keys_for

CONV = 100  # chunks per conversation (6.4 MB); the L1 holds about ten conversations


@pytest.fixture
def ns():
    return kvtier.KeyNamespace("test/prefetch-model", 7, chunk_tokens=16)


def serving(tmp_path, ns, client_slots=900):
    """A server with a file tier, a client of it and a Prefetcher keeping a quarter of the pool
    over that client: (server, client, prefetch, counts)."""
    server = Serve("--l2", f'{{"type":"fs","path":"{tmp_path / "l2"}"}}',
                   "--write-policy", "write_through", "--max-client-slots", str(client_slots))
    client = kvtier.connect(ns, socket_path=server.socket, client_name="pytest-prefetch")
    counts = {}
    rate = [0.0]  # the file tier's read rate the connector would give it; 0: unknown
    pays = [True]  # what the cost model would say of a return: recomputed (True) or read
    prefetch = Prefetcher(lambda: [client], 0.25,
                          lambda name, v: counts.__setitem__(name, counts.get(name, 0) + v),
                          lambda: rate[0], chunk_tokens=16, pays=lambda c, r: pays[0],
                          autoplan=False)
    prefetch.rate, prefetch.pays = rate, pays
    return server, client, prefetch, counts


def close(server, client, prefetch, counts):
    prefetch.close()
    client.close()
    server.stop()


@pytest.fixture
def served(tmp_path, ns):
    parts = serving(tmp_path, ns)
    yield parts
    close(*parts)


def store(client, keys, seed):
    """Stores `keys`, waiting out the pool's back-pressure (write-through: a chunk frees its
    slot once the file tier has it)."""
    for i in range(0, len(keys), 50):
        data = chunks(len(keys[i:i + 50]), seed + i)
        deadline = time.monotonic() + 30
        while not (r := client.store(keys[i:i + 50], data).wait()).ok:
            assert r.code == "rejected" and time.monotonic() < deadline, r
            time.sleep(0.02)


def flood(client, ns, n, seed):
    """Saves `n` new chunks: everything unpinned in L1 gives way (the file tier keeps it). Returns
    once the file tier has taken all of them, so that L1 has clean chunks to give up for
    promotions."""
    store(client, keys_for(ns, n, seed=seed), seed)
    deadline = time.monotonic() + 30
    while client.stats()["pool"]["dirty"] > 0:
        assert time.monotonic() < deadline, "the file tier never took the flood"
        time.sleep(0.02)


def on_file_tier_only(client, ns, n, seed):
    """`n` conversations of CONV chunks, stored, then pushed out of L1 by a flood."""
    convs = [keys_for(ns, CONV, seed=seed + i) for i in range(n)]
    for i, keys in enumerate(convs):
        store(client, keys, 1000 * i)
    flood(client, ns, client.num_slots, seed=7)
    return convs


def settle(prefetch, now, seconds=5.0):
    """Plans every PLAN_EVERY_S for `seconds` of its clock (a promotion cut short by chunks
    not yet written below is tried again RETRY_S later), letting the server flush meanwhile."""
    end = now + seconds
    while now < end:
        prefetch.plan(now)
        while prefetch.busy:
            time.sleep(0.005)
        time.sleep(0.002)
        now += PLAN_EVERY_S
    return now


def converse(prefetch, convs, t0, gap, jitter=0.0, gpu_chunks=0, plan=True,
             returns=MIN_RETURNS):
    """Conversation i finishes first at t0 + i, then, `returns` times over, comes back `gap`
    after it finished (`jitter` later and sooner by turns) and finishes half a
    second later; the last finishes are left expected. With `plan`, the prefetch plans every
    second in between, as the connector's planning thread does. Returns the time of the last
    finish."""
    events = []  # (time, conversation, arrival?)
    for i in range(len(convs)):
        finish = t0 + i
        events.append((finish, i, False))
        for k in range(returns // len(convs) + 1):
            back = finish + gap + (jitter if (i + k) % 2 else -jitter)
            finish = back + 0.5
            events += [(back, i, True), (finish, i, False)]
    events.sort()
    clock = t0
    for n, (t, i, arrival) in enumerate(events):
        while plan and clock < t:
            prefetch.plan(clock)
            while prefetch.busy:  # the promotion's real time is the clock's no time at all
                time.sleep(0.002)
            clock += 1.0
        if arrival:
            prefetch.arrived(f"{n}", convs[i] + [b"x" * 32], t, gpu_chunks)
            prefetch.forget(f"{n}")  # its lookup answered (a load pins by itself)
        else:
            prefetch.finished(convs[i], len(convs[i]), t)
    return events[-1][0]


def test_keeps_the_conversations_expected_soonest_in_l1(served, ns):
    server, client, prefetch, counts = served
    budget = int(0.25 * client.pool_bytes // CHUNK)
    convs = on_file_tier_only(client, ns, 4, seed=100)
    assert all(client.lookup(k)[1] == 0 for k in convs)  # in the file tier only

    now = converse(prefetch, convs, 0.0, gap=30.0)
    now = settle(prefetch, now)
    # Oldest finish first, as far as a quarter of the pool goes; the one at the edge keeps its
    # head, the next nothing. Pinned: a flood of saves evicts everything else.
    flood(client, ns, client.num_slots, seed=8)
    resident = [client.lookup(k)[1] for k in convs]
    assert resident[0] == CONV and resident[1] == CONV
    assert resident[2] == min(CONV, budget - 2 * CONV) and resident[3] == 0
    assert counts["chunks_prefetched"] >= sum(resident)
    assert counts["tokens_prefetched_from_file"] >= sum(resident) * 16  # read from the file

    # The first comes back: its load takes the pins of the chunks it reads over; the rest go.
    returns = counts["prefetched_returns"]  # those of converse's rounds
    prefetch.arrived("back", convs[0] + [b"y" * 32], now, 0)
    assert counts["prefetched_returns"] == returns + 1
    pins = prefetch.take_pins("back", [client], 10, CONV)
    assert pins is not None and len(pins[0]) == CONV - 10
    assert prefetch.take_pins("back", [client], 10, CONV) is None  # handed over once
    client.unpin(pins[0])
    with pytest.raises(kvtier.InvalidArgumentError, match="not pinned"):
        client.unpin(pins[0])

    # With the first gone, the next ones move up: the fourth is now (partly) kept.
    now = settle(prefetch, now + 1)
    flood(client, ns, client.num_slots, seed=10)
    assert client.lookup(convs[1])[1] == CONV and client.lookup(convs[2])[1] == CONV
    assert client.lookup(convs[3])[1] == min(CONV, budget - 2 * CONV)

    # Past the horizon every conversation is given up and its pins released.
    settle(prefetch, now + 100)
    flood(client, ns, client.num_slots, seed=9)
    assert all(client.lookup(k)[1] == 0 for k in convs)


def test_nothing_is_prefetched_without_steady_returns(served, ns):
    server, client, prefetch, counts = served
    convs = on_file_tier_only(client, ns, 2, seed=200)

    # Too few returns to predict from.
    for i, keys in enumerate(convs):
        prefetch.finished(keys, CONV, float(i))
    settle(prefetch, 10.0)
    assert all(client.lookup(k)[1] == 0 for k in convs)

    # Enough returns, but their gaps spread wider than half their mean (5 s and 55 s).
    converse(prefetch, convs, 100.0, gap=30.0, jitter=25.0)
    settle(prefetch, 1000.0)
    assert all(client.lookup(k)[1] == 0 for k in convs)

    # Steady returns, but vLLM's own cache held their whole prompts: reads would be wasted.
    converse(prefetch, convs, 2000.0, gap=30.0, gpu_chunks=CONV)
    settle(prefetch, 3000.0)
    assert all(client.lookup(k)[1] == 0 for k in convs)
    assert counts.get("chunks_prefetched", 0) == 0


def test_a_server_that_dies_under_it(served, ns):
    server, client, prefetch, counts = served
    convs = [keys_for(ns, CONV, seed=300 + i) for i in range(2)]
    for i, keys in enumerate(convs):
        store(client, keys, 1000 * i)
    now = converse(prefetch, convs, 0.0, gap=30.0)
    assert counts["chunks_prefetched"] > 0
    server.stop()  # promotions fail, pins cannot be released: no exception, nothing held
    now = settle(prefetch, now)
    prefetch.arrived("back", convs[0] + [b"z" * 32], now, 0)
    # The rank's connection is gone (a reconnection is another client): its pins went with
    # the server, none is handed over.
    assert prefetch.take_pins("back", [None], 0, CONV) is None
    settle(prefetch, now + 1000)


def test_a_read_that_would_end_after_the_return_is_not_started(served, ns):
    server, client, prefetch, counts = served
    convs = on_file_tier_only(client, ns, 2, seed=400)
    prefetch.rate[0] = 13e6  # reading a conversation (6.5 MB) takes half a second
    now = converse(prefetch, convs, 0.0, gap=30.0, plan=False)
    # The last finishes were at now - 1 and now: at now + 28.7 the first is due back in 0.3 s
    # (too soon for its read), the second in 1.3 s.
    settle(prefetch, now + 28.7, seconds=0.25)
    assert counts.get("prefetches_late", 0) == 1
    assert client.lookup(convs[0])[1] == 0 and client.lookup(convs[1])[1] == CONV


def test_returns_slower_than_the_gaps_learned_before_are_still_learned(served, ns):
    """Gaps learned in a burst (a capacity probe's back-to-back users) put the horizon at a few
    seconds; the paced run after it brings users back every minute. A conversation past the
    horizon holds no pins but is still remembered, so its return teaches the new gap and the
    prefetch follows the new pace."""
    server, client, prefetch, counts = served
    convs = on_file_tier_only(client, ns, 2, seed=500)
    now = converse(prefetch, convs, 0.0, gap=0.3)
    before = counts.get("prefetched_returns", 0)
    now = converse(prefetch, convs, now + 100, gap=30.0, returns=GAP_WINDOW + 4)
    assert counts.get("prefetched_returns", 0) > before
    settle(prefetch, now)
    flood(client, ns, client.num_slots, seed=9)
    assert client.lookup(convs[0])[1] == CONV  # pinned: it is expected back next


def test_nothing_is_read_ahead_for_returns_that_read_the_file_tier_anyway(served, ns):
    """Where the cost model would load a return from the file tier (it is faster than
    recomputing), a prefetch would only add its reads to the load's: nothing is promoted."""
    server, client, prefetch, counts = served
    convs = on_file_tier_only(client, ns, 2, seed=600)
    prefetch.pays[0] = False
    now = converse(prefetch, convs, 0.0, gap=30.0)
    settle(prefetch, now)
    assert counts.get("prefetches_unneeded", 0) >= 1
    assert counts.get("tokens_prefetched_from_file", 0) == 0
    assert all(client.lookup(k)[1] == 0 for k in convs)


def test_a_server_limit_below_the_prefetch_share_is_reported_with_the_fix(tmp_path, ns, caplog):
    """The server lets one client hold 150 slots, less than the prefetch's quarter of the pool
    (two conversations): the first is kept, the rest refused, and the log says which setting to
    raise, once (not on every refusal)."""
    parts = serving(tmp_path, ns, client_slots=150)
    server, client, prefetch, counts = parts
    try:
        convs = on_file_tier_only(client, ns, 3, seed=700)
        with caplog.at_level(logging.WARNING, logger="vllm.kvtier"):
            now = converse(prefetch, convs, 0.0, gap=30.0)
            settle(prefetch, now)
        told = [r.getMessage() for r in caplog.records if "--max-client-slots" in r.getMessage()]
        assert len(told) == 1, told
        assert "kvtier.prefetch_fraction" in told[0] and "0.50 of the pool" in told[0]
        assert client.lookup(convs[0])[1] == CONV  # within the limit: kept
    finally:
        close(*parts)


def test_the_horizon_follows_the_spread_of_the_gaps():
    """A departed user's last conversation, the oldest of all, holds the first share of L1 until
    the horizon: steady gaps give it up soon after the mean, spread ones later."""
    assert horizon_s([30.0] * 8) == pytest.approx(30 * 1.25)  # no spread: a quarter's slack
    assert horizon_s([20.0, 40.0] * 4) == pytest.approx(30 + 3 * 10)


def test_a_new_pace_is_taken_up_after_a_few_returns():
    """The whole window speaks while it is steady; after a change of pace (a burst, then paced
    users) the newest returns do, once there are enough of them and they agree."""
    burst = [0.3, 0.1, 0.6, 0.2] * 6
    assert predictable(burst + [30.0] * 4, [False] * 28) is None  # too few at the new pace
    assert predictable(burst + [30.0] * 8, [False] * 32) == [30.0] * 8
    assert predictable([30.0] * 32, [False] * 32) == [30.0] * 32
    assert predictable([30.0] * 32, [True] * 32) is None  # vLLM's own cache held them
    assert predictable([30.0] * 7, [False] * 7) is None
