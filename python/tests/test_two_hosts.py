"""Several hosts on one shared file tier, with network namespaces standing in for the hosts.

The test makes three network namespaces joined by a bridge: a file server (10.213.0.1) that runs
the loopback NFS server of scripts/nfs-server.sh (nfs-ganesha, with an rpcbind of its own under
a private /run) and the S3 server of scripts/s3-server.sh (moto), both bound to its address; and
two hosts (10.213.0.2, .3), each running `kvtier serve` with an L1 pool and a Unix socket of its
own and the same nfs:// (or s3://) L2. This process is the hosts' clients: a Unix socket is a
path in the filesystem, which the namespaces share, so it reaches each server as a local client
would. All traffic between the tiers and the servers crosses the namespaces' veth pairs; nothing
else is touched, and everything is torn down at the end.

What is checked, on NFS and on S3: a chunk stored through host A is loaded by a client of host B
with the exact bytes (and how long it took to become visible is printed); host A SIGKILLed in
the middle of a burst of writes leaves B nothing wrong (temporaries and torn files are misses,
every hit is verified); two hosts evicting against one capacity settle at or under it, going
over it meanwhile by up to a whole capacity without shared_capacity and by at most one chunk per
host with it (the peaks are printed). docs/multi-node.md describes what this shows.

KV-cache events, on NFS: both hosts publish on their own address (docs/kv-events.md), and one
ZMQ SUB socket connected to both, in the file server's namespace, decodes every batch with
vLLM's published schema (written out below, and vLLM's own decoder where vLLM is installed):
each host's seq runs from 0 with no gap, and each host's events are what it stored (BlockStored
CPU and STORAGE, BlockRemoved CPU for what its L1 evicted); and B, having looked up A's
prefix, announces A's chunks in STORAGE with A's hashes, from the chunk files' headers.

Needs root (namespaces, ganesha's VFS FSAL). Skipped, with the reason, where namespaces cannot
be made; the servers failing to start is a failure when KVTIER_REQUIRE_NFS / KVTIER_REQUIRE_S3
is set (scripts/test.sh sets both), a skip otherwise.
"""

import json
import os
import shlex
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import kvtier

from cli import kvtier_binary, stop_process

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts"
CHUNK = 64 * 1024
FILE_BYTES = 4096 + CHUNK  # a chunk file: header block and payload (docs/file-format.md)
SERVER_ADDR = "10.213.0.1"
HOST_ADDRS = {"a": "10.213.0.2", "b": "10.213.0.3"}


def run(*args, check=True, **kw):
    return subprocess.run(args, check=check, capture_output=True, text=True, timeout=120, **kw)


class Network:
    """The three namespaces and their links; `close` deletes them (and with them the links)."""

    def __init__(self):
        self.prefix = f"kvt{os.getpid()}"
        self.server = self.prefix + "s"
        self.hosts = {h: self.prefix + h for h in HOST_ADDRS}
        self.made = []
        try:
            for ns in [self.server, *self.hosts.values()]:
                run("ip", "netns", "add", ns)
                self.made.append(ns)
                run("ip", "-n", ns, "link", "set", "lo", "up")
            s = self.server
            run("ip", "-n", s, "link", "add", "br0", "type", "bridge")
            run("ip", "-n", s, "addr", "add", f"{SERVER_ADDR}/24", "dev", "br0")
            run("ip", "-n", s, "link", "set", "br0", "up")
            for h, ns in self.hosts.items():
                # Made inside the namespaces: no interface ever appears in the caller's.
                run("ip", "-n", s, "link", "add", f"to-{h}", "type", "veth", "peer", "name",
                    "eth0", "netns", ns)
                run("ip", "-n", s, "link", "set", f"to-{h}", "master", "br0", "up")
                run("ip", "-n", ns, "addr", "add", f"{HOST_ADDRS[h]}/24", "dev", "eth0")
                run("ip", "-n", ns, "link", "set", "eth0", "up")
        except (subprocess.CalledProcessError, OSError) as e:
            self.close()
            detail = getattr(e, "stderr", "") or str(e)
            pytest.skip(f"cannot make network namespaces here ({detail.strip()})")

    def exec_args(self, ns):
        return ["ip", "netns", "exec", ns]

    def close(self):
        for ns in reversed(self.made):
            run("ip", "netns", "del", ns, check=False)
        self.made = []


def required(var):
    return os.environ.get(var, "") not in ("", "0")


