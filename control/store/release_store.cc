#include "control/store/release_store.h"

#include <errno.h>
#include <fcntl.h>
#include <unistd.h>

#include <cstring>
#include <map>
#include <set>
#include <utility>

#include <sqlite3.h>
#include <sys/file.h>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

#include "runtime/status.h"

namespace moe {

namespace {

constexpr const char* kSchema = R"sql(
CREATE TABLE IF NOT EXISTS releases (
  release_id    TEXT PRIMARY KEY,
  bundle_digest TEXT NOT NULL,
  state         TEXT NOT NULL,
  revision      INTEGER NOT NULL,
  placement_version INTEGER NOT NULL DEFAULT 0,
  placement_manifest BLOB
);
CREATE TABLE IF NOT EXISTS transitions (
  seq        INTEGER PRIMARY KEY AUTOINCREMENT,
  request_id TEXT NOT NULL,
  part       INTEGER NOT NULL,
  release_id TEXT NOT NULL REFERENCES releases(release_id),
  from_state TEXT NOT NULL,
  to_state   TEXT NOT NULL,
  reason     TEXT NOT NULL,
  UNIQUE (request_id, part)
);
CREATE TABLE IF NOT EXISTS bundles (
  release_id TEXT PRIMARY KEY REFERENCES releases(release_id),
  bundle     TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS group_epochs (
  epoch      INTEGER PRIMARY KEY,
  reason     TEXT NOT NULL,
  peers      TEXT NOT NULL,
  created_ms INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS requests (
  request_id  TEXT PRIMARY KEY,
  fingerprint TEXT NOT NULL
);
)sql";

absl::Status SqlError(sqlite3* db, const std::string& what) {
  return absl::InternalError(absl::StrCat("sqlite: ", what, ": ", sqlite3_errmsg(db)));
}

// One prepared statement, finalized on scope exit.
class Stmt {
 public:
  Stmt(sqlite3* db, const char* sql) : db_(db) { rc_ = sqlite3_prepare_v2(db, sql, -1, &stmt_, nullptr); }
  ~Stmt() { sqlite3_finalize(stmt_); }
  Stmt(const Stmt&) = delete;
  Stmt& operator=(const Stmt&) = delete;

  absl::Status status() const { return rc_ == SQLITE_OK ? absl::OkStatus() : SqlError(db_, "prepare"); }
  Stmt& Bind(int i, const std::string& v) {
    sqlite3_bind_text(stmt_, i, v.data(), static_cast<int>(v.size()), SQLITE_TRANSIENT);
    return *this;
  }
  Stmt& Bind(int i, int64_t v) {
    sqlite3_bind_int64(stmt_, i, v);
    return *this;
  }
  // true: a row is available; false: done.
  absl::StatusOr<bool> Step() {
    if (rc_ != SQLITE_OK) return status();
    const int rc = sqlite3_step(stmt_);
    if (rc == SQLITE_ROW) return true;
    if (rc == SQLITE_DONE) return false;
    return SqlError(db_, "step");
  }
  std::string Text(int col) const {
    const unsigned char* p = sqlite3_column_text(stmt_, col);
    return p == nullptr ? std::string() : std::string(reinterpret_cast<const char*>(p));
  }
  int64_t Int(int col) const { return sqlite3_column_int64(stmt_, col); }

 private:
  sqlite3* db_;
  sqlite3_stmt* stmt_ = nullptr;
  int rc_;
};

absl::Status Exec(sqlite3* db, const char* sql) {
  char* err = nullptr;
  if (sqlite3_exec(db, sql, nullptr, nullptr, &err) != SQLITE_OK) {
    std::string msg = err != nullptr ? err : "unknown";
    sqlite3_free(err);
    return absl::InternalError(absl::StrCat("sqlite: ", msg));
  }
  return absl::OkStatus();
}

// The schema a registry file is at (PRAGMA user_version). 0: a file of a build before the number
// was kept, whose releases table may lack the placement columns added since; 2: kSchema.
constexpr int64_t kSchemaVersion = 2;

absl::Status MigrateSchema(sqlite3* db, const std::string& path);

// BEGIN IMMEDIATE ... COMMIT; rolls back unless Commit() succeeded.
class WriteTxn {
 public:
  explicit WriteTxn(sqlite3* db) : db_(db) { begin_ = Exec(db, "BEGIN IMMEDIATE"); }
  ~WriteTxn() {
    if (begin_.ok() && !committed_) Exec(db_, "ROLLBACK").IgnoreError();
  }
  const absl::Status& begin() const { return begin_; }
  absl::Status Commit() {
    absl::Status s = Exec(db_, "COMMIT");
    committed_ = s.ok();
    return s;
  }

 private:
  sqlite3* db_;
  absl::Status begin_;
  bool committed_ = false;
};

constexpr const char* kReleaseColumns =
    "SELECT release_id, bundle_digest, state, revision, placement_version, placement_manifest FROM releases";

// Every row of `q` (selecting kReleaseColumns), in its order.
absl::StatusOr<std::vector<ReleaseRecord>> ReadReleases(Stmt& q) {
  std::vector<ReleaseRecord> out;
  while (true) {
    auto row = q.Step();
    if (!row.ok()) return row.status();
    if (!*row) break;
    ReleaseRecord r;
    r.release_id = q.Text(0);
    r.bundle_digest = q.Text(1);
    auto state = ParseReleaseState(q.Text(2));
    if (!state.ok()) {
      return absl::InternalError(absl::StrCat("stored state of ", r.release_id, ": ", state.status().message()));
    }
    r.state = *state;
    r.revision = q.Int(3);
    r.placement_version = q.Int(4);
    r.placement_manifest = q.Text(5);
    out.push_back(std::move(r));
  }
  return out;
}

absl::StatusOr<ReleaseRecord> ReadRelease(sqlite3* db, const std::string& release_id) {
  Stmt q(db, absl::StrCat(kReleaseColumns, " WHERE release_id = ?").c_str());
  q.Bind(1, release_id);
  auto rows = ReadReleases(q);
  if (!rows.ok()) return rows.status();
  if (rows->empty()) return absl::NotFoundError(absl::StrCat("release_id: no release '", release_id, "'"));
  return std::move(rows->front());
}

// The fingerprint recorded for a request id; empty when the id is new.
absl::StatusOr<std::string> RecordedFingerprint(sqlite3* db, const std::string& request_id) {
  Stmt q(db, "SELECT fingerprint FROM requests WHERE request_id = ?");
  q.Bind(1, request_id);
  auto row = q.Step();
  if (!row.ok()) return row.status();
  return *row ? q.Text(0) : std::string();
}

absl::Status RecordRequest(sqlite3* db, const std::string& request_id, const std::string& fingerprint) {
  Stmt ins(db, "INSERT INTO requests(request_id, fingerprint) VALUES (?, ?)");
  ins.Bind(1, request_id).Bind(2, fingerprint);
  return ins.Step().status();
}

absl::StatusOr<std::vector<StoredTransition>> ReadTransitions(Stmt& q) {
  std::vector<StoredTransition> out;
  while (true) {
    auto row = q.Step();
    if (!row.ok()) return row.status();
    if (!*row) break;
    StoredTransition t;
    t.seq = q.Int(0);
    t.request_id = q.Text(1);
    t.part = static_cast<int>(q.Int(2));
    t.release_id = q.Text(3);
    auto from = ParseReleaseState(q.Text(4));
    auto to = ParseReleaseState(q.Text(5));
    if (!from.ok() || !to.ok())
      return absl::InternalError(absl::StrCat("transition seq ", t.seq, ": bad stored state"));
    t.from = *from;
    t.to = *to;
    t.reason = q.Text(6);
    out.push_back(std::move(t));
  }
  return out;
}

}  // namespace

absl::Status RequireRequestId(const std::string& request_id) {
  if (request_id.empty()) return absl::InvalidArgumentError("request_id: required (requests are idempotent by it)");
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<RegistryLock>> RegistryLock::Acquire(const std::string& store_path) {
  if (store_path.empty()) return absl::InvalidArgumentError("path: the registry lock needs the store's path");
  const std::string path = absl::StrCat(store_path, ".lock");
  const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("cannot open ", path, ": ", std::strerror(errno)));
  if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    std::string holder;
    if (err == EWOULDBLOCK) {
      char buf[512];
      const ssize_t n = pread(fd, buf, sizeof(buf) - 1, 0);
      if (n > 0) holder.assign(buf, static_cast<size_t>(n));
    }
    close(fd);
    if (err != EWOULDBLOCK) return absl::UnavailableError(absl::StrCat("cannot lock ", path, ": ", std::strerror(err)));
    holder = std::string(absl::StripAsciiWhitespace(holder));
    return absl::FailedPreconditionError(absl::StrCat("registry ", store_path, " is held by another moe-controller (",
                                                      holder.empty() ? "holder unknown" : holder, "; lock file ", path,
                                                      "): one controller writes a registry"));
  }
  // Ours: say who holds it (the previous holder's line, if any, is stale: its lock is gone).
  char host[256] = {0};
  if (gethostname(host, sizeof(host) - 1) != 0) std::strcpy(host, "unknown");
  const std::string who = absl::StrCat("pid ", getpid(), " on host ", host, "\n");
  if (ftruncate(fd, 0) != 0 || pwrite(fd, who.data(), who.size(), 0) != static_cast<ssize_t>(who.size())) {
    const int err = errno;
    close(fd);  // releases the lock
    return absl::UnavailableError(absl::StrCat("cannot write ", path, ": ", std::strerror(err)));
  }
  fsync(fd);
  return std::unique_ptr<RegistryLock>(new RegistryLock(path, fd));
}

RegistryLock::~RegistryLock() { close(fd_); }

absl::StatusOr<std::unique_ptr<ReleaseStore>> ReleaseStore::Open(const std::string& path) {
  if (path.empty() || path == ":memory:") {
    return absl::InvalidArgumentError("path: the release store needs a file on disk");
  }
  sqlite3* db = nullptr;
  if (sqlite3_open_v2(path.c_str(), &db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_FULLMUTEX, nullptr) !=
      SQLITE_OK) {
    absl::Status s = absl::UnavailableError(absl::StrCat("path: cannot open ", path, ": ", sqlite3_errmsg(db)));
    sqlite3_close(db);
    return s;
  }
  sqlite3_busy_timeout(db, 5000);
  for (const char* pragma : {"PRAGMA journal_mode=WAL", "PRAGMA synchronous=FULL", "PRAGMA foreign_keys=ON"}) {
    if (absl::Status s = Exec(db, pragma); !s.ok()) {
      sqlite3_close(db);
      return s;
    }
  }
  if (absl::Status s = MigrateSchema(db, path); !s.ok()) {
    sqlite3_close(db);
    return s;
  }
  // The readers' connection, opened once the file is in WAL mode and at the current schema.
  sqlite3* read_db = nullptr;
  if (sqlite3_open_v2(path.c_str(), &read_db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_FULLMUTEX, nullptr) != SQLITE_OK) {
    absl::Status s = absl::UnavailableError(absl::StrCat("path: cannot open ", path, ": ", sqlite3_errmsg(read_db)));
    sqlite3_close(read_db);
    sqlite3_close(db);
    return s;
  }
  std::unique_ptr<ReleaseStore> store(new ReleaseStore(db, read_db));
  sqlite3_busy_timeout(read_db, 5000);
  if (absl::Status s = Exec(read_db, "PRAGMA query_only=ON"); !s.ok()) return s;
  return store;
}

namespace {

// Creates what is missing and brings an older file to kSchemaVersion in one transaction; a file
// of a newer build is refused (FAILED_PRECONDITION) before anything is written to it.
absl::Status MigrateSchema(sqlite3* db, const std::string& path) {
  WriteTxn txn(db);
  if (!txn.begin().ok()) return txn.begin();
  int64_t version = 0;
  {
    Stmt v(db, "PRAGMA user_version");
    ASSIGN_OR_RETURN(bool row, v.Step());
    if (row) version = v.Int(0);
  }
  if (version > kSchemaVersion) {
    return absl::FailedPreconditionError(absl::StrCat("path: ", path, " is at registry schema ", version,
                                                      ", written by a newer moe-controller (this one reads up to ",
                                                      kSchemaVersion, ")"));
  }
  if (version == kSchemaVersion) return txn.Commit();
  RETURN_IF_ERROR(Exec(db, kSchema));
  // Columns added to releases after its first version (CREATE TABLE IF NOT EXISTS keeps an old table).
  std::set<std::string> columns;
  {
    Stmt info(db, "PRAGMA table_info(releases)");
    while (true) {
      ASSIGN_OR_RETURN(bool more, info.Step());
      if (!more) break;
      columns.insert(info.Text(1));
    }
  }
  if (columns.count("placement_version") == 0) {
    RETURN_IF_ERROR(Exec(db, "ALTER TABLE releases ADD COLUMN placement_version INTEGER NOT NULL DEFAULT 0"));
  }
  if (columns.count("placement_manifest") == 0) {
    RETURN_IF_ERROR(Exec(db, "ALTER TABLE releases ADD COLUMN placement_manifest BLOB"));
  }
  RETURN_IF_ERROR(Exec(db, absl::StrCat("PRAGMA user_version = ", kSchemaVersion).c_str()));
  return txn.Commit();
}

}  // namespace

ReleaseStore::~ReleaseStore() {
  sqlite3_close(read_db_);
  sqlite3_close(db_);
}

absl::StatusOr<ReleaseRecord> ReleaseStore::Register(const std::string& request_id, const std::string& release_id,
                                                     const std::string& bundle_digest, const std::string& bundle) {
  if (absl::Status s = RequireRequestId(request_id); !s.ok()) return s;
  if (release_id.empty()) return absl::InvalidArgumentError("release_id: required");
  if (bundle_digest.empty()) return absl::InvalidArgumentError("bundle_digest: required");
  const std::string fingerprint = absl::StrCat("register|", release_id, "|", bundle_digest);
  absl::MutexLock lock(&write_mu_);
  WriteTxn txn(db_);
  if (!txn.begin().ok()) return txn.begin();
  auto recorded = RecordedFingerprint(db_, request_id);
  if (!recorded.ok()) return recorded.status();
  if (!recorded->empty() && *recorded != fingerprint) {
    return absl::AlreadyExistsError(absl::StrCat("request_id: '", request_id, "' was used for another request"));
  }
  auto existing = ReadRelease(db_, release_id);
  if (existing.ok()) {
    if (existing->bundle_digest != bundle_digest) {
      return absl::AlreadyExistsError(
          absl::StrCat("release_id: '", release_id, "' is registered with bundle digest ", existing->bundle_digest));
    }
    // A repeat that brings a bundle must find that bundle stored: one registered with the digest
    // only was never checked against a bundle (VERIFIED, LoadPlacement), and is not made so now.
    if (!bundle.empty()) {
      ASSIGN_OR_RETURN(const std::string stored, Bundle(release_id));
      if (stored.empty()) {
        return absl::AlreadyExistsError(absl::StrCat("bundle_json: '", release_id,
                                                     "' is registered with its digest only, without a bundle; "
                                                     "register the bundle under a new release id"));
      }
    }
    return existing;  // idempotent repeat
  }
  if (existing.status().code() != absl::StatusCode::kNotFound) return existing.status();
  Stmt ins(db_, "INSERT INTO releases(release_id, bundle_digest, state, revision) VALUES (?, ?, ?, 0)");
  ins.Bind(1, release_id).Bind(2, bundle_digest).Bind(3, std::string(ReleaseStateName(ReleaseState::kBuilt)));
  if (auto s = ins.Step(); !s.ok()) return s.status();
  if (!bundle.empty()) {
    Stmt bins(db_, "INSERT INTO bundles(release_id, bundle) VALUES (?, ?)");
    bins.Bind(1, release_id).Bind(2, bundle);
    if (auto s = bins.Step(); !s.ok()) return s.status();
  }
  if (recorded->empty()) {
    if (absl::Status s = RecordRequest(db_, request_id, fingerprint); !s.ok()) return s;
  }
  if (before_commit_) before_commit_();
  if (absl::Status s = txn.Commit(); !s.ok()) return s;
  return ReleaseRecord{release_id, bundle_digest, ReleaseState::kBuilt, 0};
}

absl::StatusOr<int64_t> ReleaseStore::LastEpoch() const {
  auto last = LastEpochPeers();
  if (!last.ok()) return last.status();
  return last->first;
}

absl::StatusOr<std::pair<int64_t, std::string>> ReleaseStore::LastEpochPeers() const {
  absl::MutexLock lock(&read_mu_);
  Stmt q(read_db_, "SELECT epoch, peers FROM group_epochs ORDER BY epoch DESC LIMIT 1");
  auto row = q.Step();
  if (!row.ok()) return row.status();
  if (!*row) return std::make_pair(int64_t{0}, std::string());
  return std::make_pair(q.Int(0), q.Text(1));
}

absl::Status ReleaseStore::RecordEpoch(int64_t epoch, const std::string& reason, const std::string& peers,
                                       int64_t created_ms) {
  absl::MutexLock lock(&write_mu_);
  Stmt q(db_, "INSERT INTO group_epochs (epoch, reason, peers, created_ms) VALUES (?, ?, ?, ?)");
  q.Bind(1, epoch).Bind(2, reason).Bind(3, peers).Bind(4, created_ms);
  auto row = q.Step();
  return row.ok() ? absl::OkStatus() : row.status();
}

absl::StatusOr<std::string> ReleaseStore::Bundle(const std::string& release_id) const {
  absl::MutexLock lock(&read_mu_);
  Stmt q(read_db_, "SELECT bundle FROM bundles WHERE release_id = ?");
  q.Bind(1, release_id);
  auto row = q.Step();
  if (!row.ok()) return row.status();
  return *row ? q.Text(0) : std::string();
}

absl::StatusOr<StoredTransition> ReleaseStore::Transition(const std::string& request_id, const std::string& release_id,
                                                          ReleaseState to, const std::string& reason) {
  auto applied = Apply(request_id, {Move{release_id, to, reason}});
  if (!applied.ok()) return applied.status();
  if (applied->size() != 1) {
    return absl::AlreadyExistsError(absl::StrCat("request_id: '", request_id, "' was used for another request"));
  }
  return applied->front();
}

absl::StatusOr<std::vector<StoredTransition>> ReleaseStore::Apply(const std::string& request_id,
                                                                  const std::vector<Move>& moves) {
  if (absl::Status s = RequireRequestId(request_id); !s.ok()) return s;
  if (moves.empty()) return absl::InvalidArgumentError("moves: at least one transition");
  std::string fingerprint = "transition";
  for (const Move& m : moves) {
    if (m.release_id.empty()) return absl::InvalidArgumentError("release_id: required");
    // Before the replay lookup and any read: a reasonless batch is refused as such, whatever else
    // is wrong with it (CheckTransition below then finds every reason present).
    if (absl::Status s = CheckTransitionReason(m.reason); !s.ok()) return s;
    absl::StrAppend(&fingerprint, "|", m.release_id, "|", ReleaseStateName(m.to), "|", m.reason, "|",
                    m.placement_version);
  }
  absl::MutexLock lock(&write_mu_);
  WriteTxn txn(db_);
  if (!txn.begin().ok()) return txn.begin();
  auto recorded = RecordedFingerprint(db_, request_id);
  if (!recorded.ok()) return recorded.status();
  if (!recorded->empty()) {
    if (*recorded != fingerprint) {
      return absl::AlreadyExistsError(absl::StrCat("request_id: '", request_id, "' was used for another request"));
    }
    return Recorded(request_id);  // idempotent repeat: the recorded result
  }
  // Check the whole batch against the stored states before writing any of it.
  std::map<std::string, ReleaseState> state;
  std::vector<StoredTransition> out;
  for (const Move& m : moves) {
    if (!state.count(m.release_id)) {
      auto rec = ReadRelease(db_, m.release_id);
      if (!rec.ok()) return rec.status();
      state[m.release_id] = rec->state;
    }
    const ReleaseState from = state[m.release_id];
    if (absl::Status s = CheckTransition(m.release_id, from, m.to, m.reason); !s.ok()) return s;
    state[m.release_id] = m.to;
    out.push_back(StoredTransition{0, request_id, static_cast<int>(out.size()), m.release_id, from, m.to, m.reason});
  }
  for (StoredTransition& t : out) {
    Stmt ins(db_,
             "INSERT INTO transitions(request_id, part, release_id, from_state, to_state, reason) "
             "VALUES (?, ?, ?, ?, ?, ?)");
    ins.Bind(1, request_id)
        .Bind(2, static_cast<int64_t>(t.part))
        .Bind(3, t.release_id)
        .Bind(4, std::string(ReleaseStateName(t.from)))
        .Bind(5, std::string(ReleaseStateName(t.to)))
        .Bind(6, t.reason);
    if (auto s = ins.Step(); !s.ok()) return s.status();
    t.seq = sqlite3_last_insert_rowid(db_);
    Stmt upd(db_,
             "UPDATE releases SET state = ?, revision = revision + 1, "
             "placement_version = CASE WHEN ? > 0 THEN ? ELSE placement_version END, "
             "placement_manifest = CASE WHEN ? > 0 THEN ? ELSE placement_manifest END WHERE release_id = ?");
    const int64_t placement = moves[t.part].placement_version;
    upd.Bind(1, std::string(ReleaseStateName(t.to)))
        .Bind(2, placement)
        .Bind(3, placement)
        .Bind(4, placement)
        .Bind(5, moves[t.part].placement_manifest)
        .Bind(6, t.release_id);
    if (auto s = upd.Step(); !s.ok()) return s.status();
  }
  if (absl::Status s = RecordRequest(db_, request_id, fingerprint); !s.ok()) return s;
  if (before_commit_) before_commit_();
  if (absl::Status s = txn.Commit(); !s.ok()) return s;
  return out;
}

absl::StatusOr<bool> ReleaseStore::HasRequest(const std::string& request_id) const {
  absl::MutexLock lock(&read_mu_);
  ASSIGN_OR_RETURN(const std::string fingerprint, RecordedFingerprint(read_db_, request_id));
  return !fingerprint.empty();
}

absl::StatusOr<std::vector<StoredTransition>> ReleaseStore::Recorded(const std::string& request_id) const {
  absl::MutexLock lock(&read_mu_);
  Stmt q(read_db_,
         "SELECT seq, request_id, part, release_id, from_state, to_state, reason FROM transitions "
         "WHERE request_id = ? ORDER BY part");
  q.Bind(1, request_id);
  return ReadTransitions(q);
}

absl::StatusOr<ReleaseRecord> ReleaseStore::Get(const std::string& release_id) const {
  absl::MutexLock lock(&read_mu_);
  return ReadRelease(read_db_, release_id);
}

namespace {

absl::StatusOr<std::vector<ReleaseRecord>> ListOn(sqlite3* db) {
  Stmt q(db, absl::StrCat(kReleaseColumns, " ORDER BY release_id").c_str());
  return ReadReleases(q);
}

absl::StatusOr<std::vector<StoredTransition>> HistoryOn(sqlite3* db, const std::string& release_id, int64_t after_seq) {
  if (release_id.empty()) {
    Stmt q(db,
           "SELECT seq, request_id, part, release_id, from_state, to_state, reason FROM transitions WHERE seq > ? "
           "ORDER BY seq");
    q.Bind(1, after_seq);
    return ReadTransitions(q);
  }
  Stmt q(db,
         "SELECT seq, request_id, part, release_id, from_state, to_state, reason FROM transitions WHERE release_id = ? "
         "AND seq > ? ORDER BY seq");
  q.Bind(1, release_id);
  q.Bind(2, after_seq);
  return ReadTransitions(q);
}

}  // namespace

absl::StatusOr<std::vector<ReleaseRecord>> ReleaseStore::List() const {
  absl::MutexLock lock(&read_mu_);
  return ListOn(read_db_);
}

absl::StatusOr<std::vector<StoredTransition>> ReleaseStore::History(const std::string& release_id,
                                                                    int64_t after_seq) const {
  absl::MutexLock lock(&read_mu_);
  return HistoryOn(read_db_, release_id, after_seq);
}

absl::Status ReleaseStore::Verify() const {
  absl::MutexLock lock(&read_mu_);
  // One read transaction: the releases and their histories from the same committed snapshot.
  RETURN_IF_ERROR(Exec(read_db_, "BEGIN"));
  absl::Status s = VerifyOn(read_db_);
  Exec(read_db_, "COMMIT").IgnoreError();
  return s;
}

absl::Status ReleaseStore::VerifyOn(sqlite3* db) {
  {
    Stmt q(db, "PRAGMA integrity_check");
    auto row = q.Step();
    if (!row.ok()) return row.status();
    if (!*row || q.Text(0) != "ok") return absl::InternalError(absl::StrCat("integrity_check: ", q.Text(0)));
  }
  auto releases = ListOn(db);
  if (!releases.ok()) return releases.status();
  for (const ReleaseRecord& r : *releases) {
    auto history = HistoryOn(db, r.release_id, 0);
    if (!history.ok()) return history.status();
    ReleaseState state = ReleaseState::kBuilt;
    for (const StoredTransition& t : *history) {
      if (t.from != state || !LegalTransition(t.from, t.to)) {
        return absl::InternalError(absl::StrCat(r.release_id, ": transition seq ", t.seq, " ", ReleaseStateName(t.from),
                                                " -> ", ReleaseStateName(t.to), " does not follow ",
                                                ReleaseStateName(state)));
      }
      state = t.to;
    }
    if (state != r.state || static_cast<int64_t>(history->size()) != r.revision) {
      return absl::InternalError(absl::StrCat(r.release_id, ": stored state ", ReleaseStateName(r.state), " rev ",
                                              r.revision, " but history ends at ", ReleaseStateName(state), " after ",
                                              history->size()));
    }
  }
  return absl::OkStatus();
}

}  // namespace moe
