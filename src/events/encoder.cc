#include "events/encoder.h"

#include <fmt/format.h>

#include <cstring>
#include <msgpack.hpp>

namespace kvtier::events {

namespace {

using Packer = msgpack::packer<msgpack::sbuffer>;

std::string Take(msgpack::sbuffer& buf) { return std::string(buf.data(), buf.size()); }

void Str(Packer& pk, std::string_view s) {
  pk.pack_str(static_cast<uint32_t>(s.size()));
  pk.pack_str_body(s.data(), static_cast<uint32_t>(s.size()));
}

void Raw(msgpack::sbuffer& buf, std::string_view bytes) { buf.write(bytes.data(), bytes.size()); }

void OptionalInt(Packer& pk, const std::optional<int64_t>& v) {
  if (v) {
    pk.pack_int64(*v);
  } else {
    pk.pack_nil();
  }
}

void Hashes(Packer& pk, msgpack::sbuffer& buf, std::span<const PackedHash> hashes) {
  pk.pack_array(static_cast<uint32_t>(hashes.size()));
  for (const PackedHash& h : hashes) Raw(buf, h);
}

}  // namespace

PackedHash PackUintHash(uint64_t h) {
  msgpack::sbuffer buf;
  Packer(buf).pack_uint64(h);
  return Take(buf);
}

PackedHash PackBinHash(std::string_view bytes) {
  msgpack::sbuffer buf;
  Packer pk(buf);
  pk.pack_bin(static_cast<uint32_t>(bytes.size()));
  pk.pack_bin_body(bytes.data(), static_cast<uint32_t>(bytes.size()));
  return Take(buf);
}

size_t Descriptor::MemoryBytes() const {
  size_t n = sizeof(*this) + token_ids.size() * 4 + parent.size();
  for (const PackedHash& h : block_hashes) n += sizeof(h) + h.size();
  if (lora_name) n += lora_name->size();
  if (extra_keys) n += extra_keys->size();
  return n;
}

std::string EncodeBlockStored(const StoredEvent& e) {
  msgpack::sbuffer buf;
  Packer pk(buf);
  pk.pack_map(8 + (e.extra_keys ? 1 : 0) + (e.group_idx ? 1 : 0));
  Str(pk, "type");
  Str(pk, "BlockStored");
  Str(pk, "block_hashes");
  Hashes(pk, buf, e.block_hashes);
  Str(pk, "parent_block_hash");
  Raw(buf, e.parent);
  Str(pk, "token_ids");
  pk.pack_array(static_cast<uint32_t>(e.token_ids.size()));
  for (uint32_t t : e.token_ids) pk.pack_uint32(t);
  Str(pk, "block_size");
  pk.pack_uint32(e.block_size);
  Str(pk, "lora_id");
  OptionalInt(pk, e.lora_id);
  Str(pk, "medium");
  Str(pk, e.medium);
  Str(pk, "lora_name");
  if (e.lora_name) {
    Str(pk, *e.lora_name);
  } else {
    pk.pack_nil();
  }
  if (e.extra_keys) {
    Str(pk, "extra_keys");
    Raw(buf, *e.extra_keys);
  }
  if (e.group_idx) {
    Str(pk, "group_idx");
    pk.pack_int64(*e.group_idx);
  }
  return Take(buf);
}

std::string EncodeBlockRemoved(std::span<const PackedHash> block_hashes, std::string_view medium,
                               std::optional<int64_t> group_idx) {
  msgpack::sbuffer buf;
  Packer pk(buf);
  pk.pack_map(3 + (group_idx ? 1 : 0));
  Str(pk, "type");
  Str(pk, "BlockRemoved");
  Str(pk, "block_hashes");
  Hashes(pk, buf, block_hashes);
  Str(pk, "medium");
  Str(pk, medium);
  if (group_idx) {
    Str(pk, "group_idx");
    pk.pack_int64(*group_idx);
  }
  return Take(buf);
}

std::string EncodeAllBlocksCleared() {
  msgpack::sbuffer buf;
  Packer pk(buf);
  pk.pack_map(1);
  Str(pk, "type");
  Str(pk, "AllBlocksCleared");
  return Take(buf);
}

std::string EncodeBatch(double ts, std::span<const std::string> events, int64_t dp_rank) {
  size_t bytes = 16;
  for (const std::string& e : events) bytes += e.size();
  msgpack::sbuffer buf(bytes);
  Packer pk(buf);
  pk.pack_array(3);
  // float64 always, as msgspec writes a float: msgpack-cxx packs a whole-valued double as an
  // integer, which vLLM's decoder would refuse for `ts`.
  uint64_t bits;
  std::memcpy(&bits, &ts, 8);
  char f64[9] = {static_cast<char>(0xcb)};
  for (int i = 0; i < 8; ++i) f64[8 - i] = static_cast<char>((bits >> (8 * i)) & 0xff);
  buf.write(f64, 9);
  pk.pack_array(static_cast<uint32_t>(events.size()));
  for (const std::string& e : events) Raw(buf, e);
  pk.pack_int64(dp_rank);
  return Take(buf);
}

std::string EncodeDescriptor(const Descriptor& d) {
  msgpack::sbuffer buf;
  Packer pk(buf);
  pk.pack_map(7 + (d.token_ids.empty() ? 0 : 1) + (d.extra_keys ? 1 : 0));
  Str(pk, "index");
  pk.pack_uint32(d.index);
  Str(pk, "block_size");
  pk.pack_uint32(d.block_size);
  Str(pk, "group_idx");
  pk.pack_int64(d.group_idx);
  Str(pk, "block_hashes");
  Hashes(pk, buf, d.block_hashes);
  Str(pk, "parent_block_hash");
  Raw(buf, d.parent);
  if (!d.token_ids.empty()) {
    Str(pk, "token_ids");
    const uint32_t n = static_cast<uint32_t>(d.token_ids.size() * 4);
    pk.pack_bin(n);
    pk.pack_bin_body(reinterpret_cast<const char*>(d.token_ids.data()), n);  // little-endian
  }
  Str(pk, "lora_id");
  OptionalInt(pk, d.lora_id);
  Str(pk, "lora_name");
  if (d.lora_name) {
    Str(pk, *d.lora_name);
  } else {
    pk.pack_nil();
  }
  if (d.extra_keys) {
    Str(pk, "extra_keys");
    pk.pack_bin(static_cast<uint32_t>(d.extra_keys->size()));
    pk.pack_bin_body(d.extra_keys->data(), static_cast<uint32_t>(d.extra_keys->size()));
  }
  return Take(buf);
}

namespace {

// Bounds on what one descriptor may make the parser build (the body is at most 16 KiB anyway).
msgpack::unpack_limit Limits() {
  return msgpack::unpack_limit(/*array=*/16384, /*map=*/64, /*str=*/4096, /*bin=*/16384,
                               /*ext=*/0, /*depth=*/16);
}

Status Bad(std::string_view why) {
  return Status::InvalidArgument(fmt::format("bad descriptor: {}", why));
}

// One msgpack map filling `bytes` exactly, within Limits(); `what` names it in the errors.
Result<msgpack::object_handle> UnpackMap(std::span<const uint8_t> bytes, std::string_view what) {
  msgpack::object_handle oh;
  try {
    size_t off = 0;
    oh = msgpack::unpack(reinterpret_cast<const char*>(bytes.data()), bytes.size(), off, nullptr,
                         nullptr, Limits());
    if (off != bytes.size()) return Bad(fmt::format("trailing bytes after {}", what));
  } catch (const std::exception& e) {
    return Bad(fmt::format("{} is not msgpack within bounds ({})", what, e.what()));
  }
  if (oh.get().type != msgpack::type::MAP) return Bad(fmt::format("{} is not a map", what));
  return oh;
}

std::optional<int64_t> AsInt(const msgpack::object& o) {
  if (o.type == msgpack::type::POSITIVE_INTEGER) {
    if (o.via.u64 > static_cast<uint64_t>(INT64_MAX)) return std::nullopt;
    return static_cast<int64_t>(o.via.u64);
  }
  if (o.type == msgpack::type::NEGATIVE_INTEGER) return o.via.i64;
  return std::nullopt;
}

Result<PackedHash> AsHash(const msgpack::object& o, bool nil_ok, std::string_view field) {
  if (o.type == msgpack::type::POSITIVE_INTEGER) return PackUintHash(o.via.u64);
  if (o.type == msgpack::type::BIN && o.via.bin.size <= 32) {
    return PackBinHash(std::string_view(o.via.bin.ptr, o.via.bin.size));
  }
  if (nil_ok && o.type == msgpack::type::NIL) return kNilHash;
  return Bad(fmt::format("{}: a block hash is a uint64 or bin of at most 32 bytes", field));
}

}  // namespace

Result<Descriptor> ParseDescriptor(std::span<const uint8_t> bytes, uint32_t chunk_tokens) {
  KVTIER_ASSIGN_OR_RETURN(msgpack::object_handle oh, UnpackMap(bytes, "the descriptor"));
  const msgpack::object& root = oh.get();
  Descriptor d;
  bool has_index = false, has_block_size = false, has_group = false, has_hashes = false,
       has_parent = false;
  for (uint32_t i = 0; i < root.via.map.size; ++i) {
    const msgpack::object& k = root.via.map.ptr[i].key;
    const msgpack::object& v = root.via.map.ptr[i].val;
    if (k.type != msgpack::type::STR) return Bad("a key is not a string");
    const std::string_view key(k.via.str.ptr, k.via.str.size);
    if (key == "index" || key == "block_size" || key == "group_idx") {
      auto n = AsInt(v);
      if (!n || *n < 0 || (key != "group_idx" && *n > INT32_MAX)) {
        return Bad(fmt::format("{} must be a non-negative integer", key));
      }
      if (key == "index") {
        d.index = static_cast<uint32_t>(*n);
        has_index = true;
      } else if (key == "block_size") {
        d.block_size = static_cast<uint32_t>(*n);
        has_block_size = true;
      } else {
        d.group_idx = *n;
        has_group = true;
      }
    } else if (key == "block_hashes") {
      if (v.type != msgpack::type::ARRAY) return Bad("block_hashes must be an array");
      if (v.via.array.size == 0 || v.via.array.size > chunk_tokens) {
        return Bad(fmt::format("{} block hashes for a chunk of {} tokens", v.via.array.size,
                               chunk_tokens));
      }
      for (uint32_t j = 0; j < v.via.array.size; ++j) {
        KVTIER_ASSIGN_OR_RETURN(auto h, AsHash(v.via.array.ptr[j], false, "block_hashes"));
        d.block_hashes.push_back(std::move(h));
      }
      has_hashes = true;
    } else if (key == "parent_block_hash") {
      KVTIER_ASSIGN_OR_RETURN(d.parent, AsHash(v, true, "parent_block_hash"));
      has_parent = true;
    } else if (key == "token_ids") {
      if (v.type != msgpack::type::BIN) return Bad("token_ids must be bin (little-endian uint32)");
      if (v.via.bin.size != static_cast<uint64_t>(chunk_tokens) * 4) {
        return Bad(fmt::format("token_ids has {} bytes, a chunk of {} tokens needs {}",
                               v.via.bin.size, chunk_tokens, chunk_tokens * 4ull));
      }
      d.token_ids.resize(chunk_tokens);
      std::memcpy(d.token_ids.data(), v.via.bin.ptr, v.via.bin.size);  // the host is little-endian
    } else if (key == "lora_id") {
      if (v.type != msgpack::type::NIL) {
        auto n = AsInt(v);
        if (!n) return Bad("lora_id must be an integer or nil");
        d.lora_id = *n;
      }
    } else if (key == "lora_name") {
      if (v.type == msgpack::type::STR) {
        d.lora_name.emplace(v.via.str.ptr, v.via.str.size);
      } else if (v.type != msgpack::type::NIL) {
        return Bad("lora_name must be a string or nil");
      }
    } else if (key == "extra_keys") {
      if (v.type != msgpack::type::BIN) return Bad("extra_keys must be bin (encoded msgpack)");
      // One well-formed value: it is copied into events as it is.
      try {
        size_t off = 0;
        (void)msgpack::unpack(v.via.bin.ptr, v.via.bin.size, off, nullptr, nullptr, Limits());
        if (off != v.via.bin.size) return Bad("extra_keys holds more than one msgpack value");
      } catch (const std::exception& e) {
        return Bad(fmt::format("extra_keys is not msgpack ({})", e.what()));
      }
      d.extra_keys.emplace(v.via.bin.ptr, v.via.bin.size);
    }
  }
  if (!has_index || !has_block_size || !has_group || !has_hashes || !has_parent) {
    return Bad("index, block_size, group_idx, block_hashes and parent_block_hash are required");
  }
  const uint64_t n = d.block_hashes.size();
  if (d.block_size == 0) {
    if (!d.token_ids.empty()) return Bad("token_ids need a block_size");
  } else if (n * d.block_size != chunk_tokens) {
    return Bad(fmt::format("{} hashes of {}-token blocks do not make a chunk of {} tokens", n,
                           d.block_size, chunk_tokens));
  }
  if (d.index == 0 && d.parent != kNilHash) return Bad("chunk 0 has no parent block");
  if (d.index > 0 && d.parent == kNilHash) return Bad("a chunk after the first needs a parent");
  return d;
}

std::string EncodeFileDescriptor(const FileDescriptor& f, size_t max_bytes) {
  if (f.model_id.size() > 1024) return {};
  Descriptor d = f.descriptor;
  for (int attempt = 0; attempt < 3; ++attempt) {
    if (attempt == 1) d.extra_keys.reset();
    if (attempt == 2) d.token_ids.clear();
    const std::string map = EncodeDescriptor(d);
    msgpack::sbuffer buf;
    Packer pk(buf);
    pk.pack_map(7);
    Str(pk, "group");
    pk.pack_uint64(f.group);
    Str(pk, "model_id");
    Str(pk, f.model_id);
    Str(pk, "chunk_tokens");
    pk.pack_uint32(f.chunk_tokens);
    Str(pk, "world_size");
    pk.pack_uint32(f.world_size);
    Str(pk, "rank");
    pk.pack_uint32(f.rank);
    Str(pk, "key");
    pk.pack_bin(32);
    pk.pack_bin_body(reinterpret_cast<const char*>(f.client_key.data()), 32);
    Str(pk, "descriptor");
    pk.pack_bin(static_cast<uint32_t>(map.size()));
    pk.pack_bin_body(map.data(), static_cast<uint32_t>(map.size()));
    if (buf.size() <= max_bytes) return Take(buf);
  }
  return {};
}

Result<FileDescriptor> ParseFileDescriptor(std::span<const uint8_t> bytes) {
  KVTIER_ASSIGN_OR_RETURN(msgpack::object_handle oh, UnpackMap(bytes, "the file's descriptor"));
  const msgpack::object& root = oh.get();
  FileDescriptor f;
  std::span<const uint8_t> map;
  unsigned seen = 0;  // a bit per required key
  for (uint32_t i = 0; i < root.via.map.size; ++i) {
    const msgpack::object& k = root.via.map.ptr[i].key;
    const msgpack::object& v = root.via.map.ptr[i].val;
    if (k.type != msgpack::type::STR) return Bad("a key is not a string");
    const std::string_view key(k.via.str.ptr, k.via.str.size);
    if (key == "group") {
      if (v.type != msgpack::type::POSITIVE_INTEGER) return Bad("group must be a uint64");
      f.group = v.via.u64;
      seen |= 1;
    } else if (key == "model_id") {
      if (v.type != msgpack::type::STR || v.via.str.size > 1024) {
        return Bad("model_id must be a string of at most 1,024 bytes");
      }
      f.model_id.assign(v.via.str.ptr, v.via.str.size);
      seen |= 2;
    } else if (key == "chunk_tokens" || key == "world_size" || key == "rank") {
      auto n = AsInt(v);
      if (!n || *n < 0 || *n > INT32_MAX) return Bad(fmt::format("{} must be a uint32", key));
      const uint32_t u = static_cast<uint32_t>(*n);
      if (key == "chunk_tokens") {
        f.chunk_tokens = u;
        seen |= 4;
      } else if (key == "world_size") {
        f.world_size = u;
        seen |= 8;
      } else {
        f.rank = u;
        seen |= 16;
      }
    } else if (key == "key") {
      if (v.type != msgpack::type::BIN || v.via.bin.size != 32) return Bad("key must be bin 32");
      std::memcpy(f.client_key.data(), v.via.bin.ptr, 32);
      seen |= 32;
    } else if (key == "descriptor") {
      if (v.type != msgpack::type::BIN) return Bad("descriptor must be bin (a msgpack map)");
      map = std::span(reinterpret_cast<const uint8_t*>(v.via.bin.ptr), v.via.bin.size);
      seen |= 64;
    }
  }
  if (seen != 127) {
    return Bad("group, model_id, chunk_tokens, world_size, rank, key and descriptor are required");
  }
  if (f.chunk_tokens == 0 || f.world_size == 0 || f.rank >= f.world_size) {
    return Bad("chunk_tokens and world_size must be positive, rank below world_size");
  }
  KVTIER_ASSIGN_OR_RETURN(f.descriptor, ParseDescriptor(map, f.chunk_tokens));
  return f;
}

}  // namespace kvtier::events
