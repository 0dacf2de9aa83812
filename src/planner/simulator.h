// A discrete-event model of one serving engine (vLLM-like) running LMCache's multi-round QA
// workload, with or without KV offload tiers below the GPU.
//
// What it models (docs/planner.md says why, and where it is weak):
//  * Users, paced as `kvtier bench qa` (LMCache's benchmark) paces them: a user asks a question
//    every users/qps seconds, but never before its previous answer has finished; a new user joins
//    every (rounds - 1)/qps seconds; the run starts in steady state, with `users` sessions already
//    under way (docs/bench-qa.md). Every prompt carries the whole conversation: system prompt
//    (shared by all users), the user's context, then all earlier questions and answers, then the
//    new question.
//  * The engine runs steps. Each step decodes one token for every running request and prefills
//    up to `max_batched_tokens` prompt tokens (chunked prefill, first come first served); it
//    lasts step_overhead + the decode memory traffic (weights + KV read) + the prefill compute of
//    its chunks (PrefillCost::Suffix). A request arriving mid-step waits for the step to end.
//    TTFT is from sending to the end of the step that finishes the request's prefill.
//  * GPU prefix cache, block-granular: a request reserves blocks for its prompt and answer when
//    it is admitted (first come first served; it waits while they cannot be found). A finished
//    request's full blocks stay cached; under pressure blocks are taken tail-first from the
//    least recently finished conversation, so a conversation loses its end before its beginning
//    and the next turn recomputes only the lost tail. The system prompt's blocks are shared and
//    go last.
//  * Tiers (offload arm): chunk-granular stores, each one FIFO channel with read and write
//    bandwidths, so write traffic delays reads. After a prefill the prompt's full chunks missing
//    from a tier are written (write_through: every tier; write_back: the first tier, lower ones
//    when the tier above evicts; none: never). The device-to-host copy of the saved KV stalls
//    the engine step for save_blocking x bytes / save_copy_bw. Lookups walk chunks after the
//    GPU hit and take each from the first tier that has it; loads are asynchronous (the engine
//    keeps stepping: kvtier's connector) and promote chunks into the tiers above. With
//    load_blocking f > 0 the last f of a load's read is synchronous: the request joins the
//    schedule that long before its read ends, and the step that runs its first chunk waits for
//    the read, so every request in that step pays (LMCache's default retrieval, in the worker's
//    start_load_kv before the forward pass, is f = 1). Tier eviction is LRU over
//    conversations, tail-first within one (a head chunk is never dropped to keep a tail).
// Single-threaded and deterministic; Simulate is thread-safe (no shared state).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "kvtier/eviction.h"
#include "kvtier/status.h"
#include "planner/prefill.h"

namespace kvtier::planner {

enum class WritePolicy { kWriteThrough, kWriteBack, kNone };
Result<WritePolicy> ParseWritePolicy(std::string_view name);
std::string_view WritePolicyName(WritePolicy policy);

struct TierSpec {
  std::string name;
  double capacity_bytes = 0;
  double read_bytes_per_s = 0;
  double write_bytes_per_s = 0;
};
// "NAME:CAPACITY:READ_BW[:WRITE_BW]", e.g. "cpu:8GiB:20GB/s" or "nfs:200GiB:3.55GB/s:1.5GB/s".
// WRITE_BW defaults to READ_BW. Fails on a missing part, a unit-less capacity, a bandwidth <= 0,
// or a reserved name ("gpu", "recompute").
Result<TierSpec> ParseTierSpec(std::string_view text);

struct Workload {
  uint32_t users = 8;
  uint32_t rounds = 5;
  double qps = 0.5;  // requests per second over all users
  uint64_t system_prompt_tokens = 1000;
  uint64_t context_tokens = 16384;  // per user, at the first round
  uint64_t question_tokens = 128;
  uint64_t answer_tokens = 100;
  double duration_s = 1200;  // no question is sent after this; the rest drains

