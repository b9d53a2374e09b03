// moe-controller: the cluster's release registry. Serves ControlPlaneService (bearer-token
// authenticated), gRPC health (no reflection) on a loopback port by default, keeps every transition
// in a SQLite file (WAL) before answering, and exports Prometheus metrics read from that file.
#include <signal.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>

#include <grpcpp/grpcpp.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "prometheus/collectable.h"
#include "prometheus/metric_family.h"
#include "spdlog/spdlog.h"

#include "control/controller/control_plane_service.h"
#include "control/controller/group_coordinator.h"
#include "control/controller/reconciler.h"
#include "control/controller/release_manager.h"
#include "control/store/release_store.h"
#include "rpc/daemon_util.h"
#include "runtime/logging.h"
#include "runtime/placement/default_placement.h"
#include "runtime/status.h"

ABSL_FLAG(std::string, store, "", "SQLite file holding the release registry (created if missing)");
ABSL_FLAG(std::string, token_file, "", "file whose first line is the bearer token every RPC must carry");
ABSL_FLAG(std::string, read_token_file, "",
          "file whose first line is a read-only bearer token (optional): it is admitted by ClusterStatus, "
          "GetRelease, ListReleases, History, Watch and the process group's Status, and refused "
          "(PERMISSION_DENIED) by every RPC that writes");
ABSL_FLAG(int64_t, min_shadow, 100, "promotion gate: shadow samples required");
ABSL_FLAG(int64_t, min_canary, 200, "promotion gate: canary samples required");
ABSL_FLAG(double, max_drop_ratio, 0.005, "promotion gate: dropped / attempted routes");
ABSL_FLAG(double, max_fallback_ratio, 0.15, "promotion gate: fallback steps / steps");
ABSL_FLAG(std::string, ranks, "",
          "comma-separated host:port of every moe-rankd's RankAgentService, in rank order "
          "(empty: the controller keeps the registry only)");
ABSL_FLAG(int, world, 0,
          "form the ranks' process group here: ranks join with --controller (rendezvous, topology from their "
          "nodes, epochs re-formed when one is lost or replaced); N ranks (0: off; not with --ranks)");
ABSL_FLAG(int, survivor_grace_s, 0,
          "with --world: after a rank is lost and no replacement joined for this long, form an epoch over the "
          "survivors (when the placement needs the lost rank's slots, the survivors refuse it and the group waits); "
          "0: wait for a replacement");
ABSL_FLAG(int, adopt_grace_s, 10,
          "with --world, after a restart: how long to wait for the ranks of the epoch they still serve to rejoin, "
          "and adopt it without re-forming (0: always form a new epoch)");
ABSL_FLAG(std::string, agent_token_file, "",
          "bearer token for the rank agents (with --ranks or --world; the ranks join the group with it)");
ABSL_FLAG(int, drain_timeout_s, 60, "rollback: how long the ranks may take to drain a candidate's handles");
ABSL_FLAG(int64_t, migration_budget_bytes, 0,
          "placement load: refuse a placement whose migration from the active one peaks above this many bytes of "
          "expert weights (0: no admission check)");
ABSL_FLAG(int64_t, expert_bytes, 0,
          "bytes of one expert copy's parameters in one MoE layer (with --migration_budget_bytes; moectl checkpoint "
          "inspect prints it)");
ABSL_FLAG(int64_t, shadow_every, 4, "trials: in SHADOW, every Nth step also runs on the candidate and is compared");
ABSL_FLAG(int64_t, canary_every, 4, "trials: in CANARY, every Nth step is served by the candidate");
ABSL_FLAG(int64_t, max_shadow_mismatches, 0,
          "SHADOW -> CANARY is refused, and the candidate drained, when the ranks counted more shadow mismatches "
          "plus failed shadow passes of its placement than this (runner parity differs -> block canary)");
