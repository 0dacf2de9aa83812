// KV-cache events: the encoder against vLLM's own bytes, descriptor checks, and the publisher
// over real ZMQ sockets (SUB and DEALER on ipc:// in a temporary directory).
#include <gtest/gtest.h>
#include <zmq.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <msgpack.hpp>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "events/encoder.h"
#include "events/publisher.h"
#include "events/record_queue.h"
#include "testing/temp_dir.h"

namespace kvtier::events {
namespace {

using namespace std::chrono_literals;

std::string Hex(std::string_view bytes) {
  static const char* d = "0123456789abcdef";
  std::string s;
  for (unsigned char c : bytes) {
    s += d[c >> 4];
    s += d[c & 15];
  }
  return s;
}

// The golden payloads were made once with vLLM 0.32's own classes and msgspec 0.23:
//
//   from vllm.distributed.kv_events import (KVEventBatch, BlockStored, BlockRemoved,
//                                           AllBlocksCleared)
//   enc = msgspec.msgpack.Encoder()
//   stored = BlockStored(block_hashes=[2147986591436168966, 12280578781915239197],
//                        parent_block_hash=17027874615116373601, token_ids=list(range(1032, 1064)),
//                        block_size=16, lora_id=None, medium="CPU", lora_name=None, group_idx=0)
//   enc.encode(KVEventBatch(ts=1767225600.0, events=[stored], data_parallel_rank=0)).hex()
//   s0 = BlockStored(block_hashes=[b"\x01" * 32, 7], parent_block_hash=None, token_ids=[],
//                    block_size=0, lora_id=3, medium="STORAGE", lora_name="adapter",
//                    extra_keys=[("adapter", "salt"), None], group_idx=0)
//   rm = BlockRemoved(block_hashes=[2147986591436168966, 12280578781915239197], medium="CPU",
//                     group_idx=0)
//   enc.encode(KVEventBatch(ts=1767225601.5, events=[AllBlocksCleared(), s0, rm],
//                           data_parallel_rank=0)).hex()
//
// The first is docs/kv-events.md's worked example: chunk 1 of tokens 1000..1063 entering L1.
constexpr const char* kGoldenStored =
    "93cb41da556e400000009189a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cf"
    "1dcf2e6ca4dadf06cfaa6d61563c41d31db1706172656e745f626c6f636b5f68617368cfec4f29beb1e71e61"
    "a9746f6b656e5f696473dc0020cd0408cd0409cd040acd040bcd040ccd040dcd040ecd040fcd0410cd0411cd"
    "0412cd0413cd0414cd0415cd0416cd0417cd0418cd0419cd041acd041bcd041ccd041dcd041ecd041fcd0420"
    "cd0421cd0422cd0423cd0424cd0425cd0426cd0427aa626c6f636b5f73697a6510a76c6f72615f6964c0a66d"
    "656469756da3435055a96c6f72615f6e616d65c0a967726f75705f6964780000";
constexpr const char* kGoldenMixed =
    "93cb41da556e406000009381a474797065b0416c6c426c6f636b73436c65617265648aa474797065ab426c6f"
    "636b53746f726564ac626c6f636b5f68617368657392c4200101010101010101010101010101010101010101"
    "01010101010101010101010107b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f69647390aa"
    "626c6f636b5f73697a6500a76c6f72615f696403a66d656469756da753544f52414745a96c6f72615f6e616d"
    "65a761646170746572aa65787472615f6b6579739292a761646170746572a473616c74c0a967726f75705f69"
    "64780084a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657392cf1dcf2e6ca4dadf"
    "06cfaa6d61563c41d31da66d656469756da3435055a967726f75705f6964780000";

const uint64_t kChunk0[] = {7322446309363477352ull, 17027874615116373601ull};
const uint64_t kChunk1[] = {2147986591436168966ull, 12280578781915239197ull};

std::vector<uint32_t> Tokens(uint32_t from, uint32_t n) {
  std::vector<uint32_t> t(n);
  for (uint32_t i = 0; i < n; ++i) t[i] = from + i;
  return t;
}

Descriptor ChunkDescriptor(uint32_t index) {
  Descriptor d;
  d.index = index;
  d.block_size = 16;
  const uint64_t* h = index == 0 ? kChunk0 : kChunk1;
  d.block_hashes = {PackUintHash(h[0]), PackUintHash(h[1])};
  d.parent = index == 0 ? kNilHash : PackUintHash(kChunk0[1]);
  d.token_ids = Tokens(1000 + 32 * index, 32);
  return d;
}

TEST(EventsEncoderTest, MatchesVllmsOwnBytes) {
  const Descriptor d = ChunkDescriptor(1);
  StoredEvent e;
  e.block_hashes = d.block_hashes;
  e.parent = d.parent;
  e.token_ids = d.token_ids;
  e.block_size = 16;
  e.medium = "CPU";
  e.group_idx = 0;
  const std::string events[] = {EncodeBlockStored(e)};
  const std::string batch = EncodeBatch(1767225600.0, events, 0);
  EXPECT_EQ(batch.size(), 252u);
  EXPECT_EQ(Hex(batch), kGoldenStored);

  const PackedHash mixed[] = {PackBinHash(std::string(32, '\x01')), PackUintHash(7)};
  StoredEvent s0;
  s0.block_hashes = mixed;
  s0.lora_id = 3;
  s0.medium = "STORAGE";
  s0.lora_name = "adapter";
  const std::string extra =
      "\x92\x92\xa7"
      "adapter"
      "\xa4"
      "salt"
      "\xc0";
  s0.extra_keys = extra;
  s0.group_idx = 0;
  const std::string three[] = {EncodeAllBlocksCleared(), EncodeBlockStored(s0),
                               EncodeBlockRemoved(d.block_hashes, "CPU", 0)};
  EXPECT_EQ(Hex(EncodeBatch(1767225601.5, three, 0)), kGoldenMixed);
}

TEST(EventsDescriptorTest, RoundTripAndChecks) {
  Descriptor d = ChunkDescriptor(1);
  d.lora_id = 5;
  d.lora_name = "l";
  d.extra_keys = std::string("\x91\xc0", 2);
  const std::string bytes = EncodeDescriptor(d);
  auto span = [](const std::string& s) {
    return std::span(reinterpret_cast<const uint8_t*>(s.data()), s.size());
  };
  auto back = ParseDescriptor(span(bytes), 32);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, d);

