// moe-controller: the cluster's release registry. Serves ControlPlaneService (bearer-token
// authenticated), gRPC health (no reflection) on a loopback port by default, keeps every transition
// in a SQLite file (WAL) before answering, and exports Prometheus metrics read from that file.
#include <signal.h>

#include <memory>
#include <string>
#include <thread>

#include <grpcpp/grpcpp.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"
#include "control/controller/control_plane_service.h"
#include "control/store/release_store.h"
#include "prometheus/collectable.h"
#include "prometheus/metric_family.h"
#include "runtime/logging.h"
#include "rpc/daemon_util.h"
#include "spdlog/spdlog.h"

ABSL_FLAG(std::string, store, "", "SQLite file holding the release registry (created if missing)");
ABSL_FLAG(std::string, token_file, "", "file whose first line is the bearer token every RPC must carry");
ABSL_FLAG(int64_t, min_shadow, 100, "promotion gate: shadow samples required");
ABSL_FLAG(int64_t, min_canary, 200, "promotion gate: canary samples required");
ABSL_FLAG(double, max_drop_ratio, 0.005, "promotion gate: dropped / attempted routes");
ABSL_FLAG(double, max_fallback_ratio, 0.15, "promotion gate: fallback steps / steps");
ABSL_FLAG(std::string, ranks, "", "comma-separated host:port of every moe-rankd's RankAgentService, in rank order "
          "(empty: the controller keeps the registry only)");
ABSL_FLAG(std::string, agent_token_file, "", "bearer token for the rank agents (with --ranks)");
ABSL_FLAG(int, drain_timeout_s, 60, "rollback: how long the ranks may take to drain a candidate's handles");
ABSL_FLAG(int64_t, migration_budget_bytes, 0,
          "placement load: refuse a placement whose migration from the active one peaks above this many bytes of "
          "expert weights (0: no admission check)");
