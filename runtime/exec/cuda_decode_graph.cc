#include "runtime/exec/cuda_decode_graph.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"

#include "kernels/api.h"
#include "runtime/status.h"
#include "runtime/transport/gpu_checks.h"
#include "runtime/transport/nccl.h"

namespace moe {
namespace {

int64_t Align(int64_t b) { return (b + 255) / 256 * 256; }

class CudaDecodeGraph final : public DecodeStepGraph {
 public:
  CudaDecodeGraph(Transport* transport, const DecodeGraphShape& shape) : transport_(transport), s_(shape) {}

  ~CudaDecodeGraph() override {
    cudaSetDevice(handles_.device);
    if (exec_ != nullptr) cudaGraphExecDestroy(exec_);
    if (staging_ != nullptr) cudaFreeHost(staging_);
    if (out_host_ != nullptr) cudaFreeHost(out_host_);
  }

  absl::Status Init() {
    handles_ = NativeNcclHandles(*transport_);
    if (handles_.comm == nullptr)
      return absl::FailedPreconditionError("decode graph: the transport is not a live NCCL one");
    CUDART_RETURN_IF_ERROR(cudaSetDevice(handles_.device));
    ASSIGN_OR_RETURN(kernels_, kernels::CreateCudaKernels());
    const int64_t ps = s_.peers * s_.segment_rows, lay = s_.local_slots * s_.slot_routes,
                  routes = s_.rank_tokens * s_.k;
    // Staged block (one host->device copy a step): hidden, then the tables.
    off_hidden_ = 0;
    off_send_index_ = Align(s_.rank_tokens * s_.d * 2);
    off_expert_rows_ = off_send_index_ + Align(ps * 4);
    off_layout_row_ = off_expert_rows_ + Align(lay * 4);
    off_row_of_route_ = off_layout_row_ + Align(ps * 4);
    off_gates_ = off_row_of_route_ + Align(routes * 4);
    off_offsets_ = off_gates_ + Align(routes * 4);
    block_bytes_ = off_offsets_ + Align((s_.local_slots + 1) * 8);
    CUDART_RETURN_IF_ERROR(cudaMallocHost(&staging_, block_bytes_));
    CUDART_RETURN_IF_ERROR(cudaMallocHost(&out_host_, s_.rank_tokens * s_.d * 2));
    const int64_t row = static_cast<int64_t>(s_.d) * 2;
    RETURN_IF_ERROR(block_.Reserve(kernels_.get(), block_bytes_));
    for (kernels::KernelBuffer* b : {&send_rows_, &recv_rows_, &back_rows_, &returned_}) {
      if (s_.peers == 1 && (b == &recv_rows_ || b == &returned_)) continue;  // a lone member's: not used
      RETURN_IF_ERROR(b->Reserve(kernels_.get(), ps * row));
    }
    RETURN_IF_ERROR(expert_out_.Reserve(kernels_.get(), lay * row));
    if (fp8()) RETURN_IF_ERROR(expert_in_.Reserve(kernels_.get(), lay * row));
    RETURN_IF_ERROR(out_.Reserve(kernels_.get(), s_.rank_tokens * row));

    // Warm-up: the pipeline once, eagerly, with empty tables (every member does it at this
    // step): NCCL connects the peers, the kernels size their scratch; nothing moves under the
    // graph afterwards.
    std::memset(staging_, 0, block_bytes_);
    Fill(off_send_index_, ps, -1);
    Fill(off_layout_row_, ps, -1);
    Fill(off_row_of_route_, routes, -1);
    auto stream = static_cast<cudaStream_t>(handles_.stream);
    CUDART_RETURN_IF_ERROR(cudaMemcpyAsync(block_.data(), staging_, block_bytes_, cudaMemcpyHostToDevice, stream));
    RETURN_IF_ERROR(Enqueue());
    RETURN_IF_ERROR(WaitNcclStream(*transport_, ~uint64_t{0}, s_.warmup_timeout));

    cudaGraph_t graph = nullptr;
    CUDART_RETURN_IF_ERROR(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed));
    const absl::Status captured = Enqueue();
    const cudaError_t ended = cudaStreamEndCapture(stream, &graph);
    RETURN_IF_ERROR(captured);
    CUDART_RETURN_IF_ERROR(ended);
    const cudaError_t inst = cudaGraphInstantiate(&exec_, graph, 0);
    cudaGraphDestroy(graph);
    CUDART_RETURN_IF_ERROR(inst);
    return absl::OkStatus();
  }

