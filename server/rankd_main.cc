// moe-rankd: the per-rank serving daemon. Holds the expert weights of its physical slots, joins
// the process group's transport, and answers its engine's ExpertLayerService calls.
// What listens where (docs/security.md):
//  - the engine API on a Unix socket (--engine_socket; callers admitted by their uid,
//    --engine_uids), with gRPC health checking;
//  - a TCP port (--listen) only when there is something to serve on it: RankAgentService with
//    --agent_token_file, the engine API with --engine_token_file (bearer token), health with
//    --tcp_health; no daemon serves gRPC reflection (the .proto files are the schema);
//  - Prometheus metrics on their own port (--metrics_listen), UCX on --ucx_host's interface.
// SIGTERM drains: steps in flight finish, new ones get UNAVAILABLE, then the process exits.
#include <pwd.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

#include "kernels/api.h"
#include "rpc/daemon_util.h"
#include "rpc/unix_socket.h"
#include "runtime/checkpoint/checkpoint_reader.h"
#include "runtime/checkpoint/expert_loader.h"
#include "runtime/checkpoint/sha256.h"
#include "runtime/exec/layer_executor.h"
#include "runtime/logging.h"
#include "runtime/placement/default_placement.h"
#include "runtime/status.h"
#include "runtime/transport/file_rendezvous.h"
#include "runtime/transport/transport.h"
#include "server/cuda_backend.h"
#include "server/expert_layer_service.h"
#include "server/generation_metrics.h"
#include "server/group_member.h"
#include "server/metrics.h"
#include "server/rank_agent_service.h"

ABSL_FLAG(int, rank, 0, "global rank of this daemon");
ABSL_FLAG(int, world, 1, "ranks in the expert-parallel group");
ABSL_FLAG(std::string, ucx_host, "127.0.0.1", "host the UCX listener binds");
ABSL_FLAG(std::string, advertise_host, "",
          "host the rank gives moe-controller for its agent (--listen's port): a name its TLS certificate holds, "
          "e.g. a Kubernetes pod's stable DNS name (empty: --ucx_host)");
ABSL_FLAG(std::string, ucx_net_devices, "",
          "network devices UCX may use (UCX NET_DEVICES, e.g. lo or eth0); empty: the interface of --ucx_host");
ABSL_FLAG(std::string, engine_socket, "",
          "Unix socket of the engine API (empty: /tmp/moe-rankd-<uid>-<rank>.sock); callers admitted by uid");
ABSL_FLAG(std::string, engine_uids, "",
          "comma-separated uids (or user names) allowed on --engine_socket; empty: this daemon's own uid");
ABSL_FLAG(std::string, engine_token_file, "",
          "serve the engine API on the TCP port too (--listen), to callers holding this bearer token");
ABSL_FLAG(bool, tcp_health, false,
          "serve grpc.health.v1 on the TCP port without credentials (for probes); the Unix socket always has it");
ABSL_FLAG(int64_t, max_step_tokens, 65536, "most rows (tokens) one step request may carry");
ABSL_FLAG(int64_t, max_request_bytes, int64_t{1} << 30,
          "most bytes of one request (gRPC message, or rows read from a shared region); at most 2 GiB - 1");
ABSL_FLAG(int, max_step_rings, 8,
          "step rings (shared-memory submission for co-located engines; claimed on --engine_socket + \".ring\") "
          "open at once; 0: no step rings");
ABSL_FLAG(int, max_step_rings_per_uid, 0,
          "of --max_step_rings, the most one engine uid may hold at once; 0: --max_step_rings divided among the "
          "--engine_uids (at least 1)");
ABSL_FLAG(int64_t, max_ring_bytes, int64_t{4} << 30, "most bytes of one step ring");
ABSL_FLAG(int64_t, ring_spin_us, 50, "how long a step ring's thread spins for the doorbell before it sleeps");
ABSL_FLAG(int, ring_check_threads, 8,
          "threads that check a ring step's rows for NaN/Inf beside the executor's first phases (0: in line)");
ABSL_FLAG(std::string, shm_prefix, "/moe-", "shared-memory regions must have names starting with this");
ABSL_FLAG(std::string, rendezvous_dir, "",
          "without --controller: a directory where the ranks publish their UCX addresses (or the NCCL id) and node "
          "names, and form one epoch (--epoch) for their lifetime (a test convenience)");
ABSL_FLAG(std::string, controller, "",
          "host:port of moe-controller: join its process group (rendezvous, topology and epochs; the rank "
          "re-forms with its peers when one is lost or replaced); needs --agent_token_file");
ABSL_FLAG(std::string, node, "", "the node (host) this rank declares to its group (empty: the host name)");
ABSL_FLAG(std::string, checkpoint, "",
          "the experts: a Hugging Face model directory (config.json + safetensors shards), or the single-file "
          "synthetic checkpoint (moectl checkpoint synth writes either)");
ABSL_FLAG(int, load_threads, 4, "threads reading the checkpoint at start-up");
ABSL_FLAG(int, extra_replicas, 2, "extra replicas of the first experts in the default placement");
ABSL_FLAG(int64_t, epoch, 1, "process-group epoch with --rendezvous_dir (the controller numbers its own)");
ABSL_FLAG(int, timeout_ms, 10000, "collective timeout per step");
ABSL_FLAG(std::string, release, "dev", "release label on every metric");
ABSL_FLAG(int64_t, decode_bucket_tokens, 8, "decode graph bucket: tokens per rank");
ABSL_FLAG(int64_t, decode_bucket_slot_routes, 16, "decode graph bucket: routes per physical slot");
ABSL_FLAG(std::string, decode_runner, "kernels",
          "decode graph bucket's expert runner: kernels (decode kernels over compact segments), padded (GEMMs over "
          "slots padded to the bucket's routes per slot) or auto (padded when a full bucket gives each slot two "
          "rows or more); every rank must use the same (else decode steps serve eagerly)");
ABSL_FLAG(std::string, expert_dtype, "bf16",
          "precision of the experts' weights and arithmetic: bf16, or fp8 (E4M3 weights in 128 x 128 blocks, "
          "quantized when a generation is loaded; rows quantized per 128 values; half the weights' device memory). "
          "Release bundles name it as runtime.dtype (BF16 / FP8)");
