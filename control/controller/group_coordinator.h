// The controller's side of rendezvous and process-group epochs (proto/moe/v1/process_group.proto,
// spec 0x07A / 0x07G): ranks join over a stream each, the coordinator forms epoch after epoch
// from the live members and publishes each one's view (topology from the members' node names,
// peer order, endpoints), and re-forms when a member is lost or a replacement joins.
//
// Forming epoch E: PREPARE(E, peers) to every live member; each answers with a fresh endpoint;
// once all have, FORMED(view) goes to each and they connect (bound, not open for steps); once
// all report READY the epoch serves: SERVING(E) goes to each (they open it) and `on_ready` runs (the controller
// re-drives the ACTIVE placement onto the ranks). An epoch is formed only over the whole world, or, after
// `survivor_grace` without a replacement, over the survivors (when a survivor cannot serve the placement without the
// lost ranks it reports so, and the coordinator waits for a replacement instead). Epoch numbers are recorded in the
// store before they are used, so they never repeat across controller restarts.
//
// After a restart, the ranks keep serving the epoch they are bound to and rejoin declaring it
// (JoinGroup.serving_epoch). When that is the last epoch the store recorded and every one of its
// peers rejoins declaring it within `adopt_grace`, the coordinator adopts it: SERVING at that
// epoch with no PREPARE, so the data plane never stops. A member serving another epoch (or
// none), a member outside the epoch, a lost member, or the grace running out forms a new epoch
// as before.
//
// Thread-safety: gRPC calls Join and Status from its threads; everything is under one mutex.
#ifndef MOE_CONTROL_CONTROLLER_GROUP_COORDINATOR_H_
#define MOE_CONTROL_CONTROLLER_GROUP_COORDINATOR_H_

#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

#include "control/store/release_store.h"
#include "proto/moe/v1/process_group.grpc.pb.h"

namespace moe {

struct GroupCoordinatorOptions {
  int world = 0;
  std::string token;              // the rank agents' bearer token, which joining ranks present
  std::string operator_token;     // Status also answers callers holding the operators' token
  std::string read_token;         // ... and the operators' read-only token (empty: none)
  ReleaseStore* store = nullptr;  // epochs are recorded here (not owned; its own connection)
  // 0: wait for a replacement as long as it takes; else form over the survivors after this long.
  absl::Duration survivor_grace = absl::ZeroDuration();
  // After a restart: how long to wait for the last recorded epoch's members to rejoin serving it
  // (adopted without re-forming); zero: always form a new epoch.
  absl::Duration adopt_grace = absl::ZeroDuration();
  // Runs (on the coordinator's own thread) after every member of an epoch reported READY.
  std::function<void(const v1::GroupView&)> on_ready;
};

class GroupCoordinator final : public v1::ProcessGroupService::Service {
 public:
  explicit GroupCoordinator(GroupCoordinatorOptions options);
  ~GroupCoordinator() override;
  GroupCoordinator(const GroupCoordinator&) = delete;
  GroupCoordinator& operator=(const GroupCoordinator&) = delete;

  grpc::Status Join(grpc::ServerContext* ctx,
                    grpc::ServerReaderWriter<v1::GroupMessage, v1::MemberMessage>* stream) override;
  grpc::Status Status(grpc::ServerContext* ctx, const v1::GroupStatusRequest* req, v1::GroupStatus* resp) override;

  // The epoch every member reported ready for (none before the first, and while re-forming).
  std::optional<v1::GroupView> ServingView() const;
  v1::GroupStatus Snapshot() const;
  // Ends every Join stream (the server is shutting down) and waits for the tick thread, so that
  // no on_ready runs once it returns (its callee may then be destroyed). Not from on_ready.
  void Shutdown();

 private:
  using Stream = grpc::ServerReaderWriter<v1::GroupMessage, v1::MemberMessage>;
  struct Member {
    v1::JoinGroup decl;
    Stream* stream = nullptr;
    grpc::ServerContext* ctx = nullptr;
  };
  struct Adopting {
    int64_t epoch = 0;
    std::vector<int32_t> peers;
    absl::Time deadline;
  };
  struct Forming {
    int64_t epoch = 0;
    std::vector<int32_t> peers;
    std::string reason;
    std::map<int32_t, std::string> endpoints;
    bool published = false;
    std::set<int32_t> ready;
    size_t record = 0;  // index into epochs_
  };

  grpc::Status Admit(const v1::JoinGroup& decl, grpc::ServerContext* ctx, Stream* stream)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void OnMessage(int32_t rank, uint64_t incarnation, const v1::MemberMessage& m) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void OnLost(int32_t rank, uint64_t incarnation) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Starts forming the next epoch over the live members: past the highest epoch recorded in the
  // store, once recorded there; where the store cannot be read or written nothing is formed and
  // the tick thread tries again a second later (reform_retry_).
  void Reform(const std::string& reason) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Publishes the forming epoch when every peer sent its endpoint and the membership may serve.
  void MaybePublish() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The view of `epoch` over `peers` (joined members), with their endpoints when given.
  v1::GroupView ViewOf(int64_t epoch, const std::vector<int32_t>& peers,
                       const std::map<int32_t, std::string>* endpoints) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // SERVING(epoch) to each of `peers`: they open the epoch for steps.
  void SendServing(int64_t epoch, const std::vector<int32_t>& peers) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Appends to the recent epochs (256 at most); returns the record's index.
  size_t PushEpochRecord(v1::EpochRecord rec) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Adopts the epoch being adopted once every one of its peers rejoined serving it.
  void MaybeAdopt() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Send(int32_t rank, const v1::GroupMessage& m) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Tick();

  GroupCoordinatorOptions options_;
  mutable absl::Mutex mu_;
  std::map<int32_t, Member> members_ ABSL_GUARDED_BY(mu_);
  // Per rank, the processes (incarnations) admitted so far, oldest first (the last
  // kAdmittedHistory): one admitted before but not last was replaced, and is refused should it
  // come back, instead of evicting its replacement (since this controller started).
  std::map<int32_t, std::vector<uint64_t>> admitted_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> node_of_rank_ ABSL_GUARDED_BY(mu_);  // last declared node per rank
  int64_t last_epoch_ ABSL_GUARDED_BY(mu_) = 0;
  std::optional<Forming> forming_ ABSL_GUARDED_BY(mu_);
  std::optional<Adopting> adopting_ ABSL_GUARDED_BY(mu_);  // after a restart, until adopted or given up
  std::optional<v1::GroupView> serving_ ABSL_GUARDED_BY(mu_);
  v1::GroupView last_view_ ABSL_GUARDED_BY(mu_);
  std::string reason_ ABSL_GUARDED_BY(mu_);
  absl::Time short_since_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();  // live < world since
  bool survivors_refused_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<v1::EpochRecord> epochs_ ABSL_GUARDED_BY(mu_);
  std::optional<v1::GroupView> ready_pending_ ABSL_GUARDED_BY(mu_);  // for on_ready
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::optional<std::string> reform_retry_ ABSL_GUARDED_BY(mu_);  // the reason of a Reform not recorded
  absl::Time reform_retry_at_ ABSL_GUARDED_BY(mu_);
  std::thread ticker_;
};

}  // namespace moe

#endif  // MOE_CONTROL_CONTROLLER_GROUP_COORDINATOR_H_
