"""kvtier's KV-cache events, the connector's side: the descriptors of saved chunks carry vLLM's
own block hashes (docs/kv-events.md), checked with vLLM's hash functions and block pool. End to
end against the events vLLM itself publishes: test_connector.py's in-process test."""

from __future__ import annotations

import struct
import time

import msgspec
import pytest

import kvtier
from kvtier.vllm import compat
from kvtier.vllm.config import ConfigError, parse_config
from kvtier.vllm.events import chunk_hashes, encode_descriptor

TOKENS = list(range(1000, 1064))
# docs/kv-events.md, "Worked example": vLLM's block hashes of tokens 1000..1063 (block size 16,
# sha256, the fixed seed) as its events publish them, and kvtier's chunk keys (chunk_tokens 32).
EVENT_HASHES = [7322446309363477352, 17027874615116373601, 2147986591436168966,
                12280578781915239197]
DIGEST_2 = ("caf3fc6b", "a4dadf06")
KVTIER_ROOT = ("07ffa5cf", "33cf1e45")
KVTIER_KEYS = [("6220b4b6", "567f72e3"), ("1bbe61d0", "4229d777")]


def _hex_is(value: bytes, ends: tuple[str, str]) -> bool:
    return value.hex().startswith(ends[0]) and value.hex().endswith(ends[1])


