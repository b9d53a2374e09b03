// The controller's clients of every rank's RankAgentService, in rank order. Each operation runs
// on every rank and stops at the first failure, whose status names the rank and its address.
// Every agent operation is idempotent, so a caller that failed part way simply calls again.
#ifndef MOE_CONTROL_CONTROLLER_AGENT_POOL_H_
#define MOE_CONTROL_CONTROLLER_AGENT_POOL_H_

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <grpcpp/security/credentials.h>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

#include "proto/moe/v1/rank_agent.grpc.pb.h"

namespace moe {

// The process-group epoch the agents serve (control/controller/group_coordinator.h): manifests
// sent to the ranks are bound to it (its epoch, each slot's node), and only its members are
// driven.
struct AgentGroup {
  int64_t epoch = 0;
  std::vector<std::string> addresses;     // per global rank; "" for ranks outside the epoch
  std::vector<std::string> node_of_rank;  // per global rank
};

class AgentPool {
 public:
  // A fixed list of agents, in rank order (--ranks); manifests are sent as recorded.
  // `credentials`: how the agents are dialed (rpc/tls.h); null: plaintext.
  AgentPool(std::vector<std::string> addresses, std::string token, absl::Duration rpc_timeout = absl::Seconds(30),
            std::shared_ptr<grpc::ChannelCredentials> credentials = nullptr);
  // The agents of a process group of `world` ranks, known once SetGroup is called (until then
  // every operation answers UNAVAILABLE).
  AgentPool(int world, std::string token, absl::Duration rpc_timeout,
            std::shared_ptr<grpc::ChannelCredentials> credentials);

  bool empty() const { return world_ == 0; }
  // Per global rank ("" where unknown).
  std::vector<std::string> addresses() const;
  int world() const { return world_; }
  // The epoch now served (group mode).
  void SetGroup(AgentGroup group);

  // `runtime`: the release bundle's coordinates, which every rank checks against its own (none:
  // a release registered without a bundle).
  // The manifest is bound to the epoch the ranks serve (its number and the slots' nodes). A new
  // placement (`rebind` false) must name that epoch or none (0); one the controller re-drives
  // after the group re-formed (`rebind`) is re-materialized for the new epoch whatever it names.
  absl::Status Prepare(const v1::PlacementManifest& manifest, const v1::RuntimeCoordinates* runtime = nullptr,
                       bool rebind = false);
  absl::Status Activate(int64_t version);
  absl::Status Retire(int64_t version);
  // A PREPARED `version` that never served forgotten on every rank (DiscardGeneration), each
  // tried whatever the others answered: the first error, naming its rank, or OK.
  absl::Status Discard(int64_t version);
  // Trial steps of a PREPARED candidate on every rank (version 0 stops them).
  absl::Status SetTrial(int64_t version, int64_t shadow_every, int64_t canary_every);
  // Stops the trial of placement-v`version` on every rank (TrialRequest.stop_version): a rank
  // already trying another candidate keeps it.
  absl::Status StopTrial(int64_t version);
  // Polls until no rank holds a dispatch handle on `version` (or `timeout`: DEADLINE_EXCEEDED
  // naming the ranks that still hold some).
  absl::Status AwaitDrained(int64_t version, absl::Duration timeout);
  // The epoch the ranks serve and each rank's node: the formed group (group mode; UNAVAILABLE
  // before the first), or what a fixed list of agents reports (UNAVAILABLE when they disagree or
  // one does not answer).
  absl::StatusOr<AgentGroup> ServingGroup();
  // Every rank's status; a rank that does not answer has its error instead.
  std::vector<std::pair<absl::StatusOr<v1::AgentStatusResponse>, std::string>> Status();

 private:
  struct State {
    std::vector<std::string> addresses;
    std::vector<std::shared_ptr<v1::RankAgentService::Stub>> stubs;  // null: not driven
    std::optional<AgentGroup> group;
  };
  std::shared_ptr<const State> Current() const;
  // The epoch and nodes a fixed list of agents reports through Status (UNAVAILABLE when they
  // disagree).
  absl::StatusOr<AgentGroup> ObservedGroup();
  using AgentCall = std::function<grpc::Status(v1::RankAgentService::Stub&, grpc::ClientContext&)>;
  absl::Status OnEach(const std::string& what, const AgentCall& call) { return OnEachOf(*Current(), what, call); }
  // The members of one snapshot of the group (a call that also reads the group's epoch, nodes
  // or addresses takes them from the same snapshot: an epoch change between the reads would
  // send epoch E's manifest to epoch E + 1's members).
  absl::Status OnEachOf(const State& st, const std::string& what, const AgentCall& call);
  using VersionRpc = grpc::Status (v1::RankAgentService::Stub::*)(grpc::ClientContext*, const v1::GenerationRequest&,
                                                                  v1::GenerationStatus*);
  absl::Status OnEachVersion(const char* verb, int64_t version, VersionRpc rpc);
  std::unique_ptr<grpc::ClientContext> Context() const;

  int world_ = 0;
  bool group_mode_ = false;
  std::string token_;
  absl::Duration rpc_timeout_;
  std::shared_ptr<grpc::ChannelCredentials> credentials_;
  mutable absl::Mutex mu_;
  std::shared_ptr<const State> state_ ABSL_GUARDED_BY(mu_);
};

}  // namespace moe

#endif  // MOE_CONTROL_CONTROLLER_AGENT_POOL_H_