def unavailable(var, what):
    if required(var):
        pytest.fail(what)
    pytest.skip(what)


class NfsServer:
    """ganesha in the server namespace, under a private /run (its rpcbind's socket and lock
    would otherwise be those of the machine's own rpcbind)."""

    def __init__(self, net):
        self.net = net
        self.state = tempfile.mkdtemp(prefix="kvtier-two-hosts-nfs-")
        env = dict(os.environ, KVTIER_NFS_ADDR=SERVER_ADDR)
        start = (f"mount -t tmpfs -o mode=755 kvtier-run /run && "
                 f"exec {shlex.quote(str(SCRIPTS / 'nfs-server.sh'))} start "
                 f"{shlex.quote(self.state)}")
        r = subprocess.run([*net.exec_args(net.server), "unshare", "--mount", "--propagation",
                            "private", "sh", "-c", start], env=env, capture_output=True,
                           text=True, timeout=300)
        if r.returncode != 0:
            self.close()
            unavailable("KVTIER_REQUIRE_NFS",
                        f"no NFS server in the namespace: {r.stdout}{r.stderr}")
        self.url = f"nfs://{SERVER_ADDR}/export"
        self.export_dir = Path(self.state) / "export"

    def close(self):
        env = dict(os.environ, KVTIER_NFS_ADDR=SERVER_ADDR)
        subprocess.run([*self.net.exec_args(self.net.server), str(SCRIPTS / "nfs-server.sh"),
                        "stop", self.state], env=env, capture_output=True, timeout=60)
        shutil.rmtree(self.state, ignore_errors=True)


class S3Server:
    def __init__(self, net):
        self.net = net
        self.state = tempfile.mkdtemp(prefix="kvtier-two-hosts-s3-")
        self.env = dict(os.environ, KVTIER_S3_HOST=SERVER_ADDR, KVTIER_S3_PORT="9000")
        r = subprocess.run([*net.exec_args(net.server), str(SCRIPTS / "s3-server.sh"), "start",
                            self.state], env=self.env, capture_output=True, text=True,
                           timeout=600)
        if r.returncode != 0:
            self.close()
            unavailable("KVTIER_REQUIRE_S3", f"no S3 server in the namespace: {r.stdout}{r.stderr}")
        out = run(*net.exec_args(net.server), str(SCRIPTS / "s3-server.sh"), "env", self.state,
                  env=self.env).stdout
        self.client_env = dict(os.environ)
        for line in out.splitlines():
            words = shlex.split(line)
            if words[:1] == ["unset"]:
                for name in words[1:]:
                    self.client_env.pop(name, None)
            elif words[:1] == ["export"]:
                name, _, value = words[1].partition("=")
                self.client_env[name] = value
        self.url = self.client_env["KVTIER_TEST_S3_URL"]

    def close(self):
        subprocess.run([*self.net.exec_args(self.net.server), str(SCRIPTS / "s3-server.sh"),
                        "stop", self.state], env=self.env, capture_output=True, timeout=60)
        shutil.rmtree(self.state, ignore_errors=True)


@pytest.fixture(scope="module")
def net():
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        pytest.skip("iproute2's ip and util-linux's unshare are needed to make namespaces")
    n = Network()
    yield n
    n.close()


@pytest.fixture(scope="module")
def nfs(net):
    s = NfsServer(net)
    yield s
    s.close()


@pytest.fixture(scope="module")
def s3(net):
    s = S3Server(net)
    yield s
    s.close()


class Host:
    """`kvtier serve` in a host's namespace: its own L1 pool, its own Unix socket."""

    def __init__(self, net, name, l2, env=None, write_policy="write_through", l1_gb=0.0625,
                 args=()):
        self.name = name
        self.dir = tempfile.mkdtemp(prefix=f"kvt-{name}-")
        self.socket = os.path.join(self.dir, "s.sock")
        self.log = open(os.path.join(self.dir, "serve.log"), "w")
        # `ip netns exec` execs the command: the Popen is kvtier itself (SIGKILL reaches it).
        args = [*net.exec_args(net.hosts[name]), kvtier_binary(), "serve", "--socket",
                self.socket, "--http-port", "-1", "--l1-size-gb", str(l1_gb), "--chunk-bytes",
                str(CHUNK), "--log-level", "warn", "--write-policy", write_policy, "--l2",
                json.dumps(l2), *args]
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 30
        while not os.path.exists(self.socket):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                text = self.log_text()
                self.stop()
                if "built with libzmq and msgpack-cxx" in text:
                    pytest.skip("this kvtier was built without KV-cache events (libzmq, "
                                "msgpack-cxx)")
                raise RuntimeError(f"kvtier serve ({name}) did not start: {text}")
            time.sleep(0.02)

    def connect(self, ns):
        return kvtier.connect(ns, CHUNK, socket_path=self.socket, client_name=f"host-{self.name}")

    def log_text(self):
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def stop(self):
        stop_process(self.proc)
        if not self.log.closed:
            self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def hosts():
    started = []

    def start(*args, **kw):
        started.append(Host(*args, **kw))
        return started[-1]

    yield start
    for h in started:
        h.stop()


