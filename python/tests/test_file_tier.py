"""kvtier.open_file_tier: the file tier alone, reading into and writing from a caller's buffer."""

import mmap
import os

import pytest

import kvtier

CHUNK = 64 * 1024


def ns(name="file-tier-test"):
    return kvtier.KeyNamespace(name, 7, 256)


def keys(n, tag=0):
    return [bytes([tag, i]) * 16 for i in range(n)]


def region(n):
    """Page-aligned memory, as vLLM's CPU offload region is."""
    return memoryview(mmap.mmap(-1, n * CHUNK))


def fill(view, n, seed):
    for i in range(n):
        view[i * CHUNK:(i + 1) * CHUNK] = bytes([(seed + i) % 251]) * CHUNK


def finish(tier):
    assert tier.wait_idle(10)
    return tier.finished()


def test_write_then_read_back_in_place(tmp_path):
    src, dst = region(6), region(6)
    fill(src, 6, 3)
    with kvtier.open_file_tier(ns(), CHUNK, {"type": "fs", "path": str(tmp_path)}) as tier:
        tier.submit_write(11, keys(6), src, [i * CHUNK for i in range(6)])
        [(job, ok, chunks, error, seconds)] = finish(tier)
        assert (job, ok, chunks, error) == (11, True, 6, "") and seconds > 0
        assert tier.contains(keys(7)) == [True] * 6 + [False]
        # Reversed slots: offsets name where each chunk goes.
        tier.submit_read(12, keys(6), dst, [(5 - i) * CHUNK for i in range(6)])
        assert finish(tier) == [(12, True, 6, "", pytest.approx(0, abs=10))]
        for i in range(6):
            assert dst[(5 - i) * CHUNK:(6 - i) * CHUNK] == src[i * CHUNK:(i + 1) * CHUNK]
        st = tier.stats()
        if st["o_direct"]:
            assert st["bounce_copies"] == 0  # page-aligned chunks: read and written in place
        assert st["chunks"] == 6 and st["bytes_read"] == 6 * CHUNK
        assert tier.in_flight == 0 and tier.finished() == []
        assert os.path.exists(tier.chunk_path(keys(1)[0]))
        assert tier.chunk_path(keys(1)[0]).startswith(tier.namespace_dir)


def test_missing_and_corrupt_chunks_fail_reads_and_report_the_good_prefix(tmp_path):
    src, dst = region(4), region(4)
    fill(src, 4, 9)
    with kvtier.open_file_tier(ns(), CHUNK, {"type": "fs", "path": str(tmp_path)}) as tier:
        tier.submit_write(1, keys(3), src, [0, CHUNK, 2 * CHUNK])
        assert finish(tier)[0][1]
        # Flip one payload byte of chunk 1: its checksum no longer matches.
        path = tier.chunk_path(keys(3)[1])
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) - 1)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
        tier.submit_read(2, keys(4), dst, [i * CHUNK for i in range(4)])
        [(job, ok, chunks, error, _)] = finish(tier)
        assert (job, ok, chunks) == (2, False, 1) and error
        assert dst[:CHUNK] == src[:CHUNK]
        assert tier.stats()["corrupt"] == 1
        assert tier.contains(keys(3)) == [True, False, True]  # removed, never served


def test_arguments_are_checked_before_any_io(tmp_path):
    buf = region(2)
    with kvtier.open_file_tier(ns(), CHUNK, {"type": "fs", "path": str(tmp_path)}) as tier:
        with pytest.raises(kvtier.InvalidArgumentError, match="outside"):
            tier.submit_read(1, keys(1), buf, [CHUNK + 1])
        with pytest.raises(kvtier.InvalidArgumentError, match="outside"):
            tier.submit_write(1, keys(1), buf, [-1])
        with pytest.raises(kvtier.InvalidArgumentError, match="2 keys but 1 offsets"):
            tier.submit_write(1, keys(2), buf, [0])
        with pytest.raises(kvtier.InvalidArgumentError):
            tier.submit_read(1, keys(1), bytes(2 * CHUNK), [0])  # not writable
        with pytest.raises(ValueError):
            tier.submit_read(1, [b"short"], buf, [0])
        assert tier.in_flight == 0 and tier.finished() == []
        tier.submit_write(3, [], buf, [])  # an empty job finishes at once
        assert finish(tier) == [(3, True, 0, "", pytest.approx(0, abs=1))]
    with pytest.raises(kvtier.InvalidArgumentError, match="unknown L2 key"):
        kvtier.open_file_tier(ns(), CHUNK, {"type": "fs", "path": str(tmp_path), "size": 1})
    with pytest.raises(kvtier.InvalidArgumentError):
        kvtier.open_file_tier(ns(), 0, {"type": "fs", "path": str(tmp_path)})


