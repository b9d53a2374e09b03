#include "server/generation_metrics.h"

#include <map>

#include "absl/strings/str_cat.h"

namespace moe {

std::vector<prometheus::MetricFamily> GenerationCollector::Collect() const {
  prometheus::MetricFamily steps{"moe_generation_steps_total",
                                 "layer steps by placement generation: served as the active one, served as a canary "
                                 "of a candidate, or failed",
                                 prometheus::MetricType::Counter,
                                 {}};
  prometheus::MetricFamily shadow{"moe_shadow_steps_total",
                                  "shadow passes of a candidate generation by result (its output against the active "
                                  "generation's: match, mismatch; or failed)",
                                  prometheus::MetricType::Counter,
                                  {}};
  // Spec 0x0DB's stale-handle acceptance counter: steps answered by a generation they were not
  // to use (GenerationCounters::stale_accepts); the fences refuse such steps, so anything but 0
  // is a breach.
  prometheus::MetricFamily stale{"moe_stale_accepts_total",
                                 "steps answered by a placement generation other than the one they had to use "
                                 "(spec 0x0DB stale-handle acceptance; 0 unless a fence broke)",
                                 prometheus::MetricType::Counter,
                                 {}};
  auto add = [&](prometheus::MetricFamily& f, int64_t version, const char* key, const char* value, int64_t n) {
    prometheus::ClientMetric m;
    m.label = {{"release", release_}, {"placement_generation", absl::StrCat(version)}, {key, value}};
    m.counter.value = static_cast<double>(n);
    f.metric.push_back(m);
  };
  for (const auto& [version, c] : executor_->Counters()) {
    add(steps, version, "kind", "active", c.steps - c.canary_steps);
    add(steps, version, "kind", "canary", c.canary_steps);
    add(steps, version, "kind", "failed", c.failed_steps);
    add(steps, version, "kind", "aborted", c.aborted_steps);
    add(steps, version, "kind", "rejected", c.rejected_steps);
    prometheus::ClientMetric s;
    s.label = {{"release", release_}, {"placement_generation", absl::StrCat(version)}};
    s.counter.value = static_cast<double>(c.stale_accepts);
    stale.metric.push_back(s);
    if (c.shadow_samples > 0) {
      add(shadow, version, "result", "match", c.shadow_samples - c.shadow_mismatches - c.shadow_failures);
      add(shadow, version, "result", "mismatch", c.shadow_mismatches);
      add(shadow, version, "result", "failed", c.shadow_failures);
    }
  }
  prometheus::MetricFamily states{"moe_placement_generations",
                                  "placement generations this rank holds, by lifecycle state (PREPARED, ACTIVE, "
                                  "DRAINING, RETIRED)",
                                  prometheus::MetricType::Gauge,
                                  {}};
  std::map<GenerationState, int64_t> by_state = {{GenerationState::kPrepared, 0},
                                                 {GenerationState::kActive, 0},
                                                 {GenerationState::kDraining, 0},
                                                 {GenerationState::kRetired, 0}};
  for (const GenerationInfo& g : registry_->List()) ++by_state[g.state];
  for (const auto& [state, n] : by_state) {
    prometheus::ClientMetric m;
    m.label = {{"release", release_}, {"state", GenerationStateName(state)}};
    m.gauge.value = static_cast<double>(n);
    states.metric.push_back(m);
  }
  // Spec 0x0DB's count-conservation counter, per process-group epoch.
  prometheus::MetricFamily conservation{"moe_count_conservation_failures_total",
                                        "steps the ranks' agreement aborted because a member's route counts did not "
                                        "conserve (spec 0x0DC N_count_failure), by process-group epoch",
                                        prometheus::MetricType::Counter,
                                        {}};
  for (const auto& [epoch, n] : executor_->CountConservationFailures()) {
    prometheus::ClientMetric m;
    m.label = {{"release", release_}, {"process_group_epoch", absl::StrCat(epoch)}};
    m.counter.value = static_cast<double>(n);
    conservation.metric.push_back(m);
  }
  return {steps, shadow, stale, conservation, states};
}

}  // namespace moe
