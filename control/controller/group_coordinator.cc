#include "control/controller/group_coordinator.h"

#include <algorithm>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "spdlog/spdlog.h"

#include "rpc/bearer_auth.h"
#include "rpc/group_protocol.h"

namespace moe {
namespace {

constexpr char kProcessGroup[] = "ep-group-0";
constexpr size_t kMaxNameBytes = 253;       // a DNS name
constexpr size_t kMaxEndpointBytes = 4096;  // a UCX address or an NCCL unique id (128 bytes)
constexpr int kMaxDevices = 64;
constexpr int64_t kMaxEpochJump = 1'000'000;

int64_t NowMs() { return absl::ToUnixMillis(absl::Now()); }

grpc::Status Invalid(const std::string& msg) { return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, msg); }

}  // namespace

GroupCoordinator::GroupCoordinator(GroupCoordinatorOptions options) : options_(std::move(options)) {
  node_of_rank_.assign(std::max(options_.world, 0), "");
  if (options_.store != nullptr) {
    if (auto last = options_.store->LastEpochPeers(); last.ok()) {
      last_epoch_ = last->first;
      // The ranks may still serve the last recorded epoch: wait for them to rejoin and adopt it.
      Adopting a;
      a.epoch = last->first;
      bool parsed = a.epoch > 0;
      for (absl::string_view p : absl::StrSplit(last->second, ',', absl::SkipEmpty())) {
        int32_t r = -1;
        parsed = parsed && absl::SimpleAtoi(p, &r) && r >= 0 && r < options_.world;
        a.peers.push_back(r);
      }
      if (parsed && !a.peers.empty() && options_.adopt_grace > absl::ZeroDuration()) {
        a.deadline = absl::Now() + options_.adopt_grace;
        reason_ = absl::StrCat("restarted: waiting up to ", absl::FormatDuration(options_.adopt_grace), " for epoch ",
                               a.epoch, "'s ranks [", absl::StrJoin(a.peers, ","), "] to rejoin serving it");
        spdlog::info("process group: {}", reason_);
        adopting_ = std::move(a);
      }
    } else {
      spdlog::error("process group: reading the last epoch: {}", std::string(last.status().message()));
    }
  }
  ticker_ = std::thread([this] { Tick(); });
}

GroupCoordinator::~GroupCoordinator() { Shutdown(); }

void GroupCoordinator::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    for (auto& [rank, m] : members_) m.ctx->TryCancel();
  }
  // Outside mu_: the tick thread takes it, and may be inside on_ready.
  if (ticker_.joinable() && ticker_.get_id() != std::this_thread::get_id()) ticker_.join();
}

grpc::Status GroupCoordinator::Join(grpc::ServerContext* ctx, Stream* stream) {
  if (grpc::Status s = CheckBearer(ctx, options_.token); !s.ok()) return s;
  v1::MemberMessage first;
  if (!stream->Read(&first)) return grpc::Status(grpc::StatusCode::CANCELLED, "stream ended before join");
  if (!first.has_join()) return Invalid("join: the first message must be a JoinGroup");
  const v1::JoinGroup decl = first.join();
  {
    absl::MutexLock lock(&mu_);
    if (grpc::Status s = Admit(decl, ctx, stream); !s.ok()) return s;
  }
  v1::MemberMessage m;
  while (stream->Read(&m)) {
    absl::MutexLock lock(&mu_);
    OnMessage(decl.rank(), decl.incarnation(), m);
  }
  absl::MutexLock lock(&mu_);
  OnLost(decl.rank(), decl.incarnation());
  return grpc::Status::OK;
}