@pytest.fixture(params=["nfs", "s3"])
def shared(request, net):
    """(kind, the L2 URL's root, env for `kvtier serve`, local path of the export or None)."""
    if request.param == "nfs":
        s = request.getfixturevalue("nfs")
        return "nfs", s.url, None, s.export_dir
    s = request.getfixturevalue("s3")
    return "s3", s.url, s.client_env, None


def l2_spec(kind, root, case, capacity_chunks=None):
    spec = {"type": kind, "url": f"{root}/{case}"}
    if capacity_chunks:
        spec["max_size_gb"] = capacity_chunks * FILE_BYTES / 2**30
    return spec


def key_ns(case):
    return kvtier.KeyNamespace(f"two-hosts/{case}", 1, chunk_tokens=16)


def make_keys(ns, n, seed):
    rng = np.random.default_rng(seed)
    return kvtier.chunk_keys(ns, rng.integers(0, 50000, size=16 * n, dtype=np.uint32))


def make_chunks(n, seed):
    rng = np.random.default_rng(seed + 1000)
    return [rng.integers(0, 256, size=CHUNK, dtype=np.uint8) for _ in range(n)]


def wait_visible(client, keys, timeout):
    """Lookups until all of `keys` are found (each miss queues a probe on the host's tier);
    returns the seconds it took, or None."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if client.lookup(keys)[0] == len(keys):
            return time.monotonic() - t0
        time.sleep(0.01)
    return None


def load_each(client, keys):
    """Loads every key on its own: the bytes of those that hit, None for the misses."""
    out = []
    for k in keys:
        buf = bytearray(CHUNK)
        r = client.load([k], [buf]).wait(timeout=30)
        assert r is not None and (r.ok or r.code == "not_found"), r
        out.append(bytes(buf) if r.ok and r.chunks == 1 else None)
    return out


def published(export_dir, case):
    """Chunk files published under the case's directory in the export (temporaries aside)."""
    root = export_dir / case
    return [p for p in root.glob("*/*/*/*") if p.is_file() and ".tmp." not in p.name]


def test_chunk_stored_on_a_is_loaded_on_b(net, shared, hosts):
    kind, root, env, _ = shared
    spec = l2_spec(kind, root, "visible")
    a = hosts(net, "a", spec, env=env)
    b = hosts(net, "b", spec, env=env)
    ns = key_ns("visible")
    keys, data = make_keys(ns, 8, 1), make_chunks(8, 1)
    with a.connect(ns) as ca, b.connect(ns) as cb:
        assert cb.lookup(keys) == (0, 0)
        t0 = time.monotonic()
        r = ca.store(keys, data).wait(timeout=30)
        assert r.ok and r.chunks == 8
        # Write-through: the store is acknowledged once in A's L1, the file tier write follows.
        took = wait_visible(cb, keys, timeout=30)
        assert took is not None, f"B never saw A's chunks:\n{b.log_text()}"
        print(f"\n{kind}: A's 8 chunks visible to B's lookups {time.monotonic() - t0:.3f} s "
              f"after A's store was acknowledged (B had looked them up, and found them absent, "
              f"just before)")
        out = [bytearray(CHUNK) for _ in keys]
        r = cb.load(keys, out).wait(timeout=30)
        assert r.ok and r.chunks == 8
        assert [bytes(o) for o in out] == [d.tobytes() for d in data]
        total, in_l1 = cb.lookup(keys)
        assert (total, in_l1) == (8, 8)  # B's own L1 holds them now

        # Keys B never asked for: the first lookup's probe finds them once A's tier has
        # written them (write-through writes after the acknowledgement).
        more, more_data = make_keys(ns, 8, 5), make_chunks(8, 5)
        t0 = time.monotonic()
        assert ca.store(more, more_data).wait(timeout=30).ok
        while file_stats(ca)["bytes_written"] < 16 * CHUNK and time.monotonic() - t0 < 30:
            time.sleep(0.001)
        written = time.monotonic()
        took = wait_visible(cb, more, timeout=30)
        assert took is not None, b.log_text()
        print(f"{kind}: A's next 8 chunks written {written - t0:.3f} s after the store, visible "
              f"to B's lookups {took:.3f} s after that")


