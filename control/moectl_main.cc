// moectl: the operator CLI. Offline subcommands (no controller needed):
//   moectl plan --trace FILE [--json] [--selector POLICY]
//   moectl eplb solve --input FILE
//   moectl overlap --input FILE
//   moectl --controller HOST:PORT --token_file F releases list|show ID, release register|transition,
//          promote, rollback   (controller subcommands, see docs/cli.md)
// Bad input prints one message naming the field and exits 2.
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include <google/protobuf/util/json_util.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"

#include "control/bundle.h"
#include "control/eplb_io.h"
#include "control/json_util.h"
#include "control/moectl_remote.h"
#include "control/overlap_io.h"
#include "control/placement_report.h"
#include "control/trace.h"
#include "rpc/placement_proto.h"
#include "runtime/checkpoint/checkpoint_reader.h"
#include "runtime/checkpoint/expert_checkpoint.h"
#include "runtime/checkpoint/expert_loader.h"
#include "runtime/checkpoint/hf_checkpoint.h"
#include "runtime/checkpoint/hf_writer.h"
#include "runtime/checkpoint/safetensors.h"
#include "runtime/checkpoint/synthetic.h"
#include "runtime/logging.h"
#include "runtime/placement/default_placement.h"
#include "runtime/placement/migration.h"
#include "runtime/status.h"

ABSL_FLAG(std::string, trace, "", "plan: layer-step trace JSON (docs/trace-format.md)");
ABSL_FLAG(std::string, input, "",
          "eplb solve: load JSON {weight, num_replicas, num_groups, num_nodes, num_gpus}; overlap: {tasks, buffers, "
          "...} (docs/trace-format.md)");
ABSL_FLAG(bool, json, false, "print machine-readable JSON instead of tables");
ABSL_FLAG(int, experts, 16, "checkpoint synth: logical experts");
ABSL_FLAG(int, d, 256, "checkpoint synth: hidden width");
ABSL_FLAG(int, d_ff, 512, "checkpoint synth: expert FFN width");
ABSL_FLAG(int64_t, seed, 1, "checkpoint synth: weight seed");
ABSL_FLAG(std::string, version, "checkpoint-0001", "checkpoint synth: checkpoint version");
ABSL_FLAG(std::string, out, "",
          "checkpoint synth: output directory (a .safetensors file with --layers 0); rebalance: PlacementManifest "
          "JSON to write");
ABSL_FLAG(int, layers, 1,
          "checkpoint synth: decoder layers of the Hugging Face layout model it writes (0: the older single-file "
          "checkpoint instead)");
ABSL_FLAG(std::string, family, "qwen3_moe",
          "checkpoint synth --layers: model_type (mixtral, qwen2_moe, qwen3_moe, deepseek_v2, deepseek_v3)");
ABSL_FLAG(std::string, dtype, "BF16", "checkpoint synth --layers: weight dtype (BF16, F32, F16, F8_E4M3)");
ABSL_FLAG(int, top_k, 2, "checkpoint synth --layers: num_experts_per_tok");
ABSL_FLAG(int, first_dense, 0, "checkpoint synth --layers: leading dense layers (deepseek first_k_dense_replace)");
ABSL_FLAG(int64_t, shard_mb, 0, "checkpoint synth --layers: split the weights into shards of this many MB");
ABSL_FLAG(std::string, controller, "",
          "controller subcommands: moe-controller address host:port (default: $MOE_CONTROLLER)");
ABSL_FLAG(std::string, token_file, "",
          "controller subcommands: file holding the bearer token (default: $MOE_TOKEN_FILE)");
ABSL_FLAG(std::string, tls_cert, "",
          "controller subcommands: mutual TLS: this client's certificate (PEM; default: $MOE_TLS_CERT)");
ABSL_FLAG(std::string, tls_key, "", "controller subcommands: mutual TLS: its private key (default: $MOE_TLS_KEY)");
ABSL_FLAG(std::string, tls_ca, "",
          "controller subcommands: mutual TLS: the CA the controller's certificate must chain to (default: "
          "$MOE_TLS_CA)");
ABSL_FLAG(int, timeout, 0,
          "controller subcommands: deadline of each call, seconds (0: 10, or 600 for placement load, promote and "
          "rollback, which print a progress line every 5 s)");
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
ABSL_FLAG(int64_t, epoch, 0,
          "placement synth: the process-group epoch the placement is for (0: none; the controller binds it to the "
          "epoch its ranks serve when it is loaded)");
ABSL_FLAG(std::string, checkpoint, "",
          "placement synth, rebalance --out: the checkpoint whose digests the slots carry");