grpc::Status GroupCoordinator::Admit(const v1::JoinGroup& decl, grpc::ServerContext* ctx, Stream* stream) {
  if (stopping_) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "the controller is shutting down");
  if (decl.world() != options_.world) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        absl::StrCat("join.world: ", decl.world(), ", the controller forms a group of ", options_.world,
                                     " ranks (--world)"));
  }
  if (decl.rank() < 0 || decl.rank() >= options_.world) {
    return Invalid(absl::StrCat("join.rank: ", decl.rank(), " outside [0, ", options_.world, ")"));
  }
  if (decl.node().empty() || decl.node().size() > kMaxNameBytes) {
    return Invalid(absl::StrCat("join.node: must be 1..", kMaxNameBytes, " bytes"));
  }
  if (decl.devices_size() > kMaxDevices) return Invalid(absl::StrCat("join.devices: at most ", kMaxDevices));
  for (const std::string& d : decl.devices()) {
    if (d.empty() || d.size() > kMaxNameBytes)
      return Invalid(absl::StrCat("join.devices: each must be 1..", kMaxNameBytes, " bytes"));
  }
  if (decl.agent_address().size() > kMaxNameBytes) return Invalid("join.agent_address: too long");
  if (decl.transport() != "ucx" && decl.transport() != "nccl") {
    return Invalid(absl::StrCat("join.transport: '", decl.transport(), "', expected ucx or nccl"));
  }
  for (const auto& [rank, m] : members_) {
    if (rank != decl.rank() && m.decl.transport() != decl.transport()) {
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                          absl::StrCat("join.transport: ", decl.transport(), ", rank ", rank, " uses ",
                                       m.decl.transport(), "; every member must use the same"));
    }
  }
  std::vector<uint64_t>& admitted = admitted_[decl.rank()];
  if (!admitted.empty() && admitted.back() != decl.incarnation() &&
      std::find(admitted.begin(), admitted.end(), decl.incarnation()) != admitted.end()) {
    // A process a newer one replaced (it was cut off, and came back): admitting it would evict
    // the replacement, which would come back and evict it, and so on. The trailer tells the
    // member to stop serving and stop rejoining (GroupMember), rather than retry the refusal.
    ctx->AddTrailingMetadata(std::string(kFencedTrailer), "replaced");
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        absl::StrCat("join: rank ", decl.rank(), "'s process ", absl::Hex(decl.incarnation()),
                                     " was replaced by a newer one and is not admitted again (it stops serving; "
                                     "restarting it takes the rank over from the replacement)"));
  }
  auto it = members_.find(decl.rank());
  if (it != members_.end()) {
    if (it->second.decl.incarnation() == decl.incarnation()) {
      return grpc::Status(grpc::StatusCode::ALREADY_EXISTS,
                          absl::StrCat("join: rank ", decl.rank(), " is already joined by this process"));
    }
    // A replacement (same rank, new process) while the old one's stream is still open: the new
    // process wins, the old stream ends.
    spdlog::warn("process group: rank {} replaced by a new process (node {})", decl.rank(), decl.node());
    it->second.ctx->TryCancel();
    members_.erase(it);
  }
  members_[decl.rank()] = Member{decl, stream, ctx};
  if (admitted.empty() || admitted.back() != decl.incarnation()) {
    constexpr size_t kAdmittedHistory = 16;
    admitted.push_back(decl.incarnation());
    if (admitted.size() > kAdmittedHistory) admitted.erase(admitted.begin());
  }
  node_of_rank_[decl.rank()] = decl.node();
  // An epoch a member serves was numbered by a controller before: never number another the same
  // (should the registry have missed recording it). Bounded, so a member cannot run the numbers
  // out.
  if (decl.serving_epoch() > last_epoch_ && decl.serving_epoch() - last_epoch_ <= kMaxEpochJump) {
    last_epoch_ = decl.serving_epoch();
  }
  spdlog::info("process group: rank {} joined from node {} ({} of {} live, serving epoch {})", decl.rank(), decl.node(),
               members_.size(), options_.world, decl.serving_epoch());
  if (adopting_.has_value()) {
    const bool peer =
        std::find(adopting_->peers.begin(), adopting_->peers.end(), decl.rank()) != adopting_->peers.end();
    if (peer && decl.serving_epoch() == adopting_->epoch) {
      MaybeAdopt();
      return grpc::Status::OK;
    }
    spdlog::info("process group: rank {} serves epoch {}, not {} over [{}]: forming a new epoch", decl.rank(),
                 decl.serving_epoch(), adopting_->epoch, absl::StrJoin(adopting_->peers, ","));
    adopting_.reset();
  }
  Reform(absl::StrCat("rank ", decl.rank(), " joined (node ", decl.node(), ")"));
  return grpc::Status::OK;
}