def test_write_back_chunks_reach_b_after_a_drains(net, shared, hosts):
    """Write-back: A keeps its chunks in L1 and writes them when it stops (SIGTERM drains)."""
    kind, root, env, _ = shared
    spec = l2_spec(kind, root, "drain")
    a = hosts(net, "a", spec, env=env, write_policy="write_back")
    b = hosts(net, "b", spec, env=env)
    ns = key_ns("drain")
    keys, data = make_keys(ns, 4, 2), make_chunks(4, 2)
    with b.connect(ns) as cb:
        with a.connect(ns) as ca:
            assert ca.store(keys, data).wait(timeout=30).ok
        a.proc.terminate()
        assert a.proc.wait(timeout=60) == 0, a.log_text()
        assert wait_visible(cb, keys, timeout=30) is not None, b.log_text()
        out = [bytearray(CHUNK) for _ in keys]
        assert cb.load(keys, out).wait(timeout=30).chunks == 4
        assert [bytes(o) for o in out] == [d.tobytes() for d in data]


def test_a_killed_mid_burst_leaves_b_nothing_wrong(net, shared, hosts):
    kind, root, env, export_dir = shared
    case = "killed"
    # shared_capacity on: its markers are written alongside the chunks (and, at S3, as objects).
    spec = dict(l2_spec(kind, root, case, capacity_chunks=1000), shared_capacity=True)
    a = hosts(net, "a", spec, env=env)
    b = hosts(net, "b", spec, env=env)
    ns = key_ns(case)
    n = 192
    keys, data = make_keys(ns, n, 3), make_chunks(n, 3)
    expected = {k: d.tobytes() for k, d in zip(keys, data)}
    ca = a.connect(ns)
    # The burst: stores submitted 8 chunks at a time without waiting; A dies while its file
    # tier is writing (some chunks published, some mid-write, most not started).
    ops = [ca.store(keys[i:i + 8], data[i:i + 8]) for i in range(0, n, 8)]
    deadline = time.monotonic() + 30
    while file_stats(ca)["bytes_written"] < 8 * CHUNK and time.monotonic() < deadline:
        time.sleep(0.002)
    a.proc.kill()
    a.proc.wait()
    del ops  # their results died with A
    ca.close()
    # Requests A sent just before it died may still complete at the server (a RENAME in flight
    # publishes its chunk); what the server holds is final once they have.
    time.sleep(0.5)

    if export_dir is not None:
        # Also what no SIGKILL of a writer leaves but a crashed server's disk may: a published
        # name holding a torn file (a valid chunk cut short), and another with the payload
        # overwritten; and a temporary holding a whole valid chunk. All must be misses.
        # File names are the server's derived keys (docs/protocol.md): find each file's client
        # key by its payload, which is random per key.
        by_payload = {v: k for k, v in expected.items()}

        def client_key(path):
            with open(path, "rb") as f:
                f.seek(4096)
                return by_payload[f.read(CHUNK)]

        files = published(export_dir, case)
        assert len(files) >= 3, f"A published {len(files)} chunks before it was killed"
        owners = {p: client_key(p) for p in files}
        torn, bad, hidden = files[:3]
        spoiled = {owners[torn], owners[bad], owners[hidden]}
        with open(torn, "r+b") as f:
            f.truncate(FILE_BYTES // 2)
        with open(bad, "r+b") as f:
            f.seek(4096 + 100)
            f.write(b"\xff" * 64)
        os.rename(hidden, hidden.with_name(f"{hidden.name}.tmp.deadhost.1.0123456789abcdef"))
        temps = sorted(p.name for p in (export_dir / case).glob("*/*/*/*.tmp.*"))
        print(f"\n{kind}: {len(files)} chunks published before the SIGKILL; temporaries "
              f"left: {len(temps) - 1} (and one planted)")
        intact = set(owners.values()) - spoiled
    else:
        spoiled = set()

    with b.connect(ns) as cb:
        if export_dir is not None:
            # Every intact published file is found (by the probe its lookup's miss queues).
            for k in intact:
                assert wait_visible(cb, [k], timeout=30) is not None, k.hex()
        else:
            for _ in range(3):  # lookups, each miss queuing a probe
                for k in keys:
                    cb.lookup([k])
                time.sleep(0.5)
        # Then every key loaded on its own: a miss, or the exact bytes.
        got = load_each(cb, keys)
        hits = 0
        for k, g in zip(keys, got):
            if g is None:
                continue
            hits += 1
            assert k not in spoiled, f"{k.hex()}: a spoiled file was served"
            assert g == expected[k], f"{k.hex()}: wrong bytes"
        assert hits > 0, "B found none of the chunks A published"
        if export_dir is not None:
            hit = {k for k, g in zip(keys, got) if g is not None}
            assert intact <= hit, f"published but missed: {len(intact - hit)}"
        print(f"{kind}: B hit {hits} of {n} keys, every hit the exact bytes")


S3_COUNTER = """
import os, re, sys, time
import boto3
s3 = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
bucket, prefix = sys.argv[1], sys.argv[2]
chunk = re.compile(r"/[0-9a-f]{2}/[0-9a-f]{2}/[0-9a-f]{64}$")
while True:
    n = 0
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        n += sum(1 for o in page.get("Contents", []) if chunk.search(o["Key"]))
    print(n, flush=True)
    time.sleep(0.002)
"""


class ChunkCounter:
    """Counts the chunk files published under a case's directory, over and over, in a thread:
    the export's local path for NFS; for S3, listings by boto3 (from the S3 server's virtual
    environment) in a host namespace, the only place the server is reachable from."""

    def __init__(self, net, kind, root, env, export_dir, case):
        self.latest = self.peak = self.counts = 0  # the last count, the highest, how many
        self.stop = threading.Event()
        self.proc = None
        if kind == "s3":
            venv = os.environ.get("KVTIER_S3_VENV", "/opt/kvtier-s3-venv")
            bucket = root.removeprefix("s3://").split("/")[0]
            self.proc = subprocess.Popen(
                [*net.exec_args(net.hosts["a"]), f"{venv}/bin/python", "-c", S3_COUNTER, bucket,
                 case], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            self.thread = threading.Thread(target=self._read)
        else:
            self.export_dir, self.case = export_dir, case
            self.thread = threading.Thread(target=self._scan)
        self.thread.start()

    def _note(self, n):
        self.latest = n
        self.peak = max(self.peak, n)
        self.counts += 1

    def _read(self):
        for line in self.proc.stdout:
            self._note(int(line))

    def _scan(self):
        while not self.stop.is_set():
            self._note(len(published(self.export_dir, self.case)))
            time.sleep(0.002)

    def fresh(self, timeout=10):
        """The count of a listing that began after this call."""
        seen = self.counts
        t0 = time.monotonic()
        while self.counts < seen + 2 and time.monotonic() - t0 < timeout:
            time.sleep(0.005)
        return self.latest

    def close(self):
        self.stop.set()
        if self.proc:
            self.proc.kill()
            self.proc.wait()
        self.thread.join()


@pytest.mark.parametrize("shared_capacity", [False, True], ids=["alone", "shared_capacity"])
def test_two_hosts_evicting_against_one_capacity(net, shared, hosts, shared_capacity):
    """Both hosts write past one capacity at once. Each tier counts what it knows of
    (docs/file-format.md, "The index"): its own writes at once, the other host's from its next
    rescan (5 s) or probe, so in a burst the directory holds up to both tiers' capacity. With
    shared_capacity each write first counts the other's recent publishes: over by at most the
    writes in flight, one per host with one write thread each."""
    kind, root, env, export_dir = shared
    case = f"capacity-{int(shared_capacity)}"
    cap = 12
    spec = dict(l2_spec(kind, root, case, capacity_chunks=cap), write_threads=1,
                shared_capacity=shared_capacity)
    a = hosts(net, "a", spec, env=env)
    b = hosts(net, "b", spec, env=env)
    ns = key_ns(case)
    n = 48
    counter = ChunkCounter(net, kind, root, env, export_dir, case)
    try:
        with a.connect(ns) as ca, b.connect(ns) as cb:
            ka, kb = make_keys(ns, n, 10), make_keys(ns, n, 11)
            da, db = make_chunks(n, 10), make_chunks(n, 11)
            for i in range(0, n, 4):
                ra = ca.store(ka[i:i + 4], da[i:i + 4])
                rb = cb.store(kb[i:i + 4], db[i:i + 4])
                assert ra.wait(timeout=30).ok and rb.wait(timeout=30).ok
            for c in (ca, cb):  # both tiers have written everything
                t0 = time.monotonic()
                while file_stats(c)["bytes_written"] < n * CHUNK and time.monotonic() - t0 < 60:
                    time.sleep(0.05)
            # Settled: each host's rescans (every 5 s) see the other's files and evict.
            t0 = time.monotonic()
            while counter.fresh() > cap and time.monotonic() - t0 < 30:
                time.sleep(0.1)
            settled = counter.fresh()
    finally:
        counter.close()
    print(f"\n{kind}, {'shared_capacity' if shared_capacity else 'without shared_capacity'}: "
          f"capacity {cap} chunks, 2 hosts x {n} writes: peak {counter.peak} chunk files "
          f"({counter.counts} listings), {settled} after {time.monotonic() - t0:.1f} s")
    assert counter.counts > 0
    assert settled <= cap
    assert counter.peak <= (cap + 2 if shared_capacity else 2 * cap), counter.peak


def file_stats(client):
    """The host's file tier counters (FileTierStats, docs/file-format.md)."""
    return client.stats()["tiers"]["file"]["detail"]


# --- KV-cache events from both hosts (docs/kv-events.md) ---------------------------------------
#
# The subscriber's schema is vLLM's published one (vllm/distributed/kv_events.py, 0.24 to 0.34),
# written out here rather than taken from kvtier, so that what is checked is what a subscriber
# written for vLLM decodes: the batch an array-like struct, the events tagged structs (maps whose
# "type" names the class), hashes uint64 or bytes. Fields that kvtier never sends are declared
# with their defaults, as vLLM declares them.

EVENTS_PORT = 5560
CLONE_NEWNET = 0x40000000


def vllm_schema():
    """(KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared) as vLLM 0.32 declares them."""
    msgspec = pytest.importorskip("msgspec", reason="msgspec is not installed (it comes with vLLM)")
    from typing import Any, Union

    Hash = Union[bytes, int]  # vLLM's ExternalBlockHash

    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]
        data_parallel_rank: Union[int, None] = None

    class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[Hash]
        parent_block_hash: Union[Hash, None]
        token_ids: list[int]
        block_size: int
        lora_id: Union[int, None]
        medium: Union[str, None]
        lora_name: Union[str, None]
        extra_keys: Union[list[Union[tuple[Any, ...], None]], None] = None
        group_idx: Union[int, None] = None
        kv_cache_spec_kind: Union[str, None] = None
        kv_cache_spec_sliding_window: Union[int, None] = None
        locality: Union[str, None] = None
        ownership: Union[str, None] = None
        session_id: Union[str, None] = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[Hash]
        medium: Union[str, None]
        group_idx: Union[int, None] = None
        locality: Union[str, None] = None
        ownership: Union[str, None] = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(EventBatch):
        events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]

    return KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared


