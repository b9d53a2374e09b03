// Prometheus metrics of moe-rankd (spec 0x0DB). Labels come only from bounded sets: phase
// (prefill, decode), path (eager, graph_replay, recorded), status (ok, invalid_argument, aborted, ...),
// fallback reason (the five of 0x05D), route kind, stage (the nine phases of a step,
// runtime/exec/step.h); never request or token ids.
#ifndef MOE_SERVER_METRICS_H_
#define MOE_SERVER_METRICS_H_

#include <array>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "prometheus/counter.h"
#include "prometheus/exposer.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

#include "runtime/exec/step.h"

namespace moe {

class RankMetrics {
 public:
  explicit RankMetrics(const std::string& release);
  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }

  void Step(const std::string& phase, const std::string& path, const std::string& status, double seconds);
  // A served step's routes by kind, labelled with its phase ("prefill", "decode").
  void Routes(const std::string& phase, int64_t attempted, int64_t accepted, int64_t dropped, int64_t remote,
              int64_t inter_node);
  // Accepted routes of a served step of `layer` (this rank's tokens), and the routes this rank's
  // experts served in it (every member's tokens: the load balancedness compares across ranks).
  // Label `layer`: bounded by the model's MoE layers (steps of any other layer are refused
  // before they count); "all" for `layer` -1, a generation that names no layers and serves
  // every one with one expert set (StepRecord::load_layer).
  void LayerRoutes(int64_t layer, int64_t accepted, int64_t served);
  void Fallback(const std::string& reason);
  void BytesSent(int64_t bytes);
  void Generation(int64_t version);
  void InFlight(int64_t n);
  // The process-group epoch served (0 while re-forming) and each epoch change, by outcome
  // (bound: the epoch serves; failed: its transport or binding failed).
  void Epoch(int64_t epoch);
  void EpochChange(const std::string& outcome, double seconds);
  // A served epoch whose data plane failed on this rank (reported to the controller).
  void EpochFault();
  // Recordings of a lone rank's decode steps (runtime/exec/recorded_work.h), by outcome
  // (recorded, stale, failed, evicted, and full: steps run call by call because every kept
  // recording ran recently), from the executor's running totals: each call counts their growth
  // since the last.
  void RecordedWork(int64_t recorded, int64_t stale, int64_t failed, int64_t evicted, int64_t full);
  // Steps answered before their GPU work finished whose generation leases are still held, and
  // the running totals of steps that found LayerExecutor::kMaxAnswered of them held and waited
  // for the oldest work (cap_timeouts: up to the timeout; LayerExecutor::AnsweredWorkStats).
  void AnsweredWork(int64_t held, int64_t cap_waits, int64_t cap_timeouts);
  // Progress of the checkpoint load at start-up (runtime/checkpoint/expert_loader.h).
  void CheckpointLoad(int64_t bytes_done, int64_t bytes_total, int layers_done, int layers_total, double seconds);
  // The wall time of each phase of an answered step (runtime/exec/step.h), `phase` prefill or decode.
  void StepPhases(const std::string& phase, const std::array<double, kNumStepPhases>& us);

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  std::string release_;
  prometheus::Family<prometheus::Counter>* steps_;
  prometheus::Family<prometheus::Histogram>* latency_;
  prometheus::Family<prometheus::Counter>* routes_;
  prometheus::Family<prometheus::Counter>* fallbacks_;
  prometheus::Family<prometheus::Histogram>* stage_latency_;
  prometheus::Family<prometheus::Counter>* layer_routes_;
  prometheus::Family<prometheus::Counter>* layer_served_;
  prometheus::Counter* bytes_sent_;
  prometheus::Gauge* generation_;
  prometheus::Gauge* in_flight_;
  prometheus::Gauge* epoch_;
  prometheus::Family<prometheus::Histogram>* epoch_changes_;
  prometheus::Counter* epoch_faults_;
  std::array<prometheus::Counter*, 5> recorded_work_{};  // recorded, stale, failed, evicted, full
  std::mutex recorded_mu_;
  std::array<int64_t, 5> recorded_seen_{};  // the totals last counted
  prometheus::Gauge* answered_held_;
  std::array<prometheus::Counter*, 2> cap_waits_{};  // finished, timeout
  std::array<int64_t, 2> cap_seen_{};                // guarded by recorded_mu_
  prometheus::Gauge* load_bytes_done_;
  prometheus::Gauge* load_bytes_total_;
  prometheus::Gauge* load_layers_done_;
  prometheus::Gauge* load_layers_total_;
  prometheus::Gauge* load_seconds_;

  // The series each call updates, looked up once per label set and kept (a Family's series live
  // as long as the Family, nothing here removes them). Each step updates about ten series;
  // building and hashing their label maps anew on every step cost ~17 us per decode step right
  // after the experts ran (cold caches), a few us with the lookups cached (api_overhead_bench).
  struct StepSeries {
    std::string phase, path, status;
    prometheus::Counter* steps;
    prometheus::Histogram* latency;  // created with the first ok step of the label set
  };
  struct RouteSeries {
    prometheus::Counter* attempted;
    prometheus::Counter* accepted;
    prometheus::Counter* dropped;
    prometheus::Counter* remote;
    prometheus::Counter* inter_node;
  };
  std::mutex series_mu_;
  std::vector<StepSeries> step_series_;                                        // guarded by series_mu_
  std::unique_ptr<RouteSeries> route_series_[2];                               // prefill, decode; guarded by series_mu_
  std::vector<std::pair<std::string, prometheus::Counter*>> fallback_series_;  // guarded by series_mu_
  struct LayerSeries {
    prometheus::Counter* accepted = nullptr;  // moe_layer_routes_total
    prometheus::Counter* served = nullptr;    // moe_layer_routes_served_total
  };
  std::map<int64_t, LayerSeries> layer_series_;  // guarded by series_mu_
  // Per step phase (prefill, decode) the histogram of each stage, made on first use.
  std::vector<std::pair<std::string, std::array<prometheus::Histogram*, kNumStepPhases>>>
      stage_series_;  // guarded by series_mu_
};

}  // namespace moe

#endif  // MOE_SERVER_METRICS_H_
