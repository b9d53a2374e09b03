// The controller's process-group coordinator (control/controller/group_coordinator.h) on a real
// gRPC socket, with test members speaking the Join stream: an epoch forms over the whole world
// with the members' node names and endpoints; a member's data-plane fault report re-forms the
// serving epoch; a lost member re-forms over the survivors after the grace, a survivor's refusal
// makes the group wait, and a replacement brings it back; bad joins are refused, naming the field;
// after a restart, the epoch the ranks still serve is adopted without re-forming when all of its
// ranks rejoin serving it, and a new one is formed otherwise.
#include "control/controller/group_coordinator.h"

#include <memory>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

#include "control/store/release_store.h"
#include "server/group_member.h"
#include "tests/control/registry_sql.h"

namespace moe {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr char kToken[] = "agent-secret";

class Server {
 public:
  explicit Server(GroupCoordinatorOptions o) : coordinator_(std::move(o)) {
    grpc::ServerBuilder b;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    b.RegisterService(&coordinator_);
    server_ = b.BuildAndStart();
    channel_ = grpc::CreateChannel(absl::StrCat("127.0.0.1:", port_), grpc::InsecureChannelCredentials());
  }
  ~Server() {
    coordinator_.Shutdown();
    server_->Shutdown(std::chrono::system_clock::now());
  }
  GroupCoordinator& coordinator() { return coordinator_; }
  std::shared_ptr<grpc::Channel> channel() { return channel_; }
  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }

 private:
  GroupCoordinator coordinator_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
  std::shared_ptr<grpc::Channel> channel_;
};

// One rank's side of the Join stream, driven by the test.
class Member {
 public:
  Member(Server& s, int rank, uint64_t incarnation, const std::string& node, const std::string& token = kToken,
         int64_t serving_epoch = 0) {
    ctx_.AddMetadata("authorization", absl::StrCat("Bearer ", token));
    ctx_.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    stub_ = v1::ProcessGroupService::NewStub(s.channel());
    stream_ = stub_->Join(&ctx_);
    v1::MemberMessage hello;
    hello.mutable_join()->set_rank(rank);
    hello.mutable_join()->set_world(2);
    hello.mutable_join()->set_node(node);
    hello.mutable_join()->add_devices("cpu");
    hello.mutable_join()->set_incarnation(incarnation);
    hello.mutable_join()->set_transport("ucx");
    hello.mutable_join()->set_serving_epoch(serving_epoch);
    // A join the coordinator refuses (a bad token) may find the stream closed before the hello
    // is written; Finish's status says why. An admitted member's next read fails otherwise.
    (void)stream_->Write(hello);
    rank_ = rank;
  }
  // The next PREPARE over `peers` members (older epochs' are skipped: members join one by one).
  v1::PrepareEpoch NextPrepare(size_t peers) {
    v1::GroupMessage m;
    while (stream_->Read(&m)) {
      if (m.has_prepare() && static_cast<size_t>(m.prepare().peers_size()) == peers) return m.prepare();
    }
    ADD_FAILURE() << "rank " << rank_ << ": the stream ended before a PREPARE over " << peers << " members";
    return {};
  }
  v1::GroupView NextFormed() {
    v1::GroupMessage m;
    while (stream_->Read(&m)) {
      if (m.has_formed()) return m.formed();
    }
    ADD_FAILURE() << "rank " << rank_ << ": the stream ended before a FORMED view";
    return {};
  }
  // The next SERVING's epoch (every member reported ready: open it for steps).
  int64_t NextServing() {
    v1::GroupMessage m;
    while (stream_->Read(&m)) {
      if (m.has_serving()) return m.serving().epoch();
    }
    ADD_FAILURE() << "rank " << rank_ << ": the stream ended before a SERVING";
    return -1;
  }
  void SendEndpoint(int64_t epoch) {
    v1::MemberMessage out;
    out.mutable_endpoint()->set_epoch(epoch);
    out.mutable_endpoint()->set_endpoint(absl::StrCat("endpoint-of-", rank_, "-", epoch));
    EXPECT_TRUE(stream_->Write(out));
  }
  void SendReady(int64_t epoch, bool ok, const std::string& error = "") {
    v1::MemberMessage out;
    out.mutable_ready()->set_epoch(epoch);
    out.mutable_ready()->set_ok(ok);
    out.mutable_ready()->set_error(error);
    EXPECT_TRUE(stream_->Write(out));
  }
  ~Member() {
    if (finished_) return;
    ctx_.TryCancel();
    (void)Finish();
  }
  grpc::Status Finish() {
    finished_ = true;
    stream_->WritesDone();
    v1::GroupMessage m;
    while (stream_->Read(&m)) {
    }
    return stream_->Finish();
  }
  void Die() { ctx_.TryCancel(); }