void GroupCoordinator::MaybeAdopt() {
  if (!adopting_.has_value()) return;
  for (int32_t r : adopting_->peers) {
    auto it = members_.find(r);
    if (it == members_.end() || it->second.decl.serving_epoch() != adopting_->epoch) return;
  }
  const Adopting a = *adopting_;
  adopting_.reset();
  const v1::GroupView view = ViewOf(a.epoch, a.peers, nullptr);
  last_view_ = view;
  serving_ = view;
  ready_pending_ = view;
  const bool full = static_cast<int>(a.peers.size()) == options_.world;
  short_since_ = full ? absl::InfinitePast() : absl::Now();
  survivors_refused_ = false;
  reason_ = absl::StrCat("epoch ", a.epoch, " adopted after a controller restart: its ranks rejoined serving it");
  v1::EpochRecord rec;
  rec.set_epoch(a.epoch);
  rec.set_reason(reason_);
  rec.set_prepared_unix_ms(NowMs());
  rec.set_formed_unix_ms(NowMs());
  rec.set_ready_unix_ms(NowMs());
  for (int32_t r : a.peers) rec.add_peers(r);
  PushEpochRecord(std::move(rec));
  spdlog::info("process group: {} ([{}])", reason_, absl::StrJoin(a.peers, ","));
  SendServing(a.epoch, a.peers);  // a member that had bound it but not opened it yet opens it now
}

void GroupCoordinator::OnLost(int32_t rank, uint64_t incarnation) {
  auto it = members_.find(rank);
  if (it == members_.end() || it->second.decl.incarnation() != incarnation) return;  // replaced already
  members_.erase(it);
  if (stopping_) return;
  spdlog::warn("process group: rank {} lost ({} of {} live)", rank, members_.size(), options_.world);
  adopting_.reset();  // the epoch being adopted lost a member: only a new one serves
  Reform(absl::StrCat("rank ", rank, " lost"));
}

void GroupCoordinator::Reform(const std::string& reason) {
  std::vector<int32_t> peers;
  for (const auto& [rank, m] : members_) peers.push_back(rank);
  int64_t epoch = last_epoch_ + 1;
  if (options_.store != nullptr) {
    // Epochs never repeat, across controller restarts too: the next is past the highest the store
    // holds (a read that failed at start left last_epoch_ behind it), and it exists only once
    // recorded. An epoch formed unrecorded was once numbered again after a restart.
    absl::StatusOr<int64_t> recorded = options_.store->LastEpoch();
    absl::Status s = recorded.status();
    if (recorded.ok()) {
      epoch = std::max(last_epoch_, *recorded) + 1;
      s = options_.store->RecordEpoch(epoch, reason, absl::StrJoin(peers, ","), NowMs());
    }
    if (!s.ok()) {
      reason_ = absl::StrCat("epoch ", epoch, " not formed: the store did not record it (", s.message(),
                             "); retrying each second: ", reason);
      spdlog::error("process group: {}", reason_);
      reform_retry_ = reason;
      reform_retry_at_ = absl::Now() + absl::Seconds(1);
      // What formed or served before names the membership this Reform replaces (a lost rank
      // among its peers): nothing may publish or complete it while the new epoch waits.
      forming_.reset();
      serving_.reset();
      return;
    }
  }
  reform_retry_.reset();
  last_epoch_ = epoch;
  serving_.reset();
  const bool full = static_cast<int>(peers.size()) == options_.world;
  if (full) {
    short_since_ = absl::InfinitePast();
    survivors_refused_ = false;
  } else if (short_since_ == absl::InfinitePast()) {
    short_since_ = absl::Now();
  }
  Forming f;
  f.epoch = epoch;
  f.peers = peers;
  f.reason = reason;
  v1::EpochRecord rec;
  rec.set_epoch(epoch);
  rec.set_reason(reason);
  rec.set_prepared_unix_ms(NowMs());
  for (int32_t r : peers) rec.add_peers(r);
  f.record = PushEpochRecord(std::move(rec));
  forming_ = std::move(f);
  reason_ = reason;
  v1::GroupMessage m;
  m.mutable_prepare()->set_epoch(epoch);
  for (int32_t r : peers) m.mutable_prepare()->add_peers(r);
  m.mutable_prepare()->set_reason(reason);
  for (int32_t r : peers) Send(r, m);
  spdlog::info("process group: preparing epoch {} over ranks [{}] ({})", epoch, absl::StrJoin(peers, ","), reason);
}