  absl::Status Replay(uint64_t seq, const DecodeGraphTables& t, uint16_t* out, absl::Duration timeout) override {
    if (t.tokens < 0 || t.tokens > s_.rank_tokens) {
      return absl::InvalidArgumentError(
          absl::StrCat("decode graph: ", t.tokens, " tokens, bucket holds ", s_.rank_tokens));
    }
    if (NativeNcclHandles(*transport_).comm == nullptr) {
      return absl::UnavailableError("decode graph: the NCCL communicator was aborted by an earlier failure");
    }
    CUDART_RETURN_IF_ERROR(cudaSetDevice(handles_.device));
    const int64_t ps = s_.peers * s_.segment_rows, lay = s_.local_slots * s_.slot_routes,
                  routes = s_.rank_tokens * s_.k;
    char* h = static_cast<char*>(staging_);
    if (!t.rows_on_device) std::memcpy(h + off_hidden_, t.hidden, t.tokens * s_.d * 2);
    std::memcpy(h + off_send_index_, t.send_index, ps * 4);
    std::memcpy(h + off_expert_rows_, t.expert_rows, lay * 4);
    std::memcpy(h + off_layout_row_, t.layout_row, ps * 4);
    std::memcpy(h + off_row_of_route_, t.row_of_route, routes * 4);
    std::memcpy(h + off_gates_, t.gates, routes * 4);
    std::memcpy(h + off_offsets_, t.expert_offsets, (s_.local_slots + 1) * 8);
    auto stream = static_cast<cudaStream_t>(handles_.stream);
    CUDART_RETURN_IF_ERROR(cudaMemcpyAsync(block_.data(), staging_, block_bytes_, cudaMemcpyHostToDevice, stream));
    if (t.rows_on_device) {
      // The engine's rows into the captured input, after the block that holds it. They are
      // complete: the caller waited for the engine's ready event before the step began.
      CUDART_RETURN_IF_ERROR(cudaMemcpyAsync(static_cast<char*>(block_.data()) + off_hidden_, t.hidden,
                                             t.tokens * s_.d * 2, cudaMemcpyDeviceToDevice, stream));
    }
    CUDART_RETURN_IF_ERROR(cudaGraphLaunch(exec_, stream));
    if (!t.rows_on_device) {
      CUDART_RETURN_IF_ERROR(
          cudaMemcpyAsync(out_host_, out_.data(), t.tokens * s_.d * 2, cudaMemcpyDeviceToHost, stream));
    }
    if (absl::Status waited = WaitNcclStream(*transport_, seq, timeout); !waited.ok()) {
      // The stream is left to the communicator's abort, and the graph's expert kernels after
      // the exchange still read the generation's weights once it drains. The done event marks
      // that point, so a step answered with this error keeps its generation lease until then
      // (LayerExecutor::HoldUntilDone); the output copy is not enqueued.
      if (t.rows_on_device && t.done_event != nullptr) {
        cudaEventRecord(static_cast<cudaEvent_t>(t.done_event), stream);
      }
      return waited;
    }
    if (t.rows_on_device) {
      // Only once the step succeeded: a step that timed out (its stream left to the abort) never
      // writes into the engine's memory later.
      CUDART_RETURN_IF_ERROR(cudaMemcpyAsync(out, out_.data(), t.tokens * s_.d * 2, cudaMemcpyDeviceToDevice, stream));
      if (t.done_event != nullptr) {
        CUDART_RETURN_IF_ERROR(cudaEventRecord(static_cast<cudaEvent_t>(t.done_event), stream));
      } else {
        CUDART_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
      }
    } else {
      std::memcpy(out, out_host_, t.tokens * s_.d * 2);
    }
    return absl::OkStatus();
  }

 private:
  void Fill(int64_t off, int64_t n, int32_t v) {
    int32_t* p = reinterpret_cast<int32_t*>(static_cast<char*>(staging_) + off);
    for (int64_t i = 0; i < n; ++i) p[i] = v;
  }
  template <typename T>
  const T* At(int64_t off) const {
    return reinterpret_cast<const T*>(static_cast<const char*>(block_.data()) + off);
  }

  absl::Status Exchange(const kernels::KernelBuffer& from, const kernels::KernelBuffer& to) {
    auto comm = static_cast<ncclComm_t>(handles_.comm);
    auto stream = static_cast<cudaStream_t>(handles_.stream);
    const size_t seg = static_cast<size_t>(s_.segment_rows) * s_.d * 2;
    NCCL_RETURN_IF_ERROR(ncclGroupStart());
    for (int j = 0; j < s_.peers; ++j) {
      NCCL_RETURN_IF_ERROR(ncclSend(static_cast<const char*>(from.data()) + j * seg, seg, ncclUint8, j, comm, stream));
      NCCL_RETURN_IF_ERROR(ncclRecv(static_cast<char*>(to.data()) + j * seg, seg, ncclUint8, j, comm, stream));
    }
    NCCL_RETURN_IF_ERROR(ncclGroupEnd());
    return absl::OkStatus();
  }

  bool fp8() const { return s_.fp8_gate_up != nullptr; }

