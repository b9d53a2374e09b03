// ExpertLayerService on moe-rankd: authenticates the caller, validates and decodes requests at
// the edge (every size derived from a request is checked arithmetic against the configured
// limits), runs the layer step through the rank's LayerExecutor (one step at a time, in arrival
// order), encodes the response and the step record, and counts everything in RankMetrics.
// Drain() refuses new steps with UNAVAILABLE and waits for the ones in flight.
//
// Callers: a connection accepted on the engine Unix socket was admitted by its peer
// credentials (rpc/unix_socket.h; `peer_uid` resolves it); any other caller (TCP) must carry
// `authorization: Bearer <engine token>`, and without a configured token it is refused
// (UNAUTHENTICATED). RegisterRegion follows the same rule.
#ifndef MOE_SERVER_EXPERT_LAYER_SERVICE_H_
#define MOE_SERVER_EXPERT_LAYER_SERVICE_H_

#include <functional>
#include <memory>
#include <optional>
#include <string>

#include <sys/types.h>

#include "absl/synchronization/mutex.h"

#include "proto/moe/v1/expert_layer.grpc.pb.h"
#include "runtime/exec/layer_executor.h"
#include "server/metrics.h"
#include "server/shared_regions.h"
#include "server/step_rings.h"
#include "server/tensor_codec.h"

namespace moe {

struct EngineApiOptions {
  // Rows (tokens) of one request, and the bytes of one request (its gRPC message, or the rows it
  // reads from / writes to shared regions).
  int64_t max_step_tokens = 65536;
  int64_t max_request_bytes = int64_t{1} << 30;
  int max_top_k = 64;
  // Bearer token for callers that are not on the engine Unix socket; empty: they are refused.
  std::string token;
  // The uid of a caller admitted on the Unix socket, from its gRPC peer string; nullopt for any
  // other caller. Unset: no Unix socket (every caller needs the token).
  std::function<std::optional<uid_t>(const std::string& peer)> peer_uid;
  SharedRegionOptions regions;
};

class ExpertLayerServiceImpl final : public v1::ExpertLayerService::Service {
 public:
  ExpertLayerServiceImpl(LayerExecutor* executor, RankMetrics* metrics, EngineApiOptions options = {})
      : executor_(executor), metrics_(metrics), options_(std::move(options)), regions_(options_.regions) {}

  grpc::Status Execute(grpc::ServerContext* context, const v1::StepRequest* request,
                       v1::StepResponse* response) override;
  grpc::Status Step(grpc::ServerContext* context,
                    grpc::ServerReaderWriter<v1::StepResponse, v1::StepRequest>* stream) override;
  grpc::Status RegisterRegion(grpc::ServerContext* context, const v1::RegisterRegionRequest* request,
                              v1::RegisterRegionResponse* response) override;
  grpc::Status UnregisterRegion(grpc::ServerContext* context, const v1::UnregisterRegionRequest* request,
                                v1::UnregisterRegionResponse* response) override;
  grpc::Status OpenStepRing(grpc::ServerContext* context, const v1::OpenStepRingRequest* request,
                            v1::OpenStepRingResponse* response) override;
  grpc::Status CloseStepRing(grpc::ServerContext* context, const v1::CloseStepRingRequest* request,
                             v1::CloseStepRingResponse* response) override;

  // Serves step rings (server/step_rings.h) with their claim socket at options.socket_path.
  // Without it, OpenStepRing answers FAILED_PRECONDITION.
  absl::Status EnableStepRings(StepRingsOptions options);
  int step_rings() { return rings_ == nullptr ? 0 : rings_->size(); }

  // Refuses new steps, then blocks until the steps in flight have finished.
  void Drain();

 private:
  struct Caller {
    std::optional<uid_t> uid;  // set for Unix-socket callers
  };
  absl::StatusOr<Caller> Authenticate(const grpc::ServerContext* context) const;
  grpc::Status ExecuteAuthenticated(const Caller& caller, const v1::StepRequest* request, v1::StepResponse* response);
  // One step with its latency and outcome counted; RunStep decodes the request (a request it
  // refuses still takes part in the step's agreement), runs the step and encodes the response.
  absl::Status Run(const Caller& caller, const v1::StepRequest& request, v1::StepResponse* response);
  absl::Status RunStep(const Caller& caller, const v1::StepRequest& request, v1::StepResponse* response,
                       const char** path);
  absl::Status BeginStep();  // counted in flight, or UNAVAILABLE while draining
  void EndStep();
  void ServeRingStep(const RingStep& step, ring::Result* result);
  void FinishRingStep();  // ServeRingStep's metrics, once the ring published the answer
  absl::StatusOr<RingDeviceRows> MapDeviceRows(const v1::OpenStepRingRequest& request,
                                               std::vector<std::string>* done_handles);

  LayerExecutor* executor_;
  RankMetrics* metrics_;
  const EngineApiOptions options_;
  SharedRegions regions_;
  absl::Mutex step_mu_;  // one layer step at a time: collectives run in arrival order
  // The executor's recordings of lone decode steps (LayerExecutor::LoneDecodeRecordings): counted
  // in the metrics when they change, and each failed one logged.
  void NoteRecordedWork() ABSL_EXCLUSIVE_LOCKS_REQUIRED(step_mu_);  // and NoteAnsweredWork
  // The answered steps' leases and cap waits into the metrics; a new cap timeout is logged.
  void NoteAnsweredWork() ABSL_EXCLUSIVE_LOCKS_REQUIRED(step_mu_);
  int64_t cap_timeouts_logged_ ABSL_GUARDED_BY(step_mu_) = 0;
  LayerExecutor::AnsweredStats answered_noted_ ABSL_GUARDED_BY(step_mu_);  // last put into the metrics
  int64_t recorded_counted_ ABSL_GUARDED_BY(step_mu_) = 0;
  int64_t failures_logged_ ABSL_GUARDED_BY(step_mu_) = 0;
  absl::Mutex mu_;
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  int in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  std::unique_ptr<FiniteCheckPool> check_pool_;  // ring steps' row checks
  std::unique_ptr<StepRings> rings_;             // last: its threads call into the members above
};

}  // namespace moe

#endif  // MOE_SERVER_EXPERT_LAYER_SERVICE_H_