ABSL_FLAG(bool, lone_member_graphs, false,
          "a rank alone in its group serves decode steps through the decode bucket's CUDA graph, as a group does "
          "(default: the one-call local layer, eager)");
ABSL_FLAG(bool, device_plan, true,
          "plan prefill steps on the kernels (route keys, checks and the send and receive orders where the rows "
          "are; the host reads back counts per slot) wherever replica choice does not depend on the step");
ABSL_FLAG(bool, lone_decode_on_kernels, true,
          "with --device_plan, a rank alone in its group plans its decode steps whose routing is on the GPU there "
          "too, and enqueues their layer before it reads the checks back (false: it copies the routing to the host)");
ABSL_FLAG(bool, lone_decode_graphs, true,
          "with --lone_decode_on_kernels: such a step's GPU work (the checks, their read-back, the layer) is "
          "recorded once per step shape and buffers as a CUDA graph and launched again in one call (a key's first "
          "step runs eagerly; false: every step enqueues its calls one by one");
ABSL_FLAG(int32_t, lone_decode_recordings, 1024,
          "with --lone_decode_graphs: how many recordings are kept (one per MoE layer, token count and engine "
          "ring slot; ~250 KiB of GPU memory each on H200; in [1, 65536]); a new one replaces the least recently "
          "used only once that has been idle for twice this many steps");
ABSL_FLAG(std::string, agent_token_file, "",
          "serve RankAgentService (generation prepare/activate/stop/retire) to callers holding this bearer token; "
          "empty: the agent API is off and the rank serves placement-v1 only");
ABSL_FLAG(std::string, kernels, "cpu", "where experts run: cpu, or cuda (loads the CUDA backend)");
ABSL_FLAG(std::string, transport, "ucx",
          "how rows move between ranks: ucx (host memory), or nccl (GPU memory; loads the CUDA backend; needs "
          "--kernels=cuda for device-resident rows, otherwise rows are staged through the GPU)");
ABSL_FLAG(std::string, inject_fault, "",
          "fault injection for tests: trial_drift = this rank's shadow and canary passes return outputs scaled by "
          "1.05 (a candidate runner that computes something else)");
ABSL_FLAG(bool, nccl_host_agreement, true,
          "with --transport nccl: agree on each step over shared memory when every rank is on this host (else, or "
          "when false, an NCCL all-gather)");
ABSL_FLAG(int, nccl_wait_poll_us, 0,
          "with --transport nccl: 0 polls NCCL work without pause (lowest latency, a core busy while rows move); "
          "> 0 sleeps that many microseconds between polls (frees the core for an engine sharing it)");
ABSL_FLAG(int, gpu, -1, "CUDA device of this rank (-1: the rank's index)");
ABSL_FLAG(std::string, cuda_backend, "", "path of libmoe_cuda.so (empty: next to this executable)");
ABSL_FLAG(std::string, cuda_tuning, "",
          "switches of the CUDA kernels for side-by-side measurements, e.g. pdl=0,fused_layer=0 (kernels/api.h "
          "CudaTuning; empty: the tuned defaults)");

namespace moe {
namespace {

absl::Status Annotate(const absl::Status& s, absl::string_view what) {
  return absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
}

// Logs why the daemon cannot go on and returns the exit status for it.
int Fail(const absl::Status& s, int exit_code) {
  spdlog::error("{}", std::string(s.message()));
  return exit_code;
}

absl::StatusOr<std::vector<uid_t>> ParseUids(const std::string& list) {
  std::vector<uid_t> out;
  for (absl::string_view part : absl::StrSplit(list, ',', absl::SkipWhitespace())) {
    uint32_t uid = 0;
    if (absl::SimpleAtoi(part, &uid)) {
      out.push_back(uid);
      continue;
    }
    const passwd* pw = getpwnam(std::string(part).c_str());
    if (pw == nullptr) return absl::InvalidArgumentError(absl::StrCat("--engine_uids: '", part, "' is no uid or user"));
    out.push_back(pw->pw_uid);
  }
  return out;
}

// Everything moe-rankd takes from its flags, validated before the daemon acts on any of it.
struct RankdOptions {
  int rank = 0;
  int world = 1;
  EngineApiOptions api;  // limits, --shm_prefix and the engine token; peer_uid is set with the socket
  std::vector<uid_t> engine_uids;
  std::string kernels;    // cpu | cuda
  std::string transport;  // ucx | nccl
  int gpu = 0;
  kernels::CudaTuning cuda_tuning;  // parsed only when the CUDA backend is loaded
  DecodeRunner decode_runner = DecodeRunner::kKernels;
  ExpertDtype expert_dtype = ExpertDtype::kBf16;
  bool trial_drift = false;  // --inject_fault=trial_drift
  std::string agent_token;   // empty: RankAgentService is off
  TlsFiles tls;              // --tls_*: mutual TLS on the TCP port and toward the peers' agents
  std::string controller;    // --controller: join its process group; empty: --rendezvous_dir
  std::string node;          // --node, or the host name