ABSL_FLAG(std::string, from, "", "placement diff: the current placement (PlacementManifest JSON)");
ABSL_FLAG(std::string, to, "", "placement diff: the next placement (PlacementManifest JSON)");
ABSL_FLAG(int64_t, expert_bytes, 0, "placement diff: bytes of one expert copy in one MoE layer (or give --checkpoint)");
ABSL_FLAG(int64_t, budget_bytes, 0, "placement diff: fail (exit 2) when the overlap's peak exceeds this");
ABSL_FLAG(bool, dry_run, false, "rebalance: plan only (required)");
ABSL_FLAG(int, num_replicas, 0, "rebalance: physical slots of the new placement (0: current, rounded to the ranks)");
ABSL_FLAG(int, num_groups, 1, "rebalance: expert groups (EPLB hierarchical policy)");
ABSL_FLAG(int, num_nodes, 1, "rebalance: nodes (EPLB hierarchical policy)");
ABSL_FLAG(int, window_s, 0,
          "rebalance: plan the routes counted over this many seconds, read twice (0: since each daemon started; "
          "at most 3600)");
ABSL_FLAG(std::string, prior, "", "rollback: the DRAINING release to re-activate");
ABSL_FLAG(int64_t, min_shadow, 100, "rollout: shadow samples every rank must count before CANARY");
ABSL_FLAG(int64_t, min_canary, 200, "rollout: canary steps every rank must count before the promotion");
ABSL_FLAG(int64_t, after, 0, "watch: start after this transition seq (0: the whole history)");
ABSL_FLAG(int, count, 0, "watch: stop after this many transitions (0: until interrupted)");
ABSL_FLAG(int, timeout_s, 0, "watch: stop after this many seconds (0: never); drain: give up after (default 60)");
ABSL_FLAG(std::string, release, "", "bundle make: the release the bundle describes");
ABSL_FLAG(std::string, bundle, "",
          "release register: a release bundle (moectl bundle make); the controller verifies it before VERIFIED");
ABSL_FLAG(std::string, decode_runner, "kernels", "bundle make: the ranks' --decode_runner (kernels, padded, auto)");
ABSL_FLAG(std::string, expert_dtype, "bf16", "bundle make: the ranks' --expert_dtype (bf16, fp8)");
ABSL_FLAG(int64_t, decode_bucket_tokens, 8, "bundle make: the ranks' --decode_bucket_tokens");
ABSL_FLAG(int64_t, decode_bucket_slot_routes, 16, "bundle make: the ranks' --decode_bucket_slot_routes");
ABSL_FLAG(std::string, kernel_build, "",
          "bundle make: the kernels build every rank must run (moectl status --json reports each rank's "
          "kernelBuild; empty: any)");
ABSL_FLAG(std::string, nodes, "",
          "bundle make: comma-separated node of each rank, in rank order, as `moectl group status` shows them "
          "(empty: any node); the controller and every rank refuse the bundle on other nodes");
ABSL_FLAG(std::string, selector, "locality-first",
          "plan: replica selector for routes without physical_slot (locality-first, least-load, round-robin, hash)");