def enter_netns(name):
    """Moves the calling thread, and only it, into the network namespace `name` (setns(2) on a
    network namespace is per thread); threads it starts afterwards are born there."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


class Subscriber:
    """One ZMQ SUB socket connected to every host's publisher, as a router's would be. The hosts'
    addresses are reachable from the file server's namespace (the bridge), not from this one: the
    socket lives in a thread that entered that namespace before it made its ZMQ context, whose
    I/O thread (which makes the TCP connections) is then born there too. The thread only
    receives and keeps the raw frames; decoding is the test's. `ready` is set once the ZMTP
    handshake with every publisher is done (the subscription is then on its way, ahead of any
    event a host publishes after)."""

    def __init__(self, netns, endpoints):
        self.zmq = pytest.importorskip("zmq", reason="pyzmq is not installed (it comes with vLLM)")
        self.netns, self.endpoints = netns, endpoints
        self.frames = []  # [topic, seq, payload] as received
        self.ready, self.stop = threading.Event(), threading.Event()
        self.error = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        if not self.ready.wait(timeout=20) or self.error:
            self.close()
            raise RuntimeError(f"the subscriber did not connect: {self.error}")

    def _run(self):
        zmq = self.zmq
        try:
            enter_netns(self.netns)
            from zmq.utils.monitor import recv_monitor_message
            ctx = zmq.Context()
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.setsockopt(zmq.LINGER, 0)
            mon = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
            for ep in self.endpoints:
                sub.connect(ep)
            shaken = 0
            deadline = time.monotonic() + 15
            while shaken < len(self.endpoints) and time.monotonic() < deadline:
                if mon.poll(100):
                    recv_monitor_message(mon)
                    shaken += 1
            if shaken < len(self.endpoints):
                raise RuntimeError(f"{shaken} of {len(self.endpoints)} handshakes")
            self.ready.set()
            while not self.stop.is_set():
                if sub.poll(50):
                    self.frames.append(sub.recv_multipart())
            sub.disable_monitor()
            mon.close()
            sub.close()
            ctx.term()
        except Exception as e:  # reported by the constructor or close()
            self.error = repr(e)
            self.ready.set()

    def close(self):
        self.stop.set()
        self.thread.join(timeout=10)


def event_hash(host, i, j):
    """A made-up vLLM block hash per host, chunk and block (uint64, most above 2^63: msgpack's
    widest form)."""
    return (((ord(host) << 16) + i * 2 + j + 1) * 0x9E3779B97F4A7C15) & (2**64 - 1)


def event_descriptor(host, i, tokens):
    """A chunk's descriptor (docs/kv-events.md): two 8-token vLLM blocks per 16-token chunk."""
    import msgspec
    return msgspec.msgpack.encode({
        "index": i, "block_size": 8, "group_idx": 0,
        "block_hashes": [event_hash(host, i, 0), event_hash(host, i, 1)],
        "parent_block_hash": None if i == 0 else event_hash(host, i - 1, 1),
        "token_ids": np.asarray(tokens, dtype="<u4").tobytes(),
        "lora_id": None, "lora_name": None,
    })


