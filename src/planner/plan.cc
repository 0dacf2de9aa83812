#include "planner/plan.h"

#include <fmt/format.h>
#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "common/paced_capacity.h"
#include "planner/units.h"

namespace kvtier::planner {
SimOptions SimOptionsFor(const PlanInputs& in, bool offload) {
  SimOptions o;
  o.engine = in.engine;
  o.workload = in.workload;
  if (offload) o.tiers = in.tiers;
  o.write_policy = in.write_policy;
  o.l1_eviction = in.l1_eviction;
  o.cost_aware = in.cost_aware;
  o.prefetch = in.prefetch;
  o.prefetch_fraction = in.prefetch_fraction;
  return o;
}

namespace {

constexpr double kProbeMaxS = 300;     // capacity probes need not be as long as the run
constexpr int kCapacityMaxStages = 8;  // as bench qa's --capacity-max-stages

std::string WithCommas(uint64_t v) {
  std::string s = std::to_string(v);
  for (int i = static_cast<int>(s.size()) - 3; i > 0; i -= 3) s.insert(i, ",");
  return s;
}

std::string Percent(double f) { return fmt::format("{:.0f}%", f * 100); }

// Per-tier vectors are laid out over all of `tiers` (the no-offload arm has none of its own).
ArmReport FromSim(const SimResult& r, const std::vector<TierSpec>& tiers) {
  ArmReport a;
  a.mean_ttft_s = r.mean_ttft_s;
  a.median_ttft_s = r.median_ttft_s;
  a.p90_ttft_s = r.p90_ttft_s;
  a.hit_rate.assign(tiers.size() + 2, 0);
  a.bytes_written.assign(tiers.size(), 0);
  a.bytes_read.assign(tiers.size(), 0);
  a.token_share.assign(tiers.size() + 2, 0);
  const double prompt = std::max<double>(1, static_cast<double>(r.prompt_tokens));
  a.hit_rate.front() = r.HitRate(0);
  a.hit_rate.back() = r.HitRate(r.source_names.size() - 1);
  a.token_share.front() = r.tokens_by_source.front() / prompt;
  a.token_share.back() = r.tokens_by_source.back() / prompt;
  for (size_t t = 0; t < tiers.size(); ++t) {
    for (size_t s = 1; s + 1 < r.source_names.size(); ++s) {
      if (r.source_names[s] != tiers[t].name) continue;
      a.hit_rate[t + 1] = r.HitRate(s);
      a.token_share[t + 1] = r.tokens_by_source[s] / prompt;
      a.bytes_written[t] = r.bytes_written[s - 1];
      a.bytes_read[t] = r.bytes_read[s - 1];
    }
  }
  a.requests = r.requests;
  a.evicted_recompute_fraction =
      r.prompt_tokens ? static_cast<double>(r.evicted_recompute_tokens) / r.prompt_tokens : 0;
  a.sim_wall_s = r.wall_s;
  return a;
}

Status CheckLoad(const PlanInputs& in) {
  if (in.qps <= 0 && !(in.load > 0 && in.load <= 1.5)) {
    return Status::InvalidArgument("--load must be in (0, 1.5] (a fraction of capacity)");
  }
  return Status::Ok();
}

double MeanPrompt(const Workload& w) {
  double sum = 0;
  for (uint32_t r = 0; r < w.rounds; ++r) sum += static_cast<double>(w.PromptTokens(r));
  return sum / w.rounds;
}

class Planner {
 public:
  Planner(const PlanInputs& in, const ProgressFn& progress) : in_(in), progress_(progress) {}

  Result<PlanReport> Run();
  // The --qps at which the arm's pacing sends `load` x its capacity (bench qa's recommendation).
  Result<double> QpsFor(const EngineModel& engine, const Workload& w, bool offload,
                        double* capacity) const {
    if (in_.qps > 0) return in_.qps;
    KVTIER_ASSIGN_OR_RETURN(double cap, Capacity(engine, w, offload));
    if (!(cap > 0)) return Status::Internal("capacity probe completed no request");
    if (capacity) *capacity = cap;
    return in_.load * cap / w.SendsPerQps();
  }