namespace {

constexpr char kUsage[] =
    "moectl: operator CLI of moe-runtime.\n"
    "  moectl plan --trace FILE [--json] [--selector POLICY]   plan a layer-step trace, print plan and ledgers\n"
    "  moectl eplb solve --input FILE                          solve expert placement (EPLB) as JSON\n"
    "  moectl overlap --input FILE                             communication-compute overlap schedule (spec 0x09):\n"
    "                                                          serialized and overlapped, buffer lifetimes; checks a\n"
    "                                                          given schedule and lifetimes (analytical units)\n"
    "  moectl checkpoint synth --experts E --d D --d_ff F --seed S [--layers L --family F --dtype T --top_k K\n"
    "                          --first_dense N --shard_mb M --version V] --out DIR\n"
    "                                                          write a synthetic model in Hugging Face layout with a\n"
    "                                                          digest sidecar (--layers 0: the older single file)\n"
    "  moectl checkpoint inspect PATH [--world P --extra_replicas N] [--json]\n"
    "                                                          architecture, MoE layers, experts, dtypes, bytes per "
    "rank\n"
    "  moectl checkpoint digest DIR --version V                record every expert's per-layer digest "
    "(moe_checkpoint.json)\n"
    "  moectl bundle make --release ID --checkpoint DIR --manifest F --world P [--prior ID --decode_runner R\n"
    "                     --decode_bucket_tokens N --decode_bucket_slot_routes S --expert_dtype bf16|fp8\n"
    "                     --kernel_build B --nodes A,B,..]\n"
    "                     --out F\n"
    "                                                          a release bundle: checkpoint digests, placement, "
    "runtime, topology\n"
    "  moectl bundle verify FILE                               its digest, every expert re-read and hashed, the "
    "placement's digests\n"
    "Controller subcommands (need --controller HOST:PORT --token_file FILE; --json for scripts):\n"
    "  moectl releases list | releases show ID                 releases, states, transition history\n"
    "  moectl release register ID (--bundle F | --digest D)    register a release (BUILT); with a bundle, the\n"
    "                                                          controller verifies it before VERIFIED\n"
    "  moectl release transition ID STATE --reason R           one lifecycle transition\n"
    "  moectl promote ID [--evidence FILE]                     CANARY -> ACTIVE through the promotion gate (inputs\n"
    "                                                          from FILE, or from the ranks' counters without it)\n"
    "  moectl rollback ID --prior PRIOR [--reason R]           stop ID, re-activate PRIOR (drain + retire ID on the "
    "ranks)\n"
    "  moectl drain ID [--reason R] [--timeout_s S]            stop a non-serving release, wait for its handles, "
    "retire it\n"
    "  moectl rollout ID (--bundle F | --manifest F [--digest D]) [--min_shadow N --min_canary N] [--evidence F]\n"
    "                 [--timeout_s S]\n"
    "                                                          register .. load .. shadow .. canary .. promote "
    "(resumable)\n"
    "  moectl watch [ID] [--after SEQ] [--count N] [--timeout_s S] [--json]  transitions as they commit\n"
    "  moectl placement load ID [--manifest FILE]              prepare a placement on every rank (VERIFIED -> "
    "LOADED);\n"
    "                                                          without --manifest, the release bundle's\n"
    "  moectl status                                           every rank's generations and handles\n"
    "  moectl rebalance --dry_run [--num_replicas Q] [--out F --checkpoint C --placement_version V]\n"
    "                                                          EPLB over the ranks' observed load, balancedness "
    "before/after\n"
    "  moectl placement synth --checkpoint F --world P --extra_replicas N --placement_version V\n"
    "                                                          (offline) a PlacementManifest JSON for placement load\n"
    "  moectl placement show --manifest F --world P            (offline) a placement's slots\n"
    "  moectl placement diff --from A --to B --world P (--checkpoint C | --expert_bytes N) [--budget_bytes B]\n"
    "                                                          (offline) the migration plan and its peak memory\n";

constexpr char kVersion[] = "moectl 0.1.0 (moe-runtime)";

// moectl's exit codes, one table for every command (docs/cli.md):
//   0 ok; 1 the operation was refused (a lifecycle rule, the promotion gate, a wrong token, a
//   conflicting request id); 2 bad usage or input (flags, arguments, files, fields); 3
//   unavailable (the controller or a rank could not be reached in time). The offline commands
//   read nothing but their arguments and files, so every failure of theirs is 2.
constexpr int kExitRefused = 1, kExitBadInput = 2, kExitUnavailable = 3;
bool g_offline = false;  // an offline command is running
int CliExitCode(const absl::Status& s) {
  if (!s.ok() && g_offline) return kExitBadInput;
  switch (s.code()) {
    case absl::StatusCode::kOk:
      return moe::kExitOk;
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kOutOfRange:
      return kExitBadInput;
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kDeadlineExceeded:
      return kExitUnavailable;
    default:
      return kExitRefused;
  }
}

// Prints a failure as one line on stderr (and, with --json, as {"error": {code, message, exit}}
// on stdout) and returns its exit code (never called with OK).
int Fail(const absl::Status& s) {
  std::string message(s.message());
  for (char& c : message) {
    if (c == '\n') c = ' ';
  }
  const int code = CliExitCode(s);
  std::fprintf(stderr, "moectl: %s: %s\n", absl::StatusCodeToString(s.code()).c_str(), message.c_str());
  if (absl::GetFlag(FLAGS_json)) {
    moe::json::Json err;
    err["error"] = {{"code", absl::StatusCodeToString(s.code())}, {"message", message}, {"exit", code}};
    std::cout << err.dump() << "\n";
  }
  return code;
}

// The usage lines of the command in `words` (e.g. {"placement", "load"}): every line of kUsage
// whose command starts with those words, with its continuation lines; all of kUsage for none.
std::string CommandHelp(const std::vector<std::string>& words) {
  std::string prefix = "  moectl";
  for (const std::string& w : words) absl::StrAppend(&prefix, " ", w);
  std::string out;
  bool in = false;
  for (absl::string_view line : absl::StrSplit(kUsage, '\n')) {
    if (absl::StartsWith(line, "  moectl ")) {
      in = absl::StartsWith(line, prefix) &&
           (line.size() == prefix.size() || line[prefix.size()] == ' ' || line[prefix.size()] == '|');
    } else if (!absl::StartsWith(line, "   ")) {
      in = false;
    }
    if (in) absl::StrAppend(&out, line, "\n");
  }
  return out;
}

// What main does before absl parses the flags: `moectl --version` (alone) or `moectl version`,
// -h / --help / help [COMMAND] (exit 0), and flags moectl does not have (exit 2, where absl
// would exit 1). Returns -1 to go on.
int PreParse(int argc, char** argv) {
  std::vector<std::string> words;
  bool help = false, version = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--") break;
    if (a == "-h" || a == "--help" || a == "-help" || (a == "help" && words.empty())) {
      help = true;
      continue;
    }
    if (a.size() > 1 && a[0] == '-') {
      const size_t begin = a.find_first_not_of('-');
      std::string name = begin == std::string::npos ? std::string() : a.substr(begin);
      const bool has_value = name.find('=') != std::string::npos;
      name = name.substr(0, name.find('='));
      const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
      if (flag == nullptr && absl::StartsWith(name, "no")) {
        flag = absl::FindCommandLineFlag(name.substr(2));
        if (flag != nullptr && !flag->IsOfType<bool>()) flag = nullptr;
      }
      if (flag == nullptr) {
        std::fprintf(stderr, "moectl: unknown flag %s (moectl -h lists the commands, --helpfull every flag)\n",
                     a.c_str());
        return kExitBadInput;
      }
      if (name == "version" && !has_value && (i + 1 == argc || argv[i + 1][0] == '-')) version = true;
      // A non-boolean flag given as `--flag value` takes the next argument (e.g. `--after -1`).
      if (!has_value && !flag->IsOfType<bool>() && i + 1 < argc) ++i;
      continue;
    }
    if (a == "version" && words.empty()) version = true;
    words.push_back(a);
  }
  if (version && (words.empty() || words == std::vector<std::string>{"version"})) {
    std::printf("%s\n", kVersion);
    return moe::kExitOk;
  }
  if (!help) return -1;
  // The command's words are the leading non-flag arguments that are not IDs: try the longest
  // prefix that matches a usage line.
  for (size_t n = std::min<size_t>(words.size(), 2); n > 0; --n) {
    const std::string h = CommandHelp({words.begin(), words.begin() + n});
    if (!h.empty()) {
      std::printf("%s", h.c_str());
      return moe::kExitOk;
    }
  }
  std::printf("%s", kUsage);
  return moe::kExitOk;
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

// The offline commands over one --input JSON file: `answer` turns the document into the JSON
// printed; its errors are reported naming the file.
int AnswerInput(const std::function<absl::StatusOr<moe::json::Json>(const moe::json::Json&)>& answer) {
  const std::string path = absl::GetFlag(FLAGS_input);
  if (path.empty()) return Fail(absl::InvalidArgumentError("--input: required"));
  auto doc = moe::json::ParseFile(path);
  if (!doc.ok()) return Fail(doc.status());
  auto out = answer(*doc);
  if (!out.ok()) return Fail(absl::Status(out.status().code(), absl::StrCat(path, ": ", out.status().message())));
  std::cout << out->dump() << "\n";
  return moe::kExitOk;
}

int Overlap() {
  return AnswerInput([](const moe::json::Json& doc) -> absl::StatusOr<moe::json::Json> {
    ASSIGN_OR_RETURN(const moe::OverlapInput in, moe::ParseOverlapInput(doc));
    return moe::OverlapReport(in);
  });
}

int EplbSolve() {
  return AnswerInput([](const moe::json::Json& doc) -> absl::StatusOr<moe::json::Json> {
    ASSIGN_OR_RETURN(const moe::EplbProblem problem, moe::ParseEplbProblem(doc));
    ASSIGN_OR_RETURN(const moe::EplbSolution solution, moe::RebalanceExperts(problem));
    return moe::EplbSolutionJson(solution);
  });
}

absl::StatusOr<moe::HfFamily> ParseFamily(const std::string& name) {
  for (moe::HfFamily f : {moe::HfFamily::kMixtral, moe::HfFamily::kQwen2Moe, moe::HfFamily::kQwen3Moe,
                          moe::HfFamily::kDeepseekV2, moe::HfFamily::kDeepseekV3}) {
    if (name == moe::HfFamilyName(f)) return f;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--family: '", name, "' (mixtral, qwen2_moe, qwen3_moe, deepseek_v2, deepseek_v3)"));
}

int CheckpointSynth() {
  const std::string out = absl::GetFlag(FLAGS_out);
  if (out.empty()) return Fail(absl::InvalidArgumentError("--out: required"));
  const int e = absl::GetFlag(FLAGS_experts), d = absl::GetFlag(FLAGS_d), f = absl::GetFlag(FLAGS_d_ff);
  if (e <= 0 || d <= 0 || f <= 0 || d % 8 != 0 || f % 8 != 0 || e > 4096 || d > 65536 || f > 65536) {
    return Fail(absl::InvalidArgumentError(
        "--experts, --d, --d_ff: must be positive (at most 4096, 65536, 65536), d and d_ff multiples of 8"));
  }
  const uint64_t seed = static_cast<uint64_t>(absl::GetFlag(FLAGS_seed));
  const int layers = absl::GetFlag(FLAGS_layers);
  if (layers < 0 || layers > 1024) return Fail(absl::InvalidArgumentError("--layers: must be in [0, 1024]"));
  if (layers > 0) {
    auto family = ParseFamily(absl::GetFlag(FLAGS_family));
    if (!family.ok()) return Fail(family.status());
    moe::HfModelSpec spec;
    spec.family = *family;
    spec.naming = *family == moe::HfFamily::kMixtral ? moe::ExpertNaming::kMixtral : moe::ExpertNaming::kProjections;
    spec.hidden_size = d;
    spec.moe_intermediate_size = f;
    spec.num_experts = e;
    spec.top_k = absl::GetFlag(FLAGS_top_k);
    spec.num_hidden_layers = layers;
    spec.first_k_dense_replace = absl::GetFlag(FLAGS_first_dense);
    spec.dtype = absl::GetFlag(FLAGS_dtype);
    spec.max_shard_bytes = absl::GetFlag(FLAGS_shard_mb) << 20;
    spec.version = absl::GetFlag(FLAGS_version);
    absl::Status s = moe::WriteHfModel(out, spec, moe::SyntheticExpertSource(d, f, seed));
    if (!s.ok()) return Fail(s);
    auto written = moe::HfCheckpoint::Open(out);
    if (!written.ok()) return Fail(written.status());
    std::cout << "wrote " << out << ": " << (*written)->Describe() << ", " << (*written)->version() << "\n";
    return moe::kExitOk;
  }
  const auto file = moe::SyntheticCheckpoint({e, d, f}, seed, absl::GetFlag(FLAGS_version));
  absl::Status s = moe::WriteSafetensors(out, file);
  if (!s.ok()) return Fail(s);
  std::cout << "wrote " << out << ": " << e << " experts, d=" << d << ", d_ff=" << f << ", "
            << file.metadata.at(moe::checkpoint_keys::kVersion) << "\n";
  return moe::kExitOk;
}

// "1-3,5,7-60": a layer list compressed into ranges.
std::string LayerRanges(const std::vector<int64_t>& layers) {
  std::string out;
  for (size_t i = 0; i < layers.size();) {
    size_t j = i;
    while (j + 1 < layers.size() && layers[j + 1] == layers[j] + 1) ++j;
    absl::StrAppend(&out, out.empty() ? "" : ",", layers[i]);
    if (j > i) absl::StrAppend(&out, "-", layers[j]);
    i = j + 1;
  }
  return out;
}

// `checkpoint inspect PATH`: what a rank would load, and how much of it each rank holds under
// the default placement of --world ranks.
int CheckpointInspect(const std::string& path) {
  std::unique_ptr<moe::SafetensorsFile> storage;
  auto ckpt = moe::OpenCheckpoint(path, &storage);
  if (!ckpt.ok()) return Fail(absl::InvalidArgumentError(ckpt.status().message()));
  const moe::CheckpointReader& c = **ckpt;
  const int world = absl::GetFlag(FLAGS_world);
  if (world <= 0) return Fail(absl::InvalidArgumentError("--world: must be positive"));
  const moe::Topology topology = ClusterTopology(world);
  const moe::ProcessGroup group = moe::LocalClusterGroup(world, absl::GetFlag(FLAGS_epoch));
  moe::CheckpointIdentity id = c.Identity();
  int recorded = 0;
  for (auto& expert : id.digests) {
    for (std::string& digest : expert) {
      if (!digest.empty()) ++recorded;
      digest = "x";  // the byte counts below need a placement, not the digests
    }
  }
  auto m = moe::DefaultPlacement(moe::PlacementVersion(1), c.shape().num_experts, absl::GetFlag(FLAGS_extra_replicas),
                                 topology, group, id);
  if (!m.ok()) return Fail(m.status());
  const auto* hf = dynamic_cast<const moe::HfCheckpoint*>(&c);
  moe::json::Json out;
  out["path"] = path;
  out["version"] = c.version();
  out["layout"] = hf != nullptr ? "huggingface" : "single-file";
  if (hf != nullptr) {
    out["model_type"] = hf->config().model_type;
    out["naming"] = moe::ExpertNamingName(hf->naming());
    out["weight_dtype"] = hf->weight_dtype();
    out["top_k"] = hf->config().top_k;
    out["decoder_layers"] = hf->config().num_hidden_layers;
    out["shards"] = hf->num_shards();
    out["file_bytes"] = hf->file_bytes();
    if (hf->config().fp8_block_rows > 0) {
      out["fp8_block"] = {hf->config().fp8_block_rows, hf->config().fp8_block_cols};
    }
  }
  out["moe_layers"] = c.layers();
  out["experts"] = c.shape().num_experts;
  out["d"] = c.shape().d;
  out["d_ff"] = c.shape().d_ff;
  out["expert_bytes_bf16"] = c.expert_bytes();
  out["digests_recorded"] = recorded;
  out["digests_total"] = c.shape().num_experts * c.num_layers();
  for (int r = 0; r < world; ++r) {
    auto bytes = moe::LocalExpertBytes(c, **m, moe::Rank(r));
    if (!bytes.ok()) return Fail(bytes.status());
    out["rank_bytes"].push_back({{"rank", r}, {"slots", (*m)->LocalSlots(moe::Rank(r)).size()}, {"bytes", *bytes}});
  }
  if (absl::GetFlag(FLAGS_json)) {
    std::cout << out.dump(2) << "\n";
    return moe::kExitOk;
  }
  std::cout << path << "\n  " << c.Describe() << "\n  version            " << c.version() << "\n";
  if (hf != nullptr) {
    std::cout << "  architecture       " << hf->config().model_type << ", " << hf->config().num_hidden_layers
              << " decoder layers, top-" << hf->config().top_k << "\n  weights            " << hf->weight_dtype()
              << (hf->config().fp8_block_rows > 0
                      ? absl::StrCat(" with ", hf->config().fp8_block_rows, "x", hf->config().fp8_block_cols,
                                     " block scales (dequantized to BF16 at load)")
                      : "")
              << ", " << hf->num_shards() << " shard(s), " << hf->file_bytes() << " bytes\n";
  }
  std::cout << "  MoE layers         "
            << (c.layers().empty() ? "one expert set for every layer" : LayerRanges(c.layers())) << " ("
            << c.num_layers() << ")\n  experts            " << c.shape().num_experts << " x (d " << c.shape().d
            << ", d_ff " << c.shape().d_ff << "), " << c.expert_bytes() << " BF16 bytes each per layer\n"
            << "  digests recorded   " << recorded << " of " << c.shape().num_experts * c.num_layers()
            << (recorded == 0 ? " (moectl checkpoint digest records them)" : "") << "\n"
            << "  default placement over " << world << " rank(s), " << absl::GetFlag(FLAGS_extra_replicas)
            << " extra replica(s):\n";
  for (const auto& r : out["rank_bytes"]) {
    std::cout << absl::StrFormat("    rank %-3d %4d slots  %14lld bytes (%.2f GiB)\n", r["rank"].get<int>(),
                                 r["slots"].get<int>(), static_cast<long long>(r["bytes"].get<int64_t>()),
                                 r["bytes"].get<int64_t>() / double(1 << 30));
  }
  return moe::kExitOk;
}

// `checkpoint digest DIR --version V`: reads every expert once and records the digests.
int CheckpointDigest(const std::string& dir) {
  if (absl::GetFlag(FLAGS_version).empty()) return Fail(absl::InvalidArgumentError("--version: required"));
  absl::Status s = moe::WriteCheckpointSidecar(dir, absl::GetFlag(FLAGS_version));
  if (!s.ok()) return Fail(absl::Status(s.code(), absl::StrCat(dir, ": ", s.message())));
  auto c = moe::HfCheckpoint::Open(dir);
  if (!c.ok()) return Fail(c.status());
  std::cout << "recorded " << (*c)->shape().num_experts * (*c)->num_layers() << " expert digests of " << dir << " as "
            << (*c)->version() << "\n";
  return moe::kExitOk;
}

// The default placement moe-rankd builds for itself (DefaultPlacement), at another version and
// replica count, as PlacementManifest JSON for `moectl placement load`.
int PlacementSynth() {
  std::unique_ptr<moe::SafetensorsFile> storage;
  auto ckpt = moe::OpenCheckpoint(absl::GetFlag(FLAGS_checkpoint), &storage);
  if (!ckpt.ok()) return Fail(absl::InvalidArgumentError(absl::StrCat("--checkpoint: ", ckpt.status().message())));
  const int experts = (*ckpt)->shape().num_experts;
  const int world = absl::GetFlag(FLAGS_world);
  if (world <= 0) return Fail(absl::InvalidArgumentError("--world: must be positive"));
  const moe::Topology topology = ClusterTopology(world);
  const moe::ProcessGroup group = moe::LocalClusterGroup(world, absl::GetFlag(FLAGS_epoch));
  auto m = moe::DefaultPlacement(moe::PlacementVersion(absl::GetFlag(FLAGS_placement_version)), experts,
                                 absl::GetFlag(FLAGS_extra_replicas), topology, group, (*ckpt)->Identity());
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
    std::unique_ptr<moe::SafetensorsFile> storage;
    auto ckpt = moe::OpenCheckpoint(absl::GetFlag(FLAGS_checkpoint), &storage);
    if (!ckpt.ok()) return Fail(absl::InvalidArgumentError(absl::StrCat("--checkpoint: ", ckpt.status().message())));
    expert_bytes = (*ckpt)->expert_bytes();  // gate, up and down in BF16, one layer
  }
  if (expert_bytes <= 0) return Fail(absl::InvalidArgumentError("--expert_bytes or --checkpoint: required"));
  auto plan = moe::PlanLayeredMigration(**from, **to, topology, expert_bytes);
  if (!plan.ok()) return Fail(plan.status());
  const size_t layers = plan->layers.size();
  if (layers == 0 || (!(*from)->per_layer() && !(*to)->per_layer())) {
    std::cout << moe::RenderMigration(**from, **to, plan->per_layer.front());
    if (layers > 1) std::cout << "(the same plan in each of the " << layers << " MoE layers)\n";
  } else {
    for (size_t i = 0; i < layers; ++i) {
      std::cout << "== layer " << plan->layers[i] << "\n"
                << moe::RenderMigration((*from)->LayerAt(static_cast<int>(i)), (*to)->LayerAt(static_cast<int>(i)),
                                        plan->per_layer[i]);
    }
  }
  if (layers > 1) {
    std::cout << absl::StrFormat(
        "every layer: %d retained, %d copied, %d loaded; peak %d bytes (as materialized: %d bytes)\n",
        plan->total.retained_copies, plan->total.same_node_copies + plan->total.cross_node_copies,
        plan->total.checkpoint_loads, plan->total.peak_bytes, plan->total.materialized_peak_bytes);
  }
  // The budget holds what the ranks will hold at once: they copy retained slots too.
  const int64_t budget = absl::GetFlag(FLAGS_budget_bytes);
  if (budget > 0 && plan->total.materialized_peak_bytes > budget) {
    return Fail(absl::FailedPreconditionError(
        absl::StrCat("--budget_bytes: the ranks will hold ", plan->total.materialized_peak_bytes,
                     " bytes at once (retained copies copied), over the budget of ", budget)));
  }
  return moe::kExitOk;
}

int BundleMake() {
  moe::BundleInputs in;
  in.release_id = absl::GetFlag(FLAGS_release);
  in.prior_release = absl::GetFlag(FLAGS_prior);
  in.checkpoint_path = absl::GetFlag(FLAGS_checkpoint);
  in.manifest_path = absl::GetFlag(FLAGS_manifest);
  in.decode_runner = absl::GetFlag(FLAGS_decode_runner);
  in.dtype = absl::AsciiStrToUpper(absl::GetFlag(FLAGS_expert_dtype));
  in.decode_bucket_tokens = absl::GetFlag(FLAGS_decode_bucket_tokens);
  in.decode_bucket_slot_routes = absl::GetFlag(FLAGS_decode_bucket_slot_routes);
  in.kernel_build = absl::GetFlag(FLAGS_kernel_build);
  in.world = absl::GetFlag(FLAGS_world);
  if (const std::string nodes = absl::GetFlag(FLAGS_nodes); !nodes.empty()) {
    for (absl::string_view n : absl::StrSplit(nodes, ',')) in.nodes.emplace_back(absl::StripAsciiWhitespace(n));
  }
  const std::string out = absl::GetFlag(FLAGS_out);
  if (out.empty()) return Fail(absl::InvalidArgumentError("--out: required"));
  auto bundle = moe::MakeBundle(in);
  if (!bundle.ok()) return Fail(bundle.status());
  if (absl::Status s = moe::json::WriteFile(out, bundle->dump(2) + "\n", "--out"); !s.ok()) return Fail(s);
  std::cout << "wrote " << out << ": " << in.release_id << ", " << (*bundle)["digest"].get<std::string>() << "\n";
  return moe::kExitOk;
}

int BundleVerify(const std::string& path) {
  auto doc = moe::json::ParseFile(path);
  if (!doc.ok()) return Fail(doc.status());
  if (absl::Status s = moe::VerifyBundle(*doc, ClusterTopology); !s.ok()) {
    return Fail(absl::Status(s.code(), absl::StrCat(path, ": ", s.message())));
  }
  std::cout << path << ": verified " << (*doc)["release_id"].get<std::string>() << " "
            << (*doc)["digest"].get<std::string>() << " (every expert of " << (*doc)["checkpoint"]["digests"].size()
            << " MoE layers re-read and hashed, the placement's digests match)\n";
  return moe::kExitOk;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(kUsage);
  if (const int early = PreParse(argc, argv); early >= 0) return early;
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  moe::InitLogging("moectl", "info");
  std::vector<std::string> cmd(args.begin() + 1, args.end());
  g_offline = !moe::IsRemoteCommand(cmd);
  if (cmd.size() == 1 && cmd[0] == "plan") return Plan();
  if (cmd.size() == 2 && cmd[0] == "eplb" && cmd[1] == "solve") return EplbSolve();
  if (cmd.size() == 1 && cmd[0] == "overlap") return Overlap();
  if (cmd.size() == 2 && cmd[0] == "checkpoint" && cmd[1] == "synth") return CheckpointSynth();
  if (cmd.size() == 3 && cmd[0] == "checkpoint" && cmd[1] == "inspect") return CheckpointInspect(cmd[2]);
  if (cmd.size() == 3 && cmd[0] == "checkpoint" && cmd[1] == "digest") return CheckpointDigest(cmd[2]);
  if (cmd.size() == 2 && cmd[0] == "placement" && cmd[1] == "synth") return PlacementSynth();
  if (cmd.size() == 2 && cmd[0] == "bundle" && cmd[1] == "make") return BundleMake();
  if (cmd.size() == 3 && cmd[0] == "bundle" && cmd[1] == "verify") return BundleVerify(cmd[2]);
  if (cmd.size() == 2 && cmd[0] == "placement" && (cmd[1] == "show" || cmd[1] == "diff")) {
    return PlacementOffline(cmd[1]);
  }
  if (moe::IsRemoteCommand(cmd)) {
    moe::RemoteOptions o;
    // A flag left empty takes its environment variable.
    const auto flag_or_env = [](const std::string& flag, const char* env) {
      const char* v = std::getenv(env);
      return flag.empty() && v != nullptr ? std::string(v) : flag;
    };
    o.controller = flag_or_env(absl::GetFlag(FLAGS_controller), "MOE_CONTROLLER");
    o.token_file = flag_or_env(absl::GetFlag(FLAGS_token_file), "MOE_TOKEN_FILE");
    if (absl::GetFlag(FLAGS_timeout) < 0) return Fail(absl::InvalidArgumentError("--timeout: must be >= 0"));
    o.tls.cert = flag_or_env(absl::GetFlag(FLAGS_tls_cert), "MOE_TLS_CERT");
    o.tls.key = flag_or_env(absl::GetFlag(FLAGS_tls_key), "MOE_TLS_KEY");
    o.tls.ca = flag_or_env(absl::GetFlag(FLAGS_tls_ca), "MOE_TLS_CA");
    o.rpc_timeout_s = absl::GetFlag(FLAGS_timeout);
    o.request_id = absl::GetFlag(FLAGS_request_id);
    o.json = absl::GetFlag(FLAGS_json);
    o.digest = absl::GetFlag(FLAGS_digest);
    o.bundle = absl::GetFlag(FLAGS_bundle);
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
    o.window_s = absl::GetFlag(FLAGS_window_s);
    o.out = absl::GetFlag(FLAGS_out);
    o.checkpoint = absl::GetFlag(FLAGS_checkpoint);
    o.placement_version = absl::GetFlag(FLAGS_placement_version);
    o.epoch = absl::GetFlag(FLAGS_epoch);
    o.topology = ClusterTopology;
    absl::Status s = moe::RunRemote(cmd, o);
    return s.ok() ? moe::kExitOk : Fail(s);
  }
  std::fputs(kUsage, stderr);
  return kExitBadInput;
}
