// Per-layer-step overhead of the engine API, against a bare gRPC echo of the same
// bytes, in one process and one run: an in-process moe-rankd service (one rank, loopback
// transport, CPU kernels, or CUDA ones with MOE_BENCH_KERNELS=cuda) and an Echo service on the
// same socket: the engine Unix socket, admitted by uid, as moe-rankd serves engines by default.
//
// API overhead of a step = client-observed latency - time inside the layer executor (reported
// in StepRecord.compute_latency_us): request encoding, transport, decoding, validation, response
// encoding and decoding. The echo sends the inline StepRequest's size and answers with the inline
// StepResponse's size. Medians over repetitions; unary, streaming, and unary with the rows in a
// registered shared-memory region (in and out); and through a step ring (server/step_rings.h:
// rows, routing and output in the ring's slot, a futex doorbell, no gRPC per step; the rows are
// written into the slot once, as an engine producing them there would); decode- and
// prefill-sized. A second control,
// the held echo, keeps its handler busy for as long as the step's executor ran before it
// answers (held_echo_us = its latency minus the hold): the same wait on an idle client, without
// the API's work. "ratio" is api / echo, "held" api / held echo. HOLD_TOUCH=1 makes the held
// echo stream over 16 MiB while it holds (caches as cold as after the experts ran).
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>
#include <sys/mman.h>

#include "absl/strings/str_split.h"
#include "absl/time/clock.h"

#include "bench/echo.grpc.pb.h"
#include "bench/one_member.h"
#include "bench/stats.h"
#include "kernels/api.h"
#include "kernels/numeric.h"
#include "rpc/daemon_util.h"
#include "rpc/unix_socket.h"
#include "runtime/checkpoint/synthetic.h"
#include "runtime/placement/default_placement.h"
#include "server/client.h"
#include "server/expert_layer_service.h"

