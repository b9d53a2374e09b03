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

#include <fstream>
#include <memory>
#include <optional>
#include <string>

#include <grpcpp/grpcpp.h>


#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "kernels/api.h"
#include "runtime/checkpoint/synthetic.h"
#include "runtime/exec/layer_executor.h"
#include "runtime/logging.h"
#include "runtime/placement/default_placement.h"
#include "runtime/status.h"
#include "runtime/transport/transport.h"
#include "server/cuda_backend.h"
#include "server/expert_layer_service.h"
#include "server/generation_metrics.h"
#include "rpc/daemon_util.h"
#include "server/metrics.h"
#include "server/rank_agent_service.h"
#include "rpc/unix_socket.h"

ABSL_FLAG(int, rank, 0, "global rank of this daemon");
ABSL_FLAG(int, world, 1, "ranks in the expert-parallel group");
ABSL_FLAG(std::string, ucx_host, "127.0.0.1", "host the UCX listener binds");
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
ABSL_FLAG(std::string, shm_prefix, "/moe-", "shared-memory regions must have names starting with this");
ABSL_FLAG(std::string, rendezvous_dir, "", "directory where ranks publish their UCX addresses");
ABSL_FLAG(std::string, checkpoint, "", "safetensors checkpoint (moectl checkpoint synth writes one)");
ABSL_FLAG(int, extra_replicas, 2, "extra replicas of the first experts in the default placement");
ABSL_FLAG(int64_t, epoch, 1, "process-group epoch");
ABSL_FLAG(int, timeout_ms, 10000, "collective timeout per step");
ABSL_FLAG(std::string, release, "dev", "release label on every metric");
ABSL_FLAG(int64_t, decode_bucket_tokens, 8, "decode graph bucket: tokens per rank");
ABSL_FLAG(int64_t, decode_bucket_slot_routes, 16, "decode graph bucket: routes per physical slot");
ABSL_FLAG(std::string, decode_runner, "kernels",
          "decode graph bucket's expert runner: kernels (decode kernels over compact segments), padded (GEMMs over "
          "slots padded to the bucket's routes per slot) or auto (padded when a full bucket gives each slot two "
          "rows or more); every rank must use the same (else decode steps serve eagerly)");
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
ABSL_FLAG(int, gpu, -1, "CUDA device of this rank (-1: the rank's index)");
ABSL_FLAG(std::string, cuda_backend, "", "path of libmoe_cuda.so (empty: next to this executable)");
ABSL_FLAG(std::string, cuda_tuning, "",
          "switches of the CUDA kernels for side-by-side measurements, e.g. pdl=0,fused_layer=0 (kernels/api.h "
          "CudaTuning; empty: the tuned defaults)");