 private:
  grpc::ClientContext ctx_;
  std::unique_ptr<v1::ProcessGroupService::Stub> stub_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::MemberMessage, v1::GroupMessage>> stream_;
  int rank_ = -1;
  bool finished_ = false;
};

// Polls the coordinator until `pred(status)` holds, or fails after 10 s.
template <typename Pred>
v1::GroupStatus AwaitStatus(GroupCoordinator& c, Pred pred, const std::string& what) {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  v1::GroupStatus s = c.Snapshot();
  while (!pred(s) && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(10));
    s = c.Snapshot();
  }
  EXPECT_TRUE(pred(s)) << what << "; status: " << s.ShortDebugString();
  return s;
}

// Both members prepare, connect and report ready for the epoch over both; returns it.
int64_t FormOverBoth(Server& s, Member& a, Member& b) {
  const v1::PrepareEpoch pa = a.NextPrepare(2), pb = b.NextPrepare(2);
  EXPECT_EQ(pa.epoch(), pb.epoch());
  a.SendEndpoint(pa.epoch());
  b.SendEndpoint(pb.epoch());
  const v1::GroupView va = a.NextFormed(), vb = b.NextFormed();
  EXPECT_EQ(va.epoch(), pa.epoch());
  EXPECT_EQ(vb.SerializeAsString(), va.SerializeAsString());
  a.SendReady(pa.epoch(), true);
  b.SendReady(pa.epoch(), true);
  AwaitStatus(
      s.coordinator(),
      [&](const v1::GroupStatus& st) { return st.state() == "SERVING" && st.view().epoch() == pa.epoch(); },
      absl::StrCat("epoch ", pa.epoch(), " serving"));
  return pa.epoch();
}