namespace moe {
namespace {

using bench::Median;
using bench::Quantile;

class EchoImpl final : public bench::Echo::Service {
 public:
  explicit EchoImpl(size_t reply_bytes) : reply_(reply_bytes, 'x') {}
  grpc::Status Call(grpc::ServerContext*, const bench::EchoMessage*, bench::EchoMessage* out) override {
    Hold();
    out->set_payload(reply_);
    return grpc::Status::OK;
  }
  // The held echo keeps its handler busy for hold_us before replying, as the executor does.
  void Hold() {
    const double us = hold_us.load();
    if (us <= 0) return;
    const absl::Time until = absl::Now() + absl::Microseconds(us);
    if (std::getenv("HOLD_TOUCH") != nullptr) {
      if (scratch_.empty()) scratch_.assign(16 << 20, 1);
      uint64_t sum = 0;
      while (absl::Now() < until) {
        for (size_t i = 0; i < scratch_.size(); i += 64) sum += scratch_[i]++;
      }
      sink_ += sum;
      return;
    }
    while (absl::Now() < until) {
    }
  }
  std::atomic<double> hold_us{0};
  std::vector<uint8_t> scratch_;
  uint64_t sink_ = 0;
  grpc::Status Stream(grpc::ServerContext*,
                      grpc::ServerReaderWriter<bench::EchoMessage, bench::EchoMessage>* s) override {
    bench::EchoMessage in, out;
    out.set_payload(reply_);
    while (s->Read(&in)) {
      Hold();
      s->Write(out);
    }
    return grpc::Status::OK;
  }
  std::string reply_;
};

// MOE_BENCH_RING_SPIN_US: how long the ring's rank thread and the client spin before they sleep
// on the futex (moe-rankd --ring_spin_us, StepRingOptions::spin_us); default 50.
int64_t RingSpinUs() {
  const char* v = std::getenv("MOE_BENCH_RING_SPIN_US");
  return v != nullptr ? std::atoll(v) : 50;
}

int Main() {
  // MOE_BENCH_DFF shrinks the experts (less compute per step) to see how the overhead depends on
  // the work between request and response.
  // MOE_BENCH_EXPERTS sets the experts (8), MOE_BENCH_TOKENS the steps' tokens ("4,256"; up to
  // 8 tokens a step is a decode step).
  const int d = 2048, k = 8,
            experts = std::getenv("MOE_BENCH_EXPERTS") ? std::atoi(std::getenv("MOE_BENCH_EXPERTS")) : 8,
            f = std::getenv("MOE_BENCH_DFF") ? std::atoi(std::getenv("MOE_BENCH_DFF")) : 64;
  if (experts < k) {
    std::fprintf(stderr, "MOE_BENCH_EXPERTS: %d, at least k = %d\n", experts, k);
    return 2;
  }
  std::vector<int64_t> token_counts = {4, 256};
  if (const char* t = std::getenv("MOE_BENCH_TOKENS"); t != nullptr) {
    token_counts.clear();
    for (absl::string_view part : absl::StrSplit(t, ',')) token_counts.push_back(std::atoll(std::string(part).c_str()));
  }
  // MOE_BENCH_KERNELS=cuda runs the experts on the GPU (a --config=gpu build on a GPU machine):
  // the executor then takes microseconds and the host waits instead of computing.
  bench::OneMemberBackend backend;
  if (absl::Status s = bench::MakeOneMemberBackend(&backend); !s.ok()) {
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
    return 1;
  }
  std::printf("kernels: %s, ring spin %lld us\n", backend.kernels->name(), static_cast<long long>(RingSpinUs()));
  // MOE_BENCH_DECODE_RUNNER=kernels|padded|auto: the decode steps' expert runner.
  DecodeRunner runner = DecodeRunner::kKernels;
  if (const char* name = std::getenv("MOE_BENCH_DECODE_RUNNER"); name != nullptr) {
    auto parsed = ParseDecodeRunner(name);
    if (!parsed.ok()) {
      std::fprintf(stderr, "MOE_BENCH_DECODE_RUNNER: %s\n", parsed.status().ToString().c_str());
      return 2;
    }
    runner = *parsed;
  }
  bench::OneMemberRank rank;
  if (absl::Status s = bench::MakeOneMemberRank(backend, experts, d, f, runner, &rank); !s.ok()) {
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
    return 1;
  }
  LayerExecutor* executor = rank.executor.get();
  RankMetrics metrics("bench");
  // The engine API as moe-rankd serves it by default: a Unix socket whose callers are admitted by
  // uid (the echo control rides the same socket).
  // One listener per server below (set between runs, when no call is in flight).
  const std::string socket_path = "/tmp/moe-api-bench-" + std::to_string(getpid()) + ".sock";
  std::unique_ptr<UnixSocketListener> listener;
  EngineApiOptions api;
  api.peer_uid = [&listener](const std::string& peer) {
    return listener != nullptr ? listener->PeerUid(peer) : std::nullopt;
  };
  ExpertLayerServiceImpl service(executor, &metrics, api);
  {
    StepRingsOptions ro;
    ro.socket_path = socket_path + ".ring";
    ro.spin_us = RingSpinUs();
    if (absl::Status s = service.EnableStepRings(ro); !s.ok()) {
      std::fprintf(stderr, "%s\n", s.ToString().c_str());
      return 1;
    }
  }

  std::printf("%-8s %-7s %8s %12s %12s %12s %12s %12s %8s %8s %12s %12s\n", "payload", "mode", "tokens", "api_us",
              "echo_us", "held_echo_us", "server_us", "compute_us", "ratio", "held", "client_p50", "client_p99");
  for (int64_t tokens : token_counts) {
    v1::StepRequest req;
    req.set_layer(0);
    req.set_phase(tokens <= 8 ? v1::PHASE_DECODE : v1::PHASE_PREFILL);
    req.set_k(k);
    req.mutable_hidden()->set_dtype(v1::DTYPE_BF16);
    req.mutable_hidden()->set_rows(tokens);
    req.mutable_hidden()->set_cols(d);
    std::string data(tokens * d * 2, '\0');
    std::mt19937 rng(3);
    for (int64_t i = 0; i < tokens * d; ++i) {
      const uint16_t b = kernels::FloatToBf16(std::normal_distribution<float>(0, 1)(rng));
      std::memcpy(&data[2 * i], &b, 2);
    }
    req.mutable_hidden()->set_data(data);
    // Token t: k distinct experts spread over all of them (every expert for E = k = 8).
    for (int64_t t = 0; t < tokens; ++t) {
      for (int j = 0; j < k; ++j) {
        req.add_topk_ids(static_cast<int32_t>((t * 37 + j * (experts / k)) % experts));
        req.add_topk_weights(1.0f / k);
      }
    }
    const size_t reply_bytes = tokens * d * 2 + 64;
    EchoImpl echo(reply_bytes);
    auto created = UnixSocketListener::Create(socket_path, {});
    if (!created.ok()) {
      std::fprintf(stderr, "%s\n", created.status().ToString().c_str());
      return 1;
    }
    listener = *std::move(created);
    grpc::ServerBuilder builder;
    builder.RegisterService(&service);
    builder.RegisterService(&echo);
    builder.SetMaxReceiveMessageSize(1 << 30);
    auto server = builder.BuildAndStart();
    listener->Start(server.get());
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(1 << 30);
    auto channel = grpc::CreateCustomChannel("unix:" + socket_path, grpc::InsecureChannelCredentials(), args);
    auto stub = v1::ExpertLayerService::NewStub(channel);
    auto echo_stub = bench::Echo::NewStub(channel);
    bench::EchoMessage echo_req;
    echo_req.set_payload(std::string(req.ByteSizeLong(), 'y'));
    const int reps = 200;
    uint64_t step = 1;
    // A shared-memory region for the shm mode: hidden rows in, output rows out.
    const std::string region_name = "/moe-bench-" + std::to_string(getpid());
    const size_t region_bytes = 2 * data.size();
    const int fd = shm_open(region_name.c_str(), O_CREAT | O_RDWR, 0600);
    if (fd < 0 || ftruncate(fd, region_bytes) != 0) return 1;
    char* region = static_cast<char*>(mmap(nullptr, region_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
    close(fd);
    std::memcpy(region, data.data(), data.size());
    {
      grpc::ClientContext ctx;
      v1::RegisterRegionRequest reg;
      reg.set_name(region_name);
      reg.set_bytes(region_bytes);
      v1::RegisterRegionResponse ignored;
      if (!stub->RegisterRegion(&ctx, reg, &ignored).ok()) return 1;
    }
    v1::StepRequest shm_req = req;
    shm_req.mutable_hidden()->clear_data();
    shm_req.mutable_hidden_region()->set_region(region_name);
    shm_req.mutable_hidden_region()->set_bytes(data.size());
    shm_req.mutable_output_region()->set_region(region_name);
    shm_req.mutable_output_region()->set_offset(data.size());
    shm_req.mutable_output_region()->set_bytes(data.size());
    // The ring mode's ring: the step's rows and routing written into its slot once.
    auto ring_client = ExpertLayerClient::Connect("unix:" + socket_path, absl::Seconds(10));
    if (!ring_client.ok()) return 1;
    auto ring = (*ring_client)->OpenRing({1, tokens, d, k, RingSpinUs()});
    if (!ring.ok()) {
      std::fprintf(stderr, "ring: %s\n", ring.status().ToString().c_str());
      return 1;
    }
    {
      auto slot = (*ring)->NextSlot();
      if (!slot.ok()) return 1;
      std::memcpy(slot->hidden, data.data(), data.size());
      std::copy(req.topk_ids().begin(), req.topk_ids().end(), slot->topk_ids);
      std::copy(req.topk_weights().begin(), req.topk_weights().end(), slot->topk_weights);
    }
    for (const char* mode : {"unary", "stream", "shm", "ring"}) {
      std::vector<double> api, compute, plain, server_side, held, client;
      std::vector<std::vector<double>> stages(kNumStepPhases);
      const bool stream = std::string(mode) == "stream";
      const bool shm = std::string(mode) == "shm";
      const bool use_ring = std::string(mode) == "ring";
      grpc::ClientContext sctx, ectx;
      auto s = stream ? stub->Step(&sctx) : nullptr;
      auto es = stream ? echo_stub->Stream(&ectx) : nullptr;
      for (int r = 0; r < reps + 20; ++r) {
        // Interleave API and echo calls so both see the same machine state.
        v1::StepRequest& r_req = shm ? shm_req : req;
        r_req.set_step_id(step++);
        v1::StepResponse resp;
        absl::Time t0 = absl::Now();
        if (use_ring) {
          StepRing::StepMeta meta;
          meta.step_id = r_req.step_id();
          meta.decode = r_req.phase() == v1::PHASE_DECODE;
          meta.tokens = tokens;
          meta.k = k;
          absl::Status st = (*ring)->Submit(meta);
          absl::StatusOr<v1::StepRecord> rec = st.ok() ? (*ring)->Wait() : st;
          if (!rec.ok()) {
            std::fprintf(stderr, "ring step failed: %s\n", rec.status().ToString().c_str());
            return 1;
          }
          *resp.mutable_record() = *rec;
        } else if (stream) {
          s->Write(r_req);
          s->Read(&resp);
        } else {
          grpc::ClientContext ctx;
          const grpc::Status st = stub->Execute(&ctx, r_req, &resp);
          if (!st.ok()) {
            std::fprintf(stderr, "step failed: %s\n", st.error_message().c_str());
            return 1;
          }
        }
        const double a = absl::ToDoubleMicroseconds(absl::Now() - t0);
        auto echo_us = [&] {  // one echo call, client-observed
          bench::EchoMessage eresp;
          const absl::Time start = absl::Now();
          if (stream) {
            es->Write(echo_req);
            es->Read(&eresp);
          } else {
            grpc::ClientContext ctx;
            echo_stub->Call(&ctx, echo_req, &eresp);
          }
          return absl::ToDoubleMicroseconds(absl::Now() - start);
        };
        const double e = echo_us();
        // The same echo holding its handler for as long as this step's executor ran: the wait
        // (client threads idle, server thread busy) without the API's work.
        echo.hold_us.store(resp.record().compute_latency_us());
        const double eh = echo_us() - echo.hold_us.load();
        echo.hold_us.store(0);
        if (r >= 20) {
          held.push_back(eh);
          api.push_back(a - resp.record().compute_latency_us());
          client.push_back(a);
          const v1::StepStages& st = resp.record().stages();
          const double us[] = {st.validate_us(), st.acquire_us(), st.plan_us(),    st.agree_us(),  st.dispatch_us(),
                               st.experts_us(),  st.return_us(),  st.combine_us(), st.release_us()};
          for (int i = 0; i < kNumStepPhases; ++i) stages[i].push_back(us[i]);
          server_side.push_back(resp.record().server_latency_us() - resp.record().compute_latency_us());
          compute.push_back(resp.record().compute_latency_us());
          plain.push_back(e);
        }
      }
      if (stream) {
        s->WritesDone();
        s->Finish().IgnoreError();
        es->WritesDone();
        es->Finish().IgnoreError();
      }
      std::printf("%-8s %-7s %8lld %12.1f %12.1f %12.1f %12.1f %12.1f %7.2fx %7.2fx %12.1f %12.1f\n",
                  tokens <= 8 ? "decode" : "prefill", mode, static_cast<long long>(tokens), Median(api), Median(plain),
                  Median(held), Median(server_side), Median(compute), Median(api) / Median(plain),
                  Median(api) / Median(held), Median(client), Quantile(client, 0.99));
      if (use_ring) {  // where the executor's time went (medians, us)
        std::printf("  stages:");
        for (int i = 0; i < kNumStepPhases; ++i) {
          std::printf(" %s %.1f", StepPhaseName(static_cast<StepPhase>(i)), Median(stages[i]));
        }
        std::printf("\n");
      }
    }
    ring->reset();
    munmap(region, region_bytes);
    shm_unlink(region_name.c_str());
    listener.reset();
    server->Shutdown();
  }
  return 0;
}

}  // namespace
}  // namespace moe

int main() {
  moe::DisableMutexDeadlockDetection();  // as moe-rankd does (both the API and the echo gain)
  return moe::Main();
}
