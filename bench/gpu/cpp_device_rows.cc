// A C++ engine's decode steps on a co-located rank, rows and routing in the engine's GPU memory
// (issue 17): the C++ client's step ring with device rows (StepRingOptions::DeviceRows), with and
// without the rank's done events, timed in turns, against the same step through gRPC with host
// rows. Per step the engine records its interprocess ready event, submits, waits for the answer,
// makes its stream wait on the slot's done event (cudaStreamWaitEvent) and synchronizes that
// stream: "ready" is the submit to that point, the time until the engine's next GPU work could
// read the output. Every ring's output rows are compared bit for bit with the gRPC answer.
//   cpp_device_rows --target unix:/run/moe/0.sock --cells decode:1,decode:8 --steps 300
// (ENGINE=cpp bench/gpu/device_rows.sh starts a rank under test and runs it.) With --layers L,
// step i names MoE layer --layer + i % L, as a model's decode steps walk its layers (every layer's
// output is compared with that layer's gRPC answer).
// Prints one JSON line a cell and mode; exits non-zero on any failed step or mismatch.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"

#include "bench/stats.h"
#include "kernels/numeric.h"
#include "server/client.h"
#include "server/step_ring_layout.h"

ABSL_FLAG(std::string, target, "", "the rank's engine target (unix:/path: rings need the Unix socket)");
ABSL_FLAG(std::string, cells, "decode:1,decode:8", "phase:tokens cells");
ABSL_FLAG(int, steps, 300, "timed steps a cell and mode (after 20 untimed)");
ABSL_FLAG(int, d, 2048, "hidden width the rank serves");
ABSL_FLAG(int, k, 8, "experts per token");
ABSL_FLAG(int, experts, 128, "logical experts of the checkpoint");
ABSL_FLAG(int64_t, layer, 0, "the (first) MoE layer the steps name");
ABSL_FLAG(int, layers, 1, "the steps walk this many MoE layers from --layer, one a step");