 private:
  void Say(const std::string& s) const {
    if (progress_) progress_(s);
  }
  SimOptions Options(const EngineModel& engine, const Workload& w, bool offload) const {
    SimOptions o = SimOptionsFor(in_, offload);
    o.engine = engine;
    o.workload = w;
    return o;
  }
  // The arm's service rate, finished requests per second, measured as --capacity-method says.
  Result<double> Capacity(const EngineModel& engine, const Workload& w, bool offload) const {
    if (in_.capacity_method == CapacityMethod::kClosedLoop) {
      SimOptions o = Options(engine, w, offload);
      o.saturate = true;
      o.workload.duration_s = std::min(w.duration_s, kProbeMaxS);
      KVTIER_ASSIGN_OR_RETURN(SimResult r, Simulate(o));
      return r.throughput_rps;
    }
    // The published method, as `kvtier bench qa --find-capacity` runs it: the paced workload,
    // deliberately overloaded in stages (each a fresh run), qps doubling until the engine falls
    // behind (ReadPacedStage, the function bench qa judges its stages with) or its finished rate
    // stops growing by 10 %; what is unfinished at a stage's end is not counted.
    const double stage = in_.capacity_stage_s;
    double qps = in_.capacity_start_qps;
    if (!(qps > 0)) {
      // A fifth of what an idle engine finishes back to back, in the pacing's terms, but at
      // least two questions per user and stage (a stage with fewer measures nothing).
      qps = std::max(
          0.2 / engine.prefill.Full(static_cast<uint64_t>(MeanPrompt(w))) / w.SendsPerQps(),
          2.0 * w.users / stage);
    }
    double best = 0;
    for (int n = 0; n < kCapacityMaxStages; ++n, qps *= 2) {
      SimOptions o = Options(engine, w, offload);
      o.workload.qps = qps;
      o.workload.duration_s = stage;
      o.keep_requests = true;
      KVTIER_ASSIGN_OR_RETURN(SimResult r, Simulate(o));
      std::vector<std::pair<double, double>> finished;
      std::vector<double> sends;
      for (const RequestLog& l : r.request_log) {
        sends.push_back(l.sent_s);
        if (l.finish_s <= stage) finished.emplace_back(l.sent_s, l.finish_s);
      }
      const PacedStageReading reading = ReadPacedStage(finished, sends, 0, stage);
      if (reading.finished_rps < 1.1 * best) break;  // plateau: more load only queues
      best = std::max(best, reading.finished_rps);
      if (reading.fell_behind) break;  // the rate it achieves once behind is its capacity
    }
    return best;
  }
  Result<double> CalibrateStepOverhead();
  Status SimulatePoint(const EngineModel& engine, Workload w, PointReport* p);

