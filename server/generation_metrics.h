// Prometheus families read from the layer executor's per-generation counters at scrape time:
// steps by generation and kind (active / canary / failed) and shadow passes by result, the
// runner-parity evidence of a trial. Labels: release, placement_generation, kind / result. And
// the generations this rank holds by lifecycle state (release, state: four values), so a
// generation stuck in DRAINING shows.
#ifndef MOE_SERVER_GENERATION_METRICS_H_
#define MOE_SERVER_GENERATION_METRICS_H_

#include <string>
#include <vector>

#include "prometheus/collectable.h"
#include "prometheus/metric_family.h"

#include "runtime/exec/layer_executor.h"
#include "runtime/placement/registry.h"

namespace moe {

class GenerationCollector : public prometheus::Collectable {
 public:
  GenerationCollector(const LayerExecutor* executor, const GenerationRegistry* registry, std::string release)
      : executor_(executor), registry_(registry), release_(std::move(release)) {}
  std::vector<prometheus::MetricFamily> Collect() const override;

 private:
  const LayerExecutor* executor_;       // not owned; outlives the exposer's use of this object
  const GenerationRegistry* registry_;  // likewise
  std::string release_;
};

}  // namespace moe

#endif  // MOE_SERVER_GENERATION_METRICS_H_