namespace moe {
namespace {

#define CUDA_OK(expr)                                                                            \
  do {                                                                                           \
    const cudaError_t e_ = (expr);                                                               \
    if (e_ != cudaSuccess) {                                                                     \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(e_)); \
      return 1;                                                                                  \
    }                                                                                            \
  } while (0)

template <typename T>
std::string Bytes(const T& v) {
  return std::string(reinterpret_cast<const char*>(&v), sizeof(v));
}

struct Cell {
  bool decode = true;
  int64_t tokens = 1;
};

// A ring with device rows, its device slots and events (the engine's side).
struct DeviceRing {
  std::unique_ptr<StepRing> ring;
  char* device = nullptr;  // the ring's device slots (cudaMalloc)
  cudaEvent_t ready = nullptr;
  std::vector<cudaEvent_t> done;  // opened from the rank's handles (empty without done events)
  ring::DeviceGeometry geometry;
  ~DeviceRing() {
    ring.reset();
    for (cudaEvent_t e : done) cudaEventDestroy(e);
    if (ready != nullptr) cudaEventDestroy(ready);
    if (device != nullptr) cudaFree(device);
  }
};

int OpenDeviceRing(ExpertLayerClient& client, int64_t max_tokens, bool done_events, DeviceRing* r) {
  const int d = absl::GetFlag(FLAGS_d), k = absl::GetFlag(FLAGS_k), slots = 2;
  if (!ring::ComputeDeviceGeometry(max_tokens, d, k, slots, &r->geometry)) {
    std::fprintf(stderr, "device geometry overflows\n");
    return 1;
  }
  CUDA_OK(cudaMalloc(&r->device, r->geometry.total_bytes));
  CUDA_OK(cudaMemset(r->device, 0, r->geometry.total_bytes));
  cudaIpcMemHandle_t mem;
  CUDA_OK(cudaIpcGetMemHandle(&mem, r->device));
  CUDA_OK(cudaEventCreateWithFlags(&r->ready, cudaEventDisableTiming | cudaEventInterprocess));
  cudaIpcEventHandle_t ready;
  CUDA_OK(cudaIpcGetEventHandle(&ready, r->ready));
  StepRingOptions o;
  o.slots = slots;
  o.max_tokens = max_tokens;
  o.d = d;
  o.k = k;
  o.spin_us = 5000;
  o.device_rows = StepRingOptions::DeviceRows{Bytes(mem), 0, Bytes(ready), done_events};
  auto ring = client.OpenRing(o);
  if (!ring.ok()) {
    std::fprintf(stderr, "OpenRing: %s\n", ring.status().ToString().c_str());
    return 1;
  }
  r->ring = *std::move(ring);
  if (done_events && static_cast<int>(r->ring->done_events().size()) != slots) {
    std::fprintf(stderr, "the rank sent %zu done events for %d slots\n", r->ring->done_events().size(), slots);
    return 1;
  }
  for (const std::string& h : r->ring->done_events()) {
    cudaIpcEventHandle_t handle;
    std::memcpy(&handle, h.data(), sizeof(handle));
    cudaEvent_t e = nullptr;
    CUDA_OK(cudaIpcOpenEventHandle(&e, handle));
    r->done.push_back(e);
  }
  return 0;
}

struct Timing {
  std::vector<double> ready_us, answer_us;
};

// One step on `r` with the call's rows (already in every device slot) for `layer`: ready event,
// submit, wait, the done event's stream wait, synchronize. Checks the output against `want` when
// asked.
int RingStep(DeviceRing& r, const StepCall& call, int64_t layer, cudaStream_t stream, uint64_t step_id,
             const std::vector<uint16_t>* want, Timing* t) {
  auto slot = r.ring->NextSlot();
  if (!slot.ok()) {
    std::fprintf(stderr, "NextSlot: %s\n", slot.status().ToString().c_str());
    return 1;
  }
  StepRing::StepMeta meta;
  meta.step_id = step_id;
  meta.layer = layer;
  meta.decode = call.decode;
  meta.tokens = call.tokens;
  meta.k = call.k;
  meta.device_routing = true;
  const absl::Time start = absl::Now();
  CUDA_OK(cudaEventRecord(r.ready, stream));
  if (absl::Status s = r.ring->Submit(meta); !s.ok()) {
    std::fprintf(stderr, "Submit: %s\n", s.ToString().c_str());
    return 1;
  }
  auto rec = r.ring->Wait();
  const absl::Time answered = absl::Now();
  if (!rec.ok()) {
    std::fprintf(stderr, "step %llu: %s\n", static_cast<unsigned long long>(step_id), rec.status().ToString().c_str());
    return 1;
  }
  if (!r.done.empty()) CUDA_OK(cudaStreamWaitEvent(stream, r.done[r.ring->last_slot()], 0));
  CUDA_OK(cudaStreamSynchronize(stream));
  const absl::Time ready = absl::Now();
  if (t != nullptr) {
    t->ready_us.push_back(absl::ToDoubleMicroseconds(ready - start));
    t->answer_us.push_back(absl::ToDoubleMicroseconds(answered - start));
  }
  if (want != nullptr) {
    std::vector<uint16_t> got(want->size());
    CUDA_OK(cudaMemcpy(got.data(), r.device + slot->device_slot_offset + r.geometry.output_offset, got.size() * 2,
                       cudaMemcpyDeviceToHost));
    if (got != *want) {
      std::fprintf(stderr, "step %llu: the ring's output differs from the gRPC answer\n",
                   static_cast<unsigned long long>(step_id));
      return 1;
    }
  }
  return 0;
}

int Run() {
  const int d = absl::GetFlag(FLAGS_d), k = absl::GetFlag(FLAGS_k), experts = absl::GetFlag(FLAGS_experts);
  const int steps = absl::GetFlag(FLAGS_steps), layers = absl::GetFlag(FLAGS_layers);
  const int64_t first_layer = absl::GetFlag(FLAGS_layer);
  if (layers < 1 || layers > 4096) {
    std::fprintf(stderr, "--layers: %d outside [1, 4096]\n", layers);
    return 2;
  }
  std::vector<Cell> cells;
  for (absl::string_view c : absl::StrSplit(absl::GetFlag(FLAGS_cells), ',')) {
    std::vector<std::string> parts = absl::StrSplit(c, ':');
    Cell cell;
    if (parts.size() != 2 || (parts[0] != "decode" && parts[0] != "prefill") ||
        !absl::SimpleAtoi(parts[1], &cell.tokens) || cell.tokens < 1) {
      std::fprintf(stderr, "--cells: bad cell '%s'\n", std::string(c).c_str());
      return 2;
    }
    cell.decode = parts[0] == "decode";
    cells.push_back(cell);
  }
  int64_t max_tokens = 1;
  for (const Cell& c : cells) max_tokens = std::max(max_tokens, c.tokens);
  auto client = ExpertLayerClient::Connect(absl::GetFlag(FLAGS_target), absl::Seconds(30));
  if (!client.ok()) {
    std::fprintf(stderr, "Connect: %s\n", client.status().ToString().c_str());
    return 1;
  }
  DeviceRing with_events, without_events;
  if (OpenDeviceRing(**client, max_tokens, true, &with_events) != 0) return 1;
  if (OpenDeviceRing(**client, max_tokens, false, &without_events) != 0) return 1;
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::mt19937 rng(2026);
  uint64_t step_id = 1;
  int failures = 0;
  for (const Cell& cell : cells) {
    StepCall call;
    call.layer = absl::GetFlag(FLAGS_layer);
    call.decode = cell.decode;
    call.tokens = cell.tokens;
    call.d = d;
    call.k = k;
    std::normal_distribution<float> normal(0, 1);
    for (int64_t i = 0; i < cell.tokens * d; ++i) call.hidden.push_back(kernels::FloatToBf16(normal(rng)));
    for (int64_t t = 0; t < cell.tokens; ++t) {
      std::vector<int> chosen;
      while (static_cast<int>(chosen.size()) < k) {
        const int e = static_cast<int>(rng() % experts);
        if (std::find(chosen.begin(), chosen.end(), e) == chosen.end()) chosen.push_back(e);
      }
      for (int e : chosen) {
        call.topk_ids.push_back(e);
        call.topk_weights.push_back(std::uniform_real_distribution<float>(0.05f, 1.0f)(rng));
      }
    }
    // Each layer's gRPC answer (host rows), the reference every ring output must equal.
    std::vector<double> grpc_us;
    std::vector<std::vector<uint16_t>> want(layers);
    for (int i = 0; i < std::max(40, 2 * layers); ++i) {
      call.step_id = step_id++;
      call.layer = first_layer + i % layers;
      auto a = (*client)->Execute(call);
      if (!a.ok()) {
        std::fprintf(stderr, "gRPC step (layer %lld): %s\n", static_cast<long long>(call.layer),
                     a.status().ToString().c_str());
        return 1;
      }
      if (i < layers) want[i] = a->output;
      if (a->output != want[i % layers]) ++failures;
      grpc_us.push_back(a->client_latency_us);
    }
    // The rows and routing into every device slot of both rings, once.
    for (DeviceRing* r : {&with_events, &without_events}) {
      for (int s = 0; s < 2; ++s) {
        char* slot = r->device + s * r->geometry.slot_bytes;
        CUDA_OK(cudaMemcpy(slot + r->geometry.hidden_offset, call.hidden.data(), call.hidden.size() * 2,
                           cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemcpy(slot + r->geometry.ids_offset, call.topk_ids.data(), call.topk_ids.size() * 4,
                           cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemcpy(slot + r->geometry.weights_offset, call.topk_weights.data(), call.topk_weights.size() * 4,
                           cudaMemcpyHostToDevice));
      }
    }
    Timing timing[2];
    // In turns; the first 20 (and every layer's first two) untimed.
    const int warm = std::max(20, 2 * layers);
    for (int i = 0; i < warm + steps; ++i) {
      const bool timed = i >= warm, check = i < std::max(4, 2 * layers) || i % 50 == 0;
      const int64_t layer = first_layer + i % layers;
      for (int m = 0; m < 2; ++m) {
        DeviceRing& r = m == 0 ? with_events : without_events;
        const std::vector<uint16_t>* w = check ? &want[i % layers] : nullptr;
        if (RingStep(r, call, layer, stream, step_id++, w, timed ? &timing[m] : nullptr) != 0) return 1;
      }
    }
    const char* phase = cell.decode ? "decode" : "prefill";
    for (int m = 0; m < 2; ++m) {
      std::printf(
          "{\"kind\": \"cpp_device_rows\", \"cell\": \"%s:%lld\", \"mode\": \"%s\", \"ready_p50_us\": %.1f, "
          "\"ready_p99_us\": %.1f, \"answer_p50_us\": %.1f, \"steps\": %zu, \"layers\": %d}\n",
          phase, static_cast<long long>(cell.tokens), m == 0 ? "done_events" : "sync",
          bench::Median(timing[m].ready_us), bench::Quantile(timing[m].ready_us, 0.99),
          bench::Median(timing[m].answer_us), timing[m].ready_us.size(), layers);
    }
    std::printf(
        "{\"kind\": \"cpp_device_rows\", \"cell\": \"%s:%lld\", \"mode\": \"grpc_host_rows\", "
        "\"ready_p50_us\": %.1f, \"ready_p99_us\": %.1f, \"steps\": %zu}\n",
        phase, static_cast<long long>(cell.tokens), bench::Median(grpc_us), bench::Quantile(grpc_us, 0.99),
        grpc_us.size());
  }
  cudaStreamDestroy(stream);
  std::printf("cpp_device_rows: %d failure(s)\n", failures);
  return failures == 0 ? 0 : 1;
}

}  // namespace
}  // namespace moe

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return moe::Run();
}
