// The durable release store: persistence across reopen, idempotent request ids, nothing written on
// error, and 20 SIGKILLs of a writer process at random points of rollouts with no lost
// acknowledged record and a clean resume every time.
#include "control/store/release_store.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <map>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <sqlite3.h>
#include <sys/wait.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe {
namespace {

using ::testing::HasSubstr;

std::string TempPath(const std::string& name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  const std::string path = absl::StrCat(dir != nullptr ? dir : "/tmp", "/", name);
  for (const char* suffix : {"", "-wal", "-shm"}) unlink((path + suffix).c_str());
  return path;
}

void Sql(const std::string& path, const std::string& sql) {
  sqlite3* db = nullptr;
  ASSERT_EQ(sqlite3_open(path.c_str(), &db), SQLITE_OK);
  char* err = nullptr;
  EXPECT_EQ(sqlite3_exec(db, sql.c_str(), nullptr, nullptr, &err), SQLITE_OK) << (err ? err : "");
  sqlite3_free(err);
  sqlite3_close(db);
}

// A registry of a build from before the placement columns (and before the schema was numbered)
// is brought up to date when opened; one of a newer build is refused, untouched.
TEST(ReleaseStoreTest, AnOlderRegistryIsMigratedAndANewerOneRefused) {
  const std::string path = TempPath("old-schema.db");
  Sql(path,
      "CREATE TABLE releases (release_id TEXT PRIMARY KEY, bundle_digest TEXT NOT NULL, state TEXT NOT NULL, "
      "revision INTEGER NOT NULL);"
      "CREATE TABLE transitions (seq INTEGER PRIMARY KEY AUTOINCREMENT, request_id TEXT NOT NULL, part INTEGER NOT "
      "NULL, release_id TEXT NOT NULL REFERENCES releases(release_id), from_state TEXT NOT NULL, to_state TEXT NOT "
      "NULL, reason TEXT NOT NULL, UNIQUE (request_id, part));");
  {
    auto store = ReleaseStore::Open(path);
    ASSERT_TRUE(store.ok()) << store.status();
    ASSERT_TRUE((*store)->Register("r1", "release-v1", "sha256:aa").ok());
    ASSERT_TRUE((*store)->Transition("r2", "release-v1", ReleaseState::kVerified, "ok").ok());
    ASSERT_TRUE((*store)->Apply("r3", {{"release-v1", ReleaseState::kLoaded, "prepared", 4, "{}"}}).ok());
    EXPECT_TRUE((*store)->Verify().ok()) << (*store)->Verify();
  }
  {
    auto store = ReleaseStore::Open(path);  // reopened at the current schema
    ASSERT_TRUE(store.ok()) << store.status();
    auto rec = (*store)->Get("release-v1");
    ASSERT_TRUE(rec.ok()) << rec.status();
    EXPECT_EQ(rec->placement_version, 4);
    EXPECT_EQ(rec->state, ReleaseState::kLoaded);
  }
  Sql(path, "PRAGMA user_version = 99");
  auto newer = ReleaseStore::Open(path);
  ASSERT_FALSE(newer.ok());
  EXPECT_EQ(newer.status().code(), absl::StatusCode::kFailedPrecondition) << newer.status();
  EXPECT_THAT(std::string(newer.status().message()), HasSubstr("schema 99"));
}

TEST(ReleaseStoreTest, TransitionsPersistAcrossReopen) {
  const std::string path = TempPath("persist.db");
  {
    auto store = *ReleaseStore::Open(path);
    ASSERT_TRUE(store->Register("r1", "release-v19", "sha256:aa").ok());
    ASSERT_TRUE(store->Transition("r2", "release-v19", ReleaseState::kVerified, "digests match").ok());
    ASSERT_TRUE(store->Transition("r3", "release-v19", ReleaseState::kLoaded, "weights on 4 ranks").ok());
  }
  auto store = *ReleaseStore::Open(path);
  auto rec = *store->Get("release-v19");
  EXPECT_EQ(rec.state, ReleaseState::kLoaded);
  EXPECT_EQ(rec.revision, 2);
  EXPECT_EQ(rec.bundle_digest, "sha256:aa");
  auto history = *store->History("release-v19");
  ASSERT_EQ(history.size(), 2u);
  EXPECT_EQ(history[1].from, ReleaseState::kVerified);
  EXPECT_EQ(history[1].reason, "weights on 4 ranks");
  EXPECT_TRUE(store->Verify().ok());
}

TEST(ReleaseStoreTest, PlacementIsRecordedWithItsTransition) {
  const std::string path = TempPath("placement.db");
  {
    auto store = *ReleaseStore::Open(path);
    ASSERT_TRUE(store->Register("r1", "release-v2", "sha256:bb").ok());
    ASSERT_TRUE(store->Transition("r2", "release-v2", ReleaseState::kVerified, "ok").ok());
    ASSERT_TRUE(
        store->Apply("r3", {{"release-v2", ReleaseState::kLoaded, "prepared", 2, "{\"version\": \"2\"}"}}).ok());
    // A later transition without a placement keeps it.
    ASSERT_TRUE(store->Transition("r4", "release-v2", ReleaseState::kShadow, "shadow").ok());
  }
  auto rec = *(*ReleaseStore::Open(path))->Get("release-v2");
  EXPECT_EQ(rec.placement_version, 2);
  EXPECT_EQ(rec.placement_manifest, "{\"version\": \"2\"}");
  EXPECT_EQ(rec.state, ReleaseState::kShadow);
}

// A bundle is stored with its release in the same commit and survives a reopen; a release
// registered with a digest only has none.
TEST(ReleaseStoreTest, BundlesAreStoredWithTheirRelease) {
  const std::string path = TempPath("bundles.db");
  {
    auto store = *ReleaseStore::Open(path);
    ASSERT_TRUE(store->Register("r1", "release-v1", "sha256:b1", R"({"release_id":"release-v1"})").ok());
    ASSERT_TRUE(store->Register("r2", "release-v2", "sha256:b2").ok());
  }
  auto store = *ReleaseStore::Open(path);
  EXPECT_EQ(*store->Bundle("release-v1"), R"({"release_id":"release-v1"})");
  EXPECT_EQ(*store->Bundle("release-v2"), "");
  EXPECT_EQ(*store->Bundle("release-v9"), "");
  // A repeat with the bundle finds it; a release registered with its digest only does not get
  // one by a repeat (it was never checked against it).
  EXPECT_TRUE(store->Register("r3", "release-v1", "sha256:b1", R"({"release_id":"release-v1"})").ok());
  auto late = store->Register("r4", "release-v2", "sha256:b2", R"({"release_id":"release-v2"})");
  EXPECT_EQ(late.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(std::string(late.status().message()), HasSubstr("digest only"));
  EXPECT_EQ(*store->Bundle("release-v2"), "");
  EXPECT_TRUE(store->Register("r5", "release-v2", "sha256:b2").ok());  // the digest-only repeat still is one
}

TEST(ReleaseStoreTest, RequestIdsAreIdempotent) {
  auto store = *ReleaseStore::Open(TempPath("idempotent.db"));
  ASSERT_TRUE(store->Register("r1", "release-v19", "sha256:aa").ok());
  EXPECT_TRUE(store->Register("r1", "release-v19", "sha256:aa").ok());  // repeat
  EXPECT_EQ(store->Register("r9", "release-v19", "sha256:bb").status().code(), absl::StatusCode::kAlreadyExists);
  auto first = *store->Transition("r2", "release-v19", ReleaseState::kVerified, "ok");
  auto again = *store->Transition("r2", "release-v19", ReleaseState::kVerified, "ok");
  EXPECT_EQ(first.seq, again.seq);
  EXPECT_EQ(store->Get("release-v19")->revision, 1);
  auto reused = store->Transition("r2", "release-v19", ReleaseState::kLoaded, "ok");
  EXPECT_EQ(reused.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(std::string(reused.status().message()), HasSubstr("request_id"));
}

TEST(ReleaseStoreTest, ErrorsNameTheFieldAndWriteNothing) {
  auto store = *ReleaseStore::Open(TempPath("errors.db"));
  EXPECT_EQ(ReleaseStore::Open(":memory:").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store->Register("", "release-v19", "d").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(store->Register("r0", "release-v19", "").status().message()), HasSubstr("bundle_digest"));
  ASSERT_TRUE(store->Register("r1", "release-v19", "sha256:aa").ok());
  auto illegal = store->Transition("r2", "release-v19", ReleaseState::kActive, "skip the gate");
  EXPECT_EQ(illegal.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(illegal.status().message()), HasSubstr("BUILT -> ACTIVE"));
  EXPECT_EQ(store->Transition("r3", "release-v20", ReleaseState::kVerified, "x").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(store->Transition("r4", "release-v19", ReleaseState::kVerified, "").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store->Get("release-v19")->revision, 0);
  EXPECT_TRUE(store->History("")->empty());
  // The refused request ids stay free: a correct request may use them.
  EXPECT_TRUE(store->Transition("r2", "release-v19", ReleaseState::kVerified, "digests match").ok());
}

// The store runs the lifecycle's CheckTransition, with every reason of a batch checked before
// any edge: a batch with an illegal edge and a missing reason is refused for the reason.
TEST(ReleaseStoreTest, ReasonsAreCheckedBeforeEdges) {
  auto store = *ReleaseStore::Open(TempPath("order.db"));
  ASSERT_TRUE(store->Register("r1", "release-v19", "sha256:aa").ok());
  auto both = store->Apply(
      "r2", {{"release-v19", ReleaseState::kActive, "skip the gate"}, {"release-v19", ReleaseState::kVerified, ""}});
  EXPECT_EQ(both.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(both.status().message(), "reason: every transition needs one");
  auto illegal = store->Apply("r3", {{"release-v19", ReleaseState::kActive, "skip the gate"}});
  EXPECT_EQ(illegal.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(illegal.status().message(), "release-v19: BUILT -> ACTIVE is not a legal transition");
  EXPECT_EQ(illegal.status(), CheckTransition("release-v19", ReleaseState::kBuilt, ReleaseState::kActive, "x"));
  EXPECT_TRUE(store->History("")->empty());
}

TEST(ReleaseStoreTest, BatchesAreAllOrNothing) {
  auto store = *ReleaseStore::Open(TempPath("batch.db"));
  for (const char* id : {"release-v18", "release-v19"}) {
    ASSERT_TRUE(store->Register(absl::StrCat(id, ":reg"), id, "sha256:aa").ok());
    for (ReleaseState to :
         {ReleaseState::kVerified, ReleaseState::kLoaded, ReleaseState::kShadow, ReleaseState::kCanary}) {
      ASSERT_TRUE(store->Transition(absl::StrCat(id, ":", ReleaseStateName(to)), id, to, "walk").ok());
    }
  }
  ASSERT_TRUE(store->Transition("v18-active", "release-v18", ReleaseState::kActive, "promoted").ok());
  // Promotion of v19: candidate ACTIVE and prior DRAINING in one commit.
  auto promoted = *store->Apply("promote-v19", {{"release-v19", ReleaseState::kActive, "gate passed"},
                                                {"release-v18", ReleaseState::kDraining, "replaced"}});
  ASSERT_EQ(promoted.size(), 2u);
  EXPECT_EQ(promoted[1].seq, promoted[0].seq + 1);
  const size_t rows = store->History("")->size();
  // Rollback whose second move is illegal (RETIRED cannot come back): nothing is written.
  auto bad = store->Apply("rollback-1", {{"release-v19", ReleaseState::kDraining, "fault"},
                                         {"release-v19", ReleaseState::kActive, "undo"},
                                         {"release-v18", ReleaseState::kRetired, "oops"},
                                         {"release-v18", ReleaseState::kActive, "too late"}});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("release-v18: RETIRED -> ACTIVE"));
  EXPECT_EQ(store->History("")->size(), rows);
  EXPECT_EQ(store->Get("release-v19")->state, ReleaseState::kActive);
  EXPECT_EQ(store->Get("release-v18")->state, ReleaseState::kDraining);
  // The ordered rollback, and its idempotent repeat.
  auto rolled = *store->Apply("rollback-2", {{"release-v19", ReleaseState::kDraining, "candidate faulted"},
                                             {"release-v18", ReleaseState::kActive, "prior re-activated"}});
  auto repeat = *store->Apply("rollback-2", {{"release-v19", ReleaseState::kDraining, "candidate faulted"},
                                             {"release-v18", ReleaseState::kActive, "prior re-activated"}});
  ASSERT_EQ(repeat.size(), 2u);
  EXPECT_EQ(repeat[0].seq, rolled[0].seq);
  EXPECT_EQ(repeat[1].to, ReleaseState::kActive);
  EXPECT_EQ(store->Get("release-v18")->state, ReleaseState::kActive);
  EXPECT_TRUE(store->Verify().ok());
}

// Readers see committed rows only: inside a write transaction (just before its COMMIT) the
// store's own reads (what a Watch stream, the metrics collector or a status RPC calls) still see
// the state before it; after the commit they see it. Reads and writes share no connection.
TEST(ReleaseStoreTest, ReadsDuringAWriteSeeOnlyCommittedRows) {
  const std::string path = TempPath("read-committed.db");
  auto store = ReleaseStore::Open(path);
  ASSERT_TRUE(store.ok()) << store.status();
  ReleaseStore& st = **store;
  ASSERT_TRUE(st.Register("r1", "release-v1", "sha256:aa").ok());
  int calls = 0;
  st.SetBeforeCommitForTest([&] {
    ++calls;
    auto history = st.History("");
    ASSERT_TRUE(history.ok()) << history.status();
    EXPECT_TRUE(history->empty()) << "an uncommitted transition is visible: seq " << history->front().seq;
    auto rec = st.Get("release-v1");
    ASSERT_TRUE(rec.ok()) << rec.status();
    EXPECT_EQ(rec->state, ReleaseState::kBuilt);
    EXPECT_EQ(rec->revision, 0);
    auto recorded = st.Recorded("r2");
    ASSERT_TRUE(recorded.ok());
    EXPECT_TRUE(recorded->empty());
    EXPECT_FALSE(*st.HasRequest("r2"));
    auto list = st.List();
    ASSERT_TRUE(list.ok());
    EXPECT_EQ(list->size(), 1u);
  });
  ASSERT_TRUE(st.Transition("r2", "release-v1", ReleaseState::kVerified, "ok").ok());
  EXPECT_EQ(calls, 1);
  st.SetBeforeCommitForTest([&] {
    ++calls;
    EXPECT_EQ(st.Get("release-v2").status().code(), absl::StatusCode::kNotFound);
    EXPECT_EQ(*st.Bundle("release-v2"), "");
  });
  ASSERT_TRUE(st.Register("r3", "release-v2", "sha256:bb", "{\"b\":1}").ok());
  EXPECT_EQ(calls, 2);
  st.SetBeforeCommitForTest(nullptr);
  EXPECT_EQ(st.Get("release-v1")->state, ReleaseState::kVerified);
  EXPECT_EQ(st.History("")->size(), 1u);
  EXPECT_EQ(*st.Bundle("release-v2"), "{\"b\":1}");
  EXPECT_TRUE(*st.HasRequest("r2"));
  EXPECT_TRUE(st.Verify().ok());
}

// Writers on several threads (requests, epochs) each get a transaction of their own: none is
// refused for another's open transaction, and every acknowledged write is there.
TEST(ReleaseStoreTest, ConcurrentWritersAndReadersAllSucceed) {
  const std::string path = TempPath("concurrent.db");
  auto store = ReleaseStore::Open(path);
  ASSERT_TRUE(store.ok()) << store.status();
  ReleaseStore& st = **store;
  constexpr int kPerThread = 25;
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int w = 0; w < 2; ++w) {
    threads.emplace_back([&, w] {
      for (int i = 0; i < kPerThread; ++i) {
        const std::string id = absl::StrCat("release-", w, "-", i);
        if (!st.Register(absl::StrCat("reg-", w, "-", i), id, "sha256:aa").ok()) ++failures;
        if (!st.Transition(absl::StrCat("ver-", w, "-", i), id, ReleaseState::kVerified, "ok").ok()) ++failures;
      }
    });
  }
  threads.emplace_back([&] {
    for (int i = 1; i <= kPerThread; ++i) {
      if (!st.RecordEpoch(i, "test", "0,1", i).ok()) ++failures;
    }
  });
  threads.emplace_back([&] {
    for (int i = 0; i < 4 * kPerThread; ++i) {
      if (!st.History("").ok() || !st.List().ok()) ++failures;
    }
  });
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(st.List()->size(), 2u * kPerThread);
  EXPECT_EQ(st.History("")->size(), 2u * kPerThread);
  EXPECT_EQ(*st.LastEpoch(), kPerThread);
  EXPECT_TRUE(st.Verify().ok());
}

TEST(RegistryLockTest, OneWriterPerRegistryNamingTheHolder) {
  const std::string path = TempPath("locked.db");
  unlink((path + ".lock").c_str());
  char host[256] = {0};
  ASSERT_EQ(gethostname(host, sizeof(host) - 1), 0);
  // Another process holds the registry: refused, naming its pid and host.
  int ready[2], done[2];
  ASSERT_EQ(pipe(ready), 0);
  ASSERT_EQ(pipe(done), 0);
  const pid_t holder = fork();
  ASSERT_GE(holder, 0);
  if (holder == 0) {
    auto lock = RegistryLock::Acquire(path);
    const char ok = lock.ok() ? '1' : '0';
    if (write(ready[1], &ok, 1) != 1) _exit(3);
    char c;
    if (read(done[0], &c, 1) < 0) _exit(4);  // hold it until the parent is done
    _exit(0);
  }
  char ok = 0;
  ASSERT_EQ(read(ready[0], &ok, 1), 1);
  ASSERT_EQ(ok, '1');
  auto refused = RegistryLock::Acquire(path);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(refused.status().message()),
              HasSubstr(absl::StrCat("held by another moe-controller (pid ", holder, " on host ", host, ";")));
  // The holder dies (its lock file keeps the stale line): the registry is free again.
  ASSERT_EQ(write(done[1], "x", 1), 1);
  int status = 0;
  ASSERT_EQ(waitpid(holder, &status, 0), holder);
  auto mine = RegistryLock::Acquire(path);
  ASSERT_TRUE(mine.ok()) << mine.status();
  EXPECT_EQ((*mine)->path(), path + ".lock");
  // Within one process too: a second holder is refused while the first lives, and naming us.
  auto second = RegistryLock::Acquire(path);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(second.status().message()), HasSubstr(absl::StrCat("pid ", getpid(), " on host ")));
  mine->reset();
  EXPECT_TRUE(RegistryLock::Acquire(path).ok());
  // Another registry file is another lock.
  EXPECT_TRUE(RegistryLock::Acquire(TempPath("other.db")).ok());
  for (int fd : {ready[0], ready[1], done[0], done[1]}) close(fd);
}

// Rollout k: register release-k and walk it to ACTIVE, then drain and retire release-(k-1). Every
// call carries a deterministic request id, so re-running a rollout after a crash is idempotent.
// `ack` is called after each committed call.
template <typename Ack>
absl::Status RollOut(ReleaseStore& store, int k, Ack ack) {
  const std::string id = absl::StrCat("release-", k);
  if (auto r = store.Register(absl::StrCat(id, ":register"), id, absl::StrCat("sha256:", k)); !r.ok())
    return r.status();
  ack(absl::StrCat(id, ":register"));
  auto step = [&](const std::string& rid, ReleaseState to) -> absl::Status {
    const std::string req = absl::StrCat(rid, ":", ReleaseStateName(to));
    auto t = store.Transition(req, rid, to, absl::StrCat("rollout ", k));
    if (!t.ok()) return t.status();
    ack(req);
    return absl::OkStatus();
  };
  for (ReleaseState to : {ReleaseState::kVerified, ReleaseState::kLoaded, ReleaseState::kShadow, ReleaseState::kCanary,
                          ReleaseState::kActive}) {
    if (absl::Status s = step(id, to); !s.ok()) return s;
  }
  if (k > 0) {
    const std::string prior = absl::StrCat("release-", k - 1);
    if (absl::Status s = step(prior, ReleaseState::kDraining); !s.ok()) return s;
    if (absl::Status s = step(prior, ReleaseState::kRetired); !s.ok()) return s;
  }
  return absl::OkStatus();
}

TEST(ReleaseStoreTest, WriterKilledTwentyTimesLosesNothingAndResumes) {
  const std::string path = TempPath("killed.db");
  std::mt19937 rng(20261129);
  int kills_mid_rollout = 0;
  for (int round = 0; round < 20; ++round) {
    int fds[2];
    ASSERT_EQ(pipe(fds), 0);
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      close(fds[0]);
      auto store = ReleaseStore::Open(path);
      if (!store.ok()) _exit(3);
      auto ack = [&](const std::string& req) {
        const std::string line = req + "\n";
        if (write(fds[1], line.data(), line.size()) != static_cast<ssize_t>(line.size())) _exit(4);
      };
      for (int k = static_cast<int>((*store)->List()->size());; ++k) {
        if (!RollOut(**store, k, ack).ok()) _exit(5);
      }
    }
    close(fds[1]);
    std::uniform_int_distribution<int> delay_us(2000, 40000);
    usleep(delay_us(rng));
    ASSERT_EQ(kill(pid, SIGKILL), 0);
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFSIGNALED(status)) << "writer exited by itself with " << WEXITSTATUS(status);
    std::string acked;
    char buf[4096];
    for (ssize_t n; (n = read(fds[0], buf, sizeof(buf))) > 0;) acked.append(buf, n);
    close(fds[0]);

    auto store = *ReleaseStore::Open(path);
    ASSERT_TRUE(store->Verify().ok()) << "round " << round << ": " << store->Verify();
    // Every acknowledged request is in the file.
    std::set<std::string> committed;
    const auto history = *store->History("");
    for (const StoredTransition& t : history) committed.insert(t.request_id);
    const auto releases = *store->List();
    for (const ReleaseRecord& r : releases) committed.insert(r.release_id + ":register");
    for (absl::string_view req : absl::StrSplit(acked, '\n', absl::SkipEmpty())) {
      EXPECT_TRUE(committed.count(std::string(req))) << "round " << round << ": acknowledged " << req << " is lost";
    }
    // Resume the interrupted rollout; committed steps replay to their recorded results.
    const int last = static_cast<int>(releases.size()) - 1;
    if (last >= 0) {
      const auto before = store->History("")->size();
      ASSERT_TRUE(RollOut(*store, last, [](const std::string&) {}).ok());
      if (store->History("")->size() != before) ++kills_mid_rollout;
    }
    // Exactly one ACTIVE release (the newest), every earlier one RETIRED: nothing retired early.
    const auto after = *store->List();
    for (const ReleaseRecord& r : after) {
      const bool newest = r.release_id == absl::StrCat("release-", last);
      EXPECT_EQ(r.state, newest ? ReleaseState::kActive : ReleaseState::kRetired) << r.release_id;
    }
    ASSERT_TRUE(store->Verify().ok());
  }
  // The kills landed inside rollouts, not only between them (otherwise the test proves little).
  EXPECT_GT(kills_mid_rollout, 5);
}

}  // namespace
}  // namespace moe
