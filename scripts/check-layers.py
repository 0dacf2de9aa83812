#!/usr/bin/env python3
"""Fails when an #include runs up kvtier's layers (docs/architecture.md, "Layers").

Every header belongs to a unit and every unit has a layer. A non-test source may include headers
of its own unit and of units in lower layers only; a public header (include/kvtier/) likewise.
Tests (*_test.cc and the testing/ folders) are exempt: a test may reach any layer.
Usage: check-layers.py [REPO_ROOT]
"""
import pathlib
import re
import sys

# unit -> (layer, headers it owns, source folders or files it owns)
UNITS = {
    "common": (0, ["kvtier/status.h", "kvtier/chunk_key.h", "kvtier/layout.h", "kvtier/store.h",
                   "kvtier/socket_path.h", "kvtier/tier_listener.h", "common/"], ["src/common/"]),
    "protocol": (1, ["server/codec.h"], ["src/server/codec.cc", "src/server/fuzz/"]),
    "io": (1, ["kvtier/io.h", "io/"], ["src/io/"]),
    # KV-cache events in vLLM's format (docs/kv-events.md): fed by the tiers' listeners.
    "events": (1, ["events/"], ["src/events/"]),
    "gpu": (1, ["kvtier/paged_kv.h", "gpu/"], ["src/gpu/"]),
    "memory_tier": (2, ["kvtier/eviction.h", "kvtier/memory_tier.h", "tier/memory/"],
                    ["src/tier/memory/"]),
    "file_tier": (2, ["kvtier/file_tier.h", "kvtier/cache_dir.h", "tier/file/"],
                  ["src/tier/file/"]),
    "engine": (3, ["kvtier/engine.h", "engine/"], ["src/engine/"]),
    # The client links without the engine: a sibling of it, not above it.
    "client": (3, ["kvtier/client.h", "client/"], ["src/client/"]),
    "chunk_store": (4, ["kvtier/chunk_store.h"], ["src/engine/chunk_store.cc"]),
    "server": (4, ["server/"], ["src/server/"]),
    "loadgen": (5, ["loadgen/"], ["src/loadgen/"]),
    "probe": (5, ["probe/"], ["src/probe/"]),
    "planner": (6, ["planner/"], ["src/planner/"]),
    # What `kvtier bench server` and `kvtier bench tier` measure; drives a server and its clients.
    "benchmarks": (6, ["benchmarks/"], ["src/benchmarks/"]),
    # What `kvtier stress` runs: a server, its clients and an adversary, as processes.
    "stress": (6, ["stress/"], ["src/stress/"]),
    "python": (7, ["python/"], ["src/python/"]),
    "tools": (8, ["tools/"], ["src/tools/"]),
    # Test helpers (temporary directories, waits, NFS targets), also used by bench commands.
    "testing": (2, ["testing/"], ["src/testing/"]),
}


# Units that never include each other, whatever their layers: the server and its client share
# only the protocol and the common vocabulary.
APART = {("server", "client"), ("client", "server")}


def owner(path, kind):
    """The unit owning `path` (kind 0: an include path, 1: a repository path): longest match."""
    best, best_len = None, -1
    for unit, spec in UNITS.items():
        for prefix in spec[1 + kind]:
            exact = not prefix.endswith("/")
            if (path == prefix if exact else path.startswith(prefix)) and len(prefix) > best_len:
                best, best_len = unit, len(prefix)
    return best


def is_test(rel):
    return bool(re.search(r"_test\.(cc|h)$", rel)) or "/testing/" in rel or \
        rel.endswith("/test_chunks.h")


def main():
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve()
    include = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
    errors, checked = [], 0
    files = [p for p in (root / "src").rglob("*") if p.suffix in (".cc", ".h", ".cu", ".cuh")]
    files += list((root / "include" / "kvtier").glob("*.h"))
    for path in sorted(files):
        rel = path.relative_to(root).as_posix()
        if is_test(rel):
            continue
        unit = owner(rel.removeprefix("include/"), 0) if rel.startswith("include/") \
            else owner(rel, 1)
        if unit is None:
            errors.append(f"{rel}: belongs to no unit; add it to UNITS in {sys.argv[0]}")
            continue
        checked += 1
        layer = UNITS[unit][0]
        for inc in include.findall(path.read_text(errors="replace")):
            target = owner(inc, 0)
            if target is None or target == unit:
                continue
            if UNITS[target][0] >= layer or (unit, target) in APART:
                errors.append(f"{rel} ({unit}, layer {layer}) includes {inc} "
                              f"({target}, layer {UNITS[target][0]})")
    for e in errors:
        print("layer violation:", e)
    print(f"check-layers: {checked} files, {len(errors)} includes up the layers")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