ABSL_FLAG(int64_t, expert_bytes, 0, "bytes of one expert copy's parameters (with --migration_budget_bytes)");
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
    prometheus::MetricFamily releases{"moe_controller_releases", "releases by lifecycle state",
                                      prometheus::MetricType::Gauge, {}};
    prometheus::MetricFamily transitions{"moe_controller_transitions_total",
                                         "lifecycle transitions committed to the store, by target state",
                                         prometheus::MetricType::Counter, {}};
    std::map<ReleaseState, int64_t> by_state, by_target;
    if (auto list = store_->List(); list.ok()) {
      for (const ReleaseRecord& r : *list) ++by_state[r.state];
    }
    if (auto history = store_->History(""); history.ok()) {
      for (const StoredTransition& t : *history) ++by_target[t.to];
    }
    for (ReleaseState s : {ReleaseState::kBuilt, ReleaseState::kVerified, ReleaseState::kLoaded, ReleaseState::kShadow,
                           ReleaseState::kCanary, ReleaseState::kActive, ReleaseState::kDraining,
                           ReleaseState::kRetired}) {
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

int Main() {
  auto token = ReadTokenFile(absl::GetFlag(FLAGS_token_file), "--token_file");
  if (!token.ok()) {
    spdlog::error("{}", std::string(token.status().message()));
    return 2;
  }
  if (absl::GetFlag(FLAGS_store).empty()) {
    spdlog::error("--store: required");
    return 2;
  }
  // One writer per registry, for the process lifetime: a second controller on the same file
  // would accept writes this one does not serialize with.
  auto lock = RegistryLock::Acquire(absl::GetFlag(FLAGS_store));
  if (!lock.ok()) {
    spdlog::error("--store: {}; refusing to start", std::string(lock.status().message()));
    return 1;
  }
  auto store = ReleaseStore::Open(absl::GetFlag(FLAGS_store));
  if (!store.ok()) {
    spdlog::error("--store: {}", std::string(store.status().message()));
    return 1;
  }
  if (absl::Status s = (*store)->Verify(); !s.ok()) {
    spdlog::error("--store {}: refusing to serve an inconsistent registry: {}", absl::GetFlag(FLAGS_store),
                  std::string(s.message()));
    return 1;
  }
  auto exposer = StartExposer(absl::GetFlag(FLAGS_metrics_listen), absl::GetFlag(FLAGS_metrics_port_file));
  if (!exposer.ok()) {
    spdlog::error("{}", std::string(exposer.status().message()));
    return 1;
  }
  auto collector = std::make_shared<StoreCollector>(store->get());
  (*exposer)->RegisterCollectable(collector);
  sigset_t signals = BlockTerminationSignals();

  PromotionThresholds thresholds;
  thresholds.min_shadow = absl::GetFlag(FLAGS_min_shadow);
  thresholds.min_canary = absl::GetFlag(FLAGS_min_canary);
  thresholds.max_drop_ratio = absl::GetFlag(FLAGS_max_drop_ratio);
  thresholds.max_fallback_ratio = absl::GetFlag(FLAGS_max_fallback_ratio);
  std::unique_ptr<AgentPool> agents;
  if (!absl::GetFlag(FLAGS_ranks).empty()) {
    auto agent_token = ReadTokenFile(absl::GetFlag(FLAGS_agent_token_file), "--agent_token_file");
    if (!agent_token.ok()) {
      spdlog::error("{}", std::string(agent_token.status().message()));
      return 2;
    }
    agents = std::make_unique<AgentPool>(absl::StrSplit(absl::GetFlag(FLAGS_ranks), ',', absl::SkipEmpty()),
                                         *agent_token);
  }
  MigrationBudget migration{absl::GetFlag(FLAGS_migration_budget_bytes), absl::GetFlag(FLAGS_expert_bytes)};
  if (migration.budget_bytes > 0 && migration.expert_bytes <= 0) {
    spdlog::error("--expert_bytes: required with --migration_budget_bytes");
    return 2;
  }
  TrialPolicy trial{absl::GetFlag(FLAGS_shadow_every), absl::GetFlag(FLAGS_canary_every),
                    absl::GetFlag(FLAGS_max_shadow_mismatches)};
  if (trial.shadow_every <= 0 || trial.canary_every <= 0) {
    spdlog::error("--shadow_every / --canary_every: must be positive");
    return 2;
  }
  if (trial.max_shadow_mismatches < 0) {
    spdlog::error("--max_shadow_mismatches: must be >= 0");
    return 2;
  }
  ControlPlaneServiceImpl service(store->get(), *token, thresholds, agents.get(),
                                  absl::Seconds(absl::GetFlag(FLAGS_drain_timeout_s)), migration, trial);
  if (absl::Status s = service.Reconcile(); !s.ok()) {
    spdlog::warn("reconcile with the rank agents: {} (the next promote / rollback retry re-drives them)",
                 std::string(s.message()));
  }
  int port = 0;
  GrpcServeOptions serve;
  serve.listen = absl::GetFlag(FLAGS_listen);
  auto server = ServeGrpc({&service}, serve, &port);
  if (!server.ok()) {
    spdlog::error("{}", std::string(server.status().message()));
    return 1;
  }
  WriteFileAtomically(absl::GetFlag(FLAGS_port_file), absl::StrCat(port));
  auto releases = (*store)->List();
  spdlog::info("serving on port {} (metrics on {}), {} releases in {} (single writer: {}), {} rank agents", port,
               (*exposer)->GetListeningPorts().at(0), releases.ok() ? releases->size() : 0, absl::GetFlag(FLAGS_store),
               (*lock)->path(), agents == nullptr ? 0 : agents->addresses().size());
  // Periodic reconcile: a rank agent that restarted re-registers its generations here.
  absl::Notification stopping;
  std::thread reconciler;
  const int interval = absl::GetFlag(FLAGS_reconcile_interval_s);
  if (agents != nullptr && !agents->empty() && interval > 0) {
    reconciler = std::thread([&] {
      std::string last;
      while (!stopping.WaitForNotificationWithTimeout(absl::Seconds(interval))) {
        const absl::Status s = service.Reconcile();
        const std::string now = s.ok() ? "" : std::string(s.message());
        if (now != last && !s.ok()) spdlog::warn("reconcile: {}", now);  // each new failure once
        last = now;
      }
    });
  }
  int sig = 0;
  sigwait(&signals, &sig);
  spdlog::info("signal {}: shutting down", sig);
  stopping.Notify();
  if (reconciler.joinable()) reconciler.join();
  (*server)->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  return 0;
}

}  // namespace
}  // namespace moe

int main(int argc, char** argv) {
  moe::DisableMutexDeadlockDetection();
  absl::ParseCommandLine(argc, argv);
  moe::InitLogging("moe-controller", absl::GetFlag(FLAGS_log_level));
  return moe::Main();
}