  auto refused = [&](Descriptor bad, uint32_t chunk_tokens, std::string_view why) {
    auto r = ParseDescriptor(span(EncodeDescriptor(bad)), chunk_tokens);
    ASSERT_FALSE(r.ok()) << why;
    EXPECT_NE(r.status().message().find(why), std::string::npos) << r.status().ToString();
  };
  refused(d, 64, "token_ids has 128 bytes");  // the chunk is 64 tokens: wrong token count
  Descriptor three = d;
  three.block_hashes.push_back(PackUintHash(1));
  refused(three, 32, "do not make a chunk");
  Descriptor orphan = d;
  orphan.parent = kNilHash;
  refused(orphan, 32, "needs a parent");
  Descriptor first = ChunkDescriptor(0);
  first.parent = PackUintHash(9);
  refused(first, 32, "chunk 0 has no parent");
  Descriptor location_only = d;
  location_only.block_size = 0;
  refused(location_only, 32, "token_ids need a block_size");
  location_only.token_ids.clear();
  EXPECT_TRUE(ParseDescriptor(span(EncodeDescriptor(location_only)), 32).ok());
  Descriptor long_hash = d;
  long_hash.block_hashes[0] = std::string("\xc4\x21") + std::string(33, 'x');
  refused(long_hash, 32, "at most 32 bytes");
  Descriptor bad_extra = d;
  bad_extra.extra_keys = std::string("\x92\x01", 2);  // an array missing its second item
  refused(bad_extra, 32, "extra_keys");
  const std::string junk = "\x81\xa5index";
  EXPECT_FALSE(ParseDescriptor(span(junk), 32).ok());
  EXPECT_FALSE(ParseDescriptor(span(std::string("\x80", 1)), 32).ok());  // no keys
}

// The descriptor a chunk file's header carries (docs/file-format.md, "The descriptor"): what a
// host that finds the file needs to announce it, fitted to the area by dropping extra_keys, then
// the token ids, then everything.
TEST(EventsDescriptorTest, FileDescriptorRoundTripsAndFits) {
  auto span = [](const std::string& s) {
    return std::span(reinterpret_cast<const uint8_t*>(s.data()), s.size());
  };
  FileDescriptor f;
  f.group = 0xfedcba9876543210ull;
  f.model_id = "Qwen/Qwen3-8B";
  f.chunk_tokens = 32;
  f.world_size = 2;
  f.rank = 1;
  f.client_key.fill(0x5a);
  f.descriptor = ChunkDescriptor(1);
  f.descriptor.extra_keys = std::string("\x91\xa4salt", 6);
  const std::string whole = EncodeFileDescriptor(f, 1 << 20);
  auto back = ParseFileDescriptor(span(whole));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, f);