ABSL_FLAG(int64_t, auto_rollback_faults, 0,
          "with --ranks: roll the ACTIVE release back to the one its promotion drained once the ranks count this "
          "many faults of its placement (failed steps, count-conservation failures, stale accepts), checked every "
          "--reconcile_interval_s (0x0E: active candidate faults -> roll back); 0: off");
ABSL_FLAG(int, reconcile_interval_s, 5,
          "with --ranks: every N seconds, bring ranks that serve another placement than the ACTIVE release's (a "
          "restarted moe-rankd) back to it; 0: only at start and when an epoch of the process group serves");

namespace moe {
namespace {

// Scrape-time view of the store: releases per state and transitions committed, so the numbers
// are what the file says, also right after a restart. Labels are bounded (eight states).
class StoreCollector : public prometheus::Collectable {
 public:
  explicit StoreCollector(ReleaseStore* store) : store_(store) {}
  std::vector<prometheus::MetricFamily> Collect() const override {
    prometheus::MetricFamily releases{
        "moe_controller_releases", "releases by lifecycle state", prometheus::MetricType::Gauge, {}};
    prometheus::MetricFamily transitions{"moe_controller_transitions_total",
                                         "lifecycle transitions committed to the store, by target state",
                                         prometheus::MetricType::Counter,
                                         {}};
    std::map<ReleaseState, int64_t> by_state, by_target;
    if (auto list = store_->List(); list.ok()) {
      for (const ReleaseRecord& r : *list) ++by_state[r.state];
    }
    if (auto history = store_->History(""); history.ok()) {
      for (const StoredTransition& t : *history) ++by_target[t.to];
    }
    for (ReleaseState s :
         {ReleaseState::kBuilt, ReleaseState::kVerified, ReleaseState::kLoaded, ReleaseState::kShadow,
          ReleaseState::kCanary, ReleaseState::kActive, ReleaseState::kDraining, ReleaseState::kRetired}) {
      prometheus::ClientMetric g;
      g.label = {{"state", ReleaseStateName(s)}};
      g.gauge.value = static_cast<double>(by_state[s]);
      releases.metric.push_back(g);
      prometheus::ClientMetric c;
      c.label = {{"to", ReleaseStateName(s)}};
      c.counter.value = static_cast<double>(by_target[s]);
      transitions.metric.push_back(c);
    }
    return {releases, transitions};
  }

