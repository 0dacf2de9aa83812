"""The in-process engine through Python: store/load round trips, the zero-copy slot interface,
an L2 file tier that outlives the engine, errors, close semantics, and that long calls let other
Python threads run."""

import ctypes
import gc
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import kvtier

CHUNK = 64 * 1024


@pytest.fixture
def ns():
    return kvtier.KeyNamespace("test/model", 0xABC, chunk_tokens=16)


@pytest.fixture
def engine(ns):
    with kvtier.open_engine(ns, CHUNK, l1_size_gb=0.0625) as store:
        yield store


def keys_for(ns, n, seed=0):
    rng = np.random.default_rng(seed)
    return kvtier.chunk_keys(ns, rng.integers(0, 50000, size=16 * n, dtype=np.uint32))


def chunks(n, seed=0, size=CHUNK):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=size, dtype=np.uint8) for _ in range(n)]


def wait_until(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def test_store_then_load_is_byte_exact(ns, engine):
    assert engine.mode == "in_process"
    assert engine.chunk_bytes == CHUNK
    assert engine.num_slots == 1024 and engine.pool_bytes >= CHUNK * 1024
    assert engine.pool_base % 4096 == 0
    keys = keys_for(ns, 6)
    data = chunks(6)
    assert engine.lookup(keys) == (0, 0)
    # Mixed buffer types: numpy, bytes, bytearray, memoryview.
    src = [data[0], data[1].tobytes(), bytearray(data[2].tobytes()), memoryview(data[3]),
           data[4], data[5]]
    r = engine.store(keys, src).wait()
    assert r.ok and r.code == "ok" and r.chunks == 6 and r.message == ""
    assert engine.lookup(keys) == (6, 6)
    assert engine.lookup(b"".join(keys)) == (6, 6)  # keys as one buffer of n * 32 bytes
    assert engine.lookup(np.frombuffer(b"".join(keys[:3]), dtype=np.uint8)) == (3, 3)

    out = [np.zeros(CHUNK, dtype=np.uint8) for _ in range(4)] + \
          [bytearray(CHUNK), memoryview(bytearray(CHUNK))]
    op = engine.load(keys, out)
    r = op.wait(timeout=10)
    assert r.ok and r.chunks == 6
    assert op.done()
    assert op.wait() is r or op.wait().chunks == 6  # the result stays available
    for want, got in zip(data, out):
        assert bytes(got) == want.tobytes()

    st = engine.stats()
    assert st["memory_detail"]["resident"] == 6
    assert st["stores"] >= 1 and st["loads"] >= 1
    assert st["has_file"] is False


def test_store_is_idempotent_and_a_missing_chunk_ends_the_prefix(ns, engine):
    keys = keys_for(ns, 4)
    data = chunks(4)
    assert engine.store(keys[:2], data[:2]).wait().ok
    assert engine.store(keys[:2], data[:2]).wait().ok
    assert engine.lookup(keys) == (2, 2)
    out = [bytearray(CHUNK) for _ in keys]
    r = engine.load(keys, out).wait()
    assert not r.ok and r.code == "not_found" and r.chunks == 2  # a result, not an exception
    assert bytes(out[1]) == data[1].tobytes()
    assert bytes(out[2]) == bytes(CHUNK)


def test_zero_copy_slots(ns, engine):
    keys = keys_for(ns, 3)
    data = chunks(3)
    slots = engine.reserve_slots(keys)
    assert len(slots) == 3 and all(0 <= s < engine.num_slots for s in slots)
    for s, d in zip(slots, data):
        view = engine.slot_view(s)
        assert len(view) == CHUNK and not view.readonly
        view[:] = d.tobytes()
    assert engine.lookup(keys) == (0, 0)  # reserved chunks are invisible until committed
    engine.commit_slots(keys, slots)
    assert engine.lookup(keys) == (3, 3)
    assert engine.reserve_slots(keys[:2]) == [-1, -1]  # already stored

    r = engine.prepare_load(keys).wait()
    assert r.ok and r.chunks == 3 and len(r.slots) == 3
    assert engine.stats()["memory_detail"]["pinned"] == 3
    for s, d in zip(r.slots, data):
        assert bytes(engine.slot_view(s)) == d.tobytes()
        raw = (ctypes.c_ubyte * CHUNK).from_address(engine.slot_address(s))
        assert bytes(raw[:64]) == d.tobytes()[:64]
    assert np.shares_memory(np.asarray(engine.slot_view(r.slots[0])),
                            np.asarray(engine.slot_view(r.slots[0])))
    engine.unpin(r.slots)
    assert engine.stats()["memory_detail"]["pinned"] == 0

    # Abort gives a reservation back unpublished; -1 entries are skipped.
    more = keys_for(ns, 2, seed=1)
    slots = engine.reserve_slots(more)
    engine.abort_slots(slots + [-1])
    assert engine.lookup(more) == (0, 0)
    # A partial commit after one abort, as an integration does when a copy fails.
    slots = engine.reserve_slots(more)
    engine.slot_view(slots[0])[:] = data[0].tobytes()
    engine.abort_slots([slots[1]])
    engine.commit_slots(more, [slots[0], -1])
    assert engine.lookup(more) == (1, 1)


def test_dropped_ops_finish_and_release_their_pins(ns, engine):
    keys = keys_for(ns, 8)
    engine.store(keys, chunks(8))  # dropped at once: its buffers are held until it is done
    gc.collect()
    assert wait_until(lambda: engine.lookup(keys) == (8, 8))
    engine.prepare_load(keys)  # never waited on: the op gives its pins back itself
    op = engine.prepare_load(keys)
    assert op.wait().chunks == 8
    del op  # taken: the pins are the caller's now
    assert wait_until(lambda: engine.stats()["memory_detail"]["pinned"] == 8)
    engine.unpin(list(range(0)) + engine.prepare_load(keys).wait().slots)


def test_l2_write_through_survives_reopening(ns, tmp_path):
    l2 = {"type": "fs", "path": str(tmp_path / "l2"), "max_size_gb": 1, "read_threads": 2,
          "write_threads": 1}
    keys = keys_for(ns, 5)
    data = chunks(5)
    with kvtier.open_engine(ns, CHUNK, l1_size_gb=0.0625, l2=l2,
                            write_policy="write_through") as store:
        assert store.store(keys, data).wait().ok
        assert store.stats()["has_file"] is True
    with kvtier.open_engine(ns, CHUNK, l1_size_gb=0.0625, l2=l2,
                            write_policy="write_through") as store:
        assert store.lookup(keys) == (5, 0)  # all in L2, none in the new L1
        out = [bytearray(CHUNK) for _ in keys]
        r = store.load(keys, out).wait()
        assert r.ok and r.chunks == 5
        assert [bytes(o) for o in out] == [d.tobytes() for d in data]
        st = store.stats()
        assert st["file_detail"]["chunks"] == 5 and st["promotions"] == 5
        # Promoted into L1 (the engine commits a promoted slot just after the load reports it).
        assert wait_until(lambda: store.lookup(keys) == (5, 5))
        # Zero-copy reads of chunks that come from L2.
        other = kvtier.open_engine(ns, CHUNK, l1_size_gb=0.0625, l2=l2)
        r = other.prepare_load(keys).wait()
        assert r.chunks == 5 and bytes(other.slot_view(r.slots[4])) == data[4].tobytes()
        other.unpin(r.slots)
        other.close()


def test_l2_write_back_is_flushed_at_close(ns, tmp_path):
    l2 = f'{{"type": "fs", "path": "{tmp_path / "l2"}"}}'  # the JSON string form
    keys = keys_for(ns, 3)
    data = chunks(3)
    store = kvtier.open_engine(ns, CHUNK, l1_size_gb=0.0625, l2=l2)  # write_back by default
    assert store.store(keys, data).wait().ok
    store.close()
    with kvtier.open_engine(ns, CHUNK, l1_size_gb=0.0625, l2=l2) as store:
        assert store.lookup(keys) == (3, 0)


def test_argument_errors(ns, engine):
    keys = keys_for(ns, 2)
    data = chunks(2)
    invalid = kvtier.InvalidArgumentError
    with pytest.raises(invalid, match="32 bytes"):
        engine.lookup([keys[0], keys[1][:31]])
    with pytest.raises(invalid, match="multiple of 32"):
        engine.lookup(b"".join(keys)[:-1])
    with pytest.raises(TypeError):
        engine.lookup(42)
    with pytest.raises(invalid):
        engine.store(keys, [data[0], data[1][:-1]])  # a buffer too small
    with pytest.raises(invalid):
        engine.store(keys, data[:1])  # fewer buffers than keys
    with pytest.raises(TypeError):
        engine.store(keys, [data[0], object()])
    with pytest.raises(TypeError):
        engine.store(keys, b"x" * CHUNK)
    with pytest.raises(invalid, match="writable"):
        engine.load(keys, [bytes(CHUNK), bytes(CHUNK)])  # read-only destinations
    with pytest.raises(invalid, match="contiguous"):
        engine.store(keys[:1], [np.zeros(2 * CHUNK, dtype=np.uint8)[::2]])
    with pytest.raises(invalid, match="out of range"):
        engine.slot_view(engine.num_slots)
    with pytest.raises(invalid, match="out of range"):
        engine.slot_address(-1)
    with pytest.raises(invalid, match="not reserved"):
        engine.commit_slots(keys[:1], [0])
    with pytest.raises(invalid, match="not reserved"):
        engine.abort_slots([3])
    with pytest.raises(invalid, match="not pinned"):
        engine.unpin([0])
    with pytest.raises(invalid, match="out of range"):
        engine.unpin([-1])
    slots = engine.reserve_slots(keys)
    with pytest.raises(invalid, match="another key"):
        engine.commit_slots([keys[1], keys[0]], slots)
    with pytest.raises(invalid, match="twice"):
        engine.abort_slots([slots[0], slots[0]])
    with pytest.raises(invalid, match="slots but only"):
        engine.commit_slots(keys[:1], slots)
    engine.abort_slots(slots)  # the failed calls above gave nothing back
    op = engine.store(keys, data)
    with pytest.raises(invalid, match="timeout"):
        op.wait(timeout=-1)
    with pytest.raises(invalid, match="timeout"):
        op.wait(timeout=float("nan"))
    assert op.wait().ok
    assert engine.lookup(keys) == (2, 2)


def test_open_engine_errors(ns, tmp_path):
    invalid = kvtier.InvalidArgumentError
    with pytest.raises(invalid, match="chunk_bytes"):
        kvtier.open_engine(ns, 0)
    with pytest.raises(invalid, match="unknown L2 key"):
        kvtier.open_engine(ns, CHUNK, l2={"type": "fs", "path": str(tmp_path), "size": 1})
    with pytest.raises(invalid, match="path"):
        kvtier.open_engine(ns, CHUNK, l2={"type": "fs"})
    with pytest.raises(invalid, match="JSON"):
        kvtier.open_engine(ns, CHUNK, l2="{not json")
    with pytest.raises(TypeError):
        kvtier.open_engine(ns, CHUNK, l2=["fs"])
    with pytest.raises(invalid):
        kvtier.open_engine(ns, CHUNK, write_policy="sometimes")
    with pytest.raises(invalid):
        kvtier.open_engine(ns, CHUNK, eviction_policy="random")
    with pytest.raises(invalid, match="holds no chunk"):
        kvtier.open_engine(ns, 1 << 30, l1_size_gb=0.5)
    with pytest.raises(invalid, match="load_deadline_ms"):
        kvtier.open_engine(ns, CHUNK, load_deadline_ms=-5)
    with pytest.raises(invalid):
        kvtier.open_engine(ns, CHUNK, worker_threads=0)
    with pytest.raises(TypeError):
        kvtier.open_engine(ns, CHUNK, 1.0)  # options are keyword-only


def test_close_semantics(ns):
    store = kvtier.open_engine(ns, CHUNK, l1_size_gb=0.0625)
    keys = keys_for(ns, 2)
    assert store.store(keys, chunks(2)).wait().ok
    pending = store.prepare_load(keys)
    view = store.slot_view(pending.wait().slots[0])
    store.close()
    store.close()  # idempotent
    assert store.closed and store.chunk_bytes == CHUNK and store.mode == "in_process"
    for call in (lambda: store.lookup(keys), lambda: store.store(keys, chunks(2)),
                 lambda: store.reserve_slots(keys), lambda: store.slot_view(0),
                 lambda: store.stats(), lambda: store.pool_base):
        with pytest.raises(kvtier.KvtierError) as e:
            call()
        assert e.value.code == "closed"
        assert not isinstance(e.value, ValueError)
    # What was handed out stays usable: the op and the view keep the pool alive.
    assert pending.wait().chunks == 2
    assert len(bytes(view)) == CHUNK
    del view, pending

    with kvtier.open_engine(ns, CHUNK, l1_size_gb=0.0625) as s:
        assert not s.closed
    assert s.closed


def test_waits_release_the_gil(ns):
    # Big chunks on one copy thread make a store that takes a while. With a long switch interval
    # a thread waiting for the GIL would not get it during the wait unless wait() releases it.
    big = 4 << 20
    n = 48
    store = kvtier.open_engine(ns, big, l1_size_gb=0.25, worker_threads=1)
    keys = keys_for(ns, n)
    data = [np.full(big, i, dtype=np.uint8) for i in range(n)]
    ticks = []
    stop = threading.Event()

    def ticker():
        while not stop.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.0005)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1.0)
    t = threading.Thread(target=ticker)
    t.start()
    try:
        time.sleep(0.01)
        op = store.store(keys, data)
        t0 = time.monotonic()
        r = op.wait()
        t1 = time.monotonic()
    finally:
        stop.set()
        t.join()
        sys.setswitchinterval(old)
    assert r.chunks == n
    during = [x for x in ticks if t0 < x < t1]
    assert t1 - t0 > 0.005, "the store finished too fast to tell"
    assert len(during) >= 2, f"no progress in {t1 - t0:.3f} s of wait()"
    store.close()


