// moectl: the operator CLI. Offline subcommands (no controller needed):
//   moectl plan --trace FILE [--json] [--selector POLICY]
//   moectl eplb solve --input FILE
//   moectl --controller HOST:PORT --token_file F releases list|show ID, release register|transition,
//          promote, rollback   (controller subcommands, see docs/cli.md)
// Bad input prints one message naming the field and exits 2.
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include <google/protobuf/util/json_util.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

#include "control/eplb_io.h"
#include "control/moectl_remote.h"
#include "control/placement_report.h"
#include "control/trace.h"
#include "rpc/placement_proto.h"
#include "runtime/checkpoint/expert_checkpoint.h"
#include "runtime/checkpoint/safetensors.h"
#include "runtime/checkpoint/synthetic.h"
#include "runtime/logging.h"
#include "runtime/placement/default_placement.h"
#include "runtime/placement/migration.h"
#include "runtime/status.h"

ABSL_FLAG(std::string, trace, "", "plan: layer-step trace JSON (docs/trace-format.md)");
ABSL_FLAG(std::string, input, "", "eplb solve: load JSON {weight, num_replicas, num_groups, num_nodes, num_gpus}");
ABSL_FLAG(bool, json, false, "print machine-readable JSON instead of tables");
ABSL_FLAG(int, experts, 16, "checkpoint synth: logical experts");
ABSL_FLAG(int, d, 256, "checkpoint synth: hidden width");
ABSL_FLAG(int, d_ff, 512, "checkpoint synth: expert FFN width");
ABSL_FLAG(int64_t, seed, 1, "checkpoint synth: weight seed");
ABSL_FLAG(std::string, version, "checkpoint-0001", "checkpoint synth: checkpoint version");
ABSL_FLAG(std::string, out, "",
          "checkpoint synth: output .safetensors path; rebalance: PlacementManifest JSON to write");
ABSL_FLAG(std::string, controller, "", "controller subcommands: moe-controller address host:port");
ABSL_FLAG(std::string, token_file, "", "controller subcommands: file holding the bearer token");
ABSL_FLAG(std::string, request_id, "",
          "controller subcommands: idempotency key (random when empty; reuse it to retry)");
ABSL_FLAG(std::string, digest, "", "release register: bundle digest");
ABSL_FLAG(std::string, reason, "", "release transition / rollback: reason recorded with the transition");
ABSL_FLAG(std::string, evidence, "",
          "promote: JSON file with the promotion gate's inputs (PromotionEvidence); empty: the controller reads the "
          "ranks' counters");
ABSL_FLAG(std::string, manifest, "", "placement load: PlacementManifest JSON (moectl placement synth writes one)");
ABSL_FLAG(int, world, 4, "placement synth: ranks in the expert-parallel group");
ABSL_FLAG(int, extra_replicas, 2, "placement synth: extra replicas of the first experts");
ABSL_FLAG(int64_t, placement_version, 2, "placement synth, rebalance --out: generation number");
ABSL_FLAG(int64_t, epoch, 1, "placement synth: process-group epoch (moe-rankd --epoch)");
ABSL_FLAG(std::string, checkpoint, "",
          "placement synth, rebalance --out: the checkpoint whose digests the slots carry");
ABSL_FLAG(std::string, from, "", "placement diff: the current placement (PlacementManifest JSON)");
ABSL_FLAG(std::string, to, "", "placement diff: the next placement (PlacementManifest JSON)");
ABSL_FLAG(int64_t, expert_bytes, 0, "placement diff: bytes of one expert copy (or give --checkpoint)");
ABSL_FLAG(int64_t, budget_bytes, 0, "placement diff: fail (exit 2) when the overlap's peak exceeds this");
ABSL_FLAG(bool, dry_run, false, "rebalance: plan only (required)");
ABSL_FLAG(int, num_replicas, 0, "rebalance: physical slots of the new placement (0: current, rounded to the ranks)");
ABSL_FLAG(int, num_groups, 1, "rebalance: expert groups (EPLB hierarchical policy)");
ABSL_FLAG(int, num_nodes, 1, "rebalance: nodes (EPLB hierarchical policy)");
ABSL_FLAG(std::string, prior, "", "rollback: the DRAINING release to re-activate");
ABSL_FLAG(int64_t, min_shadow, 100, "rollout: shadow samples every rank must count before CANARY");
ABSL_FLAG(int64_t, min_canary, 200, "rollout: canary steps every rank must count before the promotion");
ABSL_FLAG(int64_t, after, 0, "watch: start after this transition seq (0: the whole history)");
ABSL_FLAG(int, count, 0, "watch: stop after this many transitions (0: until interrupted)");
ABSL_FLAG(int, timeout_s, 0, "watch: stop after this many seconds (0: never); drain: give up after (default 60)");
ABSL_FLAG(std::string, selector, "locality-first",
          "plan: replica selector for routes without physical_slot (locality-first, least-load, round-robin, hash)");