 private:
  ReleaseStore* store_;
};

// moe-controller's flags, checked.
struct ControllerOptions {
  std::string store_path;
  std::string token;
  std::string read_token;  // --read_token_file; empty: none
  PromotionThresholds thresholds;
  bool ranks_given = false;        // false: the controller keeps the registry only
  std::vector<std::string> ranks;  // --ranks (may still be empty: "," names no rank)
  int world = 0;                   // --world: the process group formed here
  absl::Duration survivor_grace;
  absl::Duration adopt_grace;
  std::string agent_token;  // with --ranks
  absl::Duration drain_timeout;
  MigrationBudget migration;
  TrialPolicy trial;
  int reconcile_interval_s = 0;
  TlsFiles tls;  // --tls_*: mutual TLS on the controller's port and toward the rank agents
};

// --token_file and --store (INVALID_ARGUMENT naming the flag).
absl::Status ParseRegistryFlags(ControllerOptions* o) {
  ASSIGN_OR_RETURN(o->token, ReadTokenFile(absl::GetFlag(FLAGS_token_file), "--token_file"));
  if (!absl::GetFlag(FLAGS_read_token_file).empty()) {
    ASSIGN_OR_RETURN(o->read_token, ReadTokenFile(absl::GetFlag(FLAGS_read_token_file), "--read_token_file"));
    if (o->read_token == o->token) {
      return absl::InvalidArgumentError(
          "--read_token_file: holds the same token as --token_file (a read-only "
          "token must be another one)");
    }
  }
  o->store_path = absl::GetFlag(FLAGS_store);
  if (o->store_path.empty()) return absl::InvalidArgumentError("--store: required");
  o->tls = {absl::GetFlag(FLAGS_tls_cert), absl::GetFlag(FLAGS_tls_key), absl::GetFlag(FLAGS_tls_ca)};
  RETURN_IF_ERROR(CheckTlsFiles(o->tls));
  return absl::OkStatus();
}

// The gate's thresholds and the rank agents' flags (INVALID_ARGUMENT naming the flag).
absl::Status ParseRankFlags(ControllerOptions* o) {
  o->thresholds.min_shadow = absl::GetFlag(FLAGS_min_shadow);
  o->thresholds.min_canary = absl::GetFlag(FLAGS_min_canary);
  o->thresholds.max_drop_ratio = absl::GetFlag(FLAGS_max_drop_ratio);
  o->thresholds.max_fallback_ratio = absl::GetFlag(FLAGS_max_fallback_ratio);
  o->ranks_given = !absl::GetFlag(FLAGS_ranks).empty();
  o->ranks = absl::StrSplit(absl::GetFlag(FLAGS_ranks), ',', absl::SkipEmpty());
  o->world = absl::GetFlag(FLAGS_world);
  if (o->world < 0 || o->world > 4096) return absl::InvalidArgumentError("--world: expected 0 .. 4096");
  if (o->world > 0 && o->ranks_given) return absl::InvalidArgumentError("--world / --ranks: give one of them");
  if (absl::GetFlag(FLAGS_survivor_grace_s) < 0) return absl::InvalidArgumentError("--survivor_grace_s: must be >= 0");
  o->survivor_grace = absl::Seconds(absl::GetFlag(FLAGS_survivor_grace_s));
  if (absl::GetFlag(FLAGS_adopt_grace_s) < 0) return absl::InvalidArgumentError("--adopt_grace_s: must be >= 0");
  o->adopt_grace = absl::Seconds(absl::GetFlag(FLAGS_adopt_grace_s));
  if (o->ranks_given || o->world > 0) {
    ASSIGN_OR_RETURN(o->agent_token, ReadTokenFile(absl::GetFlag(FLAGS_agent_token_file), "--agent_token_file"));
    if (!o->read_token.empty() && o->read_token == o->agent_token) {
      return absl::InvalidArgumentError(
          "--read_token_file: holds the same token as --agent_token_file (a "
          "read-only token must not let its holder join the group as a rank)");
    }
  }
  o->drain_timeout = absl::Seconds(absl::GetFlag(FLAGS_drain_timeout_s));
  o->migration = {absl::GetFlag(FLAGS_migration_budget_bytes), absl::GetFlag(FLAGS_expert_bytes)};
  if (o->migration.budget_bytes > 0 && o->migration.expert_bytes <= 0) {
    return absl::InvalidArgumentError("--expert_bytes: required with --migration_budget_bytes");
  }
  o->trial = {absl::GetFlag(FLAGS_shadow_every), absl::GetFlag(FLAGS_canary_every),
              absl::GetFlag(FLAGS_max_shadow_mismatches), absl::GetFlag(FLAGS_auto_rollback_faults)};
  if (o->trial.shadow_every <= 0 || o->trial.canary_every <= 0) {
    return absl::InvalidArgumentError("--shadow_every / --canary_every: must be positive");
  }
  if (o->trial.max_shadow_mismatches < 0) return absl::InvalidArgumentError("--max_shadow_mismatches: must be >= 0");
  if (o->trial.auto_rollback_faults < 0) return absl::InvalidArgumentError("--auto_rollback_faults: must be >= 0");
  o->reconcile_interval_s = absl::GetFlag(FLAGS_reconcile_interval_s);
  return absl::OkStatus();
}

// The registry file, held by this process for its lifetime.
struct Registry {
  std::unique_ptr<RegistryLock> lock;
  std::unique_ptr<ReleaseStore> store;
};

// Locks, opens and verifies the registry; the error's message is the whole log line.
absl::StatusOr<Registry> OpenRegistry(const std::string& path) {
  Registry registry;
  // One writer per registry, for the process lifetime: a second controller on the same file
  // would accept writes this one does not serialize with.
  auto lock = RegistryLock::Acquire(path);
  if (!lock.ok()) {
    return absl::Status(lock.status().code(),
                        absl::StrCat("--store: ", lock.status().message(), "; refusing to start"));
  }
  registry.lock = std::move(*lock);
  auto store = ReleaseStore::Open(path);
  if (!store.ok()) return absl::Status(store.status().code(), absl::StrCat("--store: ", store.status().message()));
  registry.store = std::move(*store);
  if (absl::Status s = registry.store->Verify(); !s.ok()) {
    return absl::Status(s.code(),
                        absl::StrCat("--store ", path, ": refusing to serve an inconsistent registry: ", s.message()));
  }
  return registry;
}

// The rank agents of --ranks, or of the group formed here (--world); null without either.
std::unique_ptr<AgentPool> ConnectAgents(const ControllerOptions& o) {
  if (o.world > 0) {
    return std::make_unique<AgentPool>(o.world, o.agent_token, absl::Seconds(30), ChannelCredentials(o.tls));
  }
  if (!o.ranks_given) return nullptr;
  return std::make_unique<AgentPool>(o.ranks, o.agent_token, absl::Seconds(30), ChannelCredentials(o.tls));
}

// The topology the controller's placements are written in (slots' domains there are labels; the
// pool binds each manifest to the nodes of the epoch the ranks serve before it is sent).
std::optional<Topology> AgentTopology(const AgentPool* agents) {
  if (agents == nullptr || agents->empty()) return std::nullopt;
  return TwoNodeTopology(agents->world());
}

// The agents of a formed epoch, as the pool drives them.
AgentGroup GroupOfView(const v1::GroupView& view) {
  AgentGroup g;
  g.epoch = view.epoch();
  g.addresses.assign(view.world(), "");
  for (const v1::GroupMember& m : view.members()) {
    if (m.rank() >= 0 && m.rank() < view.world()) g.addresses[m.rank()] = m.agent_address();
  }
  g.node_of_rank.assign(view.node_of_rank().begin(), view.node_of_rank().end());
  return g;
}

// Logs the failure and returns `exit_code`.
int Fail(const absl::Status& s, int exit_code) {
  spdlog::error("{}", std::string(s.message()));
  return exit_code;
}

int Main() {
  ControllerOptions o;
  if (absl::Status s = ParseRegistryFlags(&o); !s.ok()) return Fail(s, ExitCode(s));
  // Registry and metrics failures exit 1 whatever their code (a held registry lock included).
  auto registry = OpenRegistry(o.store_path);
  if (!registry.ok()) return Fail(registry.status(), kExitFailure);
  auto exposer = StartExposer(absl::GetFlag(FLAGS_metrics_listen), absl::GetFlag(FLAGS_metrics_port_file));
  if (!exposer.ok()) return Fail(exposer.status(), kExitFailure);
  auto collector = std::make_shared<StoreCollector>(registry->store.get());  // the exposer holds it weakly
  (*exposer)->RegisterCollectable(collector);
  const auto build_info = BuildInfoRegistry("moe_build_info", {{"component", "moe-controller"}});
  (*exposer)->RegisterCollectable(build_info);
  sigset_t signals = BlockTerminationSignals();
  // Under systemd (Type=notify, deploy/systemd): READY once serving, a watchdog.
  const char* notify_env = std::getenv("NOTIFY_SOCKET");
  const std::string notify = notify_env == nullptr ? "" : notify_env;
  const auto watchdog = StartSdWatchdog(notify, SdWatchdogInterval(std::getenv("WATCHDOG_USEC")));
  if (absl::Status s = ParseRankFlags(&o); !s.ok()) return Fail(s, ExitCode(s));
  std::unique_ptr<AgentPool> agents = ConnectAgents(o);
  StoreReleaseManager manager(registry->store.get(), o.thresholds, agents.get(), AgentTopology(agents.get()),
                              o.drain_timeout, o.migration, o.trial);
  ControlPlaneServiceImpl service(&manager, o.token, o.read_token);
  // A rank agent that restarted re-registers its generations through the reconcile: every
  // --reconcile_interval_s, and at once when an epoch of the group serves.
  std::unique_ptr<Reconciler> reconciler;
  if (agents != nullptr && !agents->empty()) {
    reconciler = std::make_unique<Reconciler>([&manager] { return manager.Reconcile(); },
                                              absl::Seconds(std::max(0, o.reconcile_interval_s)));
  }
  // The process group formed here (--world): its own connection to the registry file records
  // the epochs; each epoch that serves re-drives the ACTIVE placement onto its ranks.
  std::unique_ptr<ReleaseStore> epoch_store;
  std::unique_ptr<GroupCoordinator> group;
  if (o.world > 0) {
    auto store = ReleaseStore::Open(o.store_path);
    if (!store.ok()) return Fail(store.status(), kExitFailure);
    epoch_store = *std::move(store);
    GroupCoordinatorOptions go;
    go.world = o.world;
    go.token = o.agent_token;
    go.operator_token = o.token;
    go.read_token = o.read_token;
    go.store = epoch_store.get();
    go.survivor_grace = o.survivor_grace;
    go.adopt_grace = o.adopt_grace;
    AgentPool* pool = agents.get();
    Reconciler* r = reconciler.get();
    // On the coordinator's tick thread: the reconcile itself waits for the manager's writer lock
    // (a LoadPlacement may hold it for minutes), so it runs on the reconciler's thread.
    go.on_ready = [pool, r](const v1::GroupView& view) {
      pool->SetGroup(GroupOfView(view));
      if (r != nullptr) r->Kick();
    };
    group = std::make_unique<GroupCoordinator>(std::move(go));
  }
  if (absl::Status s = manager.Reconcile(); !s.ok()) {
    spdlog::warn("reconcile with the rank agents: {} (the next promote / rollback retry re-drives them)",
                 std::string(s.message()));
  }
  int port = 0;
  GrpcServeOptions serve;
  serve.listen = absl::GetFlag(FLAGS_listen);
  serve.tls = o.tls;
  serve.keepalive = group != nullptr;  // the ranks' Join streams
  std::vector<grpc::Service*> services = {&service};
  if (group != nullptr) services.push_back(group.get());
  // The probes' port first: no rank's Join stream is open yet if it cannot be bound.
  auto health = ServeHealthOnly(absl::GetFlag(FLAGS_health_listen));
  if (!health.ok()) return Fail(health.status(), kExitFailure);
  auto server = ServeGrpc(services, serve, &port);
  if (!server.ok()) return Fail(server.status(), kExitFailure);
  WriteFileAtomically(absl::GetFlag(FLAGS_port_file), absl::StrCat(port));
  SdNotify(notify, absl::StrCat("READY=1\nSTATUS=serving on port ", port));
  auto releases = registry->store->List();
  spdlog::info("serving on port {} (metrics on {}), {} releases in {} (single writer: {}), {} rank agents", port,
               (*exposer)->GetListeningPorts().at(0), releases.ok() ? releases->size() : 0, o.store_path,
               registry->lock->path(), agents == nullptr ? 0 : agents->addresses().size());
  int sig = 0;
  sigwait(&signals, &sig);
  spdlog::info("signal {}: shutting down", sig);
  SdNotify(notify, "STOPPING=1");
  SetHealth({server->get(), health->get()}, "", false);
  if (group != nullptr) group->Shutdown();  // returns after the last on_ready (its tick thread joined)
  reconciler.reset();                       // waits for a reconcile in progress
  (*server)->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  if (health->get() != nullptr) health->get()->Shutdown(std::chrono::system_clock::now());
  return kExitOk;
}

}  // namespace
}  // namespace moe

int main(int argc, char** argv) {
  moe::DisableMutexDeadlockDetection();
  absl::ParseCommandLine(argc, argv);
  moe::InitLogging("moe-controller", absl::GetFlag(FLAGS_log_level));
  return moe::Main();
}
