#include "server/metrics.h"

#include <fmt/format.h>
#include <prometheus/text_serializer.h>

#include <chrono>
#include <nlohmann/json.hpp>
#include <vector>

#include "server/server_impl.h"

namespace kvtier::server {

namespace {

prometheus::Histogram::BucketBoundaries LatencyBuckets() {
  // 5 us .. ~10 s, x2.5 per bucket.
  prometheus::Histogram::BucketBoundaries b;
  for (double v = 5e-6; v < 12; v *= 2.5) b.push_back(v);
  return b;
}

}  // namespace

Metrics::Metrics()
    : registry(std::make_shared<prometheus::Registry>()),
      requests(prometheus::BuildCounter()
                   .Name("kvtier_rpc_requests_total")
                   .Help("Protocol requests received, by operation")
                   .Register(*registry)),
      rpc_latency(prometheus::BuildHistogram()
                      .Name("kvtier_rpc_latency_seconds")
                      .Help("Server-side handling time of a request, by operation")
                      .Register(*registry)),
      load_latency(prometheus::BuildHistogram()
                       .Name("kvtier_load_latency_seconds")
                       .Help("prepare_load: request received to chunks pinned and the reply ready")
                       .Register(*registry)
                       .Add({}, LatencyBuckets())),
      store_latency(prometheus::BuildHistogram()
                        .Name("kvtier_store_latency_seconds")
                        .Help("Store: slots reserved to slots committed (includes the "
                              "client's copy)")
                        .Register(*registry)
                        .Add({}, LatencyBuckets())),
      connected(prometheus::BuildGauge()
                    .Name("kvtier_connected_clients")
                    .Help("Client connections open now")
                    .Register(*registry)
                    .Add({})),
      connections(prometheus::BuildCounter()
                      .Name("kvtier_connections_total")
                      .Help("Client connections accepted")
                      .Register(*registry)
                      .Add({})),
      refused(prometheus::BuildCounter()
                  .Name("kvtier_handshakes_refused_total")
                  .Help("Handshakes refused, by reason")
                  .Register(*registry)),
      protocol_errors(prometheus::BuildCounter()
                          .Name("kvtier_protocol_errors_total")
                          .Help("Connections closed for a malformed, oversized or "
                                "out-of-order message")
                          .Register(*registry)
                          .Add({})),
      request_errors(prometheus::BuildCounter()
                         .Name("kvtier_request_errors_total")
                         .Help("Requests answered with an error (connection kept)")
                         .Register(*registry)
                         .Add({})),
      released_on_disconnect(prometheus::BuildCounter()
                                 .Name("kvtier_released_on_disconnect_total")
                                 .Help("Pins and reservations released because their "
                                       "connection closed")
                                 .Register(*registry)
                                 .Add({})),
      dropped(prometheus::BuildCounter()
                  .Name("kvtier_connections_dropped_total")
                  .Help("Connections closed by the server, by reason (slow: replies left "
                        "unread; no_thread: no thread could be started for it)")
                  .Register(*registry)),
      accept_errors(prometheus::BuildCounter()
                        .Name("kvtier_accept_errors_total")
                        .Help("accept() failures (e.g. out of file descriptors)")
                        .Register(*registry)
                        .Add({})),
      quota_limited(prometheus::BuildCounter()
                        .Name("kvtier_quota_limited_total")
                        .Help("reserve/prepare_load requests cut short by the per-client "
                              "slot quota")
                        .Register(*registry)
                        .Add({})),
      reservations_expired(prometheus::BuildCounter()
                               .Name("kvtier_reservations_expired_total")
                               .Help("Reserved slots taken back, not committed within "
                                     "--reservation-timeout-ms")
                               .Register(*registry)
                               .Add({})) {
  for (uint16_t op = 1; op <= kMaxOpcode; ++op) {
    std::string name(OpcodeName(op));
    op_requests[op] = &requests.Add({{"op", name}});
    op_latency[op] = &rpc_latency.Add({{"op", name}}, LatencyBuckets());
  }
  for (const char* reason :
       {"version", "token", "namespace", "chunk_size", "draining", "too_many_clients", "bad_name",
        "no_thread", "hello_timeout", "too_many_pending", "no_window", "too_many_from_process",
        "no_window_memory", "no_credentials"}) {
    refused_by[reason] = &refused.Add({{"reason", reason}});
  }
  for (const char* reason : {"slow", "no_thread"}) {
    dropped_by[reason] = &dropped.Add({{"reason", reason}});
  }
}

std::string Server::Impl::StatsJson(StatsView view, std::string_view tenant) const {
  EngineStats st = engine_->Stats();
  const MemoryTierStats& m = st.memory_detail;
  nlohmann::json j;
  j["version"] = KVTIER_VERSION;
  j["protocol_version"] = kProtocolVersion;
  j["uptime_s"] = std::chrono::duration<double>(Clock::now() - started_at_).count();
  j["draining"] = stopping_.load();
  j["socket"] = options_.socket_path;
  j["write_policy"] = WritePolicyName(engine_->options().write_policy);
  if (events_) {
    const events::PublisherStats ev = events_->Stats();
    j["kv_events"] = {
        {"endpoint", events_->endpoint()},
        {"replay_endpoint", events_->replay_endpoint()},
        {"stored", {{"cpu", ev.stored_events[0]}, {"storage", ev.stored_events[1]}}},
        {"removed", {{"cpu", ev.removed_events[0]}, {"storage", ev.removed_events[1]}}},
        {"batches", ev.batches},
        {"dropped_queue_full", ev.dropped_queue_full},
        {"dropped_descriptors", ev.dropped_descriptors},
        {"descriptor_conflicts", ev.descriptor_conflicts},
        {"undescribed_chunks", ev.undescribed_chunks},
        {"announced", ev.announced_chunks},
        {"replays", {{"ring", ev.replays_ring}, {"snapshot", ev.replays_snapshot}}},
        {"file_descriptors",
         {{"written", ev.file_descriptors_written},
          {"too_large", ev.file_descriptors_too_large},
          {"read", ev.file_descriptors_read},
          {"errors", ev.file_descriptor_errors}}}};
  }
  j["pool"] = {{"capacity_bytes", m.capacity_bytes},
               {"slot_bytes", m.slot_bytes},
               {"chunk_bytes", engine_->options().chunk_bytes},
               {"num_slots", m.num_slots},
               {"resident", m.resident},
               {"pinned", m.pinned},
               {"huge_pages", m.huge_pages},
               {"eviction_policy", EvictionPolicyName(engine_->options().memory.eviction)}};
  auto tier = [](const TierCounters& t) {
    nlohmann::json out = nlohmann::json::object();
    for (const TierCounterField& f : TierCounterFields()) out[std::string(f.name)] = t.*f.field;
    return out;
  };
  j["tiers"]["memory"] = tier(st.memory);
  j["engine"] = nlohmann::json::object();
  for (const EngineCounterField& f : EngineCounterFields()) {
    j["engine"][std::string(f.name)] = st.*f.field;
  }
  if (st.has_file) {
    // The tier's counters as every tier has them, then the file tier's own numbers (its
    // schema, kvtier/file_tier.h) apart: some share a name with a tier counter and mean
    // something else (a file read's hit against a lookup's).
    const FileTierStats& f = st.file_detail;
    j["tiers"]["file"] = tier(st.file);
    j["tiers"]["file"]["path"] = engine_->options().file->root;
    nlohmann::json detail = nlohmann::json::object();
    for (const FileTierStatField& field : FileTierStatFields()) {
      detail[std::string(field.name)] = f.*field.field;
    }
    detail["o_direct"] = f.o_direct;
    detail["io_engine"] = f.io_engine;
    j["tiers"]["file"]["detail"] = std::move(detail);
    j["pool"]["dirty"] = m.dirty;
  }
  // The engine-wide numbers above are aggregates over every tenant, as in /metrics, which any
  // local user may read; who the clients are is not (docs/security.md, "A tenant").
  const bool isolated = options_.isolate_clients && view != StatsView::kOperator;
  if (isolated && view == StatsView::kTenant) j["tenant"] = tenant;
  nlohmann::json clients = nlohmann::json::array();
  size_t connected = 0;
  {
    std::lock_guard lock(conns_mu_);
    for (auto& c : conns_) {
      std::lock_guard conn_lock(c->mu);
      if (c->closed || !c->handshaken) continue;
      ++connected;
      if (isolated && (view == StatsView::kHttp || c->tenant != tenant)) continue;
      clients.push_back({{"id", c->id},
                         {"pid", c->peer_pid},
                         {"name", c->name},
                         {"model_id", c->ns.model_id},
                         {"rank", c->ns.rank},
                         {"world_size", c->ns.world_size},
                         {"pins", c->pinned},
                         {"reservations", c->reservations.size()}});
      if (view == StatsView::kOperator && !c->tenant.empty()) clients.back()["tenant"] = c->tenant;
    }
  }
  j["clients_connected"] = connected;
  if (!isolated || view == StatsView::kTenant) j["clients"] = std::move(clients);
  // Paths come from the operator and names were checked at hello, but no byte sequence may make
  // a dump throw (it would take the server down): invalid UTF-8 is replaced.
  return j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

std::string MetricsText(const Metrics& metrics, const EngineStats& st,
                        const events::PublisherStats* ev) {
  std::vector<prometheus::MetricFamily> families = metrics.registry->Collect();
  using prometheus::ClientMetric;
  using prometheus::MetricFamily;
  using prometheus::MetricType;
  auto d = [](uint64_t v) { return static_cast<double>(v); };
  for (const TierCounterField& f : TierCounterFields()) {
    MetricFamily family{
        fmt::format("kvtier_{}_total", f.name), std::string(f.help), MetricType::Counter, {}};
    auto add = [&](const char* tier, const TierCounters& t) {
      ClientMetric m;
      m.label.push_back({"tier", tier});
      m.counter.value = d(t.*f.field);
      family.metric.push_back(std::move(m));
    };
    add("memory", st.memory);
    if (st.has_file) add("file", st.file);
    families.push_back(std::move(family));
  }
  {
    MetricFamily f{"kvtier_engine_ops_total", "Engine operations", MetricType::Counter, {}};
    for (const EngineCounterField& e : EngineCounterFields()) {
      ClientMetric m;
      m.label.push_back({"op", std::string(e.op)});
      m.counter.value = d(st.*e.field);
      f.metric.push_back(std::move(m));
    }
    families.push_back(std::move(f));
  }
  auto gauge = [&](const char* name, const char* help,
                   std::vector<std::pair<std::string, double>> by_state, const char* label) {
    MetricFamily f{name, help, MetricType::Gauge, {}};
    for (auto& [k, v] : by_state) {
      ClientMetric m;
      if (label) m.label.push_back({label, k});
      m.gauge.value = v;
      f.metric.push_back(std::move(m));
    }
    families.push_back(std::move(f));
  };
  const MemoryTierStats& m = st.memory_detail;
  gauge(
      "kvtier_pool_slots", "L1 pool slots by state",
      {{"total", m.num_slots}, {"resident", m.resident}, {"pinned", m.pinned}, {"dirty", m.dirty}},
      "state");
  gauge("kvtier_pool_bytes", "L1 pool bytes",
        {{"capacity", d(m.capacity_bytes)},
         {"used", d(static_cast<uint64_t>(m.resident) * m.slot_bytes)}},
        "kind");
  if (st.has_file) {
    gauge("kvtier_file_tier_bytes", "File tier bytes",
          {{"used", d(st.file_detail.bytes)}, {"capacity", d(st.file_detail.capacity_bytes)}},
          "kind");
    gauge("kvtier_file_tier_queued", "File tier operations queued now",
          {{"read", d(st.file_detail.queued_reads)}, {"write", d(st.file_detail.queued_writes)}},
          "op");
    const FileTierStats& f = st.file_detail;
    MetricFamily index{"kvtier_file_tier_index_total",
                       "File tier index upkeep: rescans of the directory, probes of lookup misses",
                       MetricType::Counter,
                       {}};
    for (auto [name, v] :
         {std::pair{"rescan", f.rescans}, std::pair{"rescan_failure", f.rescan_failures},
          std::pair{"probe", f.probes}, std::pair{"probe_hit", f.probe_hits},
          std::pair{"probe_dropped", f.probes_dropped}}) {
      ClientMetric m;
      m.label.push_back({"op", name});
      m.counter.value = d(v);
      index.metric.push_back(std::move(m));
    }
    families.push_back(std::move(index));
    gauge("kvtier_file_tier_negative_cache_entries", "File tier keys known absent now",
          {{"", d(f.negative_cache_entries)}}, nullptr);
    gauge("kvtier_file_tier_last_rescan_seconds", "Duration of the file tier's last rescan",
          {{"", f.last_rescan_us / 1e6}}, nullptr);
  }
  if (ev) {
    auto counter = [&](const char* name, const char* help,
                       std::vector<std::vector<std::pair<std::string, std::string>>> labels,
                       std::vector<uint64_t> values) {
      MetricFamily f{name, help, MetricType::Counter, {}};
      for (size_t i = 0; i < values.size(); ++i) {
        ClientMetric m;
        for (auto& [k, v] : labels[i]) m.label.push_back({k, v});
        m.counter.value = d(values[i]);
        f.metric.push_back(std::move(m));
      }
      families.push_back(std::move(f));
    };
    counter("kvtier_kv_events_total", "KV-cache events published, by kind and medium",
            {{{"kind", "stored"}, {"medium", "cpu"}},
             {{"kind", "stored"}, {"medium", "storage"}},
             {{"kind", "removed"}, {"medium", "cpu"}},
             {{"kind", "removed"}, {"medium", "storage"}},
             {{"kind", "cleared"}, {"medium", ""}}},
            {ev->stored_events[0], ev->stored_events[1], ev->removed_events[0],
             ev->removed_events[1], ev->cleared_events});
    counter("kvtier_kv_events_batches_total", "KV-cache event batches published", {{}},
            {ev->batches});
    counter("kvtier_kv_events_dropped_total",
            "KV-cache event inputs dropped: tier records on a full queue, descriptors invalid, "
            "over the bound or expired",
            {{{"reason", "queue_full"}}, {{"reason", "descriptor"}}},
            {ev->dropped_queue_full, ev->dropped_descriptors});
    counter("kvtier_kv_events_replays_total", "KV-cache event replays answered",
            {{{"kind", "ring"}}, {{"kind", "snapshot"}}}, {ev->replays_ring, ev->replays_snapshot});
    counter("kvtier_kv_events_descriptor_conflicts_total",
            "Descriptors differing from the one a chunk already had (dropped)", {{}},
            {ev->descriptor_conflicts});
    gauge("kvtier_kv_events_undescribed_chunks",
          "Chunks in a tier that no descriptor names (never announced)",
          {{"", d(ev->undescribed_chunks)}}, nullptr);
    gauge("kvtier_kv_events_announced", "(chunk, medium) pairs announced now",
          {{"", d(ev->announced_chunks)}}, nullptr);
  }
  return prometheus::TextSerializer().Serialize(families);
}

std::string Server::Impl::MetricsText() const {
  if (events_) {
    const events::PublisherStats ev = events_->Stats();
    return server::MetricsText(metrics_, engine_->Stats(), &ev);
  }
  return server::MetricsText(metrics_, engine_->Stats());
}

}  // namespace kvtier::server