  const std::string fitted = EncodeFileDescriptor(f, whole.size() - 1);
  back = ParseFileDescriptor(span(fitted));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_FALSE(back->descriptor.extra_keys.has_value());
  EXPECT_EQ(back->descriptor.token_ids, f.descriptor.token_ids);
  const std::string located = EncodeFileDescriptor(f, fitted.size() - 1);
  back = ParseFileDescriptor(span(located));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_TRUE(back->descriptor.token_ids.empty());  // location-only
  EXPECT_EQ(back->descriptor.block_hashes, f.descriptor.block_hashes);
  EXPECT_EQ(EncodeFileDescriptor(f, located.size() - 1), "");

  FileDescriptor bad = f;
  bad.rank = 2;  // not below world_size
  EXPECT_FALSE(ParseFileDescriptor(span(EncodeFileDescriptor(bad, 4096))).ok());
  bad = f;
  bad.chunk_tokens = 64;  // the descriptor's 32 tokens do not make the chunk
  EXPECT_FALSE(ParseFileDescriptor(span(EncodeFileDescriptor(bad, 4096))).ok());
  for (size_t cut : {size_t{0}, size_t{1}, whole.size() / 2, whole.size() - 1}) {
    EXPECT_FALSE(ParseFileDescriptor(span(whole.substr(0, cut))).ok()) << cut;
  }
  EXPECT_FALSE(ParseFileDescriptor(span(EncodeDescriptor(f.descriptor))).ok());  // not the file's
}

TEST(EventsQueueTest, AFullQueueRefusesInsteadOfBlocking) {
  RecordQueue<uint64_t> q(4);
  for (uint64_t i = 0; i < 4; ++i) EXPECT_TRUE(q.TryPush(i));
  EXPECT_FALSE(q.TryPush(9));
  uint64_t v;
  ASSERT_TRUE(q.TryPop(&v));
  EXPECT_EQ(v, 0u);
  EXPECT_TRUE(q.TryPush(4));
  for (uint64_t i = 1; i <= 4; ++i) {
    ASSERT_TRUE(q.TryPop(&v));
    EXPECT_EQ(v, i);
  }
  EXPECT_FALSE(q.TryPop(&v));
}

// --- the publisher over real sockets ---

struct Event {
  std::string type;
  std::vector<uint64_t> hashes;
  std::optional<uint64_t> parent;
  size_t tokens = 0;
  std::string medium;
};
struct Batch {
  std::string topic;
  uint64_t seq = 0;
  std::vector<Event> events;
};