  // The BF16 experts straight from the packed rows (the gather fused into the operand load).
  absl::Status Bf16Experts(bool lone, int64_t ps, int64_t lay, kernels::Stream st) {
    kernels::SwigluParams sw;
    sw.weights = {s_.w_gate_up, s_.w_down, s_.local_slots, s_.d, s_.d_ff};
    sw.x = (lone ? send_rows_ : recv_rows_).as<uint16_t>();
    sw.x_rows = ps;
    sw.x_row_index = At<int32_t>(off_expert_rows_);
    sw.device_offsets = At<int64_t>(off_offsets_);
    sw.rows = lay;
    sw.max_segment_rows = s_.slot_routes;
    // Admission holds every slot's routes to slot_routes: the padded runner's capacity.
    if (s_.padded_runner) sw.layout = {kernels::Layout::kPaddedDense, s_.slot_routes, 16, 128};
    sw.y = expert_out_.as<uint16_t>();
    return kernels_->Swiglu(sw, st);
  }

  // The whole step on the transport's stream (captured once, replayed every admitted step). A
  // lone member's segments go to itself: its experts read the packed rows and its combine the
  // expert rows where they are, with no exchange in the graph.
  absl::Status Enqueue() {
    const kernels::Stream st = handles_.stream;
    const bool lone = s_.peers == 1;
    const int64_t ps = s_.peers * s_.segment_rows, lay = s_.local_slots * s_.slot_routes;
    kernels::GatherParams pack;
    pack.d = s_.d;
    pack.in = At<uint16_t>(off_hidden_);
    pack.in_rows = s_.rank_tokens;
    pack.index = At<int32_t>(off_send_index_);
    pack.n = ps;
    pack.out = send_rows_.data();
    RETURN_IF_ERROR(kernels_->Gather(pack, st));
    if (!lone) RETURN_IF_ERROR(Exchange(send_rows_, recv_rows_));
    if (fp8()) {
      // FP8 experts take expert-major rows: the layout's rows gathered first (padding rows,
      // index -1, as zeros), then SwigluFp8 over the grouped layout's offsets.
      kernels::GatherParams in;
      in.d = s_.d;
      in.in = (lone ? send_rows_ : recv_rows_).data();
      in.in_rows = ps;
      in.index = At<int32_t>(off_expert_rows_);
      in.n = lay;
      in.out = expert_in_.data();
      RETURN_IF_ERROR(kernels_->Gather(in, st));
      kernels::SwigluFp8Params q;
      q.weights = {s_.fp8_gate_up, s_.fp8_gate_up_scales, s_.fp8_down, s_.fp8_down_scales, s_.local_slots, s_.d,
                   s_.d_ff};
      q.x = expert_in_.as<uint16_t>();
      q.rows = lay;
      q.offsets = At<int64_t>(off_offsets_);
      q.y = expert_out_.as<uint16_t>();
      RETURN_IF_ERROR(kernels_->SwigluFp8(q, st));
    } else {
      RETURN_IF_ERROR(Bf16Experts(lone, ps, lay, st));
    }
    kernels::GatherParams unpack;
    unpack.d = s_.d;
    unpack.in = expert_out_.data();
    unpack.in_rows = lay;
    unpack.index = At<int32_t>(off_layout_row_);
    unpack.n = ps;
    unpack.out = back_rows_.data();
    RETURN_IF_ERROR(kernels_->Gather(unpack, st));
    if (!lone) RETURN_IF_ERROR(Exchange(back_rows_, returned_));
    kernels::CombineParams c{(lone ? back_rows_ : returned_).as<uint16_t>(),
                             ps,
                             s_.d,
                             At<int32_t>(off_row_of_route_),
                             At<float>(off_gates_),
                             s_.rank_tokens,
                             s_.k,
                             nullptr,
                             out_.as<uint16_t>()};
    return kernels_->Combine(c, st);
  }

  Transport* transport_;
  DecodeGraphShape s_;
  NcclHandles handles_;
  std::unique_ptr<kernels::ExpertKernels> kernels_;
  kernels::KernelBuffer block_, send_rows_, recv_rows_, expert_in_, expert_out_, back_rows_, returned_, out_;
  void* staging_ = nullptr;
  void* out_host_ = nullptr;
  int64_t block_bytes_ = 0, off_hidden_ = 0, off_send_index_ = 0, off_expert_rows_ = 0, off_layout_row_ = 0,
          off_row_of_route_ = 0, off_gates_ = 0, off_offsets_ = 0;
  cudaGraphExec_t exec_ = nullptr;
};

}  // namespace

DecodeGraphFactory CudaDecodeGraphs(Transport* transport) {
  return [transport](const DecodeGraphShape& shape) -> absl::StatusOr<std::unique_ptr<DecodeStepGraph>> {
    auto g = std::make_unique<CudaDecodeGraph>(transport, shape);
    RETURN_IF_ERROR(g->Init());
    return std::unique_ptr<DecodeStepGraph>(std::move(g));
  };
}

}  // namespace moe