TEST(GroupCoordinatorTest, FormsTheWorldWithNodesAndReformsWhenADataPlaneReportsItsEpochFailed) {
  absl::Mutex mu;
  std::vector<int64_t> ready_epochs;
  GroupCoordinatorOptions o;
  o.world = 2;
  o.token = kToken;
  o.on_ready = [&](const v1::GroupView& v) {
    absl::MutexLock lock(&mu);
    ready_epochs.push_back(v.epoch());
  };
  Server s(o);
  Member a(s, 0, 11, "host-a"), b(s, 1, 22, "host-b");
  const v1::PrepareEpoch pa = a.NextPrepare(2), pb = b.NextPrepare(2);
  EXPECT_THAT(std::vector<int32_t>(pa.peers().begin(), pa.peers().end()), ElementsAre(0, 1));
  EXPECT_THAT(pb.reason(), ::testing::ContainsRegex("rank [01] joined"));  // whichever joined second
  a.SendEndpoint(pa.epoch());
  b.SendEndpoint(pa.epoch());
  const v1::GroupView view = a.NextFormed();
  EXPECT_EQ(view.epoch(), pa.epoch());
  EXPECT_EQ(view.world(), 2);
  EXPECT_EQ(view.transport(), "ucx");
  EXPECT_THAT(std::vector<std::string>(view.node_of_rank().begin(), view.node_of_rank().end()),
              ElementsAre("host-a", "host-b"));
  ASSERT_EQ(view.members_size(), 2);
  EXPECT_EQ(view.members(0).rank(), 0);
  EXPECT_EQ(view.members(0).endpoint(), absl::StrCat("endpoint-of-0-", pa.epoch()));
  EXPECT_EQ(view.members(1).endpoint(), absl::StrCat("endpoint-of-1-", pa.epoch()));
  EXPECT_EQ(view.members(1).incarnation(), 22u);
  EXPECT_FALSE(s.coordinator().ServingView().has_value()) << "serving before every member reported ready";
  b.NextFormed();
  a.SendReady(pa.epoch(), true);
  b.SendReady(pa.epoch(), true);
  // Every member is told to open the epoch for steps once all of them are ready.
  EXPECT_EQ(a.NextServing(), pa.epoch());
  EXPECT_EQ(b.NextServing(), pa.epoch());
  AwaitStatus(
      s.coordinator(), [&](const v1::GroupStatus& st) { return st.state() == "SERVING"; }, "the first epoch serving");
  AwaitStatus(
      s.coordinator(),
      [&](const v1::GroupStatus&) {
        absl::MutexLock lock(&mu);
        return ready_epochs == std::vector<int64_t>{pa.epoch()};
      },
      "on_ready ran once for the epoch");

  // A report for an epoch that is not served changes nothing.
  b.SendReady(pa.epoch() - 1, false, "an old epoch's transport failed");
  absl::SleepFor(absl::Milliseconds(300));
  v1::GroupStatus st = s.coordinator().Snapshot();
  EXPECT_EQ(st.state(), "SERVING");
  EXPECT_EQ(st.forming_epoch(), 0);

  // Rank 1's data plane reports the serving epoch failed: both are asked for the next one.
  b.SendReady(pa.epoch(), false, "ucx: peer slot 0 failed");
  const int64_t next = FormOverBoth(s, a, b);
  EXPECT_EQ(next, pa.epoch() + 1);
  st = s.coordinator().Snapshot();
  EXPECT_THAT(st.reason(), HasSubstr(absl::StrCat("rank 1 reports epoch ", pa.epoch(), " failed")));
  EXPECT_THAT(st.reason(), HasSubstr("peer slot 0 failed"));
  a.Die();
  b.Die();
}

TEST(GroupCoordinatorTest, SurvivorsFormAfterTheGraceRefuseWithoutACopyAndAReplacementBringsTheWorldBack) {
  GroupCoordinatorOptions o;
  o.world = 2;
  o.token = kToken;
  o.survivor_grace = absl::Milliseconds(200);
  Server s(o);
  Member a(s, 0, 11, "host-a");
  auto b = std::make_unique<Member>(s, 1, 22, "host-b");
  const int64_t first = FormOverBoth(s, a, *b);

  b->Die();  // kill -9: its stream ends
  const v1::PrepareEpoch survivors = a.NextPrepare(1);
  EXPECT_GT(survivors.epoch(), first);
  EXPECT_THAT(survivors.reason(), HasSubstr("rank 1 lost"));
  a.SendEndpoint(survivors.epoch());
  const v1::GroupView alone = a.NextFormed();  // after the grace
  EXPECT_EQ(alone.epoch(), survivors.epoch());
  ASSERT_EQ(alone.members_size(), 1);
  // The survivor cannot serve the placement alone: the group waits for a replacement.
  a.SendReady(alone.epoch(), false, "logical expert 3 has no replica on a member");
  const v1::PrepareEpoch again = a.NextPrepare(1);
  a.SendEndpoint(again.epoch());
  absl::SleepFor(absl::Milliseconds(600));  // three graces
  v1::GroupStatus st = s.coordinator().Snapshot();
  EXPECT_EQ(st.state(), "WAITING") << st.ShortDebugString();
  EXPECT_EQ(st.view().epoch(), alone.epoch()) << "formed over the survivors again after they refused";

  Member replacement(s, 1, 33, "host-c");
  const int64_t back = FormOverBoth(s, a, replacement);
  EXPECT_GT(back, again.epoch());
  st = s.coordinator().Snapshot();
  EXPECT_THAT(std::vector<std::string>(st.view().node_of_rank().begin(), st.view().node_of_rank().end()),
              ElementsAre("host-a", "host-c"));
  EXPECT_EQ(st.view().members(1).incarnation(), 33u);
  a.Die();
  replacement.Die();
}