Batch Decode(std::string topic, const std::string& seq, const std::string& payload) {
  Batch b;
  b.topic = std::move(topic);
  for (unsigned char c : seq) b.seq = (b.seq << 8) | c;
  msgpack::object_handle oh = msgpack::unpack(payload.data(), payload.size());
  const msgpack::object& root = oh.get();
  EXPECT_EQ(root.type, msgpack::type::ARRAY);
  EXPECT_EQ(root.via.array.size, 3u);
  const msgpack::object& evs = root.via.array.ptr[1];
  for (uint32_t i = 0; i < evs.via.array.size; ++i) {
    Event e;
    const msgpack::object& m = evs.via.array.ptr[i];
    for (uint32_t k = 0; k < m.via.map.size; ++k) {
      const std::string key = m.via.map.ptr[k].key.as<std::string>();
      const msgpack::object& v = m.via.map.ptr[k].val;
      if (key == "type") e.type = v.as<std::string>();
      if (key == "medium") e.medium = v.as<std::string>();
      if (key == "block_hashes") e.hashes = v.as<std::vector<uint64_t>>();
      if (key == "parent_block_hash" && v.type != msgpack::type::NIL) e.parent = v.as<uint64_t>();
      if (key == "token_ids") e.tokens = v.via.array.size;
    }
    b.events.push_back(e);
  }
  return b;
}

std::string Frame(void* socket) {
  zmq_msg_t msg;
  zmq_msg_init(&msg);
  if (zmq_msg_recv(&msg, socket, 0) < 0) return "<error>";
  std::string s(static_cast<const char*>(zmq_msg_data(&msg)), zmq_msg_size(&msg));
  zmq_msg_close(&msg);
  return s;
}

class PublisherTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ctx_ = zmq_ctx_new();
    o_.endpoint = "ipc://" + dir_.path() + "/pub";
    o_.replay_endpoint = "ipc://" + dir_.path() + "/replay";
    o_.pod = "pod";
  }
  void TearDown() override {
    for (void* s : sockets_) zmq_close(s);
    if (pub_) pub_->Stop();
    zmq_ctx_term(ctx_);
  }
  void Start() {
    auto p = Publisher::Start(o_);
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    pub_ = *p;
    pub_->RegisterGroup(kGroup, {"Qwen/Qwen3-8B", "", 32, 1});
    pub_->RegisterGroup(kWarm, {"warm", "", 32, 1});
  }
  void* Socket(int type, const std::string& ep) {
    void* s = zmq_socket(ctx_, type);
    int timeout = 20000, linger = 0;
    zmq_setsockopt(s, ZMQ_RCVTIMEO, &timeout, sizeof(int));
    zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof(int));
    if (type == ZMQ_SUB) zmq_setsockopt(s, ZMQ_SUBSCRIBE, "", 0);
    EXPECT_EQ(zmq_connect(s, ep.c_str()), 0);
    sockets_.push_back(s);
    return s;
  }
  // A SUB misses what is published before its subscription reaches the PUB: announce and
  // withdraw a chunk of another topic until the subscriber sees one, then skip those.
  void WarmUp(void* sub) {
    const Descriptor d = ChunkDescriptor(0);
    const std::string bytes = EncodeDescriptor(d);
    ASSERT_TRUE(pub_->Describe(kWarm, Key(200), Span(bytes)).ok());
    pub_->Bind(kWarm, Key(200), 0, Key(201));
    zmq_pollitem_t item{sub, 0, ZMQ_POLLIN, 0};
    for (int i = 0; i < 2000; ++i) {
      pub_->OnTierChange(TierId::kMemory, Key(201), i % 2 == 0);
      ASSERT_TRUE(pub_->Flush(20s));
      if (zmq_poll(&item, 1, 10) == 1) break;
    }
    pub_->OnTierChange(TierId::kMemory, Key(201), false);
    ASSERT_TRUE(pub_->Flush(20s));
  }
  // The next batch of the group's topic (warm-up batches skipped).
  Batch Next(void* sub) {
    for (;;) {
      std::string topic = Frame(sub), seq = Frame(sub), payload = Frame(sub);
      if (topic == "<error>") {
        Batch timeout;
        timeout.topic = "<timeout>";
        return timeout;
      }
      if (topic.find("warm") != std::string::npos) continue;
      return Decode(topic, seq, payload);
    }
  }
  static ChunkKey Key(uint8_t b) {
    std::array<uint8_t, 32> a;
    a.fill(b);
    return ChunkKey(a);
  }
  static std::span<const uint8_t> Span(const std::string& s) {
    return {reinterpret_cast<const uint8_t*>(s.data()), s.size()};
  }
  void DescribeChunks(uint64_t group = kGroup) {
    for (uint32_t i = 0; i < 2; ++i) {
      const std::string d = EncodeDescriptor(ChunkDescriptor(i));
      ASSERT_TRUE(pub_->Describe(group, Key(10 + i), Span(d)).ok());
    }
  }
  // Replays from `start`: the batches, up to the end marker.
  std::vector<Batch> Replay(uint64_t start) {
    void* dealer = Socket(ZMQ_DEALER, pub_->replay_endpoint());
    std::string seq(8, '\0');
    for (int i = 7; i >= 0; --i, start >>= 8) seq[i] = static_cast<char>(start & 0xff);
    zmq_send(dealer, "", 0, ZMQ_SNDMORE);
    zmq_send(dealer, seq.data(), 8, 0);
    std::vector<Batch> out;
    for (;;) {
      std::string empty = Frame(dealer), topic = Frame(dealer), s = Frame(dealer),
                  payload = Frame(dealer);
      if (empty == "<error>") {
        ADD_FAILURE() << "no end marker";
        break;
      }
      if (topic.empty() && s == std::string(8, '\xff')) break;
      if (topic.find("warm") == std::string::npos) out.push_back(Decode(topic, s, payload));
    }
    return out;
  }

  static constexpr uint64_t kGroup = 1, kWarm = 2;
  testing::TempDir dir_{"kvtier-events-test"};
  PublisherOptions o_;
  std::shared_ptr<Publisher> pub_;
  void* ctx_ = nullptr;
  std::vector<void*> sockets_;
};

