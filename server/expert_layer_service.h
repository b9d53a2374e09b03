// ExpertLayerService on moe-rankd: decodes requests at the edge, runs the layer step through the
// rank's LayerExecutor (one step at a time, in arrival order), encodes the response and the
// step record, and counts everything in RankMetrics. Drain() refuses new steps with UNAVAILABLE
// and waits for the ones in flight.
#ifndef MOE_SERVER_EXPERT_LAYER_SERVICE_H_
#define MOE_SERVER_EXPERT_LAYER_SERVICE_H_

#include <memory>

#include "absl/synchronization/mutex.h"
#include "proto/moe/v1/expert_layer.grpc.pb.h"
#include "runtime/exec/layer_executor.h"
#include "server/metrics.h"
#include "server/shared_regions.h"

namespace moe {

class ExpertLayerServiceImpl final : public v1::ExpertLayerService::Service {
 public:
  ExpertLayerServiceImpl(LayerExecutor* executor, RankMetrics* metrics) : executor_(executor), metrics_(metrics) {}

  grpc::Status Execute(grpc::ServerContext* context, const v1::StepRequest* request,
                       v1::StepResponse* response) override;
  grpc::Status Step(grpc::ServerContext* context,
                    grpc::ServerReaderWriter<v1::StepResponse, v1::StepRequest>* stream) override;
  grpc::Status RegisterRegion(grpc::ServerContext* context, const v1::RegisterRegionRequest* request,
                              v1::RegisterRegionResponse* response) override;
  grpc::Status UnregisterRegion(grpc::ServerContext* context, const v1::UnregisterRegionRequest* request,
                                v1::UnregisterRegionResponse* response) override;

  // Refuses new steps, then blocks until the steps in flight have finished.
  void Drain();

 private:
  absl::Status Run(const v1::StepRequest& request, v1::StepResponse* response);

  LayerExecutor* executor_;
  RankMetrics* metrics_;
  SharedRegions regions_;
  absl::Mutex step_mu_;  // one layer step at a time: collectives run in arrival order
  absl::Mutex mu_;
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  int in_flight_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace moe

#endif  // MOE_SERVER_EXPERT_LAYER_SERVICE_H_
