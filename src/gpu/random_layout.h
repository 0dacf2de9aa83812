// Test helpers: random paged-cache shapes and a reference gather written straight from the
// definition of the canonical layout (independent of the copiers' segment planning).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <span>
#include <vector>

#include "kvtier/paged_kv.h"

namespace kvtier::gpu::testing {

enum class ShapeKind {
  kSplitKvPerLayer,   // [2, blocks, tpb, ...] per layer
  kPackedKvPerLayer,  // [blocks, 2, tpb, ...] per layer
  kCrossLayer,        // [blocks, layers, 2, tpb, ...]
  kMlaPerLayer,       // [blocks, tpb, latent] per layer
  kMlaCrossLayer,     // [blocks, layers, tpb, latent]
};

// A cache shape whose tensors live in one buffer; tensor bases hold offsets until Place().
struct CacheShape {
  uint32_t tokens_per_block = 0;
  std::vector<KvPageTensor> tensors;
  uint64_t buffer_bytes = 0;
};

// `pad` extra bytes after every block and between tensors (keep it a multiple of 16 for shapes
// the SM kernel must accept).
inline CacheShape MakeShape(ShapeKind kind, uint32_t layers, uint32_t tpb, uint64_t num_blocks,
                            uint64_t token_bytes, uint64_t pad) {
  CacheShape s;
  s.tokens_per_block = tpb;
  const uint64_t page = uint64_t{tpb} * token_bytes;
  uint64_t offset = pad;
  auto add = [&](KvPageTensor t, uint64_t extent) {
    t.base = reinterpret_cast<void*>(offset);
    s.tensors.push_back(t);
    offset += extent + pad;
  };
  KvPageTensor t;
  t.num_blocks = num_blocks;
  t.token_bytes = token_bytes;
  switch (kind) {
    case ShapeKind::kSplitKvPerLayer:
      for (uint32_t l = 0; l < layers; ++l) {
        t.block_stride_bytes = page + pad;
        t.num_components = 2;
        t.component_stride_bytes = num_blocks * (page + pad) + pad;
        add(t, 2 * num_blocks * (page + pad) + pad);
      }
      break;
    case ShapeKind::kPackedKvPerLayer:
      for (uint32_t l = 0; l < layers; ++l) {
        t.block_stride_bytes = 2 * page + pad;
        t.num_components = 2;
        t.component_stride_bytes = page;
        add(t, num_blocks * (2 * page + pad));
      }
      break;
    case ShapeKind::kCrossLayer:
      t.num_layers = layers;
      t.layer_stride_bytes = 2 * page;
      t.num_components = 2;
      t.component_stride_bytes = page;
      t.block_stride_bytes = uint64_t{layers} * 2 * page + pad;
      add(t, num_blocks * t.block_stride_bytes);
      break;
    case ShapeKind::kMlaPerLayer:
      for (uint32_t l = 0; l < layers; ++l) {
        t.block_stride_bytes = page + pad;
        add(t, num_blocks * (page + pad));
      }
      break;
    case ShapeKind::kMlaCrossLayer:
      t.num_layers = layers;
      t.layer_stride_bytes = page + pad;
      t.block_stride_bytes = uint64_t{layers} * (page + pad);
      add(t, num_blocks * t.block_stride_bytes);
      break;
  }
  s.buffer_bytes = offset;
  return s;
}

inline PagedKvCacheDesc Place(const CacheShape& shape, void* buffer, MemorySpace memory,
                              int device = 0) {
  PagedKvCacheDesc d;
  d.memory = memory;
  d.device = device;
  d.tokens_per_block = shape.tokens_per_block;
  for (KvPageTensor t : shape.tensors) {
    t.base = static_cast<char*>(buffer) + reinterpret_cast<uintptr_t>(t.base);
    d.tensors.push_back(t);
  }
  return d;
}

// The chunk, byte for byte, as the canonical layout defines it: streams (tensor, layer,
// component) in order, each holding every token of the chunk in order.
inline std::vector<char> ReferenceGather(const PagedKvCacheDesc& d, std::span<const int64_t> ids) {
  std::vector<char> out;
  const uint64_t tokens = ids.size() * d.tokens_per_block;
  for (const KvPageTensor& t : d.tensors) {
    for (uint32_t l = 0; l < t.num_layers; ++l) {
      for (uint32_t c = 0; c < t.num_components; ++c) {
        for (uint64_t tok = 0; tok < tokens; ++tok) {
          const char* src = static_cast<const char*>(t.base) +
                            ids[tok / d.tokens_per_block] * t.block_stride_bytes +
                            l * t.layer_stride_bytes + c * t.component_stride_bytes +
                            (tok % d.tokens_per_block) * t.token_bytes;
          out.insert(out.end(), src, src + t.token_bytes);
        }
      }
    }
  }
  return out;
}

inline void FillRandom(void* p, uint64_t bytes, std::mt19937_64& rng) {
  auto* c = static_cast<unsigned char*>(p);
  uint64_t i = 0;
  for (; i + 8 <= bytes; i += 8) {
    const uint64_t v = rng();
    std::memcpy(c + i, &v, 8);
  }
  for (; i < bytes; ++i) c[i] = static_cast<unsigned char>(rng());
}

// `count` distinct block ids out of [0, num_blocks), shuffled.
inline std::vector<int64_t> RandomIds(std::mt19937_64& rng, uint64_t num_blocks, size_t count) {
  std::vector<int64_t> all(num_blocks);
  for (uint64_t i = 0; i < num_blocks; ++i) all[i] = static_cast<int64_t>(i);
  std::shuffle(all.begin(), all.end(), rng);
  all.resize(count);
  return all;
}

}  // namespace kvtier::gpu::testing
