// moectl's controller subcommands: a thin gRPC client over ControlPlaneService.
#ifndef MOE_CONTROL_MOECTL_REMOTE_H_
#define MOE_CONTROL_MOECTL_REMOTE_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"

#include "rpc/tls.h"
#include "runtime/placement/topology.h"

namespace moe {

struct RemoteOptions {
  std::string controller;  // host:port
  std::string token_file;
  std::string request_id;  // generated when empty
  bool json = false;
  std::string digest;    // release register
  std::string bundle;    // release register: a release bundle JSON file (its digest is the release's)
  std::string reason;    // release transition, rollback
  std::string evidence;  // promote: JSON file of PromotionEvidence fields
  std::string prior;     // rollback
  std::string manifest;  // placement load: PlacementManifest JSON file
  // rebalance
  bool dry_run = false;
  int num_replicas = 0, num_groups = 1, num_nodes = 1;
  int window_s = 0;             // > 0: plan the routes counted over this many seconds (0: since each daemon started)
  std::string out, checkpoint;  // with --out: write the plan as a PlacementManifest JSON
  int64_t placement_version = 0, epoch = 1;
  // rebalance --out: the topology of the controller's `num_ranks` ranks, which the written
  // manifest places slots on. Set by the caller (moectl: the local cluster's); required there.
  std::function<Topology(int num_ranks)> topology;
  // watch: start after this transition seq; stop after `count` transitions (0: run until
  // interrupted) or `timeout_s` seconds (0: none). drain: give up after timeout_s (default 60).
  int64_t after_seq = 0;
  int count = 0;
  int timeout_s = 0;
  // Every unary call's deadline, seconds (moectl --timeout); 0: 10 s, 600 s for the long ones
  // (placement load, promote, rollback), which print a progress line every 5 s meanwhile.
  int rpc_timeout_s = 0;
  TlsFiles tls;  // --tls_cert / --tls_key / --tls_ca: mutual TLS to the controller (rpc/tls.h)
  // rollout: wait for this many shadow samples / canary steps on every rank before moving on
  // (the controller's gate thresholds).
  int64_t min_shadow = 100, min_canary = 200;
};

// Runs `cmd` (e.g. {"releases", "list"}); prints the result on stdout. NOT_FOUND-style
// usage errors name the missing argument. Returns the RPC's status.
absl::Status RunRemote(const std::vector<std::string>& cmd, const RemoteOptions& options);

// True when `cmd` names a controller subcommand.
bool IsRemoteCommand(const std::vector<std::string>& cmd);

}  // namespace moe

#endif  // MOE_CONTROL_MOECTL_REMOTE_H_