void GroupCoordinator::OnMessage(int32_t rank, uint64_t incarnation, const v1::MemberMessage& m) {
  auto member = members_.find(rank);
  if (member == members_.end() || member->second.decl.incarnation() != incarnation) return;
  // The epoch being adopted after a restart failed on a member: a new one is formed instead.
  if (m.has_ready() && !m.ready().ok() && adopting_.has_value() && m.ready().epoch() == adopting_->epoch) {
    const int64_t epoch = adopting_->epoch;
    adopting_.reset();
    Reform(absl::StrCat("rank ", rank, " reports epoch ", epoch, " failed: ", m.ready().error().substr(0, 200)));
    return;
  }
  // The data plane of the serving epoch failed on a member (a peer it can no longer reach in
  // this epoch): only a new epoch heals that.
  if (m.has_ready() && !m.ready().ok() && !forming_.has_value() && serving_.has_value() &&
      m.ready().epoch() == serving_->epoch()) {
    spdlog::warn("process group: rank {} reports epoch {} failed: {}", rank, serving_->epoch(),
                 m.ready().error().substr(0, 200));
    Reform(absl::StrCat("rank ", rank, " reports epoch ", serving_->epoch(),
                        " failed: ", m.ready().error().substr(0, 200)));
    return;
  }
  if (!forming_.has_value()) return;
  Forming& f = *forming_;
  const bool peer = std::find(f.peers.begin(), f.peers.end(), rank) != f.peers.end();
  if (m.has_endpoint()) {
    if (m.endpoint().epoch() != f.epoch || !peer || f.published) return;  // an older epoch's
    if (m.endpoint().endpoint().size() > kMaxEndpointBytes) {
      spdlog::warn("process group: rank {}'s endpoint of {} bytes refused", rank, m.endpoint().endpoint().size());
      return;
    }
    f.endpoints[rank] = m.endpoint().endpoint();
    MaybePublish();
  } else if (m.has_ready()) {
    if (m.ready().epoch() != f.epoch || !peer) return;
    if (!m.ready().ok()) {
      spdlog::warn("process group: rank {} could not serve epoch {}: {}", rank, f.epoch, m.ready().error());
      if (static_cast<int>(f.peers.size()) < options_.world) survivors_refused_ = true;
      Reform(absl::StrCat("rank ", rank, " could not serve epoch ", f.epoch, ": ", m.ready().error().substr(0, 200)));
      return;
    }
    if (!f.published) return;
    f.ready.insert(rank);
    if (f.ready.size() < f.peers.size()) return;
    epochs_[f.record].set_ready_unix_ms(NowMs());
    serving_ = last_view_;
    ready_pending_ = last_view_;
    spdlog::info("process group: epoch {} serving over ranks [{}]", f.epoch, absl::StrJoin(f.peers, ","));
    SendServing(f.epoch, f.peers);
    forming_.reset();
  }
}

void GroupCoordinator::MaybePublish() {
  if (!forming_.has_value() || forming_->published) return;
  Forming& f = *forming_;
  if (f.peers.empty() || f.endpoints.size() < f.peers.size()) return;
  const bool full = static_cast<int>(f.peers.size()) == options_.world;
  if (!full) {
    const bool grace_over = options_.survivor_grace > absl::ZeroDuration() &&
                            absl::Now() - short_since_ >= options_.survivor_grace && !survivors_refused_;
    if (!grace_over) return;
  }
  const v1::GroupView view = ViewOf(f.epoch, f.peers, &f.endpoints);
  f.published = true;
  epochs_[f.record].set_formed_unix_ms(NowMs());
  last_view_ = view;
  v1::GroupMessage m;
  *m.mutable_formed() = view;
  for (int32_t r : f.peers) Send(r, m);
  spdlog::info("process group: epoch {} formed over ranks [{}]{}", f.epoch, absl::StrJoin(f.peers, ","),
               full ? "" : " (survivors)");
}

void GroupCoordinator::SendServing(int64_t epoch, const std::vector<int32_t>& peers) {
  v1::GroupMessage m;
  m.mutable_serving()->set_epoch(epoch);
  for (int32_t r : peers) Send(r, m);
}