  bool UsesCudaBackend() const { return kernels == "cuda" || transport == "nccl"; }
};

// The engine API's limits, --shm_prefix, --engine_uids and the engine token.
absl::Status ParseEngineApiFlags(RankdOptions* o) {
  EngineApiOptions& api = o->api;
  api.max_step_tokens = absl::GetFlag(FLAGS_max_step_tokens);
  api.max_request_bytes = absl::GetFlag(FLAGS_max_request_bytes);
  api.regions.name_prefix = absl::GetFlag(FLAGS_shm_prefix);
  if (api.max_step_tokens <= 0 || api.max_step_tokens > (int64_t{1} << 24)) {
    return absl::InvalidArgumentError(absl::StrCat("--max_step_tokens ", api.max_step_tokens, ": expected 1 .. 2^24"));
  }
  // gRPC's limits are ints; a request's message carries its rows plus top-k ids and gates.
  if (api.max_request_bytes < (1 << 20) || api.max_request_bytes > (int64_t{1} << 31) - 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_request_bytes ", api.max_request_bytes, ": expected 1 MiB .. 2 GiB - 1"));
  }
  if (api.regions.name_prefix.size() < 2 || api.regions.name_prefix[0] != '/' ||
      api.regions.name_prefix.find('/', 1) != std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("--shm_prefix '", api.regions.name_prefix, "': expected \"/name-prefix\""));
  }
  ASSIGN_OR_RETURN(o->engine_uids, ParseUids(absl::GetFlag(FLAGS_engine_uids)));
  if (!absl::GetFlag(FLAGS_engine_token_file).empty()) {
    ASSIGN_OR_RETURN(api.token, ReadTokenFile(absl::GetFlag(FLAGS_engine_token_file), "--engine_token_file"));
  }
  return absl::OkStatus();
}

// --kernels, --transport, --gpu, --cuda_tuning, --decode_runner, --expert_dtype, --inject_fault.
absl::Status ParseExecutionFlags(RankdOptions* o) {
  o->kernels = absl::GetFlag(FLAGS_kernels);
  o->transport = absl::GetFlag(FLAGS_transport);
  if (o->kernels != "cpu" && o->kernels != "cuda") {
    return absl::InvalidArgumentError(absl::StrCat("--kernels=", o->kernels, ": expected cpu or cuda"));
  }
  if (o->transport != "ucx" && o->transport != "nccl") {
    return absl::InvalidArgumentError(absl::StrCat("--transport=", o->transport, ": expected ucx or nccl"));
  }
  o->gpu = absl::GetFlag(FLAGS_gpu) >= 0 ? absl::GetFlag(FLAGS_gpu) : o->rank;
  if (o->UsesCudaBackend()) {
    auto tuning = kernels::ParseCudaTuning(absl::GetFlag(FLAGS_cuda_tuning));
    if (!tuning.ok()) return absl::InvalidArgumentError(absl::StrCat("--cuda_tuning: ", tuning.status().message()));
    o->cuda_tuning = *tuning;
  }
  auto runner = ParseDecodeRunner(absl::GetFlag(FLAGS_decode_runner));
  if (!runner.ok()) return absl::InvalidArgumentError(absl::StrCat("--", runner.status().message()));
  o->decode_runner = *runner;
  auto dtype = ParseExpertDtype(absl::GetFlag(FLAGS_expert_dtype), "--expert_dtype");
  if (!dtype.ok()) return dtype.status();
  o->expert_dtype = *dtype;
  const std::string fault = absl::GetFlag(FLAGS_inject_fault);
  if (!fault.empty() && fault != "trial_drift") {
    return absl::InvalidArgumentError(absl::StrCat("--inject_fault=", fault, ": expected trial_drift"));
  }
  o->trial_drift = fault == "trial_drift";
  return absl::OkStatus();
}

// Reads and validates every flag that says what to serve and how. Every error is INVALID_ARGUMENT
// (exit status 2).
absl::StatusOr<RankdOptions> ParseRankdOptions() {
  RankdOptions o;
  o.rank = absl::GetFlag(FLAGS_rank);
  o.world = absl::GetFlag(FLAGS_world);
  if (o.world <= 0 || o.rank < 0 || o.rank >= o.world) {
    return absl::InvalidArgumentError(
        absl::StrCat("--rank ", o.rank, " / --world ", o.world, ": rank must be in [0, world)"));
  }
  RETURN_IF_ERROR(ParseEngineApiFlags(&o));
  o.tls = {absl::GetFlag(FLAGS_tls_cert), absl::GetFlag(FLAGS_tls_key), absl::GetFlag(FLAGS_tls_ca)};
  RETURN_IF_ERROR(CheckTlsFiles(o.tls));
  RETURN_IF_ERROR(ParseExecutionFlags(&o));
  if (!absl::GetFlag(FLAGS_agent_token_file).empty()) {
    ASSIGN_OR_RETURN(o.agent_token, ReadTokenFile(absl::GetFlag(FLAGS_agent_token_file), "--agent_token_file"));
  }
  o.controller = absl::GetFlag(FLAGS_controller);
  if (!o.controller.empty() && o.agent_token.empty()) {
    return absl::InvalidArgumentError("--controller: needs --agent_token_file (the rank joins with that token)");
  }
  if (o.controller.empty() && absl::GetFlag(FLAGS_rendezvous_dir).empty() && o.world > 1) {
    return absl::InvalidArgumentError("--controller or --rendezvous_dir: one is required with --world > 1");
  }
  o.node = absl::GetFlag(FLAGS_node);
  if (o.node.empty()) {
    char host[256] = {};
    if (gethostname(host, sizeof(host) - 1) != 0 || host[0] == '\0') {
      return absl::InvalidArgumentError("--node: empty, and the host name is unknown");
    }
    o.node = host;
  }
  return o;
}

// What the rank serves as placement-v1: the checkpoint, the default placement and this rank's
// experts of it. The placement is made over a provisional one-node topology and group of
// `world` ranks: the real ones come with the first epoch, which rebinds it (LayerExecutor::Bind).
struct Model {
  std::unique_ptr<SafetensorsFile> file;  // the single-file checkpoint's contents (else null)
  std::unique_ptr<CheckpointReader> checkpoint;
  Topology topology;
  ProcessGroup group;
  std::shared_ptr<const PlacementManifest> manifest;
  LocalExperts local;
};

// Step: open the checkpoint, place it and load this rank's experts of every MoE layer, with
// progress in the log and the metrics. A load over the host memory available, or over the free
// memory of device-resident kernels (`kernels`, may be null), fails before it reads a byte,
// naming the numbers. Every error is the input's (exit status 2).
absl::StatusOr<Model> LoadModel(const RankdOptions& o, kernels::ExpertKernels* kernels, RankMetrics* metrics) {
  Model model;
  auto reader = OpenCheckpoint(absl::GetFlag(FLAGS_checkpoint), &model.file);
  if (!reader.ok()) return Annotate(reader.status(), "--checkpoint");
  model.checkpoint = *std::move(reader);
  const CheckpointReader& ckpt = *model.checkpoint;
  spdlog::info("checkpoint {}: {}; experts in {}", ckpt.version(), ckpt.Describe(), ExpertDtypeName(o.expert_dtype));
  model.topology = Topology::SingleNode(o.world);
  model.group = LocalClusterGroup(o.world, 0);
  auto manifest = DefaultPlacement(PlacementVersion(1), ckpt.shape().num_experts, absl::GetFlag(FLAGS_extra_replicas),
                                   model.topology, model.group, ckpt.Identity());
  if (!manifest.ok()) return Annotate(manifest.status(), "placement");
  if (absl::Status s = VerifyForPublish(**manifest, model.group, model.topology); !s.ok()) {
    return Annotate(s, "placement");
  }
  model.manifest = *std::move(manifest);
  LoadOptions lo;
  lo.threads = std::max(1, absl::GetFlag(FLAGS_load_threads));
  lo.max_bytes = AvailableHostBytes();
  if (kernels != nullptr && kernels->device_resident()) {
    ASSIGN_OR_RETURN(int64_t need, LocalExpertBytes(ckpt, *model.manifest, Rank(o.rank)));
    if (o.expert_dtype == ExpertDtype::kFp8) {
      // E4M3 (half the BF16 bytes), a 4-byte scale per 128 x 128 block, the 64 MB staging buffer.
      need = need / 2 + need / 2 / 4096 + (int64_t{64} << 20);
    }
    if (const int64_t free = kernels->AvailableBytes(); free >= 0 && need > free) {
      return absl::ResourceExhaustedError(absl::StrCat("weights: rank ", o.rank, " would hold ", need, " bytes of ",
                                                       ExpertDtypeName(o.expert_dtype), " experts on ", kernels->name(),
                                                       ", ", free, " bytes of device memory are free"));
    }
  }
  if (ckpt.layers().size() > 0 && ckpt.RecordedDigest(ckpt.layers().front(), 0).empty()) {
    spdlog::warn(
        "checkpoint {} records no expert digests: the ranks cannot check each other's copies "
        "(moectl checkpoint digest DIR --version V records them)",
        ckpt.version());
  }
  lo.progress = [metrics](const LoadProgress& p) {
    metrics->CheckpointLoad(p.bytes_done, p.bytes_total, p.layers_done, p.layers_total, p.seconds);
    if (p.layers_done == p.layers_total || p.layers_total <= 64 || p.layers_done % 8 == 0) {
      spdlog::info("checkpoint load: {}/{} layers, {:.1f}/{:.1f} MB, {:.2f} GB/s", p.layers_done, p.layers_total,
                   p.bytes_done / 1e6, p.bytes_total / 1e6, p.seconds > 0 ? p.bytes_done / p.seconds / 1e9 : 0.0);
    }
  };
  auto local = LoadLocalExperts(ckpt, *model.manifest, Rank(o.rank), lo);
  if (!local.ok()) return Annotate(local.status(), "weights");
  model.local = *std::move(local);
  return model;
}

// Kernels and transport: CPU + UCX built in; CUDA + NCCL from the plugin (server/cuda_backend.h).
// Members in this order so the transport goes before the kernels, and both before the plugin.
struct Backend {
  std::optional<CudaBackend> cuda;
  std::unique_ptr<kernels::ExpertKernels> kernels;
  std::unique_ptr<Transport> transport;
};

// Step: load the CUDA backend plugin when --kernels or --transport needs it (a missing or
// unusable plugin is the deployment's: exit status 2).
absl::Status LoadCudaBackend(const RankdOptions& o, Backend* b) {
  if (!o.UsesCudaBackend()) return absl::OkStatus();
  auto loaded = CudaBackend::Load(absl::GetFlag(FLAGS_cuda_backend), o.cuda_tuning);
  if (!loaded.ok())
    return Annotate(loaded.status(), absl::StrCat("--kernels=", o.kernels, " --transport=", o.transport));
  b->cuda = *loaded;
  return absl::OkStatus();
}

// Step: create the kernels (exit status 1 on failure).
absl::Status CreateKernels(const RankdOptions& o, Backend* b) {
  if (o.kernels == "cuda") {
    auto k = b->cuda->CreateKernels(o.gpu);
    if (!k.ok()) return Annotate(k.status(), absl::StrCat("--kernels=cuda --gpu ", o.gpu));
    b->kernels = *std::move(k);
  } else {
    b->kernels = kernels::CreateCpuKernels();
  }
  return absl::OkStatus();
}

// One process-group epoch as this rank joins it: the members in peer-slot order with their
// endpoints, and every rank's node (the topology).
struct EpochView {
  int64_t epoch = 0;
  std::vector<int32_t> peers;
  std::vector<std::string> endpoints;  // per peer slot
  std::vector<std::string> node_of_rank;
};

// The rank's data plane across epochs: Prepare leaves the epoch being served (steps answer
// UNAVAILABLE naming the next one, the transport is interrupted and destroyed) and opens a fresh
// endpoint; Connect joins the formed epoch's transport and binds the executor to it, open for
// steps at once (`open`) or at Open, once every member has bound it (the controller's SERVING).
class DataPlane {
 public:
  DataPlane(const RankdOptions& o, Backend* backend, LayerExecutor* executor, RankMetrics* metrics)
      : o_(o), backend_(backend), executor_(executor), metrics_(metrics) {}