// A chunk is announced once its parent is; a parent leaving its last medium withdraws its
// descendants, and they come back with it. The file tier is a medium of its own.
TEST_F(PublisherTest, ParentsFirstAndWithdrawnWithTheirParent) {
  ASSERT_NO_FATAL_FAILURE(Start());
  void* sub = Socket(ZMQ_SUB, pub_->endpoint());
  ASSERT_NO_FATAL_FAILURE(WarmUp(sub));
  DescribeChunks();
  pub_->Bind(kGroup, Key(10), 0, Key(20));
  pub_->Bind(kGroup, Key(11), 0, Key(21));
  pub_->OnTierChange(TierId::kMemory, Key(21), true);  // chunk 1 first: waits for chunk 0
  ASSERT_TRUE(pub_->Flush(20s));
  pub_->OnTierChange(TierId::kMemory, Key(20), true);
  ASSERT_TRUE(pub_->Flush(20s));
  Batch b = Next(sub);
  EXPECT_EQ(b.topic, "kv@pod@Qwen/Qwen3-8B");
  ASSERT_EQ(b.events.size(), 2u);
  EXPECT_EQ(b.events[0].type, "BlockStored");
  EXPECT_EQ(b.events[0].hashes, std::vector<uint64_t>(std::begin(kChunk0), std::end(kChunk0)));
  EXPECT_FALSE(b.events[0].parent.has_value());
  EXPECT_EQ(b.events[1].hashes, std::vector<uint64_t>(std::begin(kChunk1), std::end(kChunk1)));
  EXPECT_EQ(b.events[1].parent, kChunk0[1]);
  EXPECT_EQ(b.events[1].tokens, 32u);
  EXPECT_EQ(b.events[1].medium, "CPU");
  const uint64_t first_seq = b.seq;

  pub_->OnTierChange(TierId::kFile, Key(20), true);
  ASSERT_TRUE(pub_->Flush(20s));
  b = Next(sub);
  ASSERT_EQ(b.events.size(), 1u);
  EXPECT_EQ(b.events[0].medium, "STORAGE");
  EXPECT_EQ(b.seq, first_seq + 1);

  // Chunk 0 leaves L1 but stays on the file tier: only its CPU entry goes; chunk 1 stays.
  pub_->OnTierChange(TierId::kMemory, Key(20), false);
  ASSERT_TRUE(pub_->Flush(20s));
  b = Next(sub);
  ASSERT_EQ(b.events.size(), 1u);
  EXPECT_EQ(b.events[0].type, "BlockRemoved");
  EXPECT_EQ(b.events[0].medium, "CPU");
  EXPECT_EQ(b.events[0].hashes, std::vector<uint64_t>(std::begin(kChunk0), std::end(kChunk0)));
  // Then the file tier too: chunk 0 is gone, so chunk 1 (loadable from no prefix) goes as well.
  pub_->OnTierChange(TierId::kFile, Key(20), false);
  ASSERT_TRUE(pub_->Flush(20s));
  b = Next(sub);
  ASSERT_EQ(b.events.size(), 2u);
  EXPECT_EQ(b.events[0].medium, "STORAGE");
  EXPECT_EQ(b.events[1].type, "BlockRemoved");
  EXPECT_EQ(b.events[1].medium, "CPU");
  EXPECT_EQ(b.events[1].hashes, std::vector<uint64_t>(std::begin(kChunk1), std::end(kChunk1)));
  EXPECT_EQ(b.seq, first_seq + 3);
  // A different descriptor for a described chunk is counted and dropped.
  Descriptor other = ChunkDescriptor(0);
  other.block_hashes[0] = PackUintHash(1);
  ASSERT_TRUE(pub_->Describe(kGroup, Key(10), Span(EncodeDescriptor(other))).ok());
  ASSERT_TRUE(pub_->Flush(20s));
  EXPECT_EQ(pub_->Stats().descriptor_conflicts, 1u);
}

// A TP group's chunk is announced once every rank's shard is in, removed when the first leaves;
// two namespaces of one model with the same hashes are announced once (reference counts).
TEST_F(PublisherTest, RanksAndSharedHashesAreCountedOnce) {
  ASSERT_NO_FATAL_FAILURE(Start());
  pub_->RegisterGroup(3, {"Qwen/Qwen3-8B", "", 32, 2});
  void* sub = Socket(ZMQ_SUB, pub_->endpoint());
  ASSERT_NO_FATAL_FAILURE(WarmUp(sub));
  DescribeChunks(3);
  DescribeChunks(kGroup);
  pub_->Bind(3, Key(10), 0, Key(30));
  pub_->Bind(3, Key(10), 1, Key(31));
  pub_->Bind(kGroup, Key(10), 0, Key(20));
  pub_->OnTierChange(TierId::kMemory, Key(30), true);
  ASSERT_TRUE(pub_->Flush(20s));
  pub_->OnTierChange(TierId::kMemory, Key(31), true);  // rank 1: now complete
  pub_->OnTierChange(TierId::kMemory, Key(20), true);  // the same hashes: counted, not sent
  ASSERT_TRUE(pub_->Flush(20s));
  Batch b = Next(sub);
  ASSERT_EQ(b.events.size(), 1u);
  EXPECT_EQ(b.events[0].type, "BlockStored");
  pub_->OnTierChange(TierId::kMemory, Key(31), false);  // the first shard leaves: still held
  pub_->OnTierChange(TierId::kMemory, Key(20), false);  // by the other group, now by none
  ASSERT_TRUE(pub_->Flush(20s));
  b = Next(sub);
  ASSERT_EQ(b.events.size(), 1u);
  EXPECT_EQ(b.events[0].type, "BlockRemoved");
  const PublisherStats st = pub_->Stats();
  EXPECT_EQ(st.stored_events[0], st.removed_events[0]);
}

