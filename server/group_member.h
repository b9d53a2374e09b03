// moe-rankd's side of the controller's rendezvous (proto/moe/v1/process_group.proto): one Join
// stream for the daemon's lifetime, on which the controller drives every process-group epoch.
// PREPARE(E) runs `prepare` (stop serving the old epoch, tear its transport down, open a fresh
// endpoint) and sends the endpoint back; FORMED(view) runs `connect` (the epoch's topology,
// group and transport, bound but not yet open for steps) and reports READY or the error;
// SERVING(E), once every member is ready, runs `serve` (the epoch opens for steps). When the
// controller goes away the rank keeps serving its epoch and reconnects, declaring it; the
// controller adopts it (and sends SERVING again) or forms a new one. A process the controller
// refuses as replaced by a newer one of its rank leaves its epoch (`fenced`) and stops rejoining:
// rejoining after a controller restart, which forgets the refusal, would evict the replacement.
//
// Thread-safety: Start/Stop from one thread; the callbacks run on the member's own thread.
#ifndef MOE_SERVER_GROUP_MEMBER_H_
#define MOE_SERVER_GROUP_MEMBER_H_

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include <grpcpp/grpcpp.h>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

#include "proto/moe/v1/process_group.grpc.pb.h"

namespace moe {

struct GroupMemberOptions {
  std::string controller;                                 // host:port of moe-controller
  std::shared_ptr<grpc::ChannelCredentials> credentials;  // rpc/tls.h; null: plaintext
  std::string token;                                      // the rank agents' bearer token
  v1::JoinGroup join;                                     // incarnation: set by the member
  // Leaves the current epoch and returns this member's endpoint for the prepared one.
  std::function<absl::StatusOr<std::string>(const v1::PrepareEpoch&)> prepare;
  // Joins the formed epoch's transport (bound, not open for steps).
  std::function<absl::Status(const v1::GroupView&)> connect;
  // Opens the epoch for steps: every member of it is bound.
  std::function<void(int64_t epoch)> serve;
  // The controller refused this process for good: a newer process of the same rank replaced it
  // (the Join's kFencedTrailer). Leave the epoch served, if any; the member stops rejoining.
  std::function<void(const std::string& why)> fenced;
  absl::Duration reconnect_backoff = absl::Milliseconds(500);
};

class GroupMember {
 public:
  explicit GroupMember(GroupMemberOptions options);
  ~GroupMember();
  GroupMember(const GroupMember&) = delete;
  GroupMember& operator=(const GroupMember&) = delete;

  void Start();
  void Stop();
  // The data plane of `epoch` failed for good (LayerExecutor::SetEpochFaultListener): tells the
  // controller, which forms a new epoch. Ignored unless `epoch` is the one served. Any thread.
  void ReportFault(int64_t epoch, const std::string& why);
  // The controller refused this process as replaced by a newer one: it no longer rejoins.
  bool fenced() const { return fenced_.load(); }

 private:
  void Run();
  // One Join stream, until it ends. Returns why; *fenced: the controller refused this process
  // for good (kFencedTrailer).
  grpc::Status Session(v1::ProcessGroupService::Stub& stub, bool* fenced);
  using Stream = grpc::ClientReaderWriter<v1::MemberMessage, v1::GroupMessage>;
  // Writes on the open stream (false: none open, or it broke). Writers take turns.
  bool Write(const v1::MemberMessage& m);

  GroupMemberOptions options_;
  std::atomic<int64_t> serving_epoch_{0};
  std::atomic<bool> stopping_{false};
  std::atomic<bool> fenced_{false};
  absl::Mutex mu_;
  grpc::ClientContext* ctx_ ABSL_GUARDED_BY(mu_) = nullptr;  // the open stream's (to cancel it)
  // Separate from mu_: a write may block on flow control while Stop cancels the stream.
  absl::Mutex write_mu_;
  Stream* stream_ ABSL_GUARDED_BY(write_mu_) = nullptr;
  std::thread thread_;
};

}  // namespace moe

#endif  // MOE_SERVER_GROUP_MEMBER_H_