  // Told whether the engine API can serve steps (an epoch is open): its gRPC health.
  void SetServingHook(std::function<void(bool)> hook) { serving_hook_ = std::move(hook); }
  // The epoch open for steps (0: none).
  int64_t serving_epoch() const { return serving_epoch_.load(); }

  absl::StatusOr<std::string> Prepare(int64_t epoch, const std::vector<int32_t>& peers, const std::string& reason) {
    prepared_at_ = absl::Now();
    serving_epoch_ = 0;
    if (serving_hook_) serving_hook_(false);
    executor_->Unbind(absl::StrCat("rank ", o_.rank, ": the process group is re-forming as epoch ", epoch, " (", reason,
                                   "); retry the step"));
    metrics_->Epoch(0);
    backend_->transport.reset();
    listener_.reset();
    if (o_.transport == "nccl") {
      if (peers.empty() || peers.front() != o_.rank) return std::string();
      return backend_->cuda->NcclUniqueId();  // this rank is peer slot 0: the group's bootstrap
    }
    auto listener = CreateUcxListener(absl::GetFlag(FLAGS_ucx_host), absl::GetFlag(FLAGS_ucx_net_devices));
    if (!listener.ok()) return Annotate(listener.status(), "ucx");
    listener_ = *std::move(listener);
    return UcxListenerAddress(*listener_);
  }

