#!/usr/bin/env python3
"""Plain parallel S3 PUT/GET with boto3: the reference kvtier's own S3 client is compared with.

PUTs N objects of SIZE bytes (one put_object each, from one preallocated body, so no data
generation is timed), GETs them back into memory (get_object()["Body"].read(), length checked),
then deletes them; T requests at a time from a thread pool, each phase timed on its own.
boto3 keeps its defaults otherwise: over http:// it hashes every body for the SigV4 signature
and adds a CRC32 checksum, as any boto3 program would.

Endpoint, credentials and region come from the standard AWS_* variables, as after
    eval "$(scripts/s3-server.sh env)"
and the bucket from --url (default $KVTIER_TEST_S3_URL). Needs boto3; the virtual environment
scripts/s3-server.sh installs has it:
    /opt/kvtier-s3-venv/bin/python scripts/s3-reference.py --objects 16 --size 36MiB --threads 4
"""
import argparse
import json
import os
import re
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

try:
    import boto3
    from botocore.config import Config
except ImportError:
    sys.exit("s3-reference: needs boto3; run it with the Python of scripts/s3-server.sh's "
             "virtual environment, e.g. /opt/kvtier-s3-venv/bin/python")

UNITS = {"": 1, "B": 1, "K": 1000, "KB": 1000, "M": 1000**2, "MB": 1000**2, "G": 1000**3,
         "GB": 1000**3, "KIB": 1024, "MIB": 1024**2, "GIB": 1024**3}


def size(text):
    m = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 1048576, 36MiB, 64MB)")
    return int(m.group(1)) * UNITS[m.group(2).upper()]


def phase(name, pool, fn, keys, nbytes):
    start = time.perf_counter()
    list(pool.map(fn, keys))  # list(): raises the first request's error, if any
    seconds = time.perf_counter() - start
    return {"phase": name, "objects": len(keys), "bytes": nbytes, "seconds": seconds,
            "gb_per_s": nbytes / seconds / 1e9 if nbytes else None,
            "objects_per_s": len(keys) / seconds}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default=os.environ.get("KVTIER_TEST_S3_URL"),
                    help="s3://BUCKET[/PREFIX] (default: $KVTIER_TEST_S3_URL)")
    ap.add_argument("--prefix", default=f"s3-reference-{uuid.uuid4().hex[:12]}",
                    help="key prefix under the URL's (default: s3-reference-RANDOM)")
    ap.add_argument("--objects", type=int, default=16, help="objects (default 16)")
    ap.add_argument("--size", type=size, default=size("36MiB"),
                    help="bytes per object; K/M/G[B] are decimal, KiB/MiB/GiB binary "
                         "(default 36MiB)")
    ap.add_argument("--threads", type=int, default=4, help="requests at a time (default 4)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead")
    args = ap.parse_args()
    m = re.fullmatch(r"s3://([^/]+)/?(.*)", args.url or "")
    if not m:
        ap.error("--url s3://BUCKET[/PREFIX] is required (or set KVTIER_TEST_S3_URL)")
    if args.objects < 1 or args.threads < 1:
        ap.error("--objects and --threads must be at least 1")
    bucket = m.group(1)
    prefix = "/".join(p.strip("/") for p in (m.group(2), args.prefix) if p.strip("/"))
    keys = [f"{prefix}/{i:06d}" for i in range(args.objects)]

    # boto3 reads AWS_ENDPOINT_URL and the keys itself, but the region only from
    # AWS_DEFAULT_REGION. A pool smaller than the thread count would serialize requests.
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    s3 = boto3.client("s3", region_name=region,
                      config=Config(max_pool_connections=max(10, args.threads)))
    body = os.urandom(args.size)

    def put(key):
        s3.put_object(Bucket=bucket, Key=key, Body=body)

    def get(key):
        n = len(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
        if n != args.size:
            raise RuntimeError(f"GET s3://{bucket}/{key}: {n} bytes, expected {args.size}")

    def delete(key):
        s3.delete_object(Bucket=bucket, Key=key)

    total = args.objects * args.size
    with ThreadPoolExecutor(args.threads) as pool:
        try:
            results = [phase("put", pool, put, keys, total), phase("get", pool, get, keys, total)]
        finally:
            # Also after a failure: leave nothing behind in the bucket.
            done = phase("delete", pool, delete, keys, 0)
        results.append(done)

    if args.json:
        print(json.dumps({"endpoint": s3.meta.endpoint_url, "url": f"s3://{bucket}/{prefix}",
                          "objects": args.objects, "size": args.size, "threads": args.threads,
                          "phases": {r.pop("phase"): r for r in results}}))
        return
    print(f"{s3.meta.endpoint_url} s3://{bucket}/{prefix}: {args.objects} objects of "
          f"{args.size} bytes, {args.threads} threads")
    for r in results:
        rate = "-" if r["gb_per_s"] is None else f"{r['gb_per_s']:.3f}"
        print(f"{r['phase']:<7}{r['objects']:>7} objects {r['bytes'] / 1e6:>11.1f} MB "
              f"{r['seconds']:>9.3f} s {rate:>8} GB/s {r['objects_per_s']:>9.1f} obj/s")


if __name__ == "__main__":
    main()