  // Prompt of round r (0-based): system + context + r x (question + answer) + question.
  uint64_t PromptTokens(uint32_t round) const {
    return system_prompt_tokens + context_tokens + round * (question_tokens + answer_tokens) +
           question_tokens;
  }
  // A new user joins every JoinInterval() seconds: a user lives rounds - 1 gaps of users/qps.
  double JoinInterval() const { return (rounds > 1 ? rounds - 1 : 1) / qps; }
  // Requests per second the pacing sends per unit of qps when the engine keeps up (rounds
  // questions over rounds - 1 gaps), and at this qps: bench qa's "expected QPS".
  double SendsPerQps() const { return rounds > 1 ? static_cast<double>(rounds) / (rounds - 1) : 1; }
  double SentRate() const { return qps * SendsPerQps(); }
  // A conversation at its largest: the last prompt plus its answer.
  uint64_t PeakConversationTokens() const {
    return system_prompt_tokens + context_tokens + rounds * (question_tokens + answer_tokens);
  }
  Status Validate() const;
};

struct EngineModel {
  double gpu_kv_bytes = 0;          // KV memory of all GPUs of the instance together
  uint64_t kv_bytes_per_token = 0;  // all ranks together
  PrefillCost prefill;
  double step_overhead_s = 0.004;       // fixed cost of every engine step
  double decode_weights_s = 0;          // reading the weights once per decode step
  double decode_s_per_kv_token = 0;     // reading one cached token's KV per decode step
  uint32_t max_batched_tokens = 8192;   // tokens per step (decode + prefill chunks)
  uint32_t block_tokens = 16;           // GPU prefix-cache block
  uint32_t chunk_tokens = 256;          // offload chunk
  double save_copy_bytes_per_s = 50e9;  // device->host copy of KV being saved
  double save_blocking = 1.0;           // fraction of that copy the engine waits for
  // Fraction of a load's read (its time in the tiers, queueing included) that the engine step
  // running the loaded request waits for: 0 = asynchronous (kvtier), 1 = synchronous (LMCache's
  // default retrieval). The loaded request waits for its read once either way.
  double load_blocking = 0.0;
  // Host time to start one layer's load from the host tier (copy calls, events) on the thread
  // that launches the model: it lengthens a launch-bound suffix by layers x this.
  double layer_load_overhead_s = 0;
  // Time every request spends outside the engine's steps before its first token is seen
  // (HTTP, tokenization, scheduling, streaming the token back): added to every TTFT.
  double request_overhead_s = 0;
};

struct SimOptions {
  EngineModel engine;
  Workload workload;
  std::vector<TierSpec> tiers;  // empty: the no-offload baseline
  WritePolicy write_policy = WritePolicy::kWriteThrough;
  // The first tier's eviction, as `kvtier serve --eviction-policy` (kvtier's L1 runs it).
  EvictionPolicyKind l1_eviction = EvictionPolicyKind::kPrefixAware;
  // The connector's cost-aware lookups (kvtier.cost_aware, on by default): a hit is loaded only
  // as far as loading it is predicted to be faster than computing it.
  bool cost_aware = true;
  // The connector's prefetch (kvtier.prefetch): conversations that finished are expected back in
  // the order they finished; the oldest ones that fit in `prefetch_fraction` of the first tier
  // are promoted into it from below and pinned there until they return (docs/prefetch.md).
  bool prefetch = false;
  double prefetch_fraction = 0.5;
  // Capacity probe: `users` users ask back to back (no think time) for `duration_s`; throughput
  // is measured over the last three quarters.
  bool saturate = false;
  bool keep_requests = false;  // fill SimResult::request_log
};

// Where a request's prompt came from. `tier_tokens` has one entry per tier.
struct RequestLog {
  uint32_t conversation = 0;
  uint32_t round = 0;
  double sent_s = 0;
  double ttft_s = 0;
  double finish_s = 0;    // when its last answer token came out
  double transfer_s = 0;  // the longest tier read of this request, at full bandwidth
  uint64_t prompt_tokens = 0;
  uint64_t gpu_tokens = 0;
  std::vector<uint64_t> tier_tokens;
  uint64_t recomputed_tokens = 0;
  int source = 0;  // index into SimResult::source_names
};

struct SimResult {
  // "gpu", each tier's name, "recompute".
  std::vector<std::string> source_names;
  uint64_t requests = 0;
  // A request counts for the source that supplied most of its prompt tokens.
  std::vector<uint64_t> requests_by_source;
  std::vector<double> tokens_by_source;
  std::vector<double> ttft_sorted_s;
  double mean_ttft_s = 0, median_ttft_s = 0, p90_ttft_s = 0, p99_ttft_s = 0;
  std::vector<double> bytes_written;  // per tier
  std::vector<double> bytes_read;     // per tier
  std::vector<double> tier_peak_bytes;
  double gpu_capacity_tokens = 0;
  double peak_gpu_used_tokens = 0;
  double peak_working_set_tokens = 0;  // reserved by running requests at once
  uint64_t prompt_tokens = 0;
  // Tokens recomputed although this conversation had computed them before (evicted).
  uint64_t evicted_recompute_tokens = 0;
  // Chunks the first tier evicted before they were written below (write-back): lost.
  uint64_t dirty_evictions = 0;
  uint64_t admission_waits = 0;  // times the head request found no room
  uint64_t steps = 0;
  double engine_busy_s = 0;
  double load_wait_s = 0;  // of engine_busy_s, steps waiting for loads (load_blocking > 0)
  double end_s = 0;
  double throughput_rps = 0;  // completed requests per second (saturate: over the probe window)
  double min_ttft_minus_transfer_s = 0;
  double wall_s = 0;  // host time the simulation took
  std::vector<RequestLog> request_log;

  double HitRate(size_t source) const {
    return requests == 0 ? 0 : static_cast<double>(requests_by_source[source]) / requests;
  }
};

// Runs the model. Fails on invalid options (zero users, a conversation larger than the GPU's KV
// memory, ...). Never throws.
Result<SimResult> Simulate(const SimOptions& options);

// Percentile p in [0, 100] of sorted values, linear between ranks; 0 for an empty vector.
double Percentile(const std::vector<double>& sorted, double p);

}  // namespace kvtier::planner
