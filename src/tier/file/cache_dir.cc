#include "kvtier/cache_dir.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <nlohmann/json.hpp>
#include <thread>

#include "tier/file/chunk_file.h"

namespace kvtier {

using namespace file_tier_internal;  // NOLINT

std::string_view FsckFindingKindName(FsckFinding::Kind kind) {
  switch (kind) {
    case FsckFinding::Kind::kCorrupt:
      return "corrupt";
    case FsckFinding::Kind::kForeign:
      return "foreign";
    case FsckFinding::Kind::kStaleTemp:
      return "stale_temp";
    case FsckFinding::Kind::kUnknown:
      return "unknown";
  }
  return "?";
}

namespace {

// `env` if given, else the env for `root`: the default POSIX one, or an NFS one for nfs://.
Result<EnvForPath> EnvFor(const std::string& root, Env* env) {
  if (env != nullptr) return EnvForPath{env, nullptr};
  return OpenEnvForPath(root);
}

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

Result<std::string> ReadSmallFile(Env* env, const std::string& path, size_t limit = 1 << 20) {
  KVTIER_ASSIGN_OR_RETURN(auto file, env->Open(path, OpenOptions{}));
  KVTIER_ASSIGN_OR_RETURN(uint64_t size, file->Size());
  if (size > limit) return Status::InvalidArgument(fmt::format("{} is too large", path));
  std::string out(size, '\0');
  IoOp op = IoOp::Read(0, std::span<uint8_t>(reinterpret_cast<uint8_t*>(out.data()), size));
  KVTIER_RETURN_IF_ERROR(ReadExact(*file, std::span<IoOp>(&op, 1)));
  return out;
}

// One file found by the walk, with what the walk already knows about it.
struct Item {
  enum class Kind { kChunk, kTemp, kUnknown } kind;
  std::string path;
  std::string ns;     // namespace folder name, for chunks
  std::string place;  // "<aa><bb>" of the leaf folder, for chunks
  std::string name;
};

// Walks root/<ns>/<aa>/<bb>/*. Missing folders (removed while we walk) are skipped.
Status Walk(Env* env, const std::string& root, std::vector<Item>* items, uint64_t* namespaces) {
  KVTIER_ASSIGN_OR_RETURN(auto top, env->List(root));
  for (const DirEntry& n : top) {
    const std::string npath = fmt::format("{}/{}", root, n.name);
    if (n.name == kMarkerName || n.name == "lost+found" || n.name[0] == '.') continue;
    if (n.name.starts_with(kMarkerName) && n.name.find(kTempInfix) != std::string::npos) {
      items->push_back({Item::Kind::kTemp, npath, "", "", n.name});
      continue;
    }
    if (!(IsNamespaceName(n.name) && n.type == DirEntry::Type::kDirectory)) {
      items->push_back({Item::Kind::kUnknown, npath, "", "", n.name});
      continue;
    }
    ++*namespaces;
    auto l1 = env->List(npath);
    if (!l1.ok()) continue;
    for (const DirEntry& a : *l1) {
      const std::string apath = fmt::format("{}/{}", npath, a.name);
      if (a.name == kNamespaceFileName) continue;
      // Markers of recent publishes (shared_capacity): short-lived, removed by the tiers.
      if (a.name == kRecentDirName && a.type == DirEntry::Type::kDirectory) continue;
      if (a.name.starts_with(kNamespaceFileName) && a.name.find(kTempInfix) != std::string::npos) {
        items->push_back({Item::Kind::kTemp, apath, n.name, "", a.name});
        continue;
      }
      if (!(IsHexByteName(a.name) && a.type == DirEntry::Type::kDirectory)) {
        items->push_back({Item::Kind::kUnknown, apath, n.name, "", a.name});
        continue;
      }
      auto l2 = env->List(apath);
      if (!l2.ok()) continue;
      for (const DirEntry& b : *l2) {
        const std::string bpath = fmt::format("{}/{}", apath, b.name);
        if (!(IsHexByteName(b.name) && b.type == DirEntry::Type::kDirectory)) {
          items->push_back({Item::Kind::kUnknown, bpath, n.name, "", b.name});
          continue;
        }
        auto files = env->List(bpath);
        if (!files.ok()) continue;
        for (const DirEntry& f : *files) {
          Item::Kind kind = IsChunkName(f.name)  ? Item::Kind::kChunk
                            : IsTempName(f.name) ? Item::Kind::kTemp
                                                 : Item::Kind::kUnknown;
          // A chunk name that is not a regular file (a directory, a FIFO) is checked like a
          // chunk, and judged as the read path judges it (CheckChunk).
          if (f.type == DirEntry::Type::kDirectory && kind != Item::Kind::kChunk) {
            kind = Item::Kind::kUnknown;
          }
          items->push_back(
              {kind, fmt::format("{}/{}", bpath, f.name), n.name, a.name + b.name, f.name});
        }
      }
    }
  }
  return Status::Ok();
}

struct Verdict {
  enum class What { kGood, kCorrupt, kForeign, kStaleTemp, kFreshTemp, kUnknown, kGone } what;
  std::string reason;
  uint64_t bytes = 0;
};

Verdict CheckChunk(Env* env, const Item& item, AlignedBuffer* buf) {
  using W = Verdict::What;
  auto info = env->Stat(item.path);
  if (!info.ok()) {
    return info.status().IsNotFound() ? Verdict{W::kGone, "", 0}
                                      : Verdict{W::kCorrupt, info.status().ToString(), 0};
  }
  if (!info->is_regular) {
    // The read path calls it a miss and leaves it (it may be someone's on purpose): foreign.
    return {W::kForeign,
            info->is_directory ? "a directory at a chunk path, not a chunk file"
                               : "not a regular file (a FIFO, socket or device) at a chunk path",
            0};
  }
  const uint64_t size = info->size;
  if (size < kHeaderBytes || size % kDirectIoAlignment != 0) {
    return {W::kCorrupt,
            fmt::format("file size {} is not a 4 KiB header plus padded payload", size), size};
  }
  OpenOptions oo;
  oo.direct = true;  // do not pull the whole cache through the page cache
  auto file = env->Open(item.path, oo);
  if (!file.ok()) {
    return file.status().IsNotFound() ? Verdict{W::kGone, "", 0}
                                      : Verdict{W::kCorrupt, file.status().ToString(), size};
  }
  if (buf->size() < size) *buf = AlignedBuffer(size);
  IoOp op = IoOp::Read(0, buf->first(size));
  Status s = ReadExact(**file, std::span<IoOp>(&op, 1));
  if (!s.ok()) return {W::kCorrupt, s.ToString(), size};
  DecodedHeader d = DecodeHeader(std::span<const uint8_t, kHeaderBytes>(buf->data(), kHeaderBytes));
  if (d.verdict == HeaderVerdict::kCorrupt) return {W::kCorrupt, d.reason, size};
  if (d.verdict == HeaderVerdict::kForeign) return {W::kForeign, d.reason, size};
  const ChunkHeader& h = d.header;
  const std::string root_hex = h.namespace_root.ToHex();
  if (root_hex.substr(0, 16) != item.ns) {
    return {W::kForeign,
            fmt::format("chunk of namespace {} in folder {}", root_hex.substr(0, 16), item.ns),
            size};
  }
  if (h.key.ToHex() != item.name)
    return {W::kForeign, "file name is not the key in its header", size};
  if (item.name.substr(0, 4) != item.place) return {W::kForeign, "chunk in the wrong folder", size};
  if (size != ChunkFileBytes(h.payload_bytes)) {
    return {W::kCorrupt,
            fmt::format("file size {} does not match a payload of {} bytes", size, h.payload_bytes),
            size};
  }
  if (PayloadChecksum(std::span<const uint8_t>(buf->data() + kHeaderBytes, h.payload_bytes)) !=
      h.payload_checksum) {
    return {W::kCorrupt, "payload checksum mismatch", size};
  }
  return {W::kGood, "", size};
}

}  // namespace

Status CheckCacheDir(const std::string& root, Env* env_arg) {
  KVTIER_ASSIGN_OR_RETURN(EnvForPath holder, EnvFor(root, env_arg));
  Env* env = holder.env;
  auto info = env->Stat(root);
  if (!info.ok()) {
    if (info.status().IsNotFound()) {
      return Status::NotFound(fmt::format("{} does not exist", root));
    }
    return info.status();
  }
  if (!info->is_directory)
    return Status::InvalidArgument(fmt::format("{} is not a directory", root));
  auto marker = env->Stat(fmt::format("{}/{}", root, kMarkerName));
  if (!marker.ok()) {
    if (marker.status().IsNotFound()) {
      return Status::InvalidArgument(
          fmt::format("{} is not a kvtier cache directory (no {})", root, kMarkerName));
    }
    return marker.status();
  }
  return Status::Ok();
}

Result<FsckReport> FsckCacheDir(const std::string& root, const FsckOptions& options) {
  KVTIER_ASSIGN_OR_RETURN(EnvForPath holder, EnvFor(root, options.env));
  Env* env = holder.env;
  KVTIER_RETURN_IF_ERROR(CheckCacheDir(root, env));
  FsckReport report;
  std::vector<Item> items;
  KVTIER_RETURN_IF_ERROR(Walk(env, root, &items, &report.namespaces));
  std::sort(items.begin(), items.end(),
            [](const Item& a, const Item& b) { return a.path < b.path; });

  std::vector<Verdict> verdicts(items.size());
  const int64_t now = NowNs();
  const int64_t grace =
      std::chrono::duration_cast<std::chrono::nanoseconds>(options.temp_grace).count();
  std::atomic<size_t> next{0}, done{0};
  auto worker = [&] {
    AlignedBuffer buf;
    for (;;) {
      size_t i = next.fetch_add(1);
      if (i >= items.size()) return;
      const Item& item = items[i];
      using W = Verdict::What;
      if (item.kind == Item::Kind::kChunk) {
        verdicts[i] = CheckChunk(env, item, &buf);
      } else if (item.kind == Item::Kind::kTemp) {
        auto info = env->Stat(item.path);
        if (!info.ok()) {
          verdicts[i] = {W::kGone, "", 0};
        } else if (now - info->mtime_ns > grace) {
          verdicts[i] = {
              W::kStaleTemp,
              fmt::format("temporary file {} s old", (now - info->mtime_ns) / 1000000000),
              info->size};
        } else {
          verdicts[i] = {W::kFreshTemp, "", info->size};
        }
      } else {
        verdicts[i] = {W::kUnknown, "not a kvtier file name", 0};
      }
      done.fetch_add(1);
    }
  };
  std::vector<std::thread> threads;
  for (int t = 1; t < std::max(options.threads, 1); ++t) threads.emplace_back(worker);
  if (options.progress && !items.empty() && !threads.empty()) {
    // Report from this thread while the workers run; this thread joins in when they are done.
    while (done.load() < items.size() && next.load() < items.size()) {
      options.progress(done.load(), items.size());
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
    }
  }
  worker();
  for (auto& t : threads) t.join();
  if (options.progress) options.progress(items.size(), items.size());

  for (size_t i = 0; i < items.size(); ++i) {
    const Verdict& v = verdicts[i];
    using W = Verdict::What;
    if (v.what == W::kGone) continue;  // removed by someone else while we looked
    ++report.files;
    FsckFinding f{FsckFinding::Kind::kUnknown, items[i].path, v.reason, false};
    bool removable = false;
    switch (v.what) {
      case W::kGood:
        ++report.good;
        report.good_bytes += v.bytes;
        continue;
      case W::kFreshTemp:
        ++report.fresh_temps;
        continue;
      case W::kCorrupt:
        ++report.corrupt;
        f.kind = FsckFinding::Kind::kCorrupt;
        removable = true;
        break;
      case W::kStaleTemp:
        ++report.stale_temps;
        f.kind = FsckFinding::Kind::kStaleTemp;
        removable = true;
        break;
      case W::kForeign:
        ++report.foreign;
        f.kind = FsckFinding::Kind::kForeign;
        break;
      case W::kUnknown:
        ++report.unknown;
        break;
      case W::kGone:
        break;
    }
    if (removable && options.repair) {
      Status s = env->Unlink(f.path);
      if (s.ok() || s.IsNotFound()) {
        f.removed = true;
        ++report.removed;
      } else {
        ++report.remove_failures;
        f.reason += fmt::format(" (removing failed: {})", s.ToString());
      }
    }
    report.findings.push_back(std::move(f));
  }
  return report;
}

Result<CacheDirSummary> SummarizeCacheDir(const std::string& root, Env* env_arg) {
  KVTIER_ASSIGN_OR_RETURN(EnvForPath holder, EnvFor(root, env_arg));
  Env* env = holder.env;
  KVTIER_RETURN_IF_ERROR(CheckCacheDir(root, env));
  std::vector<Item> items;
  uint64_t namespaces = 0;
  KVTIER_RETURN_IF_ERROR(Walk(env, root, &items, &namespaces));
  CacheDirSummary sum;
  std::map<std::string, NamespaceSummary> by_ns;
  KVTIER_ASSIGN_OR_RETURN(auto top, env->List(root));
  for (const DirEntry& n : top) {
    if (!(IsNamespaceName(n.name) && n.type == DirEntry::Type::kDirectory)) continue;
    NamespaceSummary& ns = by_ns[n.name];
    ns.id = n.name;
    auto text = ReadSmallFile(env, fmt::format("{}/{}/{}", root, n.name, kNamespaceFileName));
    if (text.ok()) {
      auto j = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
      if (j.is_object()) {
        ns.model_id = j.value("model_id", "");
        ns.chunk_bytes = j.value("chunk_bytes", uint64_t{0});
      }
    }
  }
  auto widen = [](int64_t* oldest, int64_t* newest, int64_t t) {
    if (*oldest == 0 || t < *oldest) *oldest = t;
    if (t > *newest) *newest = t;
  };
  for (const Item& item : items) {
    if (item.ns.empty() || item.kind == Item::Kind::kUnknown) continue;
    auto info = env->Stat(item.path);
    if (!info.ok()) continue;
    NamespaceSummary& ns = by_ns[item.ns];
    if (item.kind == Item::Kind::kChunk) {
      ++ns.chunks;
      ns.bytes += info->size;
      widen(&ns.oldest_mtime_ns, &ns.newest_mtime_ns, info->mtime_ns);
      widen(&sum.oldest_mtime_ns, &sum.newest_mtime_ns, info->mtime_ns);
    } else {
      ++ns.temps;
      ns.temp_bytes += info->size;
    }
  }
  for (auto& [id, ns] : by_ns) {
    sum.chunks += ns.chunks;
    sum.bytes += ns.bytes;
    sum.temps += ns.temps;
    sum.temp_bytes += ns.temp_bytes;
    sum.namespaces.push_back(std::move(ns));
  }
  return sum;
}

Result<PurgeReport> PurgeCacheDir(const std::string& root, const std::string& namespace_id,
                                  Env* env_arg) {
  KVTIER_ASSIGN_OR_RETURN(EnvForPath holder, EnvFor(root, env_arg));
  Env* env = holder.env;
  KVTIER_RETURN_IF_ERROR(CheckCacheDir(root, env));
  if (!namespace_id.empty() && !IsNamespaceName(namespace_id)) {
    return Status::InvalidArgument(
        fmt::format("'{}' is not a namespace id (16 lowercase hex digits)", namespace_id));
  }
  PurgeReport report;
  KVTIER_ASSIGN_OR_RETURN(auto top, env->List(root));
  bool found = false;
  for (const DirEntry& n : top) {
    if (!(IsNamespaceName(n.name) && n.type == DirEntry::Type::kDirectory)) continue;
    if (!namespace_id.empty() && n.name != namespace_id) continue;
    found = true;
    RemovedCounts removed;
    KVTIER_RETURN_IF_ERROR(RemoveTree(*env, fmt::format("{}/{}", root, n.name), &removed));
    report.files += removed.files;
    report.bytes += removed.bytes;
    report.directories += removed.directories;
  }
  if (!namespace_id.empty() && !found) {
    return Status::NotFound(fmt::format("no namespace {} in {}", namespace_id, root));
  }
  return report;
}

}  // namespace kvtier