def test_events_of_both_hosts_reach_one_subscriber_in_order(net, nfs, hosts):
    """Both hosts publish on their own address (tcp, --kv-events-bind-host); one SUB socket
    connected to both gets each host's batches with that host's seq strictly increasing from 0
    and no gaps, and each host's events are what that host stored: BlockStored CPU and STORAGE
    for every chunk (write-through), BlockRemoved CPU for those its 8-slot L1 evicted, in an
    order that replays to the host's state. B, having looked A's prefix up, also announces A's
    chunks in STORAGE with A's hashes, read from the chunk files' headers."""
    KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared = vllm_schema()
    import msgspec
    try:
        from vllm.distributed import kv_events as vllm_events
    except ImportError:
        vllm_events = None
    case = "events"
    spec = l2_spec("nfs", nfs.url, case)
    slots = 8
    started = time.monotonic()
    hs = {}
    for name in ("a", "b"):
        hs[name] = hosts(net, name, spec, l1_gb=slots * CHUNK / 2**30, args=[
            "--kv-events",
            "--kv-events-endpoint", f"tcp://*:{EVENTS_PORT}",
            "--kv-events-bind-host", HOST_ADDRS[name], "--kv-events-pod", f"host-{name}"])
    sub = Subscriber(net.server, [f"tcp://{HOST_ADDRS[h]}:{EVENTS_PORT}" for h in hs])
    ns = key_ns(case)
    counts = {"a": 12, "b": 4}  # A's 12 chunks overflow its 8 slots; B's 4 do not
    in_l1, keys_of = {}, {}
    try:
        for name, n in counts.items():
            rng = np.random.default_rng(ord(name))
            tokens = rng.integers(0, 50000, size=16 * n, dtype=np.uint32)
            keys = keys_of[name] = kvtier.chunk_keys(ns, tokens)
            with hs[name].connect(ns) as c:
                c.describe(keys, [event_descriptor(name, i, tokens[16 * i:16 * (i + 1)])
                                  for i in range(n)])
                # Four at a time, each batch written (write-through) before the next: L1 never
                # refuses a store, and evicts its oldest clean chunks once full.
                for at in range(0, n, 4):
                    assert c.store(keys[at:at + 4], make_chunks(4, at)).wait(timeout=30).ok
                    t0 = time.monotonic()
                    while (c.stats()["kv_events"]["stored"]["storage"] < at + 4
                           and time.monotonic() - t0 < 30):
                        time.sleep(0.01)
                in_l1[name] = [c.lookup([k])[1] == 1 for k in keys]
        # B looks A's prefix up: its probe finds A's files, and B, told nothing of them, reads
        # their descriptors from the headers (docs/file-format.md) and announces them in
        # STORAGE under A's hashes.
        with hs["b"].connect(ns) as cb:
            assert wait_visible(cb, keys_of["a"], timeout=30) is not None, hs["b"].log_text()
            t0 = time.monotonic()
            while (cb.stats()["kv_events"]["file_descriptors"]["read"] < counts["a"]
                   and time.monotonic() - t0 < 30):
                time.sleep(0.01)
            assert cb.stats()["kv_events"]["file_descriptors"] == {
                "written": counts["b"], "too_large": 0, "read": counts["a"], "errors": 0}
        # Every batch each host published has arrived (they are sent 10 ms after their first
        # event).
        t0 = time.monotonic()
        published = {}
        while time.monotonic() - t0 < 10:
            for name, h in hs.items():
                with h.connect(ns) as c:
                    published[f"kv@host-{name}@{ns.model_id}"] = c.stats()["kv_events"]["batches"]
            got = {t: sum(1 for f in sub.frames if f[0].decode() == t) for t in published}
            if all(got[t] >= published[t] for t in published):
                break
            time.sleep(0.05)
    finally:
        sub.close()
    assert sub.error is None, sub.error
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    theirs = msgspec.msgpack.Decoder(vllm_events.KVEventBatch) if vllm_events else None
    streams = {}
    for topic, seq, payload in sub.frames:
        batch = decoder.decode(payload)
        if theirs:  # vLLM's own decoder reads the same events
            mine = [msgspec.structs.asdict(e) for e in batch.events]
            assert [{k: v for k, v in msgspec.structs.asdict(e).items() if k in m}
                    for e, m in zip(theirs.decode(payload).events, mine)] == mine
        streams.setdefault(topic.decode(), []).append((int.from_bytes(seq, "big"), batch))
    assert set(streams) == set(published), (set(streams), published)
    order = {name: [event_hash(name, i, j) for i in range(n) for j in (0, 1)]
             for name, n in counts.items()}
    parent_of = {h: p for o in order.values() for h, p in zip(o, [None, *o[:-1]])}
    for name, n in counts.items():
        stream = streams[f"kv@host-{name}@{ns.model_id}"]
        # In order per host: seq 0, 1, 2, ... with no gap, at least as many batches as the host
        # had sent when its counter was read (a rescan may have announced more since).
        assert [s for s, _ in stream] == list(range(len(stream)))
        assert len(stream) >= published[f"kv@host-{name}@{ns.model_id}"]
        mine = set(order[name])
        # B also announces A's chunks, from their headers, in STORAGE only (not in its L1); A
        # may announce B's too, if its rescan (every 5 s) found them before the end.
        others = set(order["b" if name == "a" else "a"])
        required = others if name == "b" else set()
        state = {"CPU": set(), "STORAGE": set()}
        stored = {"CPU": set(), "STORAGE": set()}
        for _, batch in stream:
            assert batch.data_parallel_rank == 0
            for e in batch.events:
                assert not isinstance(e, AllBlocksCleared)
                if isinstance(e, BlockStored):
                    assert set(e.block_hashes) <= mine | (
                        others if e.medium == "STORAGE" else set()), (name, e)
                    # A run of blocks chained to the one before it, as vLLM's own are.
                    assert [e.parent_block_hash, *e.block_hashes[:-1]] == \
                        [parent_of[h] for h in e.block_hashes]
                    assert e.block_size == 8 and len(e.token_ids) == 8 * len(e.block_hashes)
                    assert not state[e.medium] & set(e.block_hashes), "stored twice"
                    state[e.medium] |= set(e.block_hashes)
                    stored[e.medium] |= set(e.block_hashes)
                else:
                    assert isinstance(e, BlockRemoved)
                    assert set(e.block_hashes) <= state[e.medium], "removed before stored"
                    state[e.medium] -= set(e.block_hashes)
        assert stored["CPU"] == mine
        assert stored["STORAGE"] == state["STORAGE"]
        assert mine | required <= state["STORAGE"] <= mine | others
        assert state["CPU"] == {event_hash(name, i, j)
                                for i in range(n) if in_l1[name][i] for j in (0, 1)}
        print(f"\nhost {name}: {len(stream)} batches, seq 0..{len(stream) - 1}, "
              f"{n} chunks stored in CPU and STORAGE, {n - sum(in_l1[name])} removed from CPU, "
              f"{len(state['STORAGE'] - mine) // 2} of the other host's announced in STORAGE")
    assert sum(in_l1["a"]) <= slots < counts["a"]
    print(f"events test: {time.monotonic() - started:.1f} s")