def test_close_waits_for_jobs_and_gives_buffers_back(tmp_path):
    buf = bytearray(8 * CHUNK)
    view = memoryview(buf)
    tier = kvtier.open_file_tier(ns(), CHUNK, {"type": "fs", "path": str(tmp_path)})
    tier.submit_write(5, keys(8), view, [i * CHUNK for i in range(8)])
    tier.close()
    assert tier.closed and tier.in_flight == 0
    view.release()  # no export of it is left
    buf.extend(b"x")  # a bytearray with an export could not be resized
    assert [r[:3] for r in tier.finished()] == [(5, True, 8)]
    with pytest.raises(kvtier.KvtierError, match="closed"):
        tier.contains(keys(1))
    tier.close()  # idempotent
    # The chunks outlive the tier: a new one indexes them at open.
    with kvtier.open_file_tier(ns(), CHUNK, {"type": "fs", "path": str(tmp_path)}) as again:
        assert again.contains(keys(8)) == [True] * 8
    with kvtier.open_file_tier(ns("another"), CHUNK, {"type": "fs", "path": str(tmp_path)}) as o:
        assert o.contains(keys(8)) == [False] * 8


def test_capacity_is_enforced(tmp_path):
    buf = region(16)
    # About 8 chunk files (a file is the payload plus a 4 KiB header).
    cap_gb = 8 * (CHUNK + 4096) / 2**30
    l2 = {"type": "fs", "path": str(tmp_path), "max_size_gb": cap_gb}
    with kvtier.open_file_tier(ns(), CHUNK, l2) as tier:
        for j in range(4):
            tier.submit_write(j, keys(4, tag=j), buf, [i * CHUNK for i in range(4)])
            assert finish(tier)[0][1]
        st = tier.stats()
        assert st["chunks"] <= 8 and st["evictions"] >= 8
        assert st["bytes"] <= st["capacity_bytes"]


def nfs_export():
    """The loopback NFS server of scripts/nfs-server.sh: (url, local dir of the same export)."""
    url, local = os.environ.get("KVTIER_TEST_NFS_URL"), os.environ.get("KVTIER_TEST_NFS_EXPORT_DIR")
    if not url or not local:
        if os.environ.get("KVTIER_REQUIRE_NFS") == "1":
            pytest.fail("KVTIER_REQUIRE_NFS=1 but no NFS test server (scripts/nfs-server.sh env)")
        pytest.skip("no NFS test server (scripts/nfs-server.sh start; eval its env)")
    return url, local


def test_an_nfs_url_tier_shares_chunks_with_the_export_path(tmp_path):
    """The same JSON as `kvtier serve --l2`, with an nfs:// URL: no mount; a tier on the
    export's local path reads what it wrote."""
    url, local = nfs_export()
    name = os.path.basename(str(tmp_path))
    src, dst = region(3), region(3)
    fill(src, 3, 5)
    spec = {"type": "nfs", "url": f"{url}/{name}", "connections": 2}
    try:
        with kvtier.open_file_tier(ns(), CHUNK, spec) as tier:
            tier.submit_write(1, keys(3), src, [i * CHUNK for i in range(3)])
            assert finish(tier)[0][1:4] == (True, 3, "")
            assert tier.chunk_path(keys(1)[0]).startswith(f"{url}/{name}/")
            assert tier.stats()["io_engine"].startswith("nfs")
        with kvtier.open_file_tier(ns(), CHUNK, {"type": "fs", "path": f"{local}/{name}"}) as tier:
            tier.submit_read(2, keys(3), dst, [i * CHUNK for i in range(3)])
            assert finish(tier)[0][1:4] == (True, 3, "")
            assert bytes(dst) == bytes(src)
    finally:
        import shutil
        shutil.rmtree(f"{local}/{name}", ignore_errors=True)