// Replay: from a seq still in the ring, the batches as they were published; from before the
// ring, a snapshot (AllBlocksCleared, then what is announced now, stamped with the last seq);
// one past the newest, the end marker alone.
TEST_F(PublisherTest, ReplaysTheRingOrASnapshot) {
  o_.buffer_steps = 3;
  ASSERT_NO_FATAL_FAILURE(Start());
  DescribeChunks();
  pub_->Bind(kGroup, Key(10), 0, Key(20));
  pub_->Bind(kGroup, Key(11), 0, Key(21));
  pub_->OnTierChange(TierId::kMemory, Key(20), true);
  ASSERT_TRUE(pub_->Flush(20s));  // seq 0
  pub_->OnTierChange(TierId::kMemory, Key(21), true);
  ASSERT_TRUE(pub_->Flush(20s));  // seq 1
  std::vector<Batch> ring = Replay(0);
  ASSERT_EQ(ring.size(), 2u);
  EXPECT_EQ(ring[0].seq, 0u);
  EXPECT_EQ(ring[1].seq, 1u);
  EXPECT_EQ(ring[1].events[0].hashes,
            std::vector<uint64_t>(std::begin(kChunk1), std::end(kChunk1)));
  EXPECT_TRUE(Replay(2).empty());
  for (int i = 0; i < 4; ++i) {  // seq 2..5: the ring keeps 3..5
    pub_->OnTierChange(TierId::kFile, Key(20), i % 2 == 0);
    ASSERT_TRUE(pub_->Flush(20s));
  }
  ASSERT_EQ(Replay(3).size(), 3u);
  std::vector<Batch> snap = Replay(0);
  ASSERT_EQ(snap.size(), 1u);
  EXPECT_EQ(snap[0].seq, 5u);
  ASSERT_EQ(snap[0].events.size(), 3u);
  EXPECT_EQ(snap[0].events[0].type, "AllBlocksCleared");
  EXPECT_EQ(snap[0].events[1].hashes,
            std::vector<uint64_t>(std::begin(kChunk0), std::end(kChunk0)));
  EXPECT_EQ(snap[0].events[2].parent, kChunk0[1]);
  const PublisherStats st = pub_->Stats();
  EXPECT_EQ(st.replays_ring, 3u);
  EXPECT_EQ(st.replays_snapshot, 1u);
}