  // This process no longer serves any epoch (the controller refused it as replaced by a newer
  // process of its rank): steps answer UNAVAILABLE naming why, the transport is destroyed.
  void Leave(const std::string& why) {
    serving_epoch_ = 0;
    if (serving_hook_) serving_hook_(false);
    executor_->Unbind(absl::StrCat("rank ", o_.rank, ": this process no longer serves (", why, ")"));
    metrics_->Epoch(0);
    backend_->transport.reset();
    listener_.reset();
  }

  absl::Status Connect(const EpochView& view, bool open) {
    absl::Status s = ConnectOnce(view, open);
    metrics_->EpochChange(s.ok() ? "bound" : "failed", absl::ToDoubleSeconds(absl::Now() - prepared_at_));
    if (!s.ok()) {
      backend_->transport.reset();
      return s;
    }
    spdlog::info("process group: epoch {} bound, peer slot {} of {} (ranks [{}]) in {:.3f} s", view.epoch,
                 backend_->transport->slot(), view.peers.size(), absl::StrJoin(view.peers, ","),
                 absl::ToDoubleSeconds(absl::Now() - prepared_at_));
    if (open) Serving(view.epoch);
    return absl::OkStatus();
  }

  // Every member bound `epoch`: steps run from now on (a stale epoch's message does nothing).
  void Open(int64_t epoch) {
    if (executor_->Open(epoch)) Serving(epoch);
  }

 private:
  void Serving(int64_t epoch) {
    serving_epoch_ = epoch;
    metrics_->Epoch(epoch);
    if (serving_hook_) serving_hook_(true);
    spdlog::info("process group: epoch {} serving, {:.3f} s after its PREPARE", epoch,
                 absl::ToDoubleSeconds(absl::Now() - prepared_at_));
  }

  absl::Status ConnectOnce(const EpochView& view, bool open) {
    const auto me = std::find(view.peers.begin(), view.peers.end(), o_.rank);
    if (me == view.peers.end()) return absl::FailedPreconditionError("epoch: this rank is not a member");
    const int slot = static_cast<int>(me - view.peers.begin());
    if (view.endpoints.size() != view.peers.size()) return absl::InvalidArgumentError("epoch: one endpoint per peer");
    if (static_cast<int>(view.node_of_rank.size()) != o_.world) {
      return absl::InvalidArgumentError(
          absl::StrCat("epoch: ", view.node_of_rank.size(), " nodes for a world of ", o_.world));
    }
    ASSIGN_OR_RETURN(Topology topology, Topology::FromNodeNames(view.node_of_rank));
    std::vector<Rank> ranks;
    for (int32_t r : view.peers) {
      if (r < 0 || r >= o_.world) {
        return absl::InvalidArgumentError(absl::StrCat("epoch: member rank ", r, " outside [0, ", o_.world, ")"));
      }
      ranks.push_back(Rank(r));
    }
    ASSIGN_OR_RETURN(ProcessGroup group,
                     ProcessGroup::Create(ProcessGroupId("ep-group-0"), ProcessGroupEpoch(view.epoch), ranks));
    if (o_.transport == "nccl") {
      NcclBackendOptions nccl;
      nccl.slot = slot;
      nccl.size = static_cast<int>(view.peers.size());
      nccl.device = o_.gpu;
      nccl.unique_id = view.endpoints.front();
      nccl.rendezvous_dir = absl::GetFlag(FLAGS_rendezvous_dir);
      nccl.host_agreement = absl::GetFlag(FLAGS_nccl_host_agreement);
      nccl.wait_poll_us = std::clamp(absl::GetFlag(FLAGS_nccl_wait_poll_us), 0, 100000);
      ASSIGN_OR_RETURN(backend_->transport, backend_->cuda->CreateNccl(nccl));
    } else {
      if (listener_ == nullptr) return absl::FailedPreconditionError("ucx: no listener prepared for this epoch");
      UcxOptions ucx;
      ucx.slot = slot;
      ucx.net_devices = absl::GetFlag(FLAGS_ucx_net_devices);
      ucx.addresses = view.endpoints;
      auto transport = CreateUcxTransportWithListener(std::move(listener_), ucx);
      if (!transport.ok()) return Annotate(transport.status(), "ucx");
      backend_->transport = *std::move(transport);
    }
    DecodeGraphFactory graphs;
    // Decode graphs where experts and rows live on the GPU and NCCL moves them; on the CPU
    // backend admission still runs and each decode step reports why it ran eagerly.
    if (o_.kernels == "cuda" && o_.transport == "nccl")
      graphs = backend_->cuda->DecodeGraphs(backend_->transport.get());
    return executor_->Bind(backend_->transport.get(), topology, group, std::move(graphs), open);
  }

