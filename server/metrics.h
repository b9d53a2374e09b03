// Prometheus metrics of moe-rankd (spec 0x0DB). Labels come only from bounded sets: phase
// (prefill, decode), path (eager, graph_replay), status (ok, invalid_argument, aborted, ...),
// fallback reason (the five of 0x05D), route kind; never request or token ids.
#ifndef MOE_SERVER_METRICS_H_
#define MOE_SERVER_METRICS_H_

#include <memory>
#include <string>

#include "prometheus/counter.h"
#include "prometheus/exposer.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace moe {

class RankMetrics {
 public:
  explicit RankMetrics(const std::string& release);
  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }

  void Step(const std::string& phase, const std::string& path, const std::string& status, double seconds);
  void Routes(int64_t attempted, int64_t accepted, int64_t dropped, int64_t remote, int64_t inter_node);
  void Fallback(const std::string& reason);
  void BytesSent(int64_t bytes);
  void Generation(int64_t version);
  void InFlight(int64_t n);

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  std::string release_;
  prometheus::Family<prometheus::Counter>* steps_;
  prometheus::Family<prometheus::Histogram>* latency_;
  prometheus::Family<prometheus::Counter>* routes_;
  prometheus::Family<prometheus::Counter>* fallbacks_;
  prometheus::Counter* bytes_sent_;
  prometheus::Gauge* generation_;
  prometheus::Gauge* in_flight_;
};

}  // namespace moe

#endif  // MOE_SERVER_METRICS_H_
