// moe-controller: the cluster's release registry. Serves ControlPlaneService (bearer-token
// authenticated), gRPC health (no reflection) on a loopback port by default, keeps every transition
// in a SQLite file (WAL) before answering, and exports Prometheus metrics read from that file.
#include <signal.h>

#include <memory>
#include <optional>
#include <string>
#include <thread>

#include <grpcpp/grpcpp.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"
#include "prometheus/collectable.h"
#include "prometheus/metric_family.h"
#include "spdlog/spdlog.h"

#include "control/controller/control_plane_service.h"
#include "control/controller/release_manager.h"
#include "control/store/release_store.h"
#include "rpc/daemon_util.h"
#include "runtime/logging.h"
#include "runtime/placement/default_placement.h"
#include "runtime/status.h"

ABSL_FLAG(std::string, store, "", "SQLite file holding the release registry (created if missing)");
ABSL_FLAG(std::string, token_file, "", "file whose first line is the bearer token every RPC must carry");
ABSL_FLAG(int64_t, min_shadow, 100, "promotion gate: shadow samples required");
ABSL_FLAG(int64_t, min_canary, 200, "promotion gate: canary samples required");
ABSL_FLAG(double, max_drop_ratio, 0.005, "promotion gate: dropped / attempted routes");
ABSL_FLAG(double, max_fallback_ratio, 0.15, "promotion gate: fallback steps / steps");
ABSL_FLAG(std::string, ranks, "",
          "comma-separated host:port of every moe-rankd's RankAgentService, in rank order "
          "(empty: the controller keeps the registry only)");
ABSL_FLAG(std::string, agent_token_file, "", "bearer token for the rank agents (with --ranks)");
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
ABSL_FLAG(int, reconcile_interval_s, 5,
          "with --ranks: every N seconds, bring ranks that serve another placement than the ACTIVE release's (a "
          "restarted moe-rankd) back to it; 0: only at start");

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
  PromotionThresholds thresholds;
  bool ranks_given = false;        // false: the controller keeps the registry only
  std::vector<std::string> ranks;  // --ranks (may still be empty: "," names no rank)
  std::string agent_token;         // with --ranks
  absl::Duration drain_timeout;
  MigrationBudget migration;
  TrialPolicy trial;
  int reconcile_interval_s = 0;
  TlsFiles tls;  // --tls_*: mutual TLS on the controller's port and toward the rank agents
};

// --token_file and --store (INVALID_ARGUMENT naming the flag).
absl::Status ParseRegistryFlags(ControllerOptions* o) {
  ASSIGN_OR_RETURN(o->token, ReadTokenFile(absl::GetFlag(FLAGS_token_file), "--token_file"));
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
  if (o->ranks_given) {
    ASSIGN_OR_RETURN(o->agent_token, ReadTokenFile(absl::GetFlag(FLAGS_agent_token_file), "--agent_token_file"));
  }
  o->drain_timeout = absl::Seconds(absl::GetFlag(FLAGS_drain_timeout_s));
  o->migration = {absl::GetFlag(FLAGS_migration_budget_bytes), absl::GetFlag(FLAGS_expert_bytes)};
  if (o->migration.budget_bytes > 0 && o->migration.expert_bytes <= 0) {
    return absl::InvalidArgumentError("--expert_bytes: required with --migration_budget_bytes");
  }
  o->trial = {absl::GetFlag(FLAGS_shadow_every), absl::GetFlag(FLAGS_canary_every),
              absl::GetFlag(FLAGS_max_shadow_mismatches)};
  if (o->trial.shadow_every <= 0 || o->trial.canary_every <= 0) {
    return absl::InvalidArgumentError("--shadow_every / --canary_every: must be positive");
  }
  if (o->trial.max_shadow_mismatches < 0) return absl::InvalidArgumentError("--max_shadow_mismatches: must be >= 0");
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

// The rank agents of --ranks (null without).
std::unique_ptr<AgentPool> ConnectAgents(const ControllerOptions& o) {
  if (!o.ranks_given) return nullptr;
  return std::make_unique<AgentPool>(o.ranks, o.agent_token, absl::Seconds(30), ChannelCredentials(o.tls));
}

// The agents' topology: the local cluster's two nodes, until the controller is told its ranks'.
std::optional<Topology> AgentTopology(const AgentPool* agents) {
  if (agents == nullptr || agents->empty()) return std::nullopt;
  return TwoNodeTopology(static_cast<int>(agents->addresses().size()));
}

// Periodic reconcile: a rank agent that restarted re-registers its generations here. Returns a
// thread that is not joinable when there is nothing to reconcile.
std::thread StartReconciler(ReleaseManager* manager, const AgentPool* agents, int interval_s,
                            absl::Notification* stopping) {
  if (agents == nullptr || agents->empty() || interval_s <= 0) return std::thread();
  return std::thread([manager, interval_s, stopping] {
    std::string last;
    while (!stopping->WaitForNotificationWithTimeout(absl::Seconds(interval_s))) {
      const absl::Status s = manager->Reconcile();
      const std::string now = s.ok() ? "" : std::string(s.message());
      if (now != last && !s.ok()) spdlog::warn("reconcile: {}", now);  // each new failure once
      last = now;
    }
  });
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
  sigset_t signals = BlockTerminationSignals();
  if (absl::Status s = ParseRankFlags(&o); !s.ok()) return Fail(s, ExitCode(s));
  std::unique_ptr<AgentPool> agents = ConnectAgents(o);
  StoreReleaseManager manager(registry->store.get(), o.thresholds, agents.get(), AgentTopology(agents.get()),
                              o.drain_timeout, o.migration, o.trial);
  ControlPlaneServiceImpl service(&manager, o.token);
  if (absl::Status s = manager.Reconcile(); !s.ok()) {
    spdlog::warn("reconcile with the rank agents: {} (the next promote / rollback retry re-drives them)",
                 std::string(s.message()));
  }
  int port = 0;
  GrpcServeOptions serve;
  serve.listen = absl::GetFlag(FLAGS_listen);
  serve.tls = o.tls;
  auto server = ServeGrpc({&service}, serve, &port);
  if (!server.ok()) return Fail(server.status(), kExitFailure);
  WriteFileAtomically(absl::GetFlag(FLAGS_port_file), absl::StrCat(port));
  auto releases = registry->store->List();
  spdlog::info("serving on port {} (metrics on {}), {} releases in {} (single writer: {}), {} rank agents", port,
               (*exposer)->GetListeningPorts().at(0), releases.ok() ? releases->size() : 0, o.store_path,
               registry->lock->path(), agents == nullptr ? 0 : agents->addresses().size());
  absl::Notification stopping;
  std::thread reconciler = StartReconciler(&manager, agents.get(), o.reconcile_interval_s, &stopping);
  int sig = 0;
  sigwait(&signals, &sig);
  spdlog::info("signal {}: shutting down", sig);
  stopping.Notify();
  if (reconciler.joinable()) reconciler.join();
  (*server)->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
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