// A chunk's descriptor goes into its file's header (ChunkDescriptor: the binding and the
// descriptor this publisher was given), and another publisher (another host, or this one
// restarted) that finds the files announces them from their headers, parents first whatever
// order it found them in; a file without a descriptor or with a bad header stays unannounced.
TEST_F(PublisherTest, FilesFoundAreAnnouncedFromTheirHeaders) {
  constexpr uint64_t kFound = 7;  // a group the second publisher learns from the files
  ASSERT_NO_FATAL_FAILURE(Start());
  pub_->RegisterGroup(kFound, {"Qwen/Qwen3-8B", "", 32, 1});
  DescribeChunks(kFound);
  pub_->Bind(kFound, Key(10), 0, Key(20));
  pub_->Bind(kFound, Key(11), 0, Key(21));
  pub_->Bind(kFound, Key(12), 0, Key(22));  // never described
  std::map<ChunkKey, std::string> headers;
  for (uint8_t k : {20, 21, 22}) headers[Key(k)] = pub_->ChunkDescriptor(Key(k));
  EXPECT_NE(headers[Key(20)], "");
  EXPECT_NE(headers[Key(21)], "");
  EXPECT_EQ(headers[Key(22)], "");
  EXPECT_EQ(pub_->ChunkDescriptor(Key(99)), "");  // never bound
  EXPECT_EQ(pub_->Stats().file_descriptors_written, 2u);
  pub_->Stop();

  ASSERT_NO_FATAL_FAILURE(Start());
  std::atomic<int> reads{0};
  pub_->SetDescriptorReader([&](const ChunkKey& k) -> Result<std::string> {
    ++reads;
    if (k == Key(23)) return Status::Corruption("header checksum mismatch");
    return headers.at(k);
  });
  for (uint8_t k : {21, 23, 22, 20}) pub_->OnTierChange(TierId::kFile, Key(k), true);
  // Read (paced, on the describer thread) and filed: what they found is queued by then.
  auto done = [&] {
    const PublisherStats st = pub_->Stats();
    return reads == 4 && st.file_descriptors_read == 2 && st.file_descriptor_errors == 1;
  };
  for (int i = 0; i < 4000 && !done(); ++i) std::this_thread::sleep_for(5ms);
  ASSERT_TRUE(done());
  ASSERT_TRUE(pub_->Flush(20s));
  const PublisherStats st = pub_->Stats();
  EXPECT_EQ(st.file_descriptors_read, 2u);
  EXPECT_EQ(st.file_descriptor_errors, 1u);
  EXPECT_EQ(st.announced_chunks, 2u);
  std::vector<Batch> snap = Replay(0);
  std::vector<Event> stored;
  for (const Batch& b : snap) {
    for (const Event& e : b.events) {
      if (e.type == "BlockStored" && b.topic == "kv@pod@Qwen/Qwen3-8B") stored.push_back(e);
    }
  }
  ASSERT_EQ(stored.size(), 2u);
  EXPECT_EQ(stored[0].hashes, std::vector<uint64_t>(std::begin(kChunk0), std::end(kChunk0)));
  EXPECT_FALSE(stored[0].parent.has_value());
  EXPECT_EQ(stored[1].hashes, std::vector<uint64_t>(std::begin(kChunk1), std::end(kChunk1)));
  EXPECT_EQ(stored[1].parent, kChunk0[1]);
  for (const Event& e : stored) {
    EXPECT_EQ(e.medium, "STORAGE");
    EXPECT_EQ(e.tokens, 32u);
  }
}

// A tier hook never waits: with a tiny queue, a flood of records is dropped and counted while
// every push returns at once.
TEST_F(PublisherTest, AFullQueueDropsAndCountsNeverBlocks) {
  o_.max_queue_size = 16;
  ASSERT_NO_FATAL_FAILURE(Start());
  for (int i = 0; i < 1'000'000; ++i) {
    pub_->OnTierChange(TierId::kMemory, Key(static_cast<uint8_t>(i)), i % 2 == 0);
  }
  EXPECT_GT(pub_->Stats().dropped_queue_full, 0u);
  ASSERT_TRUE(pub_->Flush(20s));
}

TEST(PublisherStartTest, BadEndpointsFailWithAMessage) {
  PublisherOptions o;
  o.endpoint = "udp://nowhere";
  auto p = Publisher::Start(o);
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("not a ZMQ endpoint"), std::string::npos);
  o.endpoint = "tcp://*";
  EXPECT_FALSE(Publisher::Start(o).ok());
  o.endpoint = "ipc:///nonexistent-dir/x/y";
  p = Publisher::Start(o);
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("cannot bind"), std::string::npos) << p.status().ToString();
  o.endpoint = "tcp://127.0.0.1:0";  // connects: fine, nobody needs to be there
  o.replay_endpoint = "tcp://*:0";
  o.bind_host = "127.0.0.1";
  p = Publisher::Start(o);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ((*p)->replay_endpoint().find("tcp://127.0.0.1:"), 0u) << (*p)->replay_endpoint();
}

}  // namespace
}  // namespace kvtier::events
