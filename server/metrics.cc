#include "server/metrics.h"

#include <algorithm>

namespace moe {

RankMetrics::RankMetrics(const std::string& release)
    : registry_(std::make_shared<prometheus::Registry>()), release_(release) {
  steps_ = &prometheus::BuildCounter()
                .Name("moe_steps_total")
                .Help("Layer steps answered, by phase, execution path and status")
                .Register(*registry_);
  latency_ = &prometheus::BuildHistogram()
                  .Name("moe_step_latency_seconds")
                  .Help("Server-side layer-step latency, by phase and execution path")
                  .Register(*registry_);
  routes_ = &prometheus::BuildCounter()
                 .Name("moe_routes_total")
                 .Help(
                     "Routes of served steps by phase and kind: attempted (the denominator of dropped), "
                     "accepted (the denominator of remote and inter_node), dropped, remote, inter_node")
                 .Register(*registry_);
  fallbacks_ = &prometheus::BuildCounter()
                    .Name("moe_decode_fallbacks_total")
                    .Help("Decode steps served eagerly instead of by graph replay, by reason")
                    .Register(*registry_);
  stage_latency_ = &prometheus::BuildHistogram()
                        .Name("moe_step_stage_seconds")
                        .Help(
                            "Wall time of each stage of an answered layer step (validate, acquire, plan, agree, "
                            "dispatch, experts, return, combine, release), by phase")
                        .Register(*registry_);
  bytes_sent_ = &prometheus::BuildCounter()
                     .Name("moe_payload_bytes_sent_total")
                     .Help("Row payload bytes sent to other ranks (dispatch and return)")
                     .Register(*registry_)
                     .Add({{"release", release_}});
  generation_ = &prometheus::BuildGauge()
                     .Name("moe_active_placement_generation")
                     .Help("Placement generation eligible for new dispatches")
                     .Register(*registry_)
                     .Add({{"release", release_}});
  in_flight_ = &prometheus::BuildGauge()
                    .Name("moe_steps_in_flight")
                    .Help("Layer steps being executed")
                    .Register(*registry_)
                    .Add({{"release", release_}});
  epoch_ = &prometheus::BuildGauge()
                .Name("moe_process_group_epoch")
                .Help("Process-group epoch this rank serves (0 while the group re-forms)")
                .Register(*registry_)
                .Add({{"release", release_}});
  epoch_faults_ = &prometheus::BuildCounter()
                       .Name("moe_process_group_faults_total")
                       .Help(
                           "Served epochs whose data plane failed on this rank (each reported to the controller, "
                           "which forms a new epoch)")
                       .Register(*registry_)
                       .Add({{"release", release_}});
  auto& recorded = prometheus::BuildCounter()
                       .Name("moe_recorded_work_total")
                       .Help(
                           "Recordings of a lone rank's decode steps as CUDA graphs (--lone_decode_graphs), by "
                           "outcome: recorded, stale (dropped after the kernels freed memory), failed (the step ran "
                           "call by call), evicted (an idle one dropped for another, --lone_decode_recordings kept), "
                           "full (a step run call by call because every kept one ran recently)")
                       .Register(*registry_);
  int i = 0;
  for (const char* outcome : {"recorded", "stale", "failed", "evicted", "full"}) {
    recorded_work_[i++] = &recorded.Add({{"release", release_}, {"outcome", outcome}});
  }
  answered_held_ = &prometheus::BuildGauge()
                        .Name("moe_answered_steps_held")
                        .Help(
                            "Steps answered before their GPU work finished (device rows with done events) whose "
                            "generation leases are still held, as of the last step")
                        .Register(*registry_)
                        .Add({{"release", release_}});
  auto& cap_waits = prometheus::BuildCounter()
                        .Name("moe_answered_cap_waits_total")
                        .Help(
                            "Steps that found 256 answered steps' leases held and waited for the oldest work, by "
                            "outcome: finished, or timeout (waited the collective timeout, the leases still held: "
                            "an engine whose GPU work does not finish)")
                        .Register(*registry_);
  cap_waits_[0] = &cap_waits.Add({{"release", release_}, {"outcome", "finished"}});
  cap_waits_[1] = &cap_waits.Add({{"release", release_}, {"outcome", "timeout"}});
  epoch_changes_ = &prometheus::BuildHistogram()
                        .Name("moe_process_group_rebuild_seconds")
                        .Help("Time from a PREPARE of a new epoch to its transport bound (or failed), by outcome")
                        .Register(*registry_);
  layer_served_ = &prometheus::BuildCounter()
                       .Name("moe_layer_routes_served_total")
                       .Help(
                           "Routes this rank's experts computed, per MoE layer, from every member's tokens (the "
                           "per-rank expert load: balancedness is its mean over ranks divided by its max)")
                       .Register(*registry_);
  layer_routes_ = &prometheus::BuildCounter()
                       .Name("moe_layer_routes_total")
                       .Help("Accepted routes of served steps, per MoE layer (the per-layer load EPLB balances)")
                       .Register(*registry_);
  auto& load_bytes = prometheus::BuildGauge()
                         .Name("moe_checkpoint_load_bytes")
                         .Help("Expert bytes of this rank's checkpoint load: placed so far (state=done) and in all")
                         .Register(*registry_);
  load_bytes_done_ = &load_bytes.Add({{"release", release_}, {"state", "done"}});
  load_bytes_total_ = &load_bytes.Add({{"release", release_}, {"state", "total"}});
  auto& load_layers = prometheus::BuildGauge()
                          .Name("moe_checkpoint_load_layers")
                          .Help("MoE layers of this rank's checkpoint load: complete (state=done) and in all")
                          .Register(*registry_);
  load_layers_done_ = &load_layers.Add({{"release", release_}, {"state", "done"}});
  load_layers_total_ = &load_layers.Add({{"release", release_}, {"state", "total"}});
  load_seconds_ = &prometheus::BuildGauge()
                       .Name("moe_checkpoint_load_seconds")
                       .Help("Wall time of the checkpoint load so far")
                       .Register(*registry_)
                       .Add({{"release", release_}});
}

void RankMetrics::LayerRoutes(int64_t layer, int64_t accepted, int64_t served) {
  std::lock_guard<std::mutex> lock(series_mu_);
  LayerSeries& series = layer_series_[layer];
  if (series.accepted == nullptr) {
    const std::map<std::string, std::string> labels = {
        {"release", release_}, {"layer", layer < 0 ? std::string("all") : std::to_string(layer)}};
    series.accepted = &layer_routes_->Add(labels);
    series.served = &layer_served_->Add(labels);
  }
  series.accepted->Increment(static_cast<double>(accepted));
  series.served->Increment(static_cast<double>(served));
}

void RankMetrics::CheckpointLoad(int64_t bytes_done, int64_t bytes_total, int layers_done, int layers_total,
                                 double seconds) {
  load_bytes_done_->Set(static_cast<double>(bytes_done));
  load_bytes_total_->Set(static_cast<double>(bytes_total));
  load_layers_done_->Set(layers_done);
  load_layers_total_->Set(layers_total);
  load_seconds_->Set(seconds);
}

void RankMetrics::Step(const std::string& phase, const std::string& path, const std::string& status, double seconds) {
  const bool ok = status == "ok";
  prometheus::Counter* steps = nullptr;
  prometheus::Histogram* latency = nullptr;
  {
    std::lock_guard<std::mutex> lock(series_mu_);
    StepSeries* found = nullptr;
    for (StepSeries& s : step_series_) {
      if (s.phase == phase && s.path == path && s.status == status) {
        found = &s;
        break;
      }
    }
    if (found == nullptr) {
      step_series_.push_back(StepSeries{
          phase, path, status,
          &steps_->Add({{"release", release_}, {"phase", phase}, {"path", path}, {"status", status}}), nullptr});
      found = &step_series_.back();
    }
    if (ok && found->latency == nullptr) {
      static const prometheus::Histogram::BucketBoundaries kBuckets = {
          0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5};
      found->latency = &latency_->Add({{"release", release_}, {"phase", phase}, {"path", path}}, kBuckets);
    }
    steps = found->steps;
    latency = found->latency;
  }
  steps->Increment();
  if (ok) latency->Observe(seconds);
}

void RankMetrics::StepPhases(const std::string& phase, const std::array<double, kNumStepPhases>& us) {
  std::array<prometheus::Histogram*, kNumStepPhases> histograms{};
  {
    std::array<prometheus::Histogram*, kNumStepPhases>* series = nullptr;
    std::lock_guard<std::mutex> lock(series_mu_);
    for (auto& [name, histograms] : stage_series_) {
      if (name == phase) series = &histograms;
    }
    if (series == nullptr) {
      static const prometheus::Histogram::BucketBoundaries kBuckets = {0.000002, 0.000005, 0.00001, 0.000025, 0.00005,
                                                                       0.0001,   0.00025,  0.0005,  0.001,    0.0025,
                                                                       0.005,    0.01,     0.025,   0.1,      1};
      std::array<prometheus::Histogram*, kNumStepPhases> made{};
      for (int i = 0; i < kNumStepPhases; ++i) {
        made[i] = &stage_latency_->Add(
            {{"release", release_}, {"phase", phase}, {"stage", StepPhaseName(static_cast<StepPhase>(i))}}, kBuckets);
      }
      stage_series_.emplace_back(phase, made);
      series = &stage_series_.back().second;
    }
    histograms = *series;  // the histograms live as long as their family
  }
  for (int i = 0; i < kNumStepPhases; ++i) histograms[i]->Observe(us[i] * 1e-6);
}

void RankMetrics::Routes(const std::string& phase, int64_t attempted, int64_t accepted, int64_t dropped, int64_t remote,
                         int64_t inter_node) {
  const bool decode = phase == "decode";
  RouteSeries* r;
  {
    std::lock_guard<std::mutex> lock(series_mu_);
    std::unique_ptr<RouteSeries>& series = route_series_[decode ? 1 : 0];
    if (series == nullptr) {
      const auto add = [&](const char* kind) {
        // The phase label takes these two values only.
        return &routes_->Add({{"release", release_}, {"phase", decode ? "decode" : "prefill"}, {"kind", kind}});
      };
      series = std::make_unique<RouteSeries>(
          RouteSeries{add("attempted"), add("accepted"), add("dropped"), add("remote"), add("inter_node")});
    }
    r = series.get();
  }
  r->attempted->Increment(static_cast<double>(attempted));
  r->accepted->Increment(static_cast<double>(accepted));
  r->dropped->Increment(static_cast<double>(dropped));
  r->remote->Increment(static_cast<double>(remote));
  r->inter_node->Increment(static_cast<double>(inter_node));
}

void RankMetrics::Fallback(const std::string& reason) {
  prometheus::Counter* c = nullptr;
  {
    std::lock_guard<std::mutex> lock(series_mu_);
    for (const auto& [r, counter] : fallback_series_) {
      if (r == reason) c = counter;
    }
    if (c == nullptr) {
      c = &fallbacks_->Add({{"release", release_}, {"reason", reason}});
      fallback_series_.emplace_back(reason, c);
    }
  }
  c->Increment();
}

void RankMetrics::BytesSent(int64_t bytes) { bytes_sent_->Increment(static_cast<double>(bytes)); }
void RankMetrics::Generation(int64_t version) { generation_->Set(static_cast<double>(version)); }
void RankMetrics::Epoch(int64_t epoch) { epoch_->Set(static_cast<double>(epoch)); }

void RankMetrics::EpochFault() { epoch_faults_->Increment(); }

namespace {

// Counts running totals' growth since the totals last seen (each counter by its own total),
// keeping the larger of the two as seen.
template <size_t N>
void CountGrowth(const std::array<int64_t, N>& now, std::array<int64_t, N>& seen,
                 const std::array<prometheus::Counter*, N>& counters) {
  for (size_t i = 0; i < N; ++i) {
    if (now[i] > seen[i]) counters[i]->Increment(static_cast<double>(now[i] - seen[i]));
    seen[i] = std::max(seen[i], now[i]);
  }
}

}  // namespace

void RankMetrics::RecordedWork(int64_t recorded, int64_t stale, int64_t failed, int64_t evicted, int64_t full) {
  std::lock_guard<std::mutex> lock(recorded_mu_);
  CountGrowth<5>({recorded, stale, failed, evicted, full}, recorded_seen_, recorded_work_);
}

void RankMetrics::AnsweredWork(int64_t held, int64_t cap_waits, int64_t cap_timeouts) {
  answered_held_->Set(static_cast<double>(held));
  std::lock_guard<std::mutex> lock(recorded_mu_);
  CountGrowth<2>({cap_waits - cap_timeouts, cap_timeouts}, cap_seen_, cap_waits_);
}

void RankMetrics::EpochChange(const std::string& outcome, double seconds) {
  static const prometheus::Histogram::BucketBoundaries kBuckets = {0.001, 0.01, 0.05, 0.1, 0.25, 0.5,
                                                                   1,     2.5,  5,    10,  30};
  epoch_changes_->Add({{"release", release_}, {"outcome", outcome}}, kBuckets).Observe(seconds);
}

void RankMetrics::InFlight(int64_t n) { in_flight_->Set(static_cast<double>(n)); }

}  // namespace moe