TEST(GroupCoordinatorTest, StatusAnswersTheAgentsTheOperatorsAndTheReadOnlyTokenOnly) {
  GroupCoordinatorOptions o;
  o.world = 2;
  o.token = kToken;
  o.operator_token = "operator-secret-0123";
  o.read_token = "reader-secret-0123";
  Server s(o);
  auto stub = v1::ProcessGroupService::NewStub(s.channel());
  auto status = [&](const std::string& token) {
    grpc::ClientContext ctx;
    if (!token.empty()) ctx.AddMetadata("authorization", absl::StrCat("Bearer ", token));
    v1::GroupStatus st;
    return stub->Status(&ctx, {}, &st).error_code();
  };
  EXPECT_EQ(status(kToken), grpc::StatusCode::OK);
  EXPECT_EQ(status("operator-secret-0123"), grpc::StatusCode::OK);
  EXPECT_EQ(status("reader-secret-0123"), grpc::StatusCode::OK);
  EXPECT_EQ(status("reader-secret-0124"), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(status(""), grpc::StatusCode::UNAUTHENTICATED);
  // The read-only token never joins the group as a rank.
  {
    Member m(s, 0, 1, "host-a", "reader-secret-0123");
    EXPECT_EQ(m.Finish().error_code(), grpc::StatusCode::UNAUTHENTICATED);
  }
  // The members' endpoints (an NCCL group's unique id) reach the ranks' token only.
  Member a(s, 0, 11, "host-a"), b(s, 1, 22, "host-b");
  const int64_t epoch = FormOverBoth(s, a, b);
  auto view = [&](const std::string& token) {
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", absl::StrCat("Bearer ", token));
    v1::GroupStatus st;
    EXPECT_TRUE(stub->Status(&ctx, {}, &st).ok());
    return st.view();
  };
  const v1::GroupView ranks = view(kToken);
  ASSERT_EQ(ranks.members_size(), 2);
  EXPECT_EQ(ranks.members(0).endpoint(), absl::StrCat("endpoint-of-0-", epoch));
  for (const std::string token : {"operator-secret-0123", "reader-secret-0123"}) {
    const v1::GroupView seen = view(token);
    ASSERT_EQ(seen.members_size(), 2) << token;
    EXPECT_EQ(seen.epoch(), epoch);
    EXPECT_EQ(seen.members(1).node(), "host-b");
    for (const v1::GroupMember& m : seen.members()) EXPECT_TRUE(m.endpoint().empty()) << token;
  }
  a.Die();
  b.Die();
}

TEST(GroupCoordinatorTest, BadJoinsAreRefusedNamingTheField) {
  GroupCoordinatorOptions o;
  o.world = 2;
  o.token = kToken;
  Server s(o);
  {
    Member m(s, 0, 1, "host-a", "wrong-token");
    EXPECT_EQ(m.Finish().error_code(), grpc::StatusCode::UNAUTHENTICATED);
  }
  {
    Member m(s, 2, 1, "host-a");
    const grpc::Status st = m.Finish();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(st.error_message(), HasSubstr("join.rank"));
  }
  {
    Member m(s, 0, 1, "");
    const grpc::Status st = m.Finish();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(st.error_message(), HasSubstr("join.node"));
  }
  Member a(s, 0, 7, "host-a");
  a.NextPrepare(1);
  {
    Member twin(s, 0, 7, "host-a");  // the same process joining twice
    const grpc::Status st = twin.Finish();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::ALREADY_EXISTS);
  }
  EXPECT_EQ(s.coordinator().Snapshot().live_ranks_size(), 1) << "a refused join changed the membership";
  a.Die();
}