namespace {

constexpr char kUsage[] =
    "moectl: operator CLI of moe-runtime.\n"
    "  moectl plan --trace FILE [--json] [--selector POLICY]   plan a layer-step trace, print plan and ledgers\n"
    "  moectl eplb solve --input FILE                          solve expert placement (EPLB) as JSON\n"
    "  moectl checkpoint synth --experts E --d D --d_ff F --seed S --out FILE\n"
    "                                                          write a synthetic safetensors checkpoint\n"
    "Controller subcommands (need --controller HOST:PORT --token_file FILE; --json for scripts):\n"
    "  moectl releases list | releases show ID                 releases, states, transition history\n"
    "  moectl release register ID --digest D                   register a release bundle (BUILT)\n"
    "  moectl release transition ID STATE --reason R           one lifecycle transition\n"
    "  moectl promote ID [--evidence FILE]                     CANARY -> ACTIVE through the promotion gate (inputs\n"
    "                                                          from FILE, or from the ranks' counters without it)\n"
    "  moectl rollback ID --prior PRIOR [--reason R]           stop ID, re-activate PRIOR (drain + retire ID on the "
    "ranks)\n"
    "  moectl drain ID [--reason R] [--timeout_s S]            stop a non-serving release, wait for its handles, "
    "retire it\n"
    "  moectl rollout ID --manifest F [--digest D] [--min_shadow N --min_canary N] [--evidence F] [--timeout_s S]\n"
    "                                                          register .. load .. shadow .. canary .. promote "
    "(resumable)\n"
    "  moectl watch [ID] [--after SEQ] [--count N] [--timeout_s S] [--json]  transitions as they commit\n"
    "  moectl placement load ID --manifest FILE                prepare a placement on every rank (VERIFIED -> LOADED)\n"
    "  moectl status                                           every rank's generations and handles\n"
    "  moectl rebalance --dry_run [--num_replicas Q] [--out F --checkpoint C --placement_version V]\n"
    "                                                          EPLB over the ranks' observed load, balancedness "
    "before/after\n"
    "  moectl placement synth --checkpoint F --world P --extra_replicas N --placement_version V\n"
    "                                                          (offline) a PlacementManifest JSON for placement load\n"
    "  moectl placement show --manifest F --world P            (offline) a placement's slots\n"
    "  moectl placement diff --from A --to B --world P (--checkpoint C | --expert_bytes N) [--budget_bytes B]\n"
    "                                                          (offline) the migration plan and its peak memory\n";

// Logs a failure and returns its exit code (never called with OK).
int Fail(const absl::Status& s) {
  spdlog::error("{}", std::string(s.message()));
  return moe::ExitCode(s);
}

// The ranks' topology for every subcommand that needs one: the local cluster's two nodes.
moe::Topology ClusterTopology(int num_ranks) { return moe::TwoNodeTopology(num_ranks); }

int Plan() {
  const std::string path = absl::GetFlag(FLAGS_trace);
  if (path.empty()) return Fail(absl::InvalidArgumentError("--trace: required"));
  auto selector = moe::ParseSelectorPolicy(absl::GetFlag(FLAGS_selector));
  if (!selector.ok()) return Fail(selector.status());
  auto doc = moe::json::ParseFile(path);
  if (!doc.ok()) return Fail(doc.status());
  auto trace = moe::ParseTrace(*doc);
  if (!trace.ok()) return Fail(absl::Status(trace.status().code(), absl::StrCat(path, ": ", trace.status().message())));
  auto report = moe::PlanTrace(*trace, *selector);
  if (!report.ok())
    return Fail(absl::Status(report.status().code(), absl::StrCat(path, ": ", report.status().message())));
  if (absl::GetFlag(FLAGS_json)) {
    std::cout << report->dump(2) << "\n";
  } else {
    std::cout << moe::RenderPlanText(*report);
  }
  return moe::kExitOk;
}

int EplbSolve() {
  const std::string path = absl::GetFlag(FLAGS_input);
  if (path.empty()) return Fail(absl::InvalidArgumentError("--input: required"));
  auto doc = moe::json::ParseFile(path);
  if (!doc.ok()) return Fail(doc.status());
  auto problem = moe::ParseEplbProblem(*doc);
  if (!problem.ok())
    return Fail(absl::Status(problem.status().code(), absl::StrCat(path, ": ", problem.status().message())));
  auto solution = moe::RebalanceExperts(*problem);
  if (!solution.ok())
    return Fail(absl::Status(solution.status().code(), absl::StrCat(path, ": ", solution.status().message())));
  std::cout << moe::EplbSolutionJson(*solution).dump() << "\n";
  return moe::kExitOk;
}

int CheckpointSynth() {
  const std::string out = absl::GetFlag(FLAGS_out);
  if (out.empty()) return Fail(absl::InvalidArgumentError("--out: required"));
  const int e = absl::GetFlag(FLAGS_experts), d = absl::GetFlag(FLAGS_d), f = absl::GetFlag(FLAGS_d_ff);
  if (e <= 0 || d <= 0 || f <= 0 || d % 8 != 0 || f % 8 != 0) {
    return Fail(absl::InvalidArgumentError("--experts, --d, --d_ff: must be positive, d and d_ff multiples of 8"));
  }
  const auto file = moe::SyntheticCheckpoint({e, d, f}, static_cast<uint64_t>(absl::GetFlag(FLAGS_seed)),
                                             absl::GetFlag(FLAGS_version));
  absl::Status s = moe::WriteSafetensors(out, file);
  if (!s.ok()) return Fail(s);
  std::cout << "wrote " << out << ": " << e << " experts, d=" << d << ", d_ff=" << f << ", "
            << file.metadata.at(moe::checkpoint_keys::kVersion) << "\n";
  return moe::kExitOk;
}

// The default placement moe-rankd builds for itself (DefaultPlacement), at another version and
// replica count, as PlacementManifest JSON for `moectl placement load`.
int PlacementSynth() {
  auto ckpt = moe::ReadSafetensors(absl::GetFlag(FLAGS_checkpoint));
  if (!ckpt.ok()) return Fail(absl::InvalidArgumentError(absl::StrCat("--checkpoint: ", ckpt.status().message())));
  auto view = moe::ExpertCheckpoint::Open(*ckpt);
  if (!view.ok()) return Fail(absl::InvalidArgumentError(absl::StrCat("--checkpoint: ", view.status().message())));
  const int experts = view->num_experts();
  const int world = absl::GetFlag(FLAGS_world);
  if (world <= 0) return Fail(absl::InvalidArgumentError("--world: must be positive"));
  const moe::Topology topology = ClusterTopology(world);
  const moe::ProcessGroup group = moe::LocalClusterGroup(world, absl::GetFlag(FLAGS_epoch));
  auto m = moe::DefaultPlacement(moe::PlacementVersion(absl::GetFlag(FLAGS_placement_version)), experts,
                                 absl::GetFlag(FLAGS_extra_replicas), topology, group, ckpt->metadata);
  if (!m.ok()) return Fail(m.status());
  std::string json;
  google::protobuf::util::JsonPrintOptions o;
  o.add_whitespace = true;
  (void)google::protobuf::util::MessageToJsonString(moe::ManifestToProto(**m, topology), &json, o);
  std::cout << json;
  return moe::kExitOk;
}

absl::StatusOr<std::shared_ptr<const moe::PlacementManifest>> ReadManifest(const std::string& flag,
                                                                           const std::string& path,
                                                                           const moe::Topology& topology) {
  if (path.empty()) return absl::InvalidArgumentError(absl::StrCat(flag, ": required"));
  std::ifstream in(path);
  if (!in) return absl::InvalidArgumentError(absl::StrCat(flag, " ", path, ": cannot read"));
  std::stringstream buf;
  buf << in.rdbuf();
  moe::v1::PlacementManifest proto;
  if (auto s = google::protobuf::util::JsonStringToMessage(buf.str(), &proto); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(flag, " ", path, ": ", s.ToString()));
  }
  auto m = moe::ManifestFromProto(proto, topology);
  if (!m.ok()) return absl::Status(m.status().code(), absl::StrCat(flag, " ", path, ": ", m.status().message()));
  return m;
}