def test_torch_tensors_as_buffers(ns, engine):
    torch = pytest.importorskip("torch")
    keys = keys_for(ns, 2)
    src = [torch.arange(CHUNK // 2, dtype=torch.int16),
           torch.ones(CHUNK // 2, dtype=torch.bfloat16)]
    assert engine.store(keys, src).wait().ok
    dst = [torch.zeros(CHUNK, dtype=torch.uint8), torch.zeros(CHUNK // 4, dtype=torch.float32)]
    assert engine.load(keys, dst).wait().chunks == 2
    assert torch.equal(dst[0].view(torch.int16), src[0])
    assert torch.equal(dst[1].view(torch.bfloat16), src[1])
    with pytest.raises(kvtier.InvalidArgumentError, match="contiguous"):
        engine.load(keys[:1], [torch.zeros(CHUNK * 2, dtype=torch.uint8)[::2]])


def run_python(code, timeout=60):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout)


def test_exit_with_work_in_flight():
    # Stores, loads and pins dropped unfinished, and a store never closed: the interpreter must
    # exit promptly and cleanly (the reaper is drained at exit, before finalization).
    r = run_python(f"""
        import kvtier, numpy as np
        ns = kvtier.KeyNamespace("exit/model")
        s = kvtier.open_engine(ns, {CHUNK}, l1_size_gb=0.0625, worker_threads=1)
        keys = kvtier.chunk_keys(ns, list(range(256 * 64)))
        for _ in range(4):
            s.store(keys, [np.ones({CHUNK}, np.uint8) for _ in keys])
        s.load(keys, [bytearray({CHUNK}) for _ in keys])
        s.prepare_load(keys)
        view = s.slot_view(0)
        print("ok")
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"
    assert "leak" not in r.stderr


def test_fork_child_gets_its_own_reaper():
    r = run_python(f"""
        import os, gc, kvtier
        ns = kvtier.KeyNamespace("fork/model")
        s = kvtier.open_engine(ns, {CHUNK}, l1_size_gb=0.0625)
        s.store(kvtier.chunk_keys(ns, range(256)), [bytes({CHUNK})])  # starts the reaper
        gc.collect()
        pid = os.fork()
        if pid == 0:
            c = kvtier.open_engine(ns, {CHUNK}, l1_size_gb=0.0625)
            c.store(kvtier.chunk_keys(ns, range(256)), [bytes({CHUNK})])
            del c
            raise SystemExit(0)  # a normal exit: atexit drains the child's reaper
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status))
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "0"


def test_threads_race_with_close(ns):
    # Several threads store, load and pin through one store while another closes it: each call
    # either works or raises KvtierError("closed"); nothing hangs or crashes.
    store = kvtier.open_engine(ns, CHUNK, l1_size_gb=0.0625, worker_threads=2)
    errors = []
    counts = [0] * 4

    def worker(t):
        rng = np.random.default_rng(t)
        buf = [bytearray(CHUNK) for _ in range(4)]
        try:
            while True:
                keys = keys_for(ns, 4, seed=int(rng.integers(0, 8)))
                store.store(keys, chunks(4, seed=t)).wait()
                store.load(keys, buf).wait(timeout=5)
                r = store.prepare_load(keys).wait()
                store.unpin(r.slots)
                slots = store.reserve_slots(keys_for(ns, 2, seed=100 + t))
                store.abort_slots(slots)
                store.lookup(keys)
                counts[t] += 1
        except kvtier.KvtierError as e:
            if e.code != "closed":
                errors.append(e)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    assert wait_until(lambda: min(counts) >= 3)
    store.close()
    for t in threads:
        t.join(timeout=30)
        assert not t.is_alive()
    assert not errors, errors
