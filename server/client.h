// C++ client library of the data plane: what an inference engine links to call its rank's
// ExpertLayerService once per layer step.
//
// Thread-safety: one client may be used by several threads (gRPC channels are thread-safe).
#ifndef MOE_SERVER_CLIENT_H_
#define MOE_SERVER_CLIENT_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

#include "proto/moe/v1/expert_layer.grpc.pb.h"

namespace moe {

struct StepCall {
  uint64_t step_id = 0;
  int64_t layer = 0;
  bool decode = false;
  std::vector<uint16_t> hidden;  // [tokens, d] BF16
  int64_t tokens = 0;
  int d = 0;
  std::vector<int32_t> topk_ids;    // [tokens, k]
  std::vector<float> topk_weights;  // [tokens, k]
  int k = 0;
  std::vector<uint8_t> admitted;    // optional [tokens, k]
  int64_t expected_generation = 0;  // 0: any
};

struct StepAnswer {
  std::vector<uint16_t> output;  // [tokens, d] BF16
  v1::StepRecord record;
  double client_latency_us = 0;
};

class ExpertLayerClient {
 public:
  // `address`: a gRPC target, "unix:/path/to/engine.sock" (the rank's --engine_socket) or
  // "host:port" (then `token` is the rank's --engine_token_file token).
  static absl::StatusOr<std::unique_ptr<ExpertLayerClient>> Connect(const std::string& address, absl::Duration timeout,
                                                                    const std::string& token = "");
  absl::StatusOr<StepAnswer> Execute(const StepCall& call, absl::Duration deadline = absl::Seconds(60));

 private:
  ExpertLayerClient(std::unique_ptr<v1::ExpertLayerService::Stub> stub, std::string token)
      : stub_(std::move(stub)), token_(std::move(token)) {}
  std::unique_ptr<v1::ExpertLayerService::Stub> stub_;
  std::string token_;
};

}  // namespace moe

#endif  // MOE_SERVER_CLIENT_H_