// A process that was replaced (cut off while a new process for its rank joined) and comes back is
// refused, naming the rank: it does not evict its replacement, which keeps serving.
TEST(GroupCoordinatorTest, AReplacedProcessThatComesBackIsRefused) {
  GroupCoordinatorOptions o;
  o.world = 2;
  o.token = kToken;
  Server s(o);
  auto a = std::make_unique<Member>(s, 0, 11, "host-a");
  Member b(s, 1, 21, "host-b");
  FormOverBoth(s, *a, b);
  Member a2(s, 0, 12, "host-a");  // the replacement: rank 0's first process is cut off
  const int64_t epoch = FormOverBoth(s, a2, b);
  a.reset();
  {
    Member old(s, 0, 11, "host-a");  // the first process comes back
    const grpc::Status st = old.Finish();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_THAT(st.error_message(), HasSubstr("rank 0's process"));
    EXPECT_THAT(st.error_message(), HasSubstr("replaced"));
  }
  const v1::GroupStatus st = s.coordinator().Snapshot();
  EXPECT_EQ(st.state(), "SERVING");
  EXPECT_EQ(st.view().epoch(), epoch);  // no re-form
  EXPECT_EQ(st.live_ranks_size(), 2);
  a2.Die();
  b.Die();
}

// The test's member `b` answers the next epoch over both ranks (its endpoint, then ready) while
// the other member is a daemon's own GroupMember; returns the epoch once it serves.
int64_t FormWithDaemon(Server& s, Member& b) {
  const v1::PrepareEpoch p = b.NextPrepare(2);
  b.SendEndpoint(p.epoch());
  EXPECT_EQ(b.NextFormed().epoch(), p.epoch());
  b.SendReady(p.epoch(), true);
  AwaitStatus(
      s.coordinator(),
      [&](const v1::GroupStatus& st) { return st.state() == "SERVING" && st.view().epoch() == p.epoch(); },
      absl::StrCat("epoch ", p.epoch(), " serving"));
  return p.epoch();
}

// The rank daemon's own member (server/group_member.h) on the other end: once a newer process of
// its rank joined, the old one is evicted, refused when it rejoins, leaves its epoch (`fenced`)
// and stops rejoining, rather than retrying the refusal every backoff (a controller restarted
// meanwhile, which forgets the refusal, would admit it and evict the replacement).
TEST(GroupCoordinatorTest, AReplacedDaemonLeavesItsEpochAndStopsRejoining) {
  GroupCoordinatorOptions o;
  o.world = 2;
  o.token = kToken;
  Server s(o);
  absl::Mutex mu;
  std::vector<std::string> fenced_why(2);  // per daemon: why it was fenced ("" while not)
  std::vector<int64_t> serving(2, 0);      // per daemon: the epoch it serves
  auto daemon = [&](int i) {
    GroupMemberOptions g;
    g.controller = s.address();
    g.token = kToken;
    g.join.set_rank(0);
    g.join.set_world(2);
    g.join.set_node("host-a");
    g.join.add_devices("cpu");
    g.join.set_transport("ucx");
    g.reconnect_backoff = absl::Milliseconds(20);
    g.prepare = [&, i](const v1::PrepareEpoch& p) -> absl::StatusOr<std::string> {
      absl::MutexLock lock(&mu);
      serving[i] = 0;
      return absl::StrCat("endpoint-of-daemon-", i, "-", p.epoch());
    };
    g.connect = [](const v1::GroupView&) { return absl::OkStatus(); };
    g.serve = [&, i](int64_t epoch) {
      absl::MutexLock lock(&mu);
      serving[i] = epoch;
    };
    g.fenced = [&, i](const std::string& why) {
      absl::MutexLock lock(&mu);
      fenced_why[i] = why;
      serving[i] = 0;
    };
    return std::make_unique<GroupMember>(std::move(g));
  };
  Member b(s, 1, 21, "host-b");
  std::unique_ptr<GroupMember> first = daemon(0);
  first->Start();
  const int64_t e1 = FormWithDaemon(s, b);
  auto serves = [&](int i, int64_t epoch) {
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (absl::Now() < deadline) {
      {
        absl::MutexLock lock(&mu);
        if (serving[i] == epoch) return true;
      }
      absl::SleepFor(absl::Milliseconds(10));
    }
    return false;
  };
  EXPECT_TRUE(serves(0, e1));
  // The replacement joins: the first daemon is evicted, comes back at once and is refused.
  std::unique_ptr<GroupMember> second = daemon(1);
  second->Start();
  const int64_t e2 = FormWithDaemon(s, b);
  EXPECT_TRUE(serves(1, e2));
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (!first->fenced() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(10));
  ASSERT_TRUE(first->fenced()) << "the replaced daemon was never told it is fenced";
  {
    absl::MutexLock lock(&mu);
    EXPECT_THAT(fenced_why[0], HasSubstr("replaced by a newer one"));
    EXPECT_EQ(serving[0], 0);
    EXPECT_EQ(fenced_why[1], "");
  }
  EXPECT_FALSE(second->fenced());
  // It stopped rejoining: the group serves the replacement's epoch, undisturbed.
  absl::SleepFor(absl::Milliseconds(200));
  const v1::GroupStatus st = s.coordinator().Snapshot();
  EXPECT_EQ(st.state(), "SERVING");
  EXPECT_EQ(st.view().epoch(), e2);
  EXPECT_EQ(st.live_ranks_size(), 2);
  first->Stop();
  second->Stop();
  b.Die();
}