namespace moe {
namespace {

absl::Status Annotate(const absl::Status& s, const char* what) {
  return absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
}

// Publishes this rank's UCX listener, learns the peers' addresses and connects.
absl::StatusOr<std::unique_ptr<Transport>> ConnectUcx(int rank, int world, const ProcessGroup& group) {
  auto listener = CreateUcxListener(absl::GetFlag(FLAGS_ucx_host), absl::GetFlag(FLAGS_ucx_net_devices));
  if (!listener.ok()) return Annotate(listener.status(), "ucx");
  auto addresses = RendezvousAddresses(absl::GetFlag(FLAGS_rendezvous_dir), rank, world, UcxListenerAddress(**listener),
                                       absl::Seconds(60));
  if (!addresses.ok()) return Annotate(addresses.status(), "rendezvous");
  UcxOptions ucx;
  ucx.slot = group.SlotOf(Rank(rank)).value();
  ucx.addresses = *addresses;
  auto transport = CreateUcxTransportWithListener(*std::move(listener), ucx);
  if (!transport.ok()) return Annotate(transport.status(), "ucx");
  return transport;
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

int Main() {
  const int rank = absl::GetFlag(FLAGS_rank), world = absl::GetFlag(FLAGS_world);
  if (world <= 0 || rank < 0 || rank >= world) {
    spdlog::error("--rank {} / --world {}: rank must be in [0, world)", rank, world);
    return 2;
  }
  EngineApiOptions api;
  api.max_step_tokens = absl::GetFlag(FLAGS_max_step_tokens);
  api.max_request_bytes = absl::GetFlag(FLAGS_max_request_bytes);
  api.regions.name_prefix = absl::GetFlag(FLAGS_shm_prefix);
  if (api.max_step_tokens <= 0 || api.max_step_tokens > (int64_t{1} << 24)) {
    spdlog::error("--max_step_tokens {}: expected 1 .. 2^24", api.max_step_tokens);
    return 2;
  }
  // gRPC's limits are ints; a request's message carries its rows plus top-k ids and gates.
  if (api.max_request_bytes < (1 << 20) || api.max_request_bytes > (int64_t{1} << 31) - 1) {
    spdlog::error("--max_request_bytes {}: expected 1 MiB .. 2 GiB - 1", api.max_request_bytes);
    return 2;
  }
  if (api.regions.name_prefix.size() < 2 || api.regions.name_prefix[0] != '/' ||
      api.regions.name_prefix.find('/', 1) != std::string::npos) {
    spdlog::error("--shm_prefix '{}': expected \"/name-prefix\"", api.regions.name_prefix);
    return 2;
  }
  auto uids = ParseUids(absl::GetFlag(FLAGS_engine_uids));
  if (!uids.ok()) {
    spdlog::error("{}", std::string(uids.status().message()));
    return 2;
  }
  if (!absl::GetFlag(FLAGS_engine_token_file).empty()) {
    auto token = ReadTokenFile(absl::GetFlag(FLAGS_engine_token_file), "--engine_token_file");
    if (!token.ok()) {
      spdlog::error("{}", std::string(token.status().message()));
      return 2;
    }
    api.token = *token;
  }
  // The exposer starts first: civetweb fails to bind once UCX has initialized in this process.
  RankMetrics metrics(absl::GetFlag(FLAGS_release));
  metrics.Generation(1);
  auto exposer = StartExposer(absl::GetFlag(FLAGS_metrics_listen), absl::GetFlag(FLAGS_metrics_port_file));
  if (!exposer.ok()) {
    spdlog::error("{}", std::string(exposer.status().message()));
    return 1;
  }
  (*exposer)->RegisterCollectable(metrics.registry());

  // Block the termination signals in every thread; the main thread waits for them below.
  sigset_t signals = BlockTerminationSignals();

  auto ckpt = ReadSafetensors(absl::GetFlag(FLAGS_checkpoint));
  if (!ckpt.ok()) {
    spdlog::error("--checkpoint: {}", std::string(ckpt.status().message()));
    return 2;
  }
  int num_experts = 0;
  if (!absl::SimpleAtoi(ckpt->metadata["num_experts"], &num_experts) || num_experts <= 0) {
    spdlog::error("--checkpoint: metadata has no num_experts");
    return 2;
  }
  const Topology topology = TwoNodeTopology(world);
  const ProcessGroup group = LocalClusterGroup(world, absl::GetFlag(FLAGS_epoch));
  auto manifest = DefaultPlacement(PlacementVersion(1), num_experts, absl::GetFlag(FLAGS_extra_replicas), topology, group,
                                   ckpt->metadata);
  if (!manifest.ok()) {
    spdlog::error("placement: {}", std::string(manifest.status().message()));
    return 2;
  }
  if (absl::Status s = VerifyForPublish(**manifest, group, topology); !s.ok()) {
    spdlog::error("placement: {}", std::string(s.message()));
    return 2;
  }
  auto local = LoadLocalExperts(*ckpt, **manifest, Rank(rank));
  if (!local.ok()) {
    spdlog::error("weights: {}", std::string(local.status().message()));
    return 2;
  }
  GenerationRegistry registry;
  registry.Prepare(*manifest).IgnoreError();
  registry.Activate(PlacementVersion(1)).IgnoreError();

  // Kernels and transport: CPU + UCX built in; CUDA + NCCL from the plugin (server/cuda_backend.h).
  const std::string kernels_flag = absl::GetFlag(FLAGS_kernels), transport_flag = absl::GetFlag(FLAGS_transport);
  if (kernels_flag != "cpu" && kernels_flag != "cuda") {
    spdlog::error("--kernels={}: expected cpu or cuda", kernels_flag);
    return 2;
  }
  if (transport_flag != "ucx" && transport_flag != "nccl") {
    spdlog::error("--transport={}: expected ucx or nccl", transport_flag);
    return 2;
  }
  const int gpu = absl::GetFlag(FLAGS_gpu) >= 0 ? absl::GetFlag(FLAGS_gpu) : rank;
  std::optional<CudaBackend> cuda;
  if (kernels_flag == "cuda" || transport_flag == "nccl") {
    auto tuning = kernels::ParseCudaTuning(absl::GetFlag(FLAGS_cuda_tuning));
    if (!tuning.ok()) {
      spdlog::error("--cuda_tuning: {}", std::string(tuning.status().message()));
      return 2;
    }
    auto loaded = CudaBackend::Load(absl::GetFlag(FLAGS_cuda_backend), *tuning);
    if (!loaded.ok()) {
      spdlog::error("--kernels={} --transport={}: {}", kernels_flag, transport_flag, std::string(loaded.status().message()));
      return 2;
    }
    cuda = *loaded;
  }
  std::unique_ptr<kernels::ExpertKernels> kernels;
  if (kernels_flag == "cuda") {
    auto k = cuda->CreateKernels(gpu);
    if (!k.ok()) {
      spdlog::error("--kernels=cuda --gpu {}: {}", gpu, std::string(k.status().message()));
      return 1;
    }
    kernels = *std::move(k);
  } else {
    kernels = kernels::CreateCpuKernels();
  }
  std::unique_ptr<Transport> transport;
  if (transport_flag == "nccl") {
    NcclBackendOptions nccl;
    nccl.slot = group.SlotOf(Rank(rank)).value();
    nccl.size = world;
    nccl.device = gpu;
    nccl.rendezvous_dir = absl::GetFlag(FLAGS_rendezvous_dir);
    auto t = cuda->CreateNccl(nccl);
    if (!t.ok()) {
      spdlog::error("{}", std::string(t.status().message()));
      return 1;
    }
    transport = *std::move(t);
  }
  if (transport == nullptr) {
    auto t = ConnectUcx(rank, world, group);
    if (!t.ok()) {
      spdlog::error("{}", std::string(t.status().message()));
      return 1;
    }
    transport = *std::move(t);
  }
  LayerExecutorOptions eo;
  eo.rank = Rank(rank);
  eo.topology = topology;
  eo.group = group;
  eo.registry = &registry;
  eo.transport = transport.get();
  eo.kernels = kernels.get();
  eo.timeout = absl::Milliseconds(absl::GetFlag(FLAGS_timeout_ms));
  eo.decode_rank_tokens = absl::GetFlag(FLAGS_decode_bucket_tokens);
  eo.decode_slot_routes = absl::GetFlag(FLAGS_decode_bucket_slot_routes);
  auto runner = ParseDecodeRunner(absl::GetFlag(FLAGS_decode_runner));
  if (!runner.ok()) {
    spdlog::error("--{}", std::string(runner.status().message()));
    return 2;
  }
  eo.decode_runner = *runner;
  if (absl::GetFlag(FLAGS_inject_fault) == "trial_drift") {
    eo.fault_trial_output_scale = 1.05f;
    spdlog::warn("fault injection: trial passes on this rank return outputs scaled by 1.05");
  } else if (!absl::GetFlag(FLAGS_inject_fault).empty()) {
    spdlog::error("--inject_fault={}: expected trial_drift", absl::GetFlag(FLAGS_inject_fault));
    return 2;
  }
  // Decode graphs where experts and rows live on the GPU and NCCL moves them; on the CPU
  // backend admission still runs and each decode step reports why it ran eagerly.
  if (kernels_flag == "cuda" && transport_flag == "nccl") eo.decode_graphs = cuda->DecodeGraphs(transport.get());
  auto executor = LayerExecutor::Create(std::move(eo));
  if (!executor.ok()) {
    spdlog::error("executor: {}", std::string(executor.status().message()));
    return 1;
  }
  (*executor)->AddGeneration(PlacementVersion(1), std::make_shared<LocalExperts>(*std::move(local))).IgnoreError();

  auto generation_metrics = std::make_shared<GenerationCollector>(executor->get(), absl::GetFlag(FLAGS_release));
  (*exposer)->RegisterCollectable(generation_metrics);

  // The engine API's Unix socket: connections are admitted by their uid before gRPC sees them.
  std::string socket_path = absl::GetFlag(FLAGS_engine_socket);
  if (socket_path.empty()) socket_path = absl::StrCat("/tmp/moe-rankd-", geteuid(), "-", rank, ".sock");
  auto unix_listener = UnixSocketListener::Create(socket_path, *uids);
  if (!unix_listener.ok()) {
    spdlog::error("{}", std::string(unix_listener.status().message()));
    return 2;
  }
  UnixSocketListener* listener = unix_listener->get();
  api.peer_uid = [listener](const std::string& peer) { return listener->PeerUid(peer); };
  const bool engine_on_tcp = !api.token.empty();
  ExpertLayerServiceImpl service(executor->get(), &metrics, api);
  std::unique_ptr<RankAgentServiceImpl> agent;
  if (!absl::GetFlag(FLAGS_agent_token_file).empty()) {
    auto token = ReadTokenFile(absl::GetFlag(FLAGS_agent_token_file), "--agent_token_file");
    if (!token.ok()) {
      spdlog::error("{}", std::string(token.status().message()));
      return 2;
    }
    agent = std::make_unique<RankAgentServiceImpl>(
        RankAgentContext{Rank(rank), topology, group, &registry, executor->get(), &*ckpt, *token});
  }
  // gRPC's message limit: the request bytes plus room for the top-k ids and gates (8 bytes a
  // route at most 64 routes a token) and framing.
  const int64_t message_limit =
      std::min<int64_t>(api.max_request_bytes + api.max_step_tokens * 64 * 8 + (1 << 16), (int64_t{1} << 31) - 1);
  // A TCP server only with something to serve on it.
  std::unique_ptr<grpc::Server> tcp_server;
  int port = 0;
  std::vector<grpc::Service*> tcp_services;
  if (agent != nullptr) tcp_services.push_back(agent.get());
  if (engine_on_tcp) tcp_services.push_back(&service);
  if (!tcp_services.empty() || absl::GetFlag(FLAGS_tcp_health)) {
    GrpcServeOptions o;
    o.listen = absl::GetFlag(FLAGS_listen);
    o.max_message_bytes = static_cast<int>(message_limit);
    o.health = absl::GetFlag(FLAGS_tcp_health);
    auto server = ServeGrpc(tcp_services, o, &port);
    if (!server.ok()) {
      spdlog::error("{}", std::string(server.status().message()));
      return 1;
    }
    tcp_server = *std::move(server);
  }
  GrpcServeOptions uo;
  uo.max_message_bytes = static_cast<int>(message_limit);
  uo.health = true;
  int no_port = 0;
  auto unix_server = ServeGrpc({&service}, uo, &no_port);
  if (!unix_server.ok()) {
    spdlog::error("{}", std::string(unix_server.status().message()));
    return 1;
  }
  listener->Start(unix_server->get());
  WriteFileAtomically(absl::GetFlag(FLAGS_port_file), absl::StrCat(port));
  spdlog::info("rank {} of {} serving engines on unix:{} (TCP port {}: {}), metrics on {}, placement-v1 with {} local "
               "slots",
               rank, world, socket_path, port,
               tcp_services.empty() ? "off" : (engine_on_tcp ? (agent ? "agent + engine" : "engine") : "agent"),
               (*exposer)->GetListeningPorts().at(0), (*manifest)->LocalSlots(Rank(rank)).size());

  int sig = 0;
  sigwait(&signals, &sig);
  spdlog::info("signal {}: draining", sig);
  service.Drain();
  unix_listener->reset();  // no new engine connections
  const auto grace = std::chrono::system_clock::now() + std::chrono::seconds(5);
  if (tcp_server != nullptr) tcp_server->Shutdown(grace);
  (*unix_server)->Shutdown(grace);
  spdlog::info("drained, exiting");
  return 0;
}

}  // namespace
}  // namespace moe

int main(int argc, char** argv) {
  moe::DisableMutexDeadlockDetection();
  absl::ParseCommandLine(argc, argv);
  moe::InitLogging(absl::StrCat("moe-rankd[", absl::GetFlag(FLAGS_rank), "]"), absl::GetFlag(FLAGS_log_level));
  return moe::Main();
}