  const PlanInputs& in_;
  const ProgressFn& progress_;
  PlanReport report_;
};

Result<double> Planner::CalibrateStepOverhead() {
  const auto [ctx, target] = *in_.calibrate;
  Workload w = in_.workload;
  w.context_tokens = ctx;
  auto mean_at = [&](double overhead) -> Result<double> {
    EngineModel e = in_.engine;
    e.step_overhead_s = overhead;
    KVTIER_ASSIGN_OR_RETURN(double qps, QpsFor(e, w, false, nullptr));
    Workload wq = w;
    wq.qps = qps;
    KVTIER_ASSIGN_OR_RETURN(SimResult r, Simulate(Options(e, wq, false)));
    return r.mean_ttft_s;
  };
  KVTIER_ASSIGN_OR_RETURN(double floor, mean_at(0));
  if (floor > target) {
    return Status::InvalidArgument(fmt::format(
        "cannot calibrate: the model predicts a mean TTFT of {} at {} tokens even with no step "
        "overhead, above the measured {}; the prefill table or FLOP efficiency is too slow",
        FormatSeconds(floor), ctx, FormatSeconds(target)));
  }
  double lo = 0, hi = 0.01;
  while (true) {
    KVTIER_ASSIGN_OR_RETURN(double m, mean_at(hi));
    if (m >= target) break;
    lo = hi;
    hi *= 2;
    if (hi > 10) {
      return Status::InvalidArgument(fmt::format(
          "cannot calibrate: even a 10 s step overhead predicts less than the measured {}",
          FormatSeconds(target)));
    }
  }
  for (int i = 0; i < 24 && hi - lo > 1e-5; ++i) {
    double mid = (lo + hi) / 2;
    KVTIER_ASSIGN_OR_RETURN(double m, mean_at(mid));
    (m < target ? lo : hi) = mid;
  }
  return (lo + hi) / 2;
}

Status Planner::SimulatePoint(const EngineModel& engine, Workload w, PointReport* p) {
  // Each arm runs at its own load: with --load, a fraction of that arm's capacity at this point.
  double cap_base = 0, cap_off = 0;
  Workload wb = w, wo = w;
  KVTIER_ASSIGN_OR_RETURN(wb.qps, QpsFor(engine, w, false, &cap_base));
  KVTIER_ASSIGN_OR_RETURN(wo.qps, QpsFor(engine, w, true, &cap_off));
  p->qps = wb.qps;
  KVTIER_ASSIGN_OR_RETURN(SimResult base, Simulate(Options(engine, wb, false)));
  KVTIER_ASSIGN_OR_RETURN(SimResult off, Simulate(Options(engine, wo, true)));
  p->baseline = FromSim(base, in_.tiers);
  p->offload = FromSim(off, in_.tiers);
  p->baseline.qps = wb.qps;
  p->offload.qps = wo.qps;
  report_.total_sim_wall_s += base.wall_s + off.wall_s;
  if (in_.service_rate) {
    if (!(cap_base > 0)) {
      KVTIER_ASSIGN_OR_RETURN(cap_base, Capacity(engine, w, false));
    }
    if (!(cap_off > 0)) {
      KVTIER_ASSIGN_OR_RETURN(cap_off, Capacity(engine, w, true));
    }
    p->baseline.service_rate_rps = cap_base;
    p->offload.service_rate_rps = cap_off;
  }
  p->regime =
      ClassifyRegime(p->baseline.evicted_recompute_fraction, MeanPrompt(w), report_.payoff_tokens);
  if (in_.sensitivity) {
    // Near the eviction threshold hit rates move steeply: show how far.
    EngineModel small = engine, large = engine;
    small.gpu_kv_bytes *= 0.9;
    large.gpu_kv_bytes *= 1.1;
    auto b_small = Simulate(Options(small, wb, false));
    auto b_large = Simulate(Options(large, wb, false));
    auto o_small = Simulate(Options(small, wo, true));
    auto o_large = Simulate(Options(large, wo, true));
    if (b_small.ok() && b_large.ok() && o_small.ok() && o_large.ok()) {
      p->has_sensitivity = true;
      p->baseline_gpu_hit_low = b_small->HitRate(0);
      p->baseline_gpu_hit_high = b_large->HitRate(0);
      p->baseline_mean_low = b_large->mean_ttft_s;
      p->baseline_mean_high = b_small->mean_ttft_s;
      p->offload_mean_low = std::min(o_small->mean_ttft_s, o_large->mean_ttft_s);
      p->offload_mean_high = std::max(o_small->mean_ttft_s, o_large->mean_ttft_s);
    }
  }
  return Status::Ok();
}

Result<PlanReport> Planner::Run() {
  const EngineModel& e0 = in_.engine;
  if (in_.contexts.empty()) return Status::InvalidArgument("no --context given");
  KVTIER_RETURN_IF_ERROR(CheckLoad(in_));
  if (!(e0.gpu_kv_bytes > 0)) return Status::InvalidArgument("GPU KV memory must be > 0");
  for (const TierSpec& t : in_.tiers) {
    if (std::count_if(in_.tiers.begin(), in_.tiers.end(),
                      [&](const TierSpec& o) { return o.name == t.name; }) > 1) {
      return Status::InvalidArgument(fmt::format("tier name '{}' given twice", t.name));
    }
  }
  PlanReport& rep = report_;
  rep.model_name = in_.model.name;
  rep.gpu_description = in_.gpu_description;
  rep.prefill_description = e0.prefill.description();
  rep.kv_bytes_per_token = e0.kv_bytes_per_token;
  rep.gpu_kv_bytes = e0.gpu_kv_bytes;
  rep.workload = in_.workload;
  rep.write_policy = in_.write_policy;
  rep.load_blocking = e0.load_blocking;
  rep.fast = in_.fast;
  std::vector<uint64_t> contexts = in_.contexts;
  std::sort(contexts.begin(), contexts.end());
  contexts.erase(std::unique(contexts.begin(), contexts.end()), contexts.end());
  Workload first = in_.workload;
  first.context_tokens = contexts.front();
  rep.peak_session_bytes_at_first_context = PeakSessionBytes(first, e0.kv_bytes_per_token);
  rep.eviction_onset_peak_tokens =
      EvictionOnsetPeakTokens(e0.gpu_kv_bytes, e0.kv_bytes_per_token, in_.workload.users);
  rep.eviction_onset_tokens =
      EvictionOnsetContext(e0.gpu_kv_bytes, e0.kv_bytes_per_token, in_.workload);
  for (const TierSpec& t : in_.tiers) {
    rep.tier_names.push_back(t.name);
    rep.tier_read_bytes_per_s.push_back(t.read_bytes_per_s);
    rep.payoff_tokens.push_back(
        PayoffTokens(e0.prefill, e0.kv_bytes_per_token, t.read_bytes_per_s));
  }

  EngineModel engine = e0;
  if (in_.calibrate && !in_.fast) {
    Say(
        fmt::format("calibrating the engine step overhead to a measured mean TTFT of {} at {} "
                    "tokens",
                    FormatSeconds(in_.calibrate->second), in_.calibrate->first));
    KVTIER_ASSIGN_OR_RETURN(engine.step_overhead_s, CalibrateStepOverhead());
    rep.calibrated = true;
  }
  rep.step_overhead_s = engine.step_overhead_s;

  for (size_t i = 0; i < contexts.size(); ++i) {
    Workload w = in_.workload;
    w.context_tokens = contexts[i];
    PointReport p;
    p.context_tokens = contexts[i];
    p.peak_working_set_bytes = PeakWorkingSetTokens(w) * e0.kv_bytes_per_token;
    const double ratio = p.peak_working_set_bytes / engine.gpu_kv_bytes;
    p.near_threshold = ratio > 0.85 && ratio < 1.15;
    if (in_.fast) {
      auto to_arm = [&](const FastArm& f) {
        ArmReport a;
        a.mean_ttft_s = f.mean_ttft_s;
        a.median_ttft_s = f.median_ttft_s;
        a.p90_ttft_s = f.p90_ttft_s;
        a.hit_rate = f.hit_rate;
        a.token_share = f.hit_rate;  // the closed forms share out tokens, not requests
        const double requests = w.users * w.rounds;  // one conversation per user, per session
        for (double b : f.bytes_written_per_request) a.bytes_written.push_back(b * requests);
        for (double b : f.bytes_read_per_request) a.bytes_read.push_back(b * requests);
        return a;
      };
      FastArm base = FastEstimate(engine, w, {}, in_.write_policy);
      base.hit_rate.insert(base.hit_rate.end() - 1, in_.tiers.size(), 0.0);
      base.bytes_read_per_request.assign(in_.tiers.size(), 0);
      base.bytes_written_per_request.assign(in_.tiers.size(), 0);
      p.baseline = to_arm(base);
      p.offload = to_arm(FastEstimate(engine, w, in_.tiers, in_.write_policy));
      p.regime = ClassifyRegime(ratio > 1 ? 1 : 0, MeanPrompt(w), rep.payoff_tokens);
    } else {
      Say(fmt::format("simulating context {} tokens ({}/{})", contexts[i], i + 1, contexts.size()));
      Status s = SimulatePoint(engine, w, &p);
      if (!s.ok()) return s.WithContext(fmt::format("context {}", contexts[i]));
    }
    rep.points.push_back(std::move(p));
  }
  rep.hit_suffix_tokens = in_.hit_suffix_tokens;
  for (uint64_t c : contexts) {
    if (c > in_.hit_suffix_tokens && !in_.tiers.empty()) {
      rep.single_hits.push_back(PredictSingleRequestHit(engine, in_.model.num_layers, in_.tiers, c,
                                                        in_.hit_suffix_tokens));
    }
  }

  // Recommendation.
  std::string rec;
  const PointReport* pays = nullptr;
  for (const PointReport& p : rep.points) {
    if (p.offload.mean_ttft_s < 0.9 * p.baseline.mean_ttft_s) {
      pays = &p;
      break;
    }
  }
  rec += fmt::format(
      "The GPU starts evicting at about {} tokens of context per user ({} users, "
      "{} of KV memory). ",
      WithCommas(rep.eviction_onset_tokens), in_.workload.users, FormatBytes(e0.gpu_kv_bytes));
  if (pays) {
    rec += fmt::format("Offload pays from {} tokens: mean TTFT {} instead of {} (regime {}).",
                       WithCommas(pays->context_tokens), FormatSeconds(pays->offload.mean_ttft_s),
                       FormatSeconds(pays->baseline.mean_ttft_s), pays->regime);
  } else {
    rec += "Offload does not cut mean TTFT by 10% at any of these context lengths.";
  }
  for (const PointReport& p : rep.points) {
    if (p.regime == 1 && p.offload.mean_ttft_s > 1.02 * p.baseline.mean_ttft_s) {
      rec += fmt::format(
          " Where everything fits (e.g. {} tokens) offload only costs: {:+.0f}% TTFT from saving "
          "KV that is never read; consider --write-policy write_back or turning offload off there.",
          WithCommas(p.context_tokens), (p.offload.mean_ttft_s / p.baseline.mean_ttft_s - 1) * 100);
      break;
    }
  }
  rep.recommendation = rec;
  return std::move(rep);
}

std::string ArmCells(const ArmReport& a) {
  return fmt::format("{:>9} {:>9} {:>9}", FormatSeconds(a.mean_ttft_s),
                     FormatSeconds(a.median_ttft_s), FormatSeconds(a.p90_ttft_s));
}

}  // namespace

int ClassifyRegime(double baseline_evicted_recompute_fraction, double mean_prompt_tokens,
                   const std::vector<std::optional<uint64_t>>& payoff_tokens) {
  if (baseline_evicted_recompute_fraction < 0.01) return 1;
  if (payoff_tokens.empty()) return 2;
  const auto& slowest = payoff_tokens.back();
  if (slowest && static_cast<double>(*slowest) <= mean_prompt_tokens) return 3;
  return 2;
}

Result<PlanReport> RunPlan(const PlanInputs& inputs, const ProgressFn& progress) {
  Planner planner(inputs, progress);
  return planner.Run();
}

Result<ArmQps> QpsForEachArm(const PlanInputs& inputs, uint64_t context) {
  KVTIER_RETURN_IF_ERROR(CheckLoad(inputs));
  static const ProgressFn kSilent;
  Planner planner(inputs, kSilent);
  Workload w = inputs.workload;
  w.context_tokens = context;
  ArmQps q;
  KVTIER_ASSIGN_OR_RETURN(q.baseline, planner.QpsFor(inputs.engine, w, false, nullptr));
  KVTIER_ASSIGN_OR_RETURN(q.offload, planner.QpsFor(inputs.engine, w, true, nullptr));
  return q;
}

std::string FormatReport(const PlanReport& r) {
  std::string out;
  const Workload& w = r.workload;
  out +=
      fmt::format("Model {} on {}: {} B of KV per token, {} of GPU KV memory\n", r.model_name,
                  r.gpu_description, WithCommas(r.kv_bytes_per_token), FormatBytes(r.gpu_kv_bytes));
  out += fmt::format("Prefill: {}; engine step overhead {}{}\n", r.prefill_description,
                     FormatSeconds(r.step_overhead_s), r.calibrated ? " (calibrated)" : "");
  out += fmt::format(
      "Workload: {} users x {} rounds; prompt = {} system + context + rounds x ({} question + {} "
      "answer) tokens; {} of sending\n",
      w.users, w.rounds, w.system_prompt_tokens, w.question_tokens, w.answer_tokens,
      FormatSeconds(w.duration_s));
  out += "Tiers:";
  if (r.tier_names.empty()) out += " none";
  for (size_t t = 0; t < r.tier_names.size(); ++t) {
    out +=
        fmt::format(" {} (read {}){}", r.tier_names[t], FormatBandwidth(r.tier_read_bytes_per_s[t]),
                    t + 1 < r.tier_names.size() ? "," : "");
  }
  out += fmt::format("; write policy {}", WritePolicyName(r.write_policy));
  if (r.load_blocking > 0 && !r.tier_names.empty()) {
    out += fmt::format("; loads stall the engine step for {:g} of their read", r.load_blocking);
  }
  out += "\n\n";

  out += "Thresholds\n";
  out += fmt::format(
      "  eviction onset    context >= {} tokens per user (peak conversation {} tokens; "
      "users x peak x bytes/token > GPU KV memory)\n",
      WithCommas(r.eviction_onset_tokens),
      WithCommas(static_cast<uint64_t>(r.eviction_onset_peak_tokens)));
  for (size_t t = 0; t < r.tier_names.size(); ++t) {
    const auto& p = r.payoff_tokens[t];
    out += fmt::format("  payoff {:<10} {}\n", r.tier_names[t],
                       p ? (*p <= 16 ? std::string("a prefix of any length is read faster "
                                                   "than recomputed")
                                     : fmt::format("prefixes >= {} tokens are read faster than "
                                                   "recomputed",
                                                   WithCommas(*p)))
                         : std::string("never: recomputing is always faster than reading"));
  }
  out += "\n";

  out += fmt::format("TTFT ({}), per first-round context length\n",
                     r.fast ? "closed form, no queueing" : "simulated");
  out += fmt::format("{:>8} {:>6} {:>7} | {:>9} {:>9} {:>9} | {:>9} {:>9} {:>9} | {:>7}\n",
                     "context", "regime", "qps", "base mean", "median", "p90", "offl mean",
                     "median", "p90", "change");
  for (const PointReport& p : r.points) {
    double change =
        p.baseline.mean_ttft_s > 0 ? (p.offload.mean_ttft_s / p.baseline.mean_ttft_s - 1) * 100 : 0;
    out += fmt::format("{:>8} {:>6} {:>7} | {} | {} | {:>+6.0f}%\n", p.context_tokens, p.regime,
                       r.fast ? std::string("-") : fmt::format("{:.3f}", p.qps),
                       ArmCells(p.baseline), ArmCells(p.offload), change);
  }
  out += "\n";

  out += "Where prompts came from (fraction of requests), bytes moved";
  out += r.fast ? " (per session of all users)" : "";
  out += r.fast ? "\n" : ", each arm's --qps and service rate (finished req/s, capacity probe)\n";
  std::string header = fmt::format("{:>8} {:>9} {:>5}", "context", "arm", "gpu");
  for (const auto& n : r.tier_names) header += fmt::format(" {:>6}", n.substr(0, 6));
  header += fmt::format(" {:>9}", "recompute");
  for (const auto& n : r.tier_names) header += fmt::format(" {:>10}", "wr " + n.substr(0, 7));
  for (const auto& n : r.tier_names) header += fmt::format(" {:>10}", "rd " + n.substr(0, 7));
  if (!r.fast) header += fmt::format(" {:>9} {:>9}", "qps", "capacity");
  out += header + "\n";
  for (const PointReport& p : r.points) {
    for (int arm = 0; arm < 2; ++arm) {
      const ArmReport& a = arm == 0 ? p.baseline : p.offload;
      std::string line =
          fmt::format("{:>8} {:>9} {:>5}", arm == 0 ? std::to_string(p.context_tokens) : "",
                      arm == 0 ? "no-offl" : "offload", Percent(a.hit_rate.front()));
      for (size_t t = 0; t < r.tier_names.size(); ++t) {
        line += fmt::format(" {:>6}", Percent(a.hit_rate[t + 1]));
      }
      line += fmt::format(" {:>9}", Percent(a.hit_rate.back()));
      for (size_t t = 0; t < r.tier_names.size(); ++t) {
        line +=
            fmt::format(" {:>10}", a.bytes_written.empty() ? "0" : FormatBytes(a.bytes_written[t]));
      }
      for (size_t t = 0; t < r.tier_names.size(); ++t) {
        line += fmt::format(" {:>10}", a.bytes_read.empty() ? "0" : FormatBytes(a.bytes_read[t]));
      }
      if (!r.fast) line += fmt::format(" {:>9.3f} {:>9.3f}", a.qps, a.service_rate_rps);
      out += line + "\n";
    }
  }
  out += "\n";

  if (!r.single_hits.empty()) {
    out += fmt::format(
        "One request alone: TTFT when all but its last {} tokens come from a tier (the first "
        "tier's copy overlapped layer by layer with the suffix's compute; later tiers read, then "
        "compute)\n",
        r.hit_suffix_tokens);
    std::string header = fmt::format("{:>8} {:>10} {:>10}", "context", "recompute", "suffix");
    for (const auto& n : r.tier_names) {
      header += fmt::format(" {:>10} {:>10} {:>7}", "rd " + n.substr(0, 7), "hit " + n.substr(0, 6),
                            "speedup");
    }
    out += header + "\n";
    for (const SingleRequestHit& h : r.single_hits) {
      std::string line = fmt::format("{:>8} {:>10} {:>10}", h.context_tokens,
                                     FormatSeconds(h.recompute_s), FormatSeconds(h.suffix_s));
      for (size_t t = 0; t < h.hit_ttft_s.size(); ++t) {
        line += fmt::format(" {:>10} {:>10} {:>6.1f}x", FormatSeconds(h.read_s[t]),
                            FormatSeconds(h.hit_ttft_s[t]), h.recompute_s / h.hit_ttft_s[t]);
      }
      out += line + "\n";
    }
    out += "\n";
  }

  bool any_sens = std::any_of(r.points.begin(), r.points.end(),
                              [](const PointReport& p) { return p.has_sensitivity; });
  if (any_sens) {
    out += "Sensitivity: the same points with 0.9x .. 1.1x the GPU KV memory\n";
    out += fmt::format("{:>8} {:>11} | {:>19} {:>21} | {:>21}\n", "context", "working/GPU",
                       "no-offl gpu hits", "no-offl mean TTFT", "offload mean TTFT");
    for (const PointReport& p : r.points) {
      if (!p.has_sensitivity) continue;
      out += fmt::format("{:>8} {:>11} | {:>19} {:>21} | {:>21}{}\n", p.context_tokens,
                         fmt::format("{:.2f}", p.peak_working_set_bytes / r.gpu_kv_bytes),
                         fmt::format("{} .. {}", Percent(p.baseline_gpu_hit_low),
                                     Percent(p.baseline_gpu_hit_high)),
                         fmt::format("{} .. {}", FormatSeconds(p.baseline_mean_low),
                                     FormatSeconds(p.baseline_mean_high)),
                         fmt::format("{} .. {}", FormatSeconds(p.offload_mean_low),
                                     FormatSeconds(p.offload_mean_high)),
                         p.near_threshold ? "  <- near the eviction threshold" : "");
    }
    out += "\n";
  }
  for (const PointReport& p : r.points) {
    for (int arm = 0; arm < 2; ++arm) {
      const ArmReport& a = arm == 0 ? p.baseline : p.offload;
      const double sent = a.qps * r.workload.SendsPerQps();
      if (a.service_rate_rps > 0 && sent > 0.95 * a.service_rate_rps) {
        out += fmt::format(
            "Warning: at {} tokens the {} arm is offered {:.3f} req/s but serves at most {:.3f}: "
            "its TTFT measures a growing queue, not the cache.\n",
            p.context_tokens, arm == 0 ? "no-offload" : "offload", sent, a.service_rate_rps);
      }
    }
  }
  out += "Recommendation: " + r.recommendation + "\n";
  return out;
}

nlohmann::json ReportToJson(const PlanReport& r) {
  using nlohmann::json;
  json payoff = json::object();
  for (size_t t = 0; t < r.tier_names.size(); ++t) {
    payoff[r.tier_names[t]] = r.payoff_tokens[t] ? json(*r.payoff_tokens[t]) : json(nullptr);
  }
  json points = json::array();
  auto arm = [&](const ArmReport& a) {
    json hit = json::object();
    hit["gpu"] = a.hit_rate.front();
    for (size_t t = 0; t < r.tier_names.size(); ++t) hit[r.tier_names[t]] = a.hit_rate[t + 1];
    hit["recompute"] = a.hit_rate.back();
    json share = json::object();
    if (!a.token_share.empty()) {
      share["gpu"] = a.token_share.front();
      for (size_t t = 0; t < r.tier_names.size(); ++t)
        share[r.tier_names[t]] = a.token_share[t + 1];
      share["recompute"] = a.token_share.back();
    }
    json written = json::object(), read = json::object();
    for (size_t t = 0; t < r.tier_names.size(); ++t) {
      written[r.tier_names[t]] = a.bytes_written.empty() ? 0.0 : a.bytes_written[t];
      read[r.tier_names[t]] = a.bytes_read.empty() ? 0.0 : a.bytes_read[t];
    }
    return json{{"qps", a.qps},
                {"service_rate_rps", a.service_rate_rps},
                {"mean_ttft_s", a.mean_ttft_s},
                {"median_ttft_s", a.median_ttft_s},
                {"p90_ttft_s", a.p90_ttft_s},
                {"hit_rate", hit},
                {"token_share", share},
                {"bytes_written", written},
                {"bytes_read", read}};
  };
  for (const PointReport& p : r.points) {
    points.push_back(json{{"context_tokens", p.context_tokens},
                          {"regime", p.regime},
                          {"baseline", arm(p.baseline)},
                          {"offload", arm(p.offload)}});
  }
  json single = json::array();
  for (const SingleRequestHit& h : r.single_hits) {
    json hit = json::object(), read = json::object();
    for (size_t t = 0; t < h.hit_ttft_s.size(); ++t) {
      hit[r.tier_names[t]] = h.hit_ttft_s[t];
      read[r.tier_names[t]] = h.read_s[t];
    }
    single.push_back(json{{"context_tokens", h.context_tokens},
                          {"prefix_tokens", h.prefix_tokens},
                          {"recompute_s", h.recompute_s},
                          {"suffix_s", h.suffix_s},
                          {"read_s", read},
                          {"hit_ttft_s", hit}});
  }
  return json{{"kv_bytes_per_token", r.kv_bytes_per_token},
              {"thresholds",
               json{{"eviction_onset_tokens", r.eviction_onset_tokens}, {"payoff_tokens", payoff}}},
              {"points", points},
              {"single_request", json{{"suffix_tokens", r.hit_suffix_tokens}, {"rows", single}}}};
}

std::string PlotScript(const PlanReport& r, const std::string& path) {
  const bool png = path.ends_with(".png");
  std::string s;
  s += png ? "set terminal pngcairo size 1000,600 enhanced font 'Sans,11' background rgb 'white'\n"
           : "set terminal svg size 1000,600 dynamic enhanced font 'Sans,11' background rgb "
             "'white'\n";
  std::string quoted = path;
  for (size_t pos = 0; (pos = quoted.find('\'', pos)) != std::string::npos; pos += 2) {
    quoted.insert(pos, "'");  // gnuplot: '' inside single quotes
  }
  s += fmt::format("set output '{}'\n", quoted);
  std::string tiers;
  for (size_t t = 0; t < r.tier_names.size(); ++t) {
    tiers += fmt::format("{}{} {}", t ? ", " : "", r.tier_names[t],
                         FormatBandwidth(r.tier_read_bytes_per_s[t]));
  }
  s += fmt::format(
      "set title \"{}: {} on {}, {} users x {} rounds ({})\\noffload tiers: {}, {}\" noenhanced\n",
      r.fast ? "Closed-form TTFT" : "Simulated TTFT", r.model_name, r.gpu_description,
      r.workload.users, r.workload.rounds, FormatBytes(r.gpu_kv_bytes) + " GPU KV",
      tiers.empty() ? "none" : tiers, WritePolicyName(r.write_policy));
  s += "set xlabel 'context per user at the first round (tokens)'\n";
  s += "set ylabel 'time to first token (s)'\n";
  s += "set grid\nset key top left box opaque\nset yrange [0:*]\n";
  s += "set format x '%.0f'\n";
  uint64_t lo = r.points.front().context_tokens, hi = r.points.back().context_tokens;
  double pad = std::max<double>(1, (hi - lo) * 0.04);
  s += fmt::format("set xrange [{}:{}]\n", lo - pad, hi + pad);
  s += "$data << EOD\n";
  for (const PointReport& p : r.points) {
    s +=
        fmt::format("{} {:.6f} {:.6f} {:.6f} {:.6f} {}\n", p.context_tokens, p.baseline.mean_ttft_s,
                    p.baseline.p90_ttft_s, p.offload.mean_ttft_s, p.offload.p90_ttft_s, p.regime);
  }
  s += "EOD\n";
  int n = 0;
  auto vline = [&](double x, const std::string& label, const char* color) {
    if (x < lo - pad || x > hi + pad) return;
    ++n;
    s += fmt::format("set arrow {} from {},graph 0 to {},graph 1 nohead dt 2 lw 1.5 lc rgb '{}'\n",
                     n, x, x, color);
    s += fmt::format(
        "set label {} \"{}\" at {},graph {:.2f} left offset 0.5,0 tc rgb '{}' "
        "noenhanced\n",
        n, label, x, 0.96 - 0.05 * (n - 1), color);
  };
  vline(static_cast<double>(r.eviction_onset_tokens),
        fmt::format("GPU evicts from {}", r.eviction_onset_tokens), "#c0392b");
  const char* colors[] = {"#27ae60", "#8e44ad", "#d35400", "#2c3e50"};
  for (size_t t = 0; t < r.tier_names.size(); ++t) {
    if (r.payoff_tokens[t]) {
      vline(static_cast<double>(*r.payoff_tokens[t]),
            fmt::format("{} beats recompute from {}", r.tier_names[t], *r.payoff_tokens[t]),
            colors[t % 4]);
    }
  }
  // Regime numbers above the offload points.
  s += "plot $data using 1:2 with linespoints lw 2 pt 7 lc rgb '#1f77b4' title 'no offload, mean', "
       "'' using 1:3 with linespoints lw 1 dt 3 pt 6 lc rgb '#1f77b4' title 'no offload, p90', "
       "'' using 1:4 with linespoints lw 2 pt 5 lc rgb '#ff7f0e' title 'offload, mean', "
       "'' using 1:5 with linespoints lw 1 dt 3 pt 4 lc rgb '#ff7f0e' title 'offload, p90', "
       "'' using 1:3:(sprintf('regime %d', $6)) with labels offset 0,1.2 font ',9' notitle\n";
  return s;
}

Status WritePlot(const PlanReport& r, const std::string& path) {
  if (!path.ends_with(".svg") && !path.ends_with(".png")) {
    return Status::InvalidArgument(
        fmt::format("--plot '{}': the file must end in .svg or .png", path));
  }
  if (r.points.empty()) return Status::InvalidArgument("nothing to plot");
  std::string script = PlotScript(r, path);
  FILE* pipe = popen("gnuplot 2>&1", "w");
  if (pipe == nullptr) return Status::FromErrno(errno, "starting gnuplot");
  fwrite(script.data(), 1, script.size(), pipe);
  int rc = pclose(pipe);
  if (rc == -1) return Status::FromErrno(errno, "waiting for gnuplot");
  if (WIFEXITED(rc) && WEXITSTATUS(rc) == 127) {
    return Status::Unavailable("gnuplot not found: install it (Debian: gnuplot-nox)");
  }
  if (!WIFEXITED(rc) || WEXITSTATUS(rc) != 0) {
    return Status::IOError(fmt::format("gnuplot failed writing '{}' (exit status {})", path,
                                       WIFEXITED(rc) ? WEXITSTATUS(rc) : -1));
  }
  return Status::Ok();
}

}  // namespace kvtier::planner