  const RankdOptions& o_;
  std::function<void(bool)> serving_hook_;
  Backend* backend_;
  LayerExecutor* executor_;
  RankMetrics* metrics_;
  UcxListener listener_;
  absl::Time prepared_at_;
  std::atomic<int64_t> serving_epoch_{0};  // read by the main thread, written on the member's
};

// Without a controller: the ranks meet in --rendezvous_dir (each publishes its endpoint and node)
// and form one epoch (--epoch) for their lifetime. Stale files of an earlier run are the caller's
// to clear.
absl::Status JoinThroughFiles(const RankdOptions& o, DataPlane* plane) {
  const int64_t epoch = absl::GetFlag(FLAGS_epoch);
  std::vector<int32_t> peers(o.world);
  for (int r = 0; r < o.world; ++r) peers[r] = r;
  ASSIGN_OR_RETURN(std::string endpoint, plane->Prepare(epoch, peers, "start"));
  EpochView view;
  view.epoch = epoch;
  view.peers = peers;
  view.node_of_rank.assign(o.world, o.node);
  view.endpoints.assign(o.world, endpoint);
  if (o.world > 1) {
    const std::string dir = absl::GetFlag(FLAGS_rendezvous_dir);
    // One byte in front: a member without an endpoint (NCCL, slot > 0) still publishes a file.
    RETURN_IF_ERROR(PublishFile(dir, absl::StrCat(o.rank, ".endpoint"), "E" + endpoint));
    RETURN_IF_ERROR(PublishFile(dir, absl::StrCat(o.rank, ".node"), o.node));
    std::vector<std::string> names;
    for (int r = 0; r < o.world; ++r) names.push_back(absl::StrCat(r, ".endpoint"));
    for (int r = 0; r < o.world; ++r) names.push_back(absl::StrCat(r, ".node"));
    auto files = AwaitFiles(dir, names, absl::Seconds(60));
    if (!files.ok()) return Annotate(files.status(), "rendezvous");
    for (int r = 0; r < o.world; ++r) {
      view.endpoints[r] = (*files)[r].substr(1);
      view.node_of_rank[r] = (*files)[o.world + r];
    }
  }
  return plane->Connect(view, /*open=*/true);  // no one else to wait for: the files name every member
}

// With a controller: the group member whose PREPARE / FORMED drive `plane`.
std::unique_ptr<GroupMember> JoinThroughController(const RankdOptions& o, int agent_port, DataPlane* plane,
                                                   LayerExecutor* executor, RankMetrics* metrics) {
  GroupMemberOptions go;
  go.controller = o.controller;
  go.credentials = ChannelCredentials(o.tls);
  go.token = o.agent_token;
  go.join.set_rank(o.rank);
  go.join.set_world(o.world);
  go.join.set_node(o.node);
  go.join.add_devices(o.UsesCudaBackend() ? absl::StrCat("cuda:", o.gpu) : "cpu");
  const std::string advertise = absl::GetFlag(FLAGS_advertise_host);
  go.join.set_agent_address(
      absl::StrCat(advertise.empty() ? absl::GetFlag(FLAGS_ucx_host) : advertise, ":", agent_port));
  go.join.set_transport(o.transport);
  go.prepare = [plane](const v1::PrepareEpoch& p) {
    return plane->Prepare(p.epoch(), std::vector<int32_t>(p.peers().begin(), p.peers().end()), p.reason());
  };
  go.connect = [plane](const v1::GroupView& v) {
    EpochView view;
    view.epoch = v.epoch();
    for (const v1::GroupMember& m : v.members()) {
      view.peers.push_back(m.rank());
      view.endpoints.push_back(m.endpoint());
    }
    view.node_of_rank.assign(v.node_of_rank().begin(), v.node_of_rank().end());
    return plane->Connect(view, /*open=*/false);  // opened by SERVING, once every member is bound
  };
  go.serve = [plane](int64_t epoch) { plane->Open(epoch); };
  go.fenced = [plane](const std::string& why) { plane->Leave(why); };
  auto member = std::make_unique<GroupMember>(std::move(go));
  // A step that left the epoch's transport failed: only a new epoch heals it.
  executor->SetEpochFaultListener([m = member.get(), metrics](int64_t epoch, const std::string& why) {
    metrics->EpochFault();
    m->ReportFault(epoch, why);
  });
  member->Start();
  return member;
}

// Step: the layer executor over the kernels, serving placement-v1 from `registry`; unbound until
// the group's first epoch (DataPlane::Connect).
absl::StatusOr<std::unique_ptr<LayerExecutor>> BuildExecutor(const RankdOptions& o, GenerationRegistry* registry,
                                                             const Backend& b) {
  LayerExecutorOptions eo;
  eo.rank = Rank(o.rank);
  eo.registry = registry;
  eo.kernels = b.kernels.get();
  eo.timeout = absl::Milliseconds(absl::GetFlag(FLAGS_timeout_ms));
  eo.decode_rank_tokens = absl::GetFlag(FLAGS_decode_bucket_tokens);
  eo.decode_slot_routes = absl::GetFlag(FLAGS_decode_bucket_slot_routes);
  eo.decode_runner = o.decode_runner;
  eo.device_plan = absl::GetFlag(FLAGS_device_plan);
  eo.lone_decode_on_kernels = absl::GetFlag(FLAGS_lone_decode_on_kernels);
  eo.lone_decode_graphs = absl::GetFlag(FLAGS_lone_decode_graphs);
  eo.lone_decode_recordings = absl::GetFlag(FLAGS_lone_decode_recordings);
  eo.lone_member_graphs = absl::GetFlag(FLAGS_lone_member_graphs);
  eo.expert_dtype = o.expert_dtype;
  if (o.trial_drift) {
    eo.fault_trial_output_scale = 1.05f;
    spdlog::warn("fault injection: trial passes on this rank return outputs scaled by 1.05");
  }
  auto executor = LayerExecutor::Create(std::move(eo));
  if (!executor.ok()) return Annotate(executor.status(), "executor");
  return executor;
}

// The daemon's gRPC side. Members in this order so that the servers are destroyed before the
// services they call, and those before the engine socket's listener.
struct Serving {
  std::string socket_path;
  std::unique_ptr<UnixSocketListener> unix_listener;
  std::unique_ptr<ExpertLayerServiceImpl> engine;
  std::unique_ptr<RankAgentServiceImpl> agent;
  std::unique_ptr<grpc::Server> tcp_server;
  std::unique_ptr<grpc::Server> unix_server;
  HealthOnlyServer health_server;  // --health_listen: plaintext health for probes
  int port = 0;                    // the TCP port; 0 when there is no TCP server
  bool engine_on_tcp = false;
};

// Step: the engine API's Unix socket, whose connections are admitted by their uid before gRPC
// sees them (a socket path that cannot be bound is the input's: exit status 2).
absl::Status OpenEngineSocket(const RankdOptions& o, Serving* s) {
  s->socket_path = absl::GetFlag(FLAGS_engine_socket);
  if (s->socket_path.empty()) s->socket_path = absl::StrCat("/tmp/moe-rankd-", geteuid(), "-", o.rank, ".sock");
  ASSIGN_OR_RETURN(s->unix_listener, UnixSocketListener::Create(s->socket_path, o.engine_uids));
  return absl::OkStatus();
}

// Step: the engine service and the agent, served on the Unix socket and, when there is something
// to serve on it, on a TCP port (exit status 1 on failure).
// The build of the code that runs this rank's experts, "<kernels>:<first 16 hex of SHA-256>":
// the CUDA plugin for --kernels cuda, this executable otherwise (release bundles may pin it).
std::string KernelBuild(const RankdOptions& o) {
  const std::string file =
      o.kernels == "cuda" ? CudaBackendFile(absl::GetFlag(FLAGS_cuda_backend)) : std::string("/proc/self/exe");
  std::ifstream in(file, std::ios::binary);
  Sha256Hex h;
  std::vector<char> buf(1 << 20);
  while (in.read(buf.data(), static_cast<std::streamsize>(buf.size())) || in.gcount() > 0) {
    h.Update(buf.data(), static_cast<size_t>(in.gcount()));
  }
  return absl::StrCat(o.kernels, ":", h.Finish().substr(0, 16));
}

absl::Status StartServices(const RankdOptions& o, const Model& m, GenerationRegistry* registry, LayerExecutor* executor,
                           RankMetrics* metrics, Serving* s) {
  EngineApiOptions api = o.api;
  UnixSocketListener* listener = s->unix_listener.get();
  api.peer_uid = [listener](const std::string& peer) { return listener->PeerUid(peer); };
  s->engine_on_tcp = !api.token.empty();
  s->engine = std::make_unique<ExpertLayerServiceImpl>(executor, metrics, api);
  if (const int rings = absl::GetFlag(FLAGS_max_step_rings); rings > 0) {
    StepRingsOptions ro;
    ro.socket_path = s->socket_path + ".ring";
    ro.max_rings = rings;
    const int uids = std::max<int>(static_cast<int>(o.engine_uids.size()), 1);
    const int per_uid = absl::GetFlag(FLAGS_max_step_rings_per_uid);
    ro.max_rings_per_uid = per_uid > 0 ? std::min(per_uid, rings) : std::max(rings / uids, 1);
    ro.max_ring_bytes = static_cast<uint64_t>(std::max<int64_t>(absl::GetFlag(FLAGS_max_ring_bytes), 0));
    ro.spin_us = std::max<int64_t>(absl::GetFlag(FLAGS_ring_spin_us), 0);
    ro.check_threads = std::clamp(absl::GetFlag(FLAGS_ring_check_threads), 0, 64);
    RETURN_IF_ERROR(s->engine->EnableStepRings(std::move(ro)));
  }
  if (!o.agent_token.empty()) {
    RankAgentContext ac{Rank(o.rank), registry, executor, m.checkpoint.get(), o.agent_token, ChannelCredentials(o.tls)};
    // The coordinates a release bundle must name to be prepared here (0x0CB).
    ac.runtime.set_decode_runner(absl::GetFlag(FLAGS_decode_runner));
    ac.runtime.set_decode_bucket_tokens(absl::GetFlag(FLAGS_decode_bucket_tokens));
    ac.runtime.set_decode_bucket_slot_routes(absl::GetFlag(FLAGS_decode_bucket_slot_routes));
    ac.runtime.set_dtype(o.expert_dtype == ExpertDtype::kFp8 ? "FP8" : "BF16");
    ac.runtime.set_kernel_build(KernelBuild(o));
    s->agent = std::make_unique<RankAgentServiceImpl>(std::move(ac));
  }
  // gRPC's message limit: the request bytes plus room for the top-k ids and gates (8 bytes a
  // route at most 64 routes a token) and framing.
  const int64_t message_limit =
      std::min<int64_t>(api.max_request_bytes + api.max_step_tokens * 64 * 8 + (1 << 16), (int64_t{1} << 31) - 1);
  // The probes' port first: nothing long-lived is open yet if it cannot be bound.
  ASSIGN_OR_RETURN(s->health_server, ServeHealthOnly(absl::GetFlag(FLAGS_health_listen)));
  // A TCP server only with something to serve on it.
  std::vector<grpc::Service*> tcp_services;
  if (s->agent != nullptr) tcp_services.push_back(s->agent.get());
  if (s->engine_on_tcp) tcp_services.push_back(s->engine.get());
  if (!tcp_services.empty() || absl::GetFlag(FLAGS_tcp_health)) {
    GrpcServeOptions to;
    to.listen = absl::GetFlag(FLAGS_listen);
    to.max_message_bytes = static_cast<int>(message_limit);
    to.health = absl::GetFlag(FLAGS_tcp_health);
    to.tls = o.tls;
    ASSIGN_OR_RETURN(s->tcp_server, ServeGrpc(tcp_services, to, &s->port));
  }
  GrpcServeOptions uo;
  uo.max_message_bytes = static_cast<int>(message_limit);
  uo.health = true;
  int no_port = 0;
  ASSIGN_OR_RETURN(s->unix_server, ServeGrpc({s->engine.get()}, uo, &no_port));
  listener->Start(s->unix_server.get());
  return absl::OkStatus();
}

// Waits until the rank serves its first epoch (open for steps): true, or false when SIGTERM /
// SIGINT came first.
bool AwaitFirstEpoch(const sigset_t& signals, const DataPlane& plane) {
  const timespec poll = {0, 20 * 1000 * 1000};
  while (plane.serving_epoch() == 0) {
    if (sigtimedwait(&signals, nullptr, &poll) > 0) return false;
  }
  return true;
}

// gRPC health of the engine API (readiness): SERVING only while an epoch is bound and the
// rank is not draining. The whole server ("", liveness) stays SERVING until the drain.
constexpr char kEngineService[] = "moe.v1.ExpertLayerService";
void SetEngineHealth(Serving* s, bool serving) {
  SetHealth({s->tcp_server.get(), s->unix_server.get(), s->health_server.get()}, kEngineService, serving);
}

// Drains the servers: health turns NOT_SERVING, steps in flight finish (5 s at most), new ones
// get UNAVAILABLE; then the rank leaves its process group (`member`, may be null: the controller
// re-forms it without this rank) and the servers stop.
void ShutDown(Serving* s, GroupMember* member) {
  // Every service, the engine API's too.
  SetHealth({s->tcp_server.get(), s->unix_server.get(), s->health_server.get()}, "", false);
  s->engine->Drain();
  if (member != nullptr) member->Stop();
  s->unix_listener.reset();  // no new engine connections
  const auto grace = std::chrono::system_clock::now() + std::chrono::seconds(5);
  if (s->tcp_server != nullptr) s->tcp_server->Shutdown(grace);
  s->unix_server->Shutdown(grace);
  if (s->health_server.get() != nullptr) s->health_server.get()->Shutdown(grace);
  spdlog::info("drained, exiting");
}

int Main() {
  auto options = ParseRankdOptions();
  if (!options.ok()) return Fail(options.status(), ExitCode(options.status()));
  const RankdOptions& o = *options;
  // The exposer starts first: civetweb fails to bind once UCX has initialized in this process.
  RankMetrics metrics(absl::GetFlag(FLAGS_release));
  metrics.Generation(1);
  auto exposer = StartExposer(absl::GetFlag(FLAGS_metrics_listen), absl::GetFlag(FLAGS_metrics_port_file));
  if (!exposer.ok()) return Fail(exposer.status(), kExitFailure);
  (*exposer)->RegisterCollectable(metrics.registry());
  // The exposer holds collectables weakly.
  const auto build_info = BuildInfoRegistry("moe_build_info", {{"component", "moe-rankd"},
                                                               {"kernels", o.kernels},
                                                               {"transport", o.transport},
                                                               {"kernel_build", KernelBuild(o)},
                                                               {"expert_dtype", ExpertDtypeName(o.expert_dtype)}});
  (*exposer)->RegisterCollectable(build_info);

  // Block the termination signals in every thread; the main thread waits for them below.
  sigset_t signals = BlockTerminationSignals();
  // Under systemd (Type=notify, deploy/systemd): READY once the first epoch serves, a watchdog.
  const char* notify_env = std::getenv("NOTIFY_SOCKET");
  const std::string notify = notify_env == nullptr ? "" : notify_env;
  const auto watchdog = StartSdWatchdog(notify, SdWatchdogInterval(std::getenv("WATCHDOG_USEC")));

  Backend backend;
  if (absl::Status s = LoadCudaBackend(o, &backend); !s.ok()) return Fail(s, kExitUsage);
  if (absl::Status s = CreateKernels(o, &backend); !s.ok()) return Fail(s, kExitFailure);
  auto model = LoadModel(o, backend.kernels.get(), &metrics);
  if (!model.ok()) return Fail(model.status(), kExitUsage);
  GenerationRegistry registry;
  registry.Prepare(model->manifest).IgnoreError();
  registry.Activate(PlacementVersion(1)).IgnoreError();
  auto executor = BuildExecutor(o, &registry, backend);
  if (!executor.ok()) return Fail(executor.status(), kExitFailure);
  if (absl::Status s =
          (*executor)->AddGeneration(PlacementVersion(1), std::make_shared<LocalExperts>(std::move(model->local)));
      !s.ok()) {
    return Fail(Annotate(s, "weights"), kExitUsage);
  }
  auto generation_metrics =
      std::make_shared<GenerationCollector>(executor->get(), &registry, absl::GetFlag(FLAGS_release));
  (*exposer)->RegisterCollectable(generation_metrics);
  DataPlane plane(o, &backend, executor->get(), &metrics);

  Serving serving;
  if (absl::Status s = OpenEngineSocket(o, &serving); !s.ok()) return Fail(s, kExitUsage);
  if (absl::Status s = StartServices(o, *model, &registry, executor->get(), &metrics, &serving); !s.ok()) {
    return Fail(s, kExitFailure);
  }
  SetEngineHealth(&serving, false);  // until the first epoch binds
  plane.SetServingHook([&serving](bool up) { SetEngineHealth(&serving, up); });
  // The process group: through the controller (epochs for the daemon's lifetime), or one epoch
  // through --rendezvous_dir. The port file is written once the first epoch serves.
  std::unique_ptr<GroupMember> member;
  if (!o.controller.empty()) {
    member = JoinThroughController(o, serving.port, &plane, executor->get(), &metrics);
    spdlog::info("rank {} of {} on node {}: joining the process group of controller {}", o.rank, o.world, o.node,
                 o.controller);
    if (!AwaitFirstEpoch(signals, plane)) {
      ShutDown(&serving, member.get());
      return kExitOk;
    }
  } else {
    (*executor)->SetEpochFaultListener([&metrics](int64_t epoch, const std::string& why) {
      metrics.EpochFault();
      spdlog::error(
          "process group: epoch {}'s data plane failed ({}); without --controller only restarting the "
          "group re-forms it",
          epoch, why);
    });
    if (absl::Status s = JoinThroughFiles(o, &plane); !s.ok()) return Fail(s, kExitFailure);
  }
  WriteFileAtomically(absl::GetFlag(FLAGS_port_file), absl::StrCat(serving.port));
  SdNotify(notify, absl::StrCat("READY=1\nSTATUS=rank ", o.rank, " of ", o.world, " serving"));
  const char* tcp = serving.agent == nullptr && !serving.engine_on_tcp
                        ? "off"
                        : (serving.engine_on_tcp ? (serving.agent ? "agent + engine" : "engine") : "agent");
  spdlog::info(
      "rank {} of {} serving engines on unix:{} (TCP port {}: {}), metrics on {}, placement-v1 with {} local "
      "slots",
      o.rank, o.world, serving.socket_path, serving.port, tcp, (*exposer)->GetListeningPorts().at(0),
      model->manifest->LocalSlots(Rank(o.rank)).size());
  int sig = 0;
  sigwait(&signals, &sig);
  spdlog::info("signal {}: draining", sig);
  SdNotify(notify, "STOPPING=1");
  ShutDown(&serving, member.get());
  return kExitOk;
}

}  // namespace
}  // namespace moe

int main(int argc, char** argv) {
  moe::DisableMutexDeadlockDetection();
  absl::ParseCommandLine(argc, argv);
  moe::InitLogging(absl::StrCat("moe-rankd[", absl::GetFlag(FLAGS_rank), "]"), absl::GetFlag(FLAGS_log_level));
  return moe::Main();
}