@pytest.fixture
def sha256_hashing(monkeypatch):
    """vLLM's block hashing as its engine sets it up with the default `sha256`: NONE_HASH from
    the fixed seed (PYTHONHASHSEED unset), restored afterwards."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    monkeypatch.delenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", raising=False)
    for name in ("NONE_HASH", "_NONE_HASH_SEED"):
        monkeypatch.setattr(kv_cache_utils, name, getattr(kv_cache_utils, name, None),
                            raising=False)
    kv_cache_utils.init_none_hash(sha256)
    return kv_cache_utils.get_request_block_hasher(16, sha256)


def _request(hasher, tokens, **kwargs):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request("r", list(tokens), SamplingParams(max_tokens=1), None, block_hasher=hasher,
                   **kwargs)


def _descriptors(request, keys, chunk_tokens=32, block_size=16):
    hashing = compat.event_hashing()
    chunks = chunk_hashes(hashing, request, keys, 0, chunk_tokens, block_size, block_size)
    return [msgspec.msgpack.decode(encode_descriptor(hashing, c, block_size, 0))
            for c in chunks]


def test_descriptor_of_the_worked_example(sha256_hashing, monkeypatch):
    ns = kvtier.KeyNamespace("Qwen/Qwen3-8B", 0x0123456789ABCDEF, 32, 0, 1, "")
    root = ns.root()
    keys = [kvtier.chain_chunk_key(root, TOKENS[:32])]
    keys.append(kvtier.chain_chunk_key(keys[0], TOKENS[32:]))
    assert _hex_is(root, KVTIER_ROOT)
    assert all(_hex_is(k, want) for k, want in zip(keys, KVTIER_KEYS))

    request = _request(sha256_hashing, TOKENS)
    # The hashes as this vLLM's events publish them, from its own block hasher: what a
    # descriptor must carry on every version. The worked example's figures are vLLM 0.31's and
    # later (whose block-hash inputs changed with the tagged extra keys): checked there.
    hashing = compat.event_hashing()
    published = [hashing.convert(h) for h in request.block_hashes]
    if hashing.to_event_extra_keys is not None:
        assert published == EVENT_HASHES
    d0, d1 = _descriptors(request, keys)
    assert d0 == {"index": 0, "block_size": 16, "group_idx": 0,
                  "block_hashes": published[:2], "parent_block_hash": None,
                  "token_ids": struct.pack("<32I", *TOKENS[:32]), "lora_id": None,
                  "lora_name": None}
    assert d1 == {"index": 1, "block_size": 16, "group_idx": 0,
                  "block_hashes": published[2:], "parent_block_hash": published[1],
                  "token_ids": struct.pack("<32I", *TOKENS[32:]), "lora_id": None,
                  "lora_name": None}
    # The whole chunk as one 32-token block (a coarser KV cache group over 16-token hashes):
    # its hash is the chunk's last 16-token block's, its parent the previous chunk's last.
    (c1,) = chunk_hashes(hashing, request, keys[1:], 1, 32, 32, 16)
    d = msgspec.msgpack.decode(encode_descriptor(hashing, c1, 32, 0))
    assert d["block_hashes"] == published[3:] and d["parent_block_hash"] == published[1]

    # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0: the digests themselves, whose low 64 bits are the
    # int form.
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    _, d1 = _descriptors(request, keys)
    digests = d1["block_hashes"]
    assert all(isinstance(h, bytes) and len(h) == 32 for h in digests)
    if hashing.to_event_extra_keys is not None:
        assert _hex_is(digests[0], DIGEST_2)
    assert [int.from_bytes(h[-8:], "big") for h in digests] == published[2:]
    assert int.from_bytes(d1["parent_block_hash"][-8:], "big") == published[1]


def test_descriptor_matches_vllms_block_pool_with_salt_and_lora(sha256_hashing):
    """With a cache salt and a LoRA adapter (extra keys): the descriptors carry what vLLM's own
    block pool publishes for the same blocks, field for field."""
    from vllm.distributed.kv_events import BlockStored
    from vllm.lora.request import LoRARequest
    from vllm.v1.core.block_pool import BlockPool

    request = _request(sha256_hashing, TOKENS, cache_salt="salt",
                       lora_request=LoRARequest("adapter", 7, "/adapters/a"))
    pool = BlockPool(8, True, 16, enable_kv_cache_events=True)
    pool.cache_full_blocks(request, pool.get_new_blocks(4), 0, 4, 16, 0)
    (gpu,) = [e for e in pool.take_events() if isinstance(e, BlockStored)]

    descs = _descriptors(request, [b"k0" * 16, b"k1" * 16])
    assert [h for d in descs for h in d["block_hashes"]] == gpu.block_hashes
    assert descs[1]["parent_block_hash"] == gpu.block_hashes[1]
    assert not set(gpu.block_hashes) & set(EVENT_HASHES)  # the salt and adapter changed them
    gpu_extra = msgspec.msgpack.decode(msgspec.msgpack.encode(gpu.extra_keys))
    for i, d in enumerate(descs):
        assert (d["lora_id"], d["lora_name"]) == (gpu.lora_id, gpu.lora_name) == (7, "adapter")
        assert msgspec.msgpack.decode(d["extra_keys"]) == gpu_extra[2 * i:2 * i + 2]
        assert struct.unpack("<32I", d["token_ids"]) == tuple(gpu.token_ids[32 * i:32 * i + 32])
    assert gpu_extra[0] == ["adapter", "salt"] and gpu_extra[1] == ["adapter"]


def test_event_hashing_before_and_after_to_event_extra_keys():
    """0.26-0.30 publish generate_block_hash_extra_keys' keys as they are; 0.31+ through
    to_event_extra_keys. A vLLM without the hash conversion is refused by name."""
    import types

    from vllm.v1.core import kv_cache_utils as utils

    old = types.SimpleNamespace(maybe_convert_block_hash=utils.maybe_convert_block_hash,
                                generate_block_hash_extra_keys=utils.generate_block_hash_extra_keys)
    h = compat.detect_event_hashing(old)
    assert h.to_event_extra_keys is None
    assert h.resolve([b"x"], 16, 16) == [b"x"]
    with pytest.raises(compat.UnsupportedVllmError):
        h.resolve([b"x"], 16, 32)
    assert (compat.detect_event_hashing(utils).to_event_extra_keys
            is getattr(utils, "to_event_extra_keys", None))
    with pytest.raises(compat.UnsupportedVllmError, match="maybe_convert_block_hash"):
        compat.detect_event_hashing(types.SimpleNamespace())


def test_describer_never_waits_for_a_stalled_server(sha256_hashing, tmp_path):
    """`kvtier serve` stopped (SIGSTOP) while the scheduler queues descriptors: queueing returns
    at once, what the bounded queue cannot hold is dropped and counted; once the server runs
    again the queued ones are sent."""
    import os
    import shutil
    import signal
    import subprocess
    import sys
    import threading

    from kvtier.vllm.events import MAX_PENDING, Describer

    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    binary = os.environ.get("KVTIER_BINARY") or shutil.which("kvtier", path=path)
    assert binary, "the kvtier CLI is not installed next to this interpreter nor on PATH"
    sock = str(tmp_path / "s.sock")
    proc = subprocess.Popen([binary, "serve", "--socket", sock, "--http-port", "-1",
                             "--l1-size-gb", "0.0625", "--chunk-bytes", "65536", "--no-l2",
                             "--log-level", "warn"])
    counts: dict[str, int] = {}
    lock = threading.Lock()

    def count(name: str, value: int) -> None:
        with lock:
            counts[name] = counts.get(name, 0) + value

    describer = None
    try:
        deadline = time.monotonic() + 20
        while not os.path.exists(sock):
            assert proc.poll() is None and time.monotonic() < deadline, "kvtier serve died"
            time.sleep(0.02)
        ns = kvtier.KeyNamespace("describe-test", 1, 32, 0, 1, "")
        client = kvtier.connect(ns, 65536, socket_path=sock, rpc_timeout_ms=60000)
        request = _request(sha256_hashing, TOKENS)
        keys = [kvtier.chain_chunk_key(ns.root(), TOKENS[:32])]
        keys.append(kvtier.chain_chunk_key(keys[0], TOKENS[32:]))
        proc.send_signal(signal.SIGSTOP)
        describer = Describer(compat.event_hashing(), lambda: client, count, 32, 16, 16, 0)
        queued = 2 * MAX_PENDING
        t0 = time.monotonic()
        for _ in range(queued // 2):
            describer.add(request, keys, 0)
        # A describe waits for the stopped server up to the 60 s RPC timeout: queueing did not.
        assert time.monotonic() - t0 < 30
        assert counts["describes_dropped"] >= queued - MAX_PENDING - 64
        proc.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 60
        while counts.get("chunks_described", 0) + counts["describes_dropped"] < queued:
            assert time.monotonic() < deadline, counts
            time.sleep(0.05)
        assert counts["chunks_described"] >= MAX_PENDING
        client.close()
    finally:
        if describer is not None:
            describer.close()
        proc.send_signal(signal.SIGCONT)
        proc.terminate()
        proc.wait(30)


@pytest.mark.parametrize("extra,error", [
    ({"kvtier.kv_events": "on"}, "expected \"off\", \"describe\""),
    ({"kvtier.kv_events": "vllm"}, "not supported yet"),
    ({"kvtier.kv_events": {"relay": True}}, "not supported yet"),
    ({"kvtier.kv_events": "{bad json"}, "kvtier.kv_events"),
    ({"kvtier.kv_events": "describe"}, "is for server mode"),
    ({"kvtier.socket": "/s", "kvtier.kv_events": {"endpoint": "ipc:///e"}}, "in server mode"),
])
def test_kv_events_config_refuses_bad_values(extra, error):
    with pytest.raises(ConfigError, match=error):
        parse_config(extra)


def test_kv_events_config_values():
    assert parse_config({}).kv_events == "off" and not parse_config({}).describes
    cfg = parse_config({"kvtier.socket": "/s", "kvtier.kv_events": "describe"})
    assert cfg.describes
    cfg = parse_config({"kvtier.kv_events": '{"endpoint": "ipc:///tmp/e", "batch_ms": 5}'})
    assert cfg.kv_events == {"endpoint": "ipc:///tmp/e", "batch_ms": 5} and cfg.describes
    for off in ({"enabled": False}, {"enable_kv_cache_events": False}, {"publisher": "null"}):
        assert not parse_config({"kvtier.kv_events": off}).describes