// A registry whose last recorded epoch is 7 over ranks 0 and 1 (the controller's state before a
// restart).
std::unique_ptr<ReleaseStore> StoreWithEpoch7(const std::string& name) {
  const std::string path = absl::StrCat(getenv("TEST_TMPDIR") ? getenv("TEST_TMPDIR") : "/tmp", "/", name, ".db");
  std::remove(path.c_str());
  auto store = ReleaseStore::Open(path);
  EXPECT_TRUE(store.ok()) << store.status();
  EXPECT_TRUE((*store)->RecordEpoch(6, "rank 1 joined", "0,1", 1).ok());
  EXPECT_TRUE((*store)->RecordEpoch(7, "rank 1 reports epoch 6 failed", "0,1", 2).ok());
  return *std::move(store);
}

// The coordinator of a restarted controller over `store`: two ranks, waiting `grace` for the last
// recorded epoch's ranks to rejoin serving it.
GroupCoordinatorOptions RestartedOver(ReleaseStore* store, absl::Duration grace = absl::Seconds(20)) {
  GroupCoordinatorOptions o;
  o.world = 2;
  o.token = kToken;
  o.store = store;
  o.adopt_grace = grace;
  return o;
}

TEST(GroupCoordinatorTest, AfterARestartTheEpochItsRanksStillServeIsAdoptedWithoutReforming) {
  auto store = StoreWithEpoch7("adopt");
  absl::Mutex mu;
  std::vector<int64_t> ready_epochs;
  GroupCoordinatorOptions o = RestartedOver(store.get());
  o.on_ready = [&](const v1::GroupView& v) {
    absl::MutexLock lock(&mu);
    ready_epochs.push_back(v.epoch());
  };
  Server s(o);
  Member a(s, 0, 11, "host-a", kToken, 7);
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_EQ(s.coordinator().Snapshot().state(), "WAITING") << "adopted before every rank of epoch 7 rejoined";
  Member b(s, 1, 22, "host-b", kToken, 7);
  v1::GroupStatus st = AwaitStatus(
      s.coordinator(), [](const v1::GroupStatus& x) { return x.state() == "SERVING" && x.view().epoch() == 7; },
      "epoch 7 adopted");
  EXPECT_EQ(st.forming_epoch(), 0);
  EXPECT_THAT(st.reason(), HasSubstr("epoch 7 adopted after a controller restart"));
  EXPECT_THAT(std::vector<std::string>(st.view().node_of_rank().begin(), st.view().node_of_rank().end()),
              ElementsAre("host-a", "host-b"));
  ASSERT_EQ(st.view().members_size(), 2);
  EXPECT_EQ(st.view().members(1).incarnation(), 22u);
  // SERVING again: a member that had bound epoch 7 but not opened it before the restart opens it.
  EXPECT_EQ(a.NextServing(), 7);
  EXPECT_EQ(b.NextServing(), 7);
  AwaitStatus(
      s.coordinator(),
      [&](const v1::GroupStatus&) {
        absl::MutexLock lock(&mu);
        return ready_epochs == std::vector<int64_t>{7};
      },
      "on_ready ran for the adopted epoch (the controller re-drives its placement)");
  // The adopted epoch is the serving one: a fault report for it forms epoch 8, the first PREPARE
  // either member sees (none was sent when they rejoined).
  b.SendReady(7, false, "ucx: peer slot 0 failed");
  EXPECT_EQ(FormOverBoth(s, a, b), 8);
  EXPECT_EQ(*store->LastEpoch(), 8);
  a.Die();
  b.Die();
}

