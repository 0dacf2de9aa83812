// What the server reports: the Prometheus metrics it keeps itself, and the text of /metrics and
// the document of /stats (the engine's counters are read at scrape time).
#pragma once

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <memory>
#include <string>
#include <unordered_map>

#include "events/publisher.h"
#include "kvtier/engine.h"
#include "server/codec.h"

namespace kvtier::server {

// Prometheus metrics kept by the server itself; the engine's counters are read at scrape time.
struct Metrics {
  Metrics();

  std::shared_ptr<prometheus::Registry> registry;
  prometheus::Family<prometheus::Counter>& requests;
  prometheus::Family<prometheus::Histogram>& rpc_latency;
  prometheus::Histogram& load_latency;
  prometheus::Histogram& store_latency;
  prometheus::Gauge& connected;
  prometheus::Counter& connections;
  prometheus::Family<prometheus::Counter>& refused;
  prometheus::Counter& protocol_errors;
  prometheus::Counter& request_errors;
  prometheus::Counter& released_on_disconnect;
  prometheus::Family<prometheus::Counter>& dropped;
  prometheus::Counter& accept_errors;
  prometheus::Counter& quota_limited;
  prometheus::Counter& reservations_expired;
  std::unordered_map<std::string, prometheus::Counter*> dropped_by;
  prometheus::Counter* op_requests[kMaxOpcode + 1] = {};
  prometheus::Histogram* op_latency[kMaxOpcode + 1] = {};
  std::unordered_map<std::string, prometheus::Counter*> refused_by;
};

// /metrics: the server's own metrics and the engine's counters and gauges, Prometheus text.
// `events`: the KV-cache events publisher's counters, when it runs.
std::string MetricsText(const Metrics& metrics, const EngineStats& stats,
                        const events::PublisherStats* events = nullptr);

}  // namespace kvtier::server