def test_a_bad_nfs_url_is_refused_with_the_reason():
    with pytest.raises(kvtier.KvtierError, match="nfs://"):
        kvtier.open_file_tier(ns(), CHUNK, {"type": "nfs", "url": "/not/a/url"})


def s3_bucket():
    """The loopback S3 server of scripts/s3-server.sh (its AWS_* variables are in the
    environment): the bucket's URL."""
    url = os.environ.get("KVTIER_TEST_S3_URL")
    if not url or not os.environ.get("AWS_ENDPOINT_URL"):
        if os.environ.get("KVTIER_REQUIRE_S3") == "1":
            pytest.fail("KVTIER_REQUIRE_S3=1 but no S3 test server (scripts/s3-server.sh env)")
        pytest.skip("no S3 test server (scripts/s3-server.sh start; eval its env)")
    return url


def test_an_s3_tier_stores_objects_that_a_new_tier_finds(tmp_path):
    """The same JSON as `kvtier serve --l2`, with an s3:// URL: the chunks are objects that a
    second tier (a restart, another host) indexes and reads."""
    url = f"{s3_bucket()}/py-{os.path.basename(str(tmp_path))}"
    src, dst = region(3), region(3)
    fill(src, 3, 9)
    spec = {"type": "s3", "url": url, "connections": 4}
    with kvtier.open_file_tier(ns(), CHUNK, spec) as tier:
        tier.submit_write(1, keys(3), src, [i * CHUNK for i in range(3)])
        assert finish(tier)[0][1:4] == (True, 3, "")
        assert tier.chunk_path(keys(1)[0]).startswith(f"{url}/")
        assert tier.stats()["io_engine"] == "s3"
    with kvtier.open_file_tier(ns(), CHUNK, spec) as tier:
        assert tier.stats()["chunks"] == 3
        tier.submit_read(2, keys(3), dst, [i * CHUNK for i in range(3)])
        assert finish(tier)[0][1:4] == (True, 3, "")
        assert bytes(dst) == bytes(src)


def test_a_bad_s3_url_or_secret_is_refused_with_the_reason(monkeypatch):
    with pytest.raises(kvtier.KvtierError, match="s3://"):
        kvtier.open_file_tier(ns(), CHUNK, {"type": "s3", "url": "/not/a/url"})
    url = s3_bucket()
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    with pytest.raises(kvtier.KvtierError, match="SignatureDoesNotMatch"):
        kvtier.open_file_tier(ns(), CHUNK, {"type": "s3", "url": f"{url}/py-bad"})


@pytest.mark.parametrize("l2_sync, kwargs", [(False, {}), (True, {"sync_data": False}),
                                             (None, {"sync_data": True})])
def test_sync_data_from_the_l2_object_or_the_argument(tmp_path, l2_sync, kwargs):
    # kvtier serve's L2 JSON takes "sync_data"; open_file_tier's argument, when given, wins.
    spec = {"type": "fs", "path": str(tmp_path)}
    if l2_sync is not None:
        spec["sync_data"] = l2_sync
    src, dst = region(2), region(2)
    fill(src, 2, 5)
    with kvtier.open_file_tier(ns(), CHUNK, spec, **kwargs) as tier:
        tier.submit_write(1, keys(2), src, [0, CHUNK])
        assert finish(tier)[0][:4] == (1, True, 2, "")
        tier.submit_read(2, keys(2), dst, [0, CHUNK])
        assert finish(tier)[0][:4] == (2, True, 2, "") and dst == src
    with pytest.raises(kvtier.InvalidArgumentError, match="sync_data"):
        kvtier.open_file_tier(ns(), CHUNK, dict(spec, sync_data="no"))