TEST(GroupCoordinatorTest, AfterARestartARankServingAnotherEpochMakesANewOne) {
  auto store = StoreWithEpoch7("adopt_other");
  Server s(RestartedOver(store.get()));
  Member a(s, 0, 11, "host-a", kToken, 7);
  AwaitStatus(
      s.coordinator(), [](const v1::GroupStatus& x) { return x.live_ranks_size() == 1; }, "rank 0 rejoined");
  Member b(s, 1, 22, "host-b", kToken, 0);  // a replacement: serves nothing yet
  EXPECT_EQ(FormOverBoth(s, a, b), 8);
  a.Die();
  b.Die();
}

// The epoch being adopted reported failed by a rank before the others rejoined: a new epoch is
// formed at once, not the broken one adopted. And an adopted epoch that loses a rank re-forms as
// any serving epoch does.
TEST(GroupCoordinatorTest, AfterARestartAFaultDuringTheAdoptionOrALossAfterItFormsANewEpoch) {
  {
    auto store = StoreWithEpoch7("adopt_fault");
    Server s(RestartedOver(store.get()));
    Member a(s, 0, 11, "host-a", kToken, 7);
    absl::SleepFor(absl::Milliseconds(100));
    a.SendReady(7, false, "ucx: peer slot 1 failed");
    const v1::PrepareEpoch p = a.NextPrepare(1);
    EXPECT_EQ(p.epoch(), 8);
    EXPECT_THAT(p.reason(), HasSubstr("rank 0 reports epoch 7 failed"));
    a.Die();
  }
  {
    auto store = StoreWithEpoch7("adopt_lost");
    Server s(RestartedOver(store.get()));
    Member a(s, 0, 11, "host-a", kToken, 7);
    {
      Member b(s, 1, 22, "host-b", kToken, 7);
      AwaitStatus(
          s.coordinator(), [](const v1::GroupStatus& x) { return x.state() == "SERVING" && x.view().epoch() == 7; },
          "epoch 7 adopted");
      b.Die();
    }
    const v1::PrepareEpoch p = a.NextPrepare(1);
    EXPECT_EQ(p.epoch(), 8);
    EXPECT_THAT(p.reason(), HasSubstr("rank 1 lost"));
    a.Die();
  }
}

// The next epoch is past the highest the store holds, not only past the coordinator's own count:
// with epoch 8 recorded behind its back, the fault forms 9 (an epoch formed though its record
// failed was once numbered again after a restart).
TEST(GroupCoordinatorTest, ANewEpochIsPastTheHighestRecorded) {
  auto store = StoreWithEpoch7("past_recorded");
  Server s(RestartedOver(store.get()));
  Member a(s, 0, 11, "host-a", kToken, 7);
  AwaitStatus(
      s.coordinator(), [](const v1::GroupStatus& x) { return x.live_ranks_size() == 1; }, "rank 0 rejoined");
  ASSERT_TRUE(store->RecordEpoch(8, "recorded elsewhere", "0", 3).ok());
  a.SendReady(7, false, "ucx: peer slot 1 failed");
  const v1::PrepareEpoch p = a.NextPrepare(1);
  EXPECT_EQ(p.epoch(), 9);
  EXPECT_EQ(*store->LastEpoch(), 9);
  a.Die();
}