// `placement show --manifest F` and `placement diff --from A --to B`, offline, on the two-node
// topology of --world ranks (the local cluster's).
int PlacementOffline(const std::string& verb) {
  const int world = absl::GetFlag(FLAGS_world);
  if (world <= 0) return Fail(absl::InvalidArgumentError("--world: must be positive"));
  const moe::Topology topology = ClusterTopology(world);
  if (verb == "show") {
    auto m = ReadManifest("--manifest", absl::GetFlag(FLAGS_manifest), topology);
    if (!m.ok()) return Fail(m.status());
    std::cout << moe::RenderManifest(**m, topology);
    return moe::kExitOk;
  }
  auto from = ReadManifest("--from", absl::GetFlag(FLAGS_from), topology);
  if (!from.ok()) return Fail(from.status());
  auto to = ReadManifest("--to", absl::GetFlag(FLAGS_to), topology);
  if (!to.ok()) return Fail(to.status());
  int64_t expert_bytes = absl::GetFlag(FLAGS_expert_bytes);
  if (expert_bytes <= 0 && !absl::GetFlag(FLAGS_checkpoint).empty()) {
    auto ckpt = moe::ReadSafetensors(absl::GetFlag(FLAGS_checkpoint));
    if (!ckpt.ok()) return Fail(absl::InvalidArgumentError(absl::StrCat("--checkpoint: ", ckpt.status().message())));
    auto view = moe::ExpertCheckpoint::Open(*ckpt);
    if (!view.ok()) return Fail(absl::InvalidArgumentError(absl::StrCat("--checkpoint: ", view.status().message())));
    expert_bytes = int64_t{3} * view->d() * view->d_ff() * 2;  // gate, up and down in BF16
  }
  if (expert_bytes <= 0) return Fail(absl::InvalidArgumentError("--expert_bytes or --checkpoint: required"));
  auto plan = moe::PlanMigration(**from, **to, topology, expert_bytes);
  if (!plan.ok()) return Fail(plan.status());
  std::cout << moe::RenderMigration(**from, **to, *plan);
  const int64_t budget = absl::GetFlag(FLAGS_budget_bytes);
  if (budget > 0 && plan->peak_bytes > budget) {
    return Fail(absl::FailedPreconditionError(absl::StrCat("--budget_bytes: the overlap peaks at ", plan->peak_bytes,
                                                           " bytes, over the budget of ", budget)));
  }
  return moe::kExitOk;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(kUsage);
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  moe::InitLogging("moectl", "info");
  std::vector<std::string> cmd(args.begin() + 1, args.end());
  if (cmd.size() == 1 && cmd[0] == "plan") return Plan();
  if (cmd.size() == 2 && cmd[0] == "eplb" && cmd[1] == "solve") return EplbSolve();
  if (cmd.size() == 2 && cmd[0] == "checkpoint" && cmd[1] == "synth") return CheckpointSynth();
  if (cmd.size() == 2 && cmd[0] == "placement" && cmd[1] == "synth") return PlacementSynth();
  if (cmd.size() == 2 && cmd[0] == "placement" && (cmd[1] == "show" || cmd[1] == "diff")) {
    return PlacementOffline(cmd[1]);
  }
  if (moe::IsRemoteCommand(cmd)) {
    moe::RemoteOptions o;
    o.controller = absl::GetFlag(FLAGS_controller);
    o.token_file = absl::GetFlag(FLAGS_token_file);
    o.request_id = absl::GetFlag(FLAGS_request_id);
    o.json = absl::GetFlag(FLAGS_json);
    o.digest = absl::GetFlag(FLAGS_digest);
    o.reason = absl::GetFlag(FLAGS_reason);
    o.evidence = absl::GetFlag(FLAGS_evidence);
    o.prior = absl::GetFlag(FLAGS_prior);
    o.after_seq = absl::GetFlag(FLAGS_after);
    o.min_shadow = absl::GetFlag(FLAGS_min_shadow);
    o.min_canary = absl::GetFlag(FLAGS_min_canary);
    o.count = absl::GetFlag(FLAGS_count);
    o.timeout_s = absl::GetFlag(FLAGS_timeout_s);
    o.manifest = absl::GetFlag(FLAGS_manifest);
    o.dry_run = absl::GetFlag(FLAGS_dry_run);
    o.num_replicas = absl::GetFlag(FLAGS_num_replicas);
    o.num_groups = absl::GetFlag(FLAGS_num_groups);
    o.num_nodes = absl::GetFlag(FLAGS_num_nodes);
    o.out = absl::GetFlag(FLAGS_out);
    o.checkpoint = absl::GetFlag(FLAGS_checkpoint);
    o.placement_version = absl::GetFlag(FLAGS_placement_version);
    o.epoch = absl::GetFlag(FLAGS_epoch);
    o.topology = ClusterTopology;
    absl::Status s = moe::RunRemote(cmd, o);
    return s.ok() ? moe::kExitOk : Fail(s);
  }
  std::fputs(kUsage, stderr);
  return moe::kExitUsage;
}
