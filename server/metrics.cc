#include "server/metrics.h"

namespace moe {

RankMetrics::RankMetrics(const std::string& release) : registry_(std::make_shared<prometheus::Registry>()), release_(release) {
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
                 .Help("Routes by kind: attempted (denominator), accepted, dropped, remote, inter_node")
                 .Register(*registry_);
  fallbacks_ = &prometheus::BuildCounter()
                    .Name("moe_decode_fallbacks_total")
                    .Help("Decode steps served eagerly instead of by graph replay, by reason")
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
}

void RankMetrics::Step(const std::string& phase, const std::string& path, const std::string& status, double seconds) {
  steps_->Add({{"release", release_}, {"phase", phase}, {"path", path}, {"status", status}}).Increment();
  if (status == "ok") {
    static const prometheus::Histogram::BucketBoundaries kBuckets = {
        0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5};
    latency_->Add({{"release", release_}, {"phase", phase}, {"path", path}}, kBuckets).Observe(seconds);
  }
}

void RankMetrics::Routes(int64_t attempted, int64_t accepted, int64_t dropped, int64_t remote, int64_t inter_node) {
  routes_->Add({{"release", release_}, {"kind", "attempted"}}).Increment(static_cast<double>(attempted));
  routes_->Add({{"release", release_}, {"kind", "accepted"}}).Increment(static_cast<double>(accepted));
  routes_->Add({{"release", release_}, {"kind", "dropped"}}).Increment(static_cast<double>(dropped));
  routes_->Add({{"release", release_}, {"kind", "remote"}}).Increment(static_cast<double>(remote));
  routes_->Add({{"release", release_}, {"kind", "inter_node"}}).Increment(static_cast<double>(inter_node));
}

void RankMetrics::Fallback(const std::string& reason) {
  fallbacks_->Add({{"release", release_}, {"reason", reason}}).Increment();
}

void RankMetrics::BytesSent(int64_t bytes) { bytes_sent_->Increment(static_cast<double>(bytes)); }
void RankMetrics::Generation(int64_t version) { generation_->Set(static_cast<double>(version)); }
void RankMetrics::InFlight(int64_t n) { in_flight_->Set(static_cast<double>(n)); }

}  // namespace moe