size_t GroupCoordinator::PushEpochRecord(v1::EpochRecord rec) {
  epochs_.push_back(std::move(rec));
  if (epochs_.size() > 256) epochs_.erase(epochs_.begin());
  return epochs_.size() - 1;
}

v1::GroupView GroupCoordinator::ViewOf(int64_t epoch, const std::vector<int32_t>& peers,
                                       const std::map<int32_t, std::string>* endpoints) const {
  v1::GroupView view;
  view.set_epoch(epoch);
  view.set_process_group(kProcessGroup);
  view.set_world(options_.world);
  view.set_transport(members_.at(peers.front()).decl.transport());
  for (int32_t r : peers) {
    const v1::JoinGroup& d = members_.at(r).decl;
    v1::GroupMember* g = view.add_members();
    g->set_rank(r);
    g->set_node(d.node());
    *g->mutable_devices() = d.devices();
    g->set_agent_address(d.agent_address());
    g->set_incarnation(d.incarnation());
    if (endpoints != nullptr) g->set_endpoint(endpoints->at(r));
  }
  for (int r = 0; r < options_.world; ++r) {
    view.add_node_of_rank(node_of_rank_[r].empty() ? absl::StrCat("unjoined-", r) : node_of_rank_[r]);
  }
  return view;
}

void GroupCoordinator::Send(int32_t rank, const v1::GroupMessage& m) {
  auto it = members_.find(rank);
  if (it == members_.end()) return;
  // A write to a stream whose peer is gone fails; its Read then ends and OnLost follows.
  if (!it->second.stream->Write(m)) spdlog::warn("process group: write to rank {} failed", rank);
}

void GroupCoordinator::Tick() {
  while (true) {
    std::optional<v1::GroupView> ready;
    {
      absl::MutexLock lock(&mu_);
      if (mu_.AwaitWithTimeout(absl::Condition(&stopping_), absl::Milliseconds(100))) return;
      MaybePublish();  // the survivors' grace may have run out
      if (reform_retry_.has_value() && absl::Now() >= reform_retry_at_ && !members_.empty()) {
        const std::string why = *reform_retry_;
        Reform(why);
      }
      if (adopting_.has_value() && absl::Now() >= adopting_->deadline) {
        const std::string why =
            absl::StrCat("epoch ", adopting_->epoch, "'s ranks did not all rejoin serving it within ",
                         absl::FormatDuration(options_.adopt_grace), " of the restart");
        spdlog::warn("process group: {}", why);
        adopting_.reset();
        if (!members_.empty()) {
          Reform(why);
        } else {
          reason_ = why;
        }
      }
      ready.swap(ready_pending_);
    }
    if (ready.has_value() && options_.on_ready) options_.on_ready(*ready);
  }
}

std::optional<v1::GroupView> GroupCoordinator::ServingView() const {
  absl::MutexLock lock(&mu_);
  return serving_;
}

v1::GroupStatus GroupCoordinator::Snapshot() const {
  absl::MutexLock lock(&mu_);
  v1::GroupStatus s;
  if (serving_.has_value()) {
    s.set_state("SERVING");
  } else if (static_cast<int>(members_.size()) < options_.world) {
    s.set_state("WAITING");
  } else {
    s.set_state("FORMING");
  }
  *s.mutable_view() = last_view_;
  if (forming_.has_value()) s.set_forming_epoch(forming_->epoch);
  for (const auto& [rank, m] : members_) s.add_live_ranks(rank);
  s.set_reason(reason_);
  for (const v1::EpochRecord& r : epochs_) *s.add_epochs() = r;
  return s;
}

grpc::Status GroupCoordinator::Status(grpc::ServerContext* ctx, const v1::GroupStatusRequest*, v1::GroupStatus* resp) {
  const grpc::Status agent = CheckBearer(ctx, options_.token);
  if (!agent.ok() && !BearerIs(ctx, options_.operator_token) && !BearerIs(ctx, options_.read_token)) return agent;
  *resp = Snapshot();
  // A member's endpoint is its data plane's bootstrap (NCCL: the group's unique id, which also
  // names its shared-memory segments): for the ranks only, not for operators or dashboards.
  if (!agent.ok()) {
    for (v1::GroupMember& m : *resp->mutable_view()->mutable_members()) m.clear_endpoint();
  }
  return grpc::Status::OK;
}

}  // namespace moe
