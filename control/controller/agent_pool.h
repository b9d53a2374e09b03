// The controller's clients of every rank's RankAgentService, in rank order. Each operation runs
// on every rank and stops at the first failure, whose status names the rank and its address.
// Every agent operation is idempotent, so a caller that failed part way simply calls again.
#ifndef MOE_CONTROL_CONTROLLER_AGENT_POOL_H_
#define MOE_CONTROL_CONTROLLER_AGENT_POOL_H_

#include <memory>
#include <string>
#include <vector>

#include <grpcpp/security/credentials.h>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

#include "proto/moe/v1/rank_agent.grpc.pb.h"

namespace moe {

class AgentPool {
 public:
  // `credentials`: how the agents are dialed (rpc/tls.h); null: plaintext.
  AgentPool(std::vector<std::string> addresses, std::string token, absl::Duration rpc_timeout = absl::Seconds(30),
            std::shared_ptr<grpc::ChannelCredentials> credentials = nullptr);

  bool empty() const { return addresses_.empty(); }
  const std::vector<std::string>& addresses() const { return addresses_; }

  // `runtime`: the release bundle's coordinates, which every rank checks against its own (none:
  // a release registered without a bundle).
  absl::Status Prepare(const v1::PlacementManifest& manifest, const v1::RuntimeCoordinates* runtime = nullptr);
  absl::Status Activate(int64_t version);
  absl::Status Retire(int64_t version);
  // Trial steps of a PREPARED candidate on every rank (version 0 stops them).
  absl::Status SetTrial(int64_t version, int64_t shadow_every, int64_t canary_every);
  // Polls until no rank holds a dispatch handle on `version` (or `timeout`: DEADLINE_EXCEEDED
  // naming the ranks that still hold some).
  absl::Status AwaitDrained(int64_t version, absl::Duration timeout);
  // Every rank's status; a rank that does not answer has its error instead.
  std::vector<std::pair<absl::StatusOr<v1::AgentStatusResponse>, std::string>> Status();

 private:
  absl::Status OnEach(const std::string& what,
                      const std::function<grpc::Status(v1::RankAgentService::Stub&, grpc::ClientContext&)>& call);
  using VersionRpc = grpc::Status (v1::RankAgentService::Stub::*)(grpc::ClientContext*, const v1::GenerationRequest&,
                                                                  v1::GenerationStatus*);
  absl::Status OnEachVersion(const char* verb, int64_t version, VersionRpc rpc);
  std::unique_ptr<grpc::ClientContext> Context() const;

  std::vector<std::string> addresses_;
  std::string token_;
  absl::Duration rpc_timeout_;
  std::vector<std::unique_ptr<v1::RankAgentService::Stub>> stubs_;
};

}  // namespace moe

#endif  // MOE_CONTROL_CONTROLLER_AGENT_POOL_H_