// A rank lost while an epoch over both is forming, when the store refuses the next epoch: the
// forming epoch (which names the lost rank) is dropped, so the survivor's READY for it completes
// nothing and the grace publishes nothing; once the store records again, the retry forms the
// survivors' epoch.
TEST(GroupCoordinatorTest, AnEpochTheStoreRefusesLeavesNoStaleEpochFormingAndIsRetried) {
  const std::string path = absl::StrCat(getenv("TEST_TMPDIR") ? getenv("TEST_TMPDIR") : "/tmp", "/refused_record.db");
  std::remove(path.c_str());
  auto store = ReleaseStore::Open(path);
  ASSERT_TRUE(store.ok()) << store.status();
  GroupCoordinatorOptions o;
  o.world = 2;
  o.token = kToken;
  o.store = store->get();
  o.survivor_grace = absl::Milliseconds(100);
  Server s(o);
  Member a(s, 0, 11, "host-a");
  auto b = std::make_unique<Member>(s, 1, 22, "host-b");
  const v1::PrepareEpoch pa = a.NextPrepare(2), pb = b->NextPrepare(2);
  a.SendEndpoint(pa.epoch());
  b->SendEndpoint(pb.epoch());
  ASSERT_EQ(a.NextFormed().epoch(), pa.epoch());
  ASSERT_EQ(b->NextFormed().epoch(), pa.epoch());
  b->SendReady(pa.epoch(), true);
  AwaitStatus(
      s.coordinator(), [&](const v1::GroupStatus& x) { return x.forming_epoch() == pa.epoch(); }, "epoch forming");
  testing::RegistrySql(
      path,
      "CREATE TRIGGER refuse_epochs BEFORE INSERT ON group_epochs BEGIN SELECT RAISE(ABORT, 'refused by the test'); "
      "END;");
  b->Die();
  const v1::GroupStatus refused = AwaitStatus(
      s.coordinator(),
      [](const v1::GroupStatus& x) {
        return x.live_ranks_size() == 1 && x.reason().find("not formed") != std::string::npos;
      },
      "the next epoch refused by the store");
  EXPECT_THAT(refused.reason(), HasSubstr("refused by the test"));
  EXPECT_EQ(refused.forming_epoch(), 0) << "the epoch over the lost rank is still forming";
  // The survivor's READY for the dropped epoch completes nothing; the grace publishes nothing.
  a.SendReady(pa.epoch(), true);
  absl::SleepFor(absl::Milliseconds(400));
  v1::GroupStatus st = s.coordinator().Snapshot();
  EXPECT_NE(st.state(), "SERVING") << st.ShortDebugString();
  EXPECT_FALSE(s.coordinator().ServingView().has_value());
  EXPECT_EQ(*(*store)->LastEpoch(), pa.epoch());
  testing::RegistrySql(path, "DROP TRIGGER refuse_epochs;");
  const v1::PrepareEpoch survivors = a.NextPrepare(1);
  EXPECT_EQ(survivors.epoch(), pa.epoch() + 1);
  EXPECT_THAT(survivors.reason(), HasSubstr("rank 1 lost"));
  EXPECT_EQ(*(*store)->LastEpoch(), pa.epoch() + 1);
  a.SendEndpoint(survivors.epoch());
  const v1::GroupView alone = a.NextFormed();
  EXPECT_EQ(alone.epoch(), survivors.epoch());
  ASSERT_EQ(alone.members_size(), 1);
  a.Die();
}

TEST(GroupCoordinatorTest, AfterARestartTheGraceRunningOutFormsANewEpochOverWhoRejoined) {
  auto store = StoreWithEpoch7("adopt_grace");
  Server s(RestartedOver(store.get(), absl::Milliseconds(300)));
  Member a(s, 0, 11, "host-a", kToken, 7);
  const v1::PrepareEpoch p = a.NextPrepare(1);
  EXPECT_EQ(p.epoch(), 8);
  EXPECT_THAT(p.reason(), HasSubstr("epoch 7's ranks did not all rejoin serving it"));
  a.Die();
}

}  // namespace
}  // namespace moe
