// CUDA implementation of kernels/api.h (host side). GEMMs go through cuBLAS (BF16 operands,
// FP32 accumulation): gate and up are one GEMM per expert ([2 d_ff, d] weights), the SwiGLU
// activation is one fused elementwise kernel, the down projection a second GEMM. The grouped
// and block-sparse layouts run as one cublasGemmGroupedBatchedEx call per projection; the padded
// layout, whose segments are all C_exec rows, as one strided-batched GEMM.
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <mutex>
#include <vector>

#include <cublas_v2.h>

#include "absl/strings/str_cat.h"

#include "kernels/api.h"
#include "kernels/cuda/checks.h"
#include "kernels/cuda/launch.h"
#include "kernels/numeric.h"

namespace moe::kernels {
namespace {

// Host-offset SwiGLU in the grouped layout with no segment above kSmallSegmentRows rows and
// experts of at most kSmallExpertElems weights a projection runs the decode kernels
// (small_batch*.cu) instead of per-expert cuBLAS GEMMs, whose launches then dominate. Measured
// on an H200: E=128, d=2048, d_ff=768 at 16 tokens (segments of 1-5 rows) 199 us there against
// 278 us here, at 64 tokens (up to ~10 rows) 429 against 390 us; one token of the Mixtral-like
// shape (d=4096, d_ff=14336, two experts of one row) 227 us there against 207 us here, where
// cuBLAS streams the large matrices well; 8 experts of 4 rows at d=2048, d_ff=64 (the engine
// API benchmark's eager step) 230-305 us of executor time against 382-479.
constexpr int64_t kSmallSegmentRows = 4;
constexpr int64_t kSmallExpertElems = int64_t{4} << 20;

// A device allocation that only grows (the kernels object's scratch space).
class Scratch {
 public:
  ~Scratch() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  absl::StatusOr<void*> Get(size_t bytes) {
    if (bytes > size_) {
      if (ptr_ != nullptr) CUDA_RETURN_IF_ERROR(cudaFree(ptr_));
      ptr_ = nullptr;
      size_ = 0;
      CUDA_RETURN_IF_ERROR(cudaMalloc(&ptr_, bytes));
      size_ = bytes;
      ++allocations_;
    }
    return ptr_;
  }
  // How many allocations Get has made (a new one has fresh contents).
  uint64_t allocations() const { return allocations_; }

 private:
  void* ptr_ = nullptr;
  size_t size_ = 0;
  uint64_t allocations_ = 0;
};

// Pinned host staging for small host->device tables (row maps, GEMM pointer tables). A copy
// from pinned memory is asynchronous; before the buffer is refilled the previous copy's event is
// waited on, which has normally completed long before.
class PinnedStaging {
 public:
  ~PinnedStaging() {
    if (host_ != nullptr) cudaFreeHost(host_);
    if (event_ != nullptr) cudaEventDestroy(event_);
  }
  // Returns a host buffer of at least `bytes`, safe to overwrite now.
  absl::StatusOr<void*> Acquire(size_t bytes) {
    if (event_ == nullptr) CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
    if (pending_) CUDA_RETURN_IF_ERROR(cudaEventSynchronize(event_));
    pending_ = false;
    if (bytes > size_) {
      if (host_ != nullptr) CUDA_RETURN_IF_ERROR(cudaFreeHost(host_));
      host_ = nullptr;
      CUDA_RETURN_IF_ERROR(cudaMallocHost(&host_, bytes));
      size_ = bytes;
    }
    return host_;
  }
  // Copies `bytes` of the acquired buffer to `dst` on `stream` and fences the buffer.
  absl::Status CopyTo(void* dst, size_t bytes, cudaStream_t stream) {
    // Recorded work would copy whatever the buffer holds when it runs, not these bytes.
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    CUDA_RETURN_IF_ERROR(cudaStreamIsCapturing(stream, &capture));
    if (capture != cudaStreamCaptureStatusNone) {
      return absl::FailedPreconditionError("a host table staged for a copy cannot be recorded");
    }
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, host_, bytes, cudaMemcpyHostToDevice, stream));
    CUDA_RETURN_IF_ERROR(cudaEventRecord(event_, stream));
    pending_ = true;
    return absl::OkStatus();
  }

 private:
  void* host_ = nullptr;
  size_t size_ = 0;
  cudaEvent_t event_ = nullptr;
  bool pending_ = false;
};

// Large copies from pageable host memory to the device, through two pinned buffers in turn: the
// host copies one chunk while the DMA engine moves the other at the pinned rate (the driver's own
// staging of pageable copies ran at 6.8-11 GB/s on the H200 host, bench/RESULTS.md). Used by one
// copy at a time (the caller holds a lock); a copy that finds it busy goes the driver's way.
// Device-to-host copies keep the driver's path: through these buffers they measured slower.
class BounceBuffers {
 public:
  static constexpr size_t kChunk = size_t{4} << 20;
  ~BounceBuffers() {
    for (int b = 0; b < 2; ++b) {
      if (host_[b] != nullptr) cudaFreeHost(host_[b]);
      if (done_[b] != nullptr) cudaEventDestroy(done_[b]);
    }
  }
  // Returns once `src` is no longer read (the last chunks may still be on their way).
  absl::Status ToDevice(char* dst, const char* src, size_t bytes, cudaStream_t stream) {
    if (absl::Status s = Init(); !s.ok()) return s;
    for (size_t off = 0, c = 0; off < bytes; off += kChunk, ++c) {
      const int b = static_cast<int>(c & 1);
      const size_t n = std::min(kChunk, bytes - off);
      if (pending_[b]) CUDA_RETURN_IF_ERROR(cudaEventSynchronize(done_[b]));
      std::memcpy(host_[b], src + off, n);
      CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst + off, host_[b], n, cudaMemcpyHostToDevice, stream));
      CUDA_RETURN_IF_ERROR(cudaEventRecord(done_[b], stream));
      pending_[b] = true;
    }
    return absl::OkStatus();
  }

 private:
  absl::Status Init() {
    for (int b = 0; b < 2; ++b) {
      if (host_[b] == nullptr) CUDA_RETURN_IF_ERROR(cudaMallocHost(&host_[b], kChunk));
      if (done_[b] == nullptr) CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&done_[b], cudaEventDisableTiming));
    }
    return absl::OkStatus();
  }

  void* host_[2] = {nullptr, nullptr};
  cudaEvent_t done_[2] = {nullptr, nullptr};
  bool pending_[2] = {false, false};
};

// A CUDA IPC handle (memory or event) from the bytes a request carries; INVALID_ARGUMENT naming
// `field` when they are not one handle's size.
template <typename Handle>
absl::StatusOr<Handle> IpcHandle(const std::string& bytes, const char* field) {
  Handle h;
  if (bytes.size() != sizeof(h)) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": ", bytes.size(), " bytes, a CUDA IPC handle has ", sizeof(h)));
  }
  std::memcpy(&h, bytes.data(), sizeof(h));
  return h;
}

// The size of the device allocation that starts at `base` (the driver's cuMemGetAddressRange,
// found through the runtime so this library links no libcuda).
absl::StatusOr<int64_t> AddressRange(void* base) {
  using GetRange = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
  static GetRange get_range = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      fn = nullptr;
    }
    return reinterpret_cast<GetRange>(fn);
  }();
  if (get_range == nullptr) return absl::InternalError("cuMemGetAddressRange: not found in the CUDA driver");
  CUdeviceptr start = 0;
  size_t size = 0;
  if (const CUresult r = get_range(&start, &size, reinterpret_cast<CUdeviceptr>(base)); r != CUDA_SUCCESS) {
    return absl::InternalError(absl::StrCat("cuMemGetAddressRange: error ", static_cast<int>(r)));
  }
  if (start != reinterpret_cast<CUdeviceptr>(base)) {
    return absl::InternalError("cuMemGetAddressRange: the mapping does not start its allocation");
  }
  return static_cast<int64_t>(size);
}

// Whether `p` is pageable host memory (not pinned, registered or device memory).
bool Pageable(const void* p) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error of an unknown pointer
    return true;
  }
  return attr.type == cudaMemoryTypeUnregistered;
}

// Copies below this size take the driver's path (the bounce pipeline needs a few chunks to pay).
constexpr int64_t kBounceMinBytes = int64_t{2} << 20;

// One row-major GEMM problem C[m, n] = A[m, k] * B[n, k]^T (B is an nn.Linear weight).
struct Problem {
  int m, n, k;
  const void* a;
  const void* b;
  void* c;
};

class CudaKernels final : public ExpertKernels {
 public:
  CudaKernels(cublasHandle_t handle, int device, const CudaTuning& tuning)
      : handle_(handle),
        device_(device),
        loop_gemm_(tuning.gemm == CudaTuning::Gemm::kLoop),
        force_grouped_(tuning.gemm == CudaTuning::Gemm::kGrouped),
        sm90_(tuning.gemm == CudaTuning::Gemm::kAuto || tuning.gemm == CudaTuning::Gemm::kSm90),
        sm90_forced_(tuning.gemm == CudaTuning::Gemm::kSm90),
        sm90_tile_(tuning.sm90_tile),
        chain_streams_forced_(tuning.chain_streams > 0 ? std::min(kSideStreams, tuning.chain_streams) : 0),
        fused_layer_(tuning.fused_layer),
        fp8_epilogue_quant_(tuning.fp8_epilogue_quant),
        capture_branches_(std::clamp(tuning.capture_branches, 0, CudaTuning::kMaxCaptureBranches)) {
    for (int i = 0; i < kSideStreams; ++i) {
      side_ok_ = side_ok_ && cudaStreamCreateWithFlags(&side_[i], cudaStreamNonBlocking) == cudaSuccess &&
                 cublasCreate(&side_handle_[i]) == CUBLAS_STATUS_SUCCESS &&
                 cublasSetStream(side_handle_[i], side_[i]) == CUBLAS_STATUS_SUCCESS &&
                 cudaEventCreateWithFlags(&side_done_[i], cudaEventDisableTiming) == cudaSuccess;
    }
    side_ok_ = side_ok_ && cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming) == cudaSuccess;
  }
  ~CudaKernels() override {
    for (int i = 0; i < kSideStreams; ++i) {
      if (side_handle_[i] != nullptr) cublasDestroy(side_handle_[i]);
      if (side_done_[i] != nullptr) cudaEventDestroy(side_done_[i]);
      if (side_[i] != nullptr) cudaStreamDestroy(side_[i]);
    }
    if (fork_ != nullptr) cudaEventDestroy(fork_);
    if (capture_stream_ != nullptr) cudaStreamDestroy(capture_stream_);
    for (CaptureBranch& b : branches_) {
      if (b.stream != nullptr) cudaStreamDestroy(b.stream);
      if (b.fork != nullptr) cudaEventDestroy(b.fork);
      if (b.join != nullptr) cudaEventDestroy(b.join);
    }
    if (find_first_ != nullptr) cudaFree(find_first_);
    if (find_host_ != nullptr) cudaFreeHost(find_host_);
    if (find_done_ != nullptr) cudaEventDestroy(find_done_);
    cublasDestroy(handle_);
    if (workspace_ != nullptr) cudaFree(workspace_);
  }
  const char* name() const override {
    if (loop_gemm_) return "cuda(gemm: loop)";
    if (force_grouped_) return "cuda(gemm: grouped)";
    if (sm90_forced_) return "cuda(gemm: sm90)";
    return sm90_ ? "cuda(gemm: auto)" : "cuda(gemm: cublas)";
  }

  bool device_resident() const override { return true; }
  bool DecodeGemmBeatsPadded(int num_experts, int d, int d_ff, int64_t routes) const override {
    return Sm90Decode(num_experts, d, d_ff, routes);
  }
  int64_t AvailableBytes() override {
    size_t free = 0, total = 0;
    if (cudaSetDevice(device_) != cudaSuccess || cudaMemGetInfo(&free, &total) != cudaSuccess) return -1;
    return static_cast<int64_t>(free);
  }
  absl::StatusOr<void*> Allocate(int64_t bytes) override {
    CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    if (bytes < 0) return absl::InvalidArgumentError(absl::StrCat("allocate: ", bytes, " bytes"));
    void* p = nullptr;
    CUDA_RETURN_IF_ERROR(cudaMalloc(&p, bytes > 0 ? static_cast<size_t>(bytes) : 1));
    return p;
  }
  void Free(void* p) override {
    cudaSetDevice(device_);
    cudaFree(p);
    freed_.fetch_add(1, std::memory_order_release);  // recorded work may name it (LaunchCaptured)
  }
  absl::Status CopyToKernel(void* dst, const void* src, int64_t bytes, Stream stream) override {
    CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    if (bytes >= kBounceMinBytes && Pageable(src)) {
      std::unique_lock<std::mutex> lock(bounce_mu_, std::try_to_lock);
      if (lock.owns_lock()) {
        return bounce_.ToDevice(static_cast<char*>(dst), static_cast<const char*>(src), static_cast<size_t>(bytes),
                                static_cast<cudaStream_t>(stream));
      }
    }
    if (bytes > 0) {
      CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), cudaMemcpyHostToDevice,
                                           static_cast<cudaStream_t>(stream)));
    }
    return absl::OkStatus();
  }
  absl::Status RegisterHostMemory(void* p, int64_t bytes) override {
    CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    // Mapped too, so that recorded work may write it with the GPU's threads (CopyToHostOn).
    CUDA_RETURN_IF_ERROR(
        cudaHostRegister(p, static_cast<size_t>(bytes), cudaHostRegisterPortable | cudaHostRegisterMapped));
    return absl::OkStatus();
  }
  void UnregisterHostMemory(void* p) override {
    cudaSetDevice(device_);
    if (cudaHostUnregister(p) != cudaSuccess) cudaGetLastError();
  }
  absl::Status CopyToHostAsync(void* dst, const void* src, int64_t bytes, Stream stream) override {
    CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    if (bytes > 0)
      CUDA_RETURN_IF_ERROR(CopyToHostOn(dst, src, static_cast<size_t>(bytes), static_cast<cudaStream_t>(stream)));
    return absl::OkStatus();
  }
  // A copy to page-locked host memory on `st`. In recorded work, where the memory is mapped into
  // the device's address space and the copy is small, the GPU's threads write it (a kernel node:
  // the recording's launch costs the host ~2 us less than with a copy node, and the copy engine
  // is not involved); otherwise a copy.
  cudaError_t CopyToHostOn(void* dst, const void* src, size_t bytes, cudaStream_t st) {
    constexpr size_t kThreadCopyBytes = size_t{1} << 20;
    if (Recording(st) && bytes <= kThreadCopyBytes) {
      void* mapped = nullptr;
      if (cudaHostGetDevicePointer(&mapped, dst, 0) == cudaSuccess && mapped != nullptr) {
        return cuda::LaunchCopyBytes(mapped, src, static_cast<int64_t>(bytes), st);
      }
      cudaGetLastError();  // not mapped: copied below
    }
    return cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, st);
  }
  absl::Status CopyToHost(void* dst, const void* src, int64_t bytes, Stream stream) override {
    CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    if (bytes > 0) {
      CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), cudaMemcpyDeviceToHost,
                                           static_cast<cudaStream_t>(stream)));
      CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
    }
    return absl::OkStatus();
  }
  absl::Status Synchronize(Stream stream) override {
    CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
    return absl::OkStatus();
  }
  absl::Status StartFindNonFiniteBf16(const uint16_t* x, int64_t n, Stream stream) override {
    if (n < 0) return absl::InvalidArgumentError(absl::StrCat("find_non_finite: ", n, " values"));
    CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    std::lock_guard<std::mutex> lock(find_mu_);
    if (find_done_ == nullptr) {  // all three, or none (a failed setup is tried again next time)
      unsigned long long *first = nullptr, *host = nullptr;
      cudaEvent_t done = nullptr;
      cudaError_t e = cudaMalloc(&first, sizeof(unsigned long long));
      if (e == cudaSuccess) e = cudaMallocHost(&host, sizeof(unsigned long long));
      if (e == cudaSuccess) e = cudaEventCreateWithFlags(&done, cudaEventDisableTiming);
      if (e != cudaSuccess) {
        if (first != nullptr) cudaFree(first);
        if (host != nullptr) cudaFreeHost(host);
        CUDA_RETURN_IF_ERROR(e);
      }
      find_first_ = first;
      find_host_ = host;
      find_done_ = done;
    }
    // In recorded work the scan is a branch of its own from this point where one is free (nothing
    // after it on `stream` waits for it), joined at the recording's end; its event is recorded
    // each time the work runs. Elsewhere ForkCapture gives `stream` back.
    absl::StatusOr<Stream> branch = ForkCapture(stream);
    if (!branch.ok()) return branch.status();
    auto st = static_cast<cudaStream_t>(*branch);
    CUDA_RETURN_IF_ERROR(cuda::LaunchFindNonFiniteBf16(x, n, find_first_, st));
    CUDA_RETURN_IF_ERROR(CopyToHostOn(find_host_, find_first_, sizeof(unsigned long long), st));
    CUDA_RETURN_IF_ERROR(Record(find_done_, st));
    return absl::OkStatus();
  }
  absl::StatusOr<int64_t> FinishFindNonFiniteBf16() override {
    CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    std::lock_guard<std::mutex> lock(find_mu_);
    if (find_done_ == nullptr) return absl::FailedPreconditionError("find_non_finite: no scan was started");
    CUDA_RETURN_IF_ERROR(cudaEventSynchronize(find_done_));
    const unsigned long long first = *find_host_;
    return first == ~0ull ? int64_t{-1} : static_cast<int64_t>(first);
  }
  absl::StatusOr<IpcMapping> OpenIpcMemory(const std::string& handle) override {
    const absl::StatusOr<cudaIpcMemHandle_t> h = IpcHandle<cudaIpcMemHandle_t>(handle, "ipc_handle");
    if (!h.ok()) return h.status();
    CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    void* base = nullptr;
    if (const cudaError_t e = cudaIpcOpenMemHandle(&base, *h, cudaIpcMemLazyEnablePeerAccess); e != cudaSuccess) {
      cudaGetLastError();
      return absl::InvalidArgumentError(absl::StrCat("ipc_handle: the driver refused it (", cudaGetErrorString(e),
                                                     "); export it from a live allocation on this host"));
    }
    // The handle maps the exporter's whole allocation; its size bounds every access after this.
    auto range = AddressRange(base);
    if (!range.ok()) {
      cudaIpcCloseMemHandle(base);
      return range.status();
    }
    return IpcMapping{base, *range};
  }
  absl::StatusOr<void*> OpenIpcEvent(const std::string& handle) override {
    const absl::StatusOr<cudaIpcEventHandle_t> h = IpcHandle<cudaIpcEventHandle_t>(handle, "ready_event");
    if (!h.ok()) return h.status();
    CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    cudaEvent_t event = nullptr;
    if (const cudaError_t e = cudaIpcOpenEventHandle(&event, *h); e != cudaSuccess) {
      cudaGetLastError();
      return absl::InvalidArgumentError(absl::StrCat("ready_event: the driver refused it (", cudaGetErrorString(e),
                                                     "); export an interprocess event without timing"));
    }
    return static_cast<void*>(event);
  }
  void CloseIpcEvent(void* event) override {
    cudaSetDevice(device_);
    if (cudaEventDestroy(static_cast<cudaEvent_t>(event)) != cudaSuccess) cudaGetLastError();
  }
  absl::StatusOr<bool> EventDone(void* event) override {
    CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    const cudaError_t e = cudaEventQuery(static_cast<cudaEvent_t>(event));
    if (e == cudaErrorNotReady) {
      cudaGetLastError();
      return false;
    }
    CUDA_RETURN_IF_ERROR(e);
    return true;
  }
  absl::StatusOr<void*> CreateIpcEvent(std::string* handle) override {
    CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    cudaEvent_t event = nullptr;
    CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&event, cudaEventDisableTiming | cudaEventInterprocess));
    cudaIpcEventHandle_t h;
    if (const cudaError_t e = cudaIpcGetEventHandle(&h, event); e != cudaSuccess) {
      cudaEventDestroy(event);
      cudaGetLastError();
      return absl::FailedPreconditionError(
          absl::StrCat("exporting an interprocess event failed: ", cudaGetErrorString(e)));
    }
    handle->assign(reinterpret_cast<const char*>(&h), sizeof(h));
    return static_cast<void*>(event);
  }
  absl::Status RecordEvent(void* event, Stream stream) override {
    CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    CUDA_RETURN_IF_ERROR(Record(static_cast<cudaEvent_t>(event), static_cast<cudaStream_t>(stream)));
    return absl::OkStatus();
  }
  // Whether calls on `st` are being recorded (BeginCapture's stream or a branch forked from it,
  // during the capture).
  bool Recording(cudaStream_t st) const {
    if (st == nullptr || !capturing_) return false;
    if (st == capture_stream_) return true;
    for (const CaptureBranch& b : branches_) {
      if (b.pending && st == b.stream) return true;
    }
    return false;
  }
  // Records `event` on `st`; on a recording stream, as a node that records it each time the
  // recorded work runs.
  cudaError_t Record(cudaEvent_t event, cudaStream_t st) const {
    return Recording(st) ? cudaEventRecordWithFlags(event, st, cudaEventRecordExternal) : cudaEventRecord(event, st);
  }

  // Recorded work: a CUDA graph captured on a stream of its own (thread-local capture mode, so a
  // call that cannot be captured fails instead of synchronizing), instantiated once, with the
  // memory epoch it was recorded in.
  struct CapturedGraph {
    cudaGraphExec_t exec = nullptr;
    uint64_t epoch = 0;
  };
  absl::StatusOr<Stream> BeginCapture() override {
    CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    if (capturing_) return absl::FailedPreconditionError("begin_capture: a capture is already under way");
    if (capture_stream_ == nullptr) {  // the branches' streams and events first, made before any capture
      for (int i = 0; i < capture_branches_; ++i) {
        CaptureBranch& b = branches_[i];
        if (b.stream == nullptr) CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&b.stream, cudaStreamNonBlocking));
        if (b.fork == nullptr) CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&b.fork, cudaEventDisableTiming));
        if (b.join == nullptr) CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&b.join, cudaEventDisableTiming));
      }
      CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&capture_stream_, cudaStreamNonBlocking));
    }
    CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(capture_stream_, cudaStreamCaptureModeThreadLocal));
    capturing_ = true;
    capture_epoch_ = MemoryEpoch();
    return static_cast<Stream>(capture_stream_);
  }
  absl::StatusOr<Stream> ForkCapture(Stream stream) override {
    auto st = static_cast<cudaStream_t>(stream);
    if (!Recording(st)) return stream;
    for (int i = 0; i < capture_branches_; ++i) {
      CaptureBranch& b = branches_[i];
      if (b.pending) continue;
      CUDA_RETURN_IF_ERROR(cudaEventRecord(b.fork, st));
      CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(b.stream, b.fork, 0));
      b.pending = true;
      return static_cast<Stream>(b.stream);
    }
    return stream;  // no branch free: in order on `stream`
  }
  absl::StatusOr<void*> EndCapture(Stream capture) override {
    CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    if (!capturing_ || capture != static_cast<Stream>(capture_stream_)) {
      return absl::FailedPreconditionError("end_capture: not the stream of the capture under way");
    }
    capturing_ = false;
    cudaError_t e = cudaSuccess;
    for (CaptureBranch& b : branches_) {  // the branches join the recording's end
      if (!b.pending) continue;
      b.pending = false;
      if (e == cudaSuccess) e = cudaEventRecord(b.join, b.stream);
      if (e == cudaSuccess) e = cudaStreamWaitEvent(capture_stream_, b.join, 0);
    }
    cudaGraph_t graph = nullptr;
    const cudaError_t ended = cudaStreamEndCapture(capture_stream_, &graph);
    if (e == cudaSuccess) e = ended;
    const bool allocated = e == cudaSuccess && MemoryEpoch() != capture_epoch_;
    cudaGraphExec_t exec = nullptr;
    if (e == cudaSuccess && !allocated) e = cudaGraphInstantiate(&exec, graph, 0);
    if (graph != nullptr) cudaGraphDestroy(graph);
    if (e != cudaSuccess || allocated) {
      // Nothing recorded ran, so what a recorded call enqueued after the kernels' own bookkeeping
      // (a new scratch buffer's zeroed ticket) is zeroed again by the next call.
      cudaGetLastError();
      route_zeroed_ = layer_zeroed_ = ~uint64_t{0};
      return absl::FailedPreconditionError(
          allocated ? "end_capture: a recorded call allocated kernel memory (run it eagerly first)"
                    : absl::StrCat("end_capture: ", cudaGetErrorString(e)));
    }
    return static_cast<void*>(new CapturedGraph{exec, capture_epoch_});
  }
  absl::StatusOr<bool> LaunchCaptured(void* work, Stream stream) override {
    if (work == nullptr) return absl::InvalidArgumentError("launch_captured: no work");
    auto* g = static_cast<CapturedGraph*>(work);
    if (g->epoch != MemoryEpoch()) return false;
    CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    CUDA_RETURN_IF_ERROR(cudaGraphLaunch(g->exec, static_cast<cudaStream_t>(stream)));
    return true;
  }
  void DropCaptured(void* work) override {
    auto* g = static_cast<CapturedGraph*>(work);
    if (g == nullptr) return;
    cudaSetDevice(device_);
    if (g->exec != nullptr && cudaGraphExecDestroy(g->exec) != cudaSuccess) cudaGetLastError();
    delete g;
  }
  void CloseIpcMemory(void* base) override {
    cudaSetDevice(device_);
    if (cudaIpcCloseMemHandle(base) != cudaSuccess) cudaGetLastError();
  }

  absl::Status Gather(const GatherParams& p, Stream stream) override {
    CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    absl::Status s = CheckGather(p);
    if (!s.ok()) return s;
    auto st = static_cast<cudaStream_t>(stream);
    CUDA_RETURN_IF_ERROR(cuda::LaunchGatherRows(p.in, p.in_rows, p.index, p.n,
                                                static_cast<int64_t>(p.d) * DTypeBytes(p.dtype), p.out, 0, st));
    if (p.scales != ScaleGranularity::kNone) {
      CUDA_RETURN_IF_ERROR(cuda::LaunchGatherScales(p.in_scales, p.in_rows, p.index, p.n, ScaleCount(p.scales, 1, p.d),
                                                    p.out_scales, st));
    }
    return absl::OkStatus();
  }

  absl::Status HistogramScan(const HistogramParams& p, Stream stream) override {
    CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    absl::Status s = CheckHistogram(p);
    if (!s.ok()) return s;
    if (p.num_bins > 12 * 1024) return absl::InvalidArgumentError("histogram.num_bins: at most 12288 on CUDA");
    CUDA_RETURN_IF_ERROR(
        cuda::LaunchHistogramScan(p.keys, p.n, p.num_bins, p.counts, p.offsets, static_cast<cudaStream_t>(stream)));
    return absl::OkStatus();
  }

  absl::Status RouteRows(const RouteRowsParams& p, Stream stream) override {
    CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    absl::Status s = CheckRouteRows(p);
    if (!s.ok()) return s;
    if (p.num_experts > 12 * 1024) return absl::InvalidArgumentError("route_rows.num_experts: at most 12288 on CUDA");
    auto st = static_cast<cudaStream_t>(stream);
    if (cuda::RouteRowsSmall(p.num_tokens * p.k, p.num_experts)) {
      CUDA_RETURN_IF_ERROR(cuda::LaunchRouteRowsSmall(p.topk, p.num_tokens, p.k, p.num_experts, p.counts, p.offsets,
                                                      p.row_of_route, p.token_of_row, st));
      return absl::OkStatus();
    }
    if (p.num_tokens == 0) {  // (more experts than one block's routing holds): empty segments
      CUDA_RETURN_IF_ERROR(cudaMemsetAsync(p.counts, 0, static_cast<size_t>(p.num_experts) * sizeof(int64_t), st));
      CUDA_RETURN_IF_ERROR(cudaMemsetAsync(p.offsets, 0, static_cast<size_t>(p.num_experts + 1) * sizeof(int64_t), st));
      return absl::OkStatus();
    }
    auto scratch =
        route_scratch_.Get(static_cast<size_t>(cuda::RouteRowsScratchBytes(p.num_tokens * p.k, p.num_experts)));
    if (!scratch.ok()) return scratch.status();
    if (route_scratch_.allocations() != route_zeroed_) {  // new scratch: the kernels keep its ticket zero
      CUDA_RETURN_IF_ERROR(cudaMemsetAsync(*scratch, 0, 16, st));
      route_zeroed_ = route_scratch_.allocations();
    }
    CUDA_RETURN_IF_ERROR(cuda::LaunchRouteRows(p.topk, p.num_tokens, p.k, p.num_experts, p.counts, p.offsets,
                                               p.row_of_route, p.token_of_row, *scratch, st));
    return absl::OkStatus();
  }

  absl::Status SealRoutes(const SealRoutesParams& p, Stream stream) override {
    CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    if (absl::Status s = CheckSealRoutes(p); !s.ok()) return s;
    CUDA_RETURN_IF_ERROR(cuda::LaunchSealRoutes(p.ids, p.gates, p.admitted, p.routes, p.num_experts, p.key_of_expert,
                                                p.keys, p.gates_out, p.local_of_key, p.num_keys, p.local, p.status,
                                                static_cast<cudaStream_t>(stream)));
    return absl::OkStatus();
  }

  absl::Status Scatter(const ScatterParams& p, Stream stream) override {
    CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    if (absl::Status s = CheckScatter(p); !s.ok()) return s;
    CUDA_RETURN_IF_ERROR(cuda::LaunchScatterRows(p.in, p.in_rows, p.d, p.out_ld, p.dest, p.fanout, p.out_rows, p.out,
                                                 static_cast<cudaStream_t>(stream)));
    return absl::OkStatus();
  }

  absl::Status ComposeIndex(const ComposeIndexParams& p, Stream stream) override {
    CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    if (absl::Status s = CheckComposeIndex(p); !s.ok()) return s;
    CUDA_RETURN_IF_ERROR(cuda::LaunchComposeIndex(p.a, p.a_n, p.b, p.n, p.out, static_cast<cudaStream_t>(stream)));
    return absl::OkStatus();
  }

  absl::Status RankByKey(const RankByKeyParams& p, Stream stream) override {
    CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    if (absl::Status s = CheckRankByKey(p); !s.ok()) return s;
    if (p.num_keys > cuda::kMaxRankKeys) {
      return absl::InvalidArgumentError(absl::StrCat("rank_by_key.num_keys: at most ", cuda::kMaxRankKeys, " on CUDA"));
    }
    auto scratch = rank_scratch_.Get(static_cast<size_t>(cuda::RankByKeyScratchBytes(p.n, p.num_keys)));
    if (!scratch.ok()) return scratch.status();
    CUDA_RETURN_IF_ERROR(cuda::LaunchRankByKey(p.raw, p.n, p.key_map, p.map_size, p.num_keys, p.position, p.order,
                                               p.order_divisor, p.key_values, p.values, p.counts, p.offsets, p.status,
                                               static_cast<int32_t*>(*scratch), static_cast<cudaStream_t>(stream)));
    return absl::OkStatus();
  }

  absl::Status LocalLayer(const LocalLayerParams& p, Stream stream) override {
    CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    absl::Status s = CheckLocalLayer(p);
    if (!s.ok()) return s;
    const ExpertWeights& w = p.weights;
    auto aligned = [](const void* q) { return reinterpret_cast<uintptr_t>(q) % 16 == 0; };
    // Captured into a CUDA graph, the stages: launches cost nothing there, and the routing
    // kernel in front hides the expert grid's launch (H200, E=128 d=2048 d_ff=768, one token:
    // graph replay 30.2-30.4 us in stages against 31.0-31.2 fused, 33.0-33.2 against 34.0-34.8
    // from a cold L2). Eager, fused: half the host time (7.1 against 14.3 us) and 34.2-34.4 us a
    // step against 36.5-37.4.
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    CUDA_RETURN_IF_ERROR(cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &capture));
    // Not where the stages' experts run on the Hopper kernels: the fused path must give the
    // stages' bits (a graph of the same step replays the stages).
    if (fused_layer_ && capture == cudaStreamCaptureStatusNone && p.padded_capacity == 0 &&
        cuda::FusedLocalLayerSupported(p.num_tokens, p.k, w.num_experts, w.d, w.d_ff) && aligned(p.x) &&
        aligned(p.out_fp32) && aligned(p.out_bf16) && !Sm90Decode(w.num_experts, w.d, w.d_ff, p.num_tokens * p.k)) {
      // Decode-sized: two kernels route for themselves and the last block combines. The stages'
      // scratch is grown too, so that a capture after this warm-up allocates nothing.
      const int64_t routes = p.num_tokens * p.k;
      s = ReserveLocalLayerScratch(this, p, &layer_stages_);
      if (!s.ok()) return s;
      auto stage_a = scratch_.Get(static_cast<size_t>(routes) * w.d_ff * 2);  // Swiglu's, on the decode path
      if (!stage_a.ok()) return stage_a.status();
      const size_t a_bytes = (static_cast<size_t>(routes) * w.d_ff * 2 + 255) & ~size_t{255};
      auto base = layer_scratch_.Get(256 + a_bytes + static_cast<size_t>(routes) * w.d * 2);
      if (!base.ok()) return base.status();
      char* ptr = static_cast<char*>(*base);
      if (layer_scratch_.allocations() != layer_zeroed_) {  // new scratch: the kernels keep it zero
        CUDA_RETURN_IF_ERROR(cudaMemsetAsync(ptr, 0, sizeof(unsigned int), static_cast<cudaStream_t>(stream)));
        layer_zeroed_ = layer_scratch_.allocations();
      }
      CUDA_RETURN_IF_ERROR(cuda::LaunchFusedLocalLayer(
          p.x, p.topk, p.gate, p.num_tokens, p.k, w.num_experts, w.d, w.d_ff, w.w_gate_up, w.w_down,
          reinterpret_cast<uint16_t*>(ptr + 256), reinterpret_cast<uint16_t*>(ptr + 256 + a_bytes),
          reinterpret_cast<unsigned int*>(ptr), p.out_fp32, p.out_bf16, static_cast<cudaStream_t>(stream)));
      return absl::OkStatus();
    }
    return RunLocalLayerInStages(this, p, &layer_stages_, stream);
  }

  absl::Status Swiglu(const SwigluParams& p, Stream stream) override {
    CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    absl::Status s = CheckSwiglu(p);
    if (!s.ok()) return s;
    auto st = static_cast<cudaStream_t>(stream);
    if (p.host_offsets == nullptr) return SwigluDeviceOffsets(p, st);
    const ExpertWeights& w = p.weights;
    const int d = w.d, f = w.d_ff, e_count = w.num_experts;
    std::vector<int64_t>& counts = counts_;  // host tables reused from call to call: no allocation a step
    counts.resize(e_count);
    int64_t max_segment = 0;
    for (int e = 0; e < e_count; ++e) {
      counts[e] = p.host_offsets[e + 1] - p.host_offsets[e];
      max_segment = std::max(max_segment, counts[e]);
    }
    if (p.layout.layout == Layout::kGrouped && max_segment <= kSmallSegmentRows &&
        static_cast<int64_t>(d) * f <= kSmallExpertElems && cuda::SmallBatchSupported(d, f)) {
      return SwigluSmallSegments(p, max_segment, st);
    }
    return SwigluExecuted(p, counts, st);
  }

  // The decode path's padded runner: every expert's segment in a fixed slot of C_exec rows
  // (the capacity rounded up to the layout's alignment), both projections as strided-batched
  // GEMMs over all slots, the activation zeroing padding rows. Nothing depends on the host-side
  // counts, so a CUDA graph can hold it; long segments run on cuBLAS's tensor-core GEMMs
  // instead of the decode kernels' GEMV passes. The first call must be eager (it sizes the
  // scratch and gives cuBLAS its workspace).
  absl::Status PaddedDecode(const SwigluParams& p, cudaStream_t st) {
    const ExpertWeights& w = p.weights;
    const int d = w.d, f = w.d_ff, e_count = w.num_experts;
    const int64_t align = p.layout.alignment > 0 ? p.layout.alignment : 1;
    // No segment holds more than `rows`: a larger capacity would only compute padding.
    const int64_t capacity = std::min(p.layout.capacity, p.rows);
    const int64_t cap = (capacity + align - 1) / align * align;
    const int64_t rows = cap * e_count;
    auto region = [](size_t b) { return (b + 255) & ~size_t{255}; };
    const size_t x_bytes = region(rows * d * 2), h_bytes = region(rows * 2 * f * 2), a_bytes = region(rows * f * 2);
    auto base = scratch_.Get(2 * x_bytes + h_bytes + a_bytes);
    if (!base.ok()) return base.status();
    absl::Status s = EnsureWorkspace();
    if (!s.ok()) return s;
    char* ptr = static_cast<char*>(*base);
    uint16_t* xp = reinterpret_cast<uint16_t*>(ptr);
    uint16_t* yp = reinterpret_cast<uint16_t*>(ptr + x_bytes);
    uint16_t* h = reinterpret_cast<uint16_t*>(ptr + 2 * x_bytes);
    uint16_t* a = reinterpret_cast<uint16_t*>(ptr + 2 * x_bytes + h_bytes);
    CUDA_RETURN_IF_ERROR(cuda::LaunchGatherPadded(p.x, p.x_row_index, p.device_offsets, e_count, cap, d, xp, st));
    CUBLAS_RETURN_IF_ERROR(cublasSetStream(handle_, st));
    std::vector<Problem>& up = up_;
    std::vector<Problem>& down = down_;
    up.resize(e_count);
    down.resize(e_count);
    for (int e = 0; e < e_count; ++e) {
      up[e] = {static_cast<int>(cap), 2 * f, d, xp + e * cap * d, w.w_gate_up + static_cast<int64_t>(e) * 2 * f * d,
               h + e * cap * 2 * f};
      down[e] = {static_cast<int>(cap), d, f, a + e * cap * f, w.w_down + static_cast<int64_t>(e) * d * f,
                 yp + e * cap * d};
    }
    s = StridedBatched(up, st);
    if (!s.ok()) return s;
    CUDA_RETURN_IF_ERROR(cuda::LaunchSwigluActivationPadded(h, p.device_offsets, e_count, cap, f, a, st));
    s = StridedBatched(down, st);
    if (!s.ok()) return s;
    CUDA_RETURN_IF_ERROR(cuda::LaunchScatterPadded(yp, p.device_offsets, e_count, cap, d, p.rows, p.y, st));
    return absl::OkStatus();
  }

  // A workspace of cuBLAS's own for handle_, so that GEMMs captured into a CUDA graph allocate
  // nothing (32 MiB, the size cuBLAS recommends for Hopper).
  absl::Status EnsureWorkspace() {
    if (workspace_ != nullptr) return absl::OkStatus();
    constexpr size_t kBytes = size_t{32} << 20;
    CUDA_RETURN_IF_ERROR(cudaMalloc(&workspace_, kBytes));
    CUBLAS_RETURN_IF_ERROR(cublasSetWorkspace(handle_, workspace_, kBytes));
    return absl::OkStatus();
  }

  absl::Status Combine(const CombineParams& p, Stream stream) override {
    CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    absl::Status s = CheckCombine(p);
    if (!s.ok()) return s;
    CUDA_RETURN_IF_ERROR(cuda::LaunchCombine(p.rows, p.num_rows, p.d, p.row_of_route, p.gate, p.num_tokens, p.k,
                                             p.out_fp32, p.out_bf16, static_cast<cudaStream_t>(stream)));
    return absl::OkStatus();
  }

  absl::Status SwigluFp8(const SwigluFp8Params& p, Stream stream) override {
    CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    absl::Status s = CheckSwigluFp8(p);
    if (!s.ok()) return s;
    const Fp8ExpertWeights& w = p.weights;
    const int d = w.d, f = w.d_ff;
    // Decode-sized steps (a few rows an expert) on the tensor-core GEMVs, unless gemm=sm90 forces
    // the Hopper kernels (side-by-side runs).
    const bool small = !sm90_forced_ && cuda::SmallBatchFp8Takes(p.rows, w.num_experts);
    if (!small && !cuda::GroupedSm90Fp8Supported(w.num_experts, d, f)) {
      return absl::UnimplementedError(absl::StrCat("swiglu_fp8: d=", d, ", d_ff=", f, ", E=", w.num_experts,
                                                   " not taken by the Hopper kernels (d a multiple of 256, d_ff of "
                                                   "128, at most 4096 experts, E x 2 d_ff and E x d below 2^31)"));
    }
    if (p.rows == 0) return absl::OkStatus();
    // Scratch: [xq rows x d] [x scales rows x d/128] [a rows x f BF16] [aq rows x f] [a scales]
    // [x scales column-major]; no xq and x scales when the caller quantized the rows. Rows the
    // Hopper kernels take quantized here (x is 16-byte aligned, CheckSwigluFp8) leave their scales
    // column-major, where the kernels read them, instead of row-major for a copy.
    auto align = [](size_t b) { return (b + 255) & ~size_t{255}; };
    const size_t rows = static_cast<size_t>(p.rows);
    const bool quantized = p.xq != nullptr;
    const bool scales_in_place = !quantized && !small;
    const size_t xq_bytes = quantized ? 0 : align(rows * d),
                 xs_bytes = quantized || scales_in_place ? 0 : align(rows * (d / 128) * 4);
    // The BF16 activation only where a kernel reads it back (the GEMVs, or the Hopper kernels with
    // fp8_epilogue_quant=0).
    const bool bf16_activation = small || !fp8_epilogue_quant_;
    const size_t a_bytes = bf16_activation ? align(rows * f * 2) : 0, aq_bytes = align(rows * f),
                 as_bytes = align(static_cast<size_t>(cuda::Fp8ActivationScaleFloats(p.rows, f)) * 4);
    // The Hopper kernels' column-major copy of the rows' scales.
    const size_t xst_bytes = small ? 0 : align(static_cast<size_t>(cuda::Fp8ActivationScaleFloats(p.rows, d)) * 4);
    auto base = scratch_.Get(xq_bytes + xs_bytes + a_bytes + aq_bytes + as_bytes + xst_bytes);
    if (!base.ok()) return base.status();
    char* ptr = static_cast<char*>(*base);
    const uint8_t* xq = quantized ? p.xq : reinterpret_cast<uint8_t*>(ptr);
    const float* xs = quantized ? p.x_scales : reinterpret_cast<float*>(ptr + xq_bytes);
    uint16_t* a = bf16_activation ? reinterpret_cast<uint16_t*>(ptr + xq_bytes + xs_bytes) : nullptr;
    uint8_t* aq = reinterpret_cast<uint8_t*>(ptr + xq_bytes + xs_bytes + a_bytes);
    float* as = reinterpret_cast<float*>(ptr + xq_bytes + xs_bytes + a_bytes + aq_bytes);
    float* xst = reinterpret_cast<float*>(ptr + xq_bytes + xs_bytes + a_bytes + aq_bytes + as_bytes);
    const cudaStream_t st = static_cast<cudaStream_t>(stream);
    if (!quantized) {
      CUDA_RETURN_IF_ERROR(cuda::LaunchQuantizeFp8(p.x, p.rows, d, 128, reinterpret_cast<uint8_t*>(ptr),
                                                   scales_in_place ? xst : reinterpret_cast<float*>(ptr + xq_bytes), st,
                                                   1, scales_in_place ? cuda::Fp8ActivationScaleRows(p.rows) : 0));
    }
    const int64_t xq_ld = quantized && p.xq_ld > 0 ? p.xq_ld : d;
    const int64_t xs_ld = quantized && p.x_scales_ld > 0 ? p.x_scales_ld : d / 128;
    if (small) {
      CUDA_RETURN_IF_ERROR(cuda::LaunchSmallBatchSwigluFp8(xq, xq_ld, xs, xs_ld, p.rows, p.offsets, w.num_experts, d, f,
                                                           w.w_gate_up, w.gate_up_scales, w.w_down, w.down_scales, a,
                                                           aq, as, p.y, st));
    } else {
      CUDA_RETURN_IF_ERROR(cuda::LaunchGroupedSm90SwigluFp8(
          xq, xq_ld, scales_in_place ? nullptr : xs, xs_ld, p.rows, p.offsets, w.num_experts, d, f, w.w_gate_up,
          w.gate_up_scales, w.w_down, w.down_scales, xst, a, aq, as, p.y, st, fp8_epilogue_quant_));
    }
    return absl::OkStatus();
  }

  absl::Status PackFp8Rows(const PackFp8Params& p, Stream stream) override {
    CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    if (absl::Status s = CheckPackFp8(p); !s.ok()) return s;
    CUDA_RETURN_IF_ERROR(
        cuda::LaunchPackFp8(p.x, p.tokens, p.d, p.dest, p.k, p.out_rows, p.out, static_cast<cudaStream_t>(stream)));
    return absl::OkStatus();
  }

  absl::Status Quantize(const QuantizeParams& p, Stream stream) override {
    CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    absl::Status s = CheckQuantize(p);
    if (!s.ok()) return s;
    const int group = p.granularity == ScaleGranularity::kPerRow ? p.d : 128;
    const int block_rows = p.granularity == ScaleGranularity::kBlock128x128 ? 128 : 1;
    CUDA_RETURN_IF_ERROR(
        cuda::LaunchQuantizeFp8(p.x, p.rows, p.d, group, p.q, p.scales, static_cast<cudaStream_t>(stream), block_rows));
    return absl::OkStatus();
  }

  absl::Status Dequantize(const DequantizeParams& p, Stream stream) override {
    CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    absl::Status s = CheckDequantize(p);
    if (!s.ok()) return s;
    const int group = p.granularity == ScaleGranularity::kPerRow ? p.d : 128;
    const int block_rows = p.granularity == ScaleGranularity::kBlock128x128 ? 128 : 1;
    CUDA_RETURN_IF_ERROR(cuda::LaunchDequantizeFp8(p.q, p.scales, p.rows, p.d, group, p.x,
                                                   static_cast<cudaStream_t>(stream), block_rows));
    return absl::OkStatus();
  }

 private:
  // Swiglu's decode path: offsets stay on the device.
  absl::Status SwigluDeviceOffsets(const SwigluParams& p, cudaStream_t st) {
    const ExpertWeights& w = p.weights;
    const int d = w.d, f = w.d_ff, e_count = w.num_experts;
    if (!cuda::SmallBatchSupported(d, f)) {
      return absl::UnimplementedError(absl::StrCat("swiglu.device_offsets: d=", d, ", d_ff=", f,
                                                   " not supported on the decode path (multiples of 8 required)"));
    }
    if (p.rows == 0) return absl::OkStatus();
    if (p.layout.layout == Layout::kPaddedDense) return PaddedDecode(p, st);
    if (Sm90Decode(e_count, d, f, p.rows) && Aligned16({p.x, p.y, w.w_gate_up, w.w_down})) {
      // Enough rows an expert that reading its weights once per 64-row tile beats once per
      // 8 or 16 rows: gather the rows (when an index is given), then the Hopper kernels.
      const size_t x_bytes = p.x_row_index != nullptr ? (static_cast<size_t>(p.rows) * d * 2 + 255) & ~size_t{255} : 0;
      auto base = scratch_.Get(x_bytes + static_cast<size_t>(p.rows) * f * 2);
      if (!base.ok()) return base.status();
      uint16_t* xe = reinterpret_cast<uint16_t*>(*base);
      uint16_t* a = reinterpret_cast<uint16_t*>(static_cast<char*>(*base) + x_bytes);
      if (p.x_row_index != nullptr) {
        CUDA_RETURN_IF_ERROR(
            cuda::LaunchGatherRows(p.x, p.x_rows, p.x_row_index, p.rows, static_cast<int64_t>(d) * 2, xe, 0, st));
      }
      CUDA_RETURN_IF_ERROR(cuda::LaunchGroupedSm90Swiglu(p.x_row_index != nullptr ? xe : p.x, p.rows, p.device_offsets,
                                                         e_count, d, f, w.w_gate_up, w.w_down, a, p.y,
                                                         Sm90ScheduleFor(p.rows / e_count, d, f), st));
      return absl::OkStatus();
    }
    auto a = scratch_.Get(static_cast<size_t>(p.rows) * f * 2);
    if (!a.ok()) return a.status();
    CUDA_RETURN_IF_ERROR(cuda::LaunchSmallBatchSwiglu(p.x, p.x_row_index, p.device_offsets, e_count, d, f, w.w_gate_up,
                                                      w.w_down, static_cast<uint16_t*>(*a), p.y, p.rows,
                                                      p.max_segment_rows, st));
    return absl::OkStatus();
  }

  // Segment offsets [e_count + 1] from the host to the device scratch, in one staged copy on `st`.
  absl::StatusOr<const int64_t*> OffsetsToDevice(const int64_t* host, int e_count, cudaStream_t st) {
    const size_t offset_bytes = static_cast<size_t>(e_count + 1) * sizeof(int64_t);
    auto staged = offsets_in_.Acquire(offset_bytes);
    if (!staged.ok()) return staged.status();
    std::memcpy(*staged, host, offset_bytes);
    auto offsets = offsets_scratch_.Get(offset_bytes);
    if (!offsets.ok()) return offsets.status();
    absl::Status s = offsets_in_.CopyTo(*offsets, offset_bytes, st);
    if (!s.ok()) return s;
    return static_cast<const int64_t*>(*offsets);
  }

  // Decode-sized segments of small experts: the offsets go to the device in one copy and
  // the decode-path kernels run both projections in two launches, instead of a GEMM or two
  // per expert (H200, 8 experts of 4 rows: ~190 us of the executor's eager step went to the
  // per-expert cuBLAS calls).
  absl::Status SwigluSmallSegments(const SwigluParams& p, int64_t max_segment, cudaStream_t st) {
    const ExpertWeights& w = p.weights;
    const int d = w.d, f = w.d_ff, e_count = w.num_experts;
    const int64_t used = p.host_offsets[e_count];
    if (used == 0) return absl::OkStatus();
    auto offsets = OffsetsToDevice(p.host_offsets, e_count, st);
    if (!offsets.ok()) return offsets.status();
    auto a = scratch_.Get(static_cast<size_t>(used) * f * 2);
    if (!a.ok()) return a.status();
    CUDA_RETURN_IF_ERROR(cuda::LaunchSmallBatchSwiglu(p.x, nullptr, *offsets, e_count, d, f, w.w_gate_up, w.w_down,
                                                      static_cast<uint16_t*>(*a), p.y, used, max_segment, st));
    return absl::OkStatus();
  }

  // Host-offset Swiglu on the executed layout (`counts[e]` useful rows of expert e): scatter,
  // both projections on cuBLAS, gather.
  absl::Status SwigluExecuted(const SwigluParams& p, const std::vector<int64_t>& counts, cudaStream_t st) {
    const ExpertWeights& w = p.weights;
    const int d = w.d, f = w.d_ff, e_count = w.num_experts;
    std::vector<int64_t>& executed = executed_;
    absl::Status s = ExecutedOffsets(p.layout, counts, &executed);
    if (!s.ok()) return s;
    const int64_t exec_rows = executed[e_count];
    if (exec_rows == 0) return absl::OkStatus();
    const bool direct = p.layout.layout == Layout::kGrouped;  // x and y are used in place

    // Scratch: [executed x] [executed y] [h: exec x 2f] [a: exec x f] [row map].
    auto align = [](size_t b) { return (b + 255) & ~size_t{255}; };
    const size_t x_bytes = direct ? 0 : align(exec_rows * d * 2);
    const size_t h_bytes = align(exec_rows * 2 * f * 2);
    const size_t a_bytes = align(exec_rows * f * 2);
    const size_t map_bytes = direct ? 0 : align(exec_rows * 4) + align(p.rows * 4);
    auto base = scratch_.Get(2 * x_bytes + h_bytes + a_bytes + map_bytes);
    if (!base.ok()) return base.status();
    char* ptr = static_cast<char*>(*base);
    uint16_t* xe = direct ? const_cast<uint16_t*>(p.x) : reinterpret_cast<uint16_t*>(ptr);
    uint16_t* ye = direct ? p.y : reinterpret_cast<uint16_t*>(ptr + x_bytes);
    uint16_t* h = reinterpret_cast<uint16_t*>(ptr + 2 * x_bytes);
    uint16_t* a = reinterpret_cast<uint16_t*>(ptr + 2 * x_bytes + h_bytes);
    int32_t* map = reinterpret_cast<int32_t*>(ptr + 2 * x_bytes + h_bytes + a_bytes);

    if (!direct) {
      s = ScatterToExecuted(p, counts, executed, map, xe, st);
      if (!s.ok()) return s;
    }
    s = SwigluProjections(p, executed, xe, h, a, ye, st);
    if (!s.ok()) return s;
    if (!direct) return GatherFromExecuted(p, counts, executed, map, ye, st);
    return absl::OkStatus();
  }

  // Phase: scatter useful rows into the executed layout; padding rows get padding_value.
  absl::Status ScatterToExecuted(const SwigluParams& p, const std::vector<int64_t>& counts,
                                 const std::vector<int64_t>& executed, int32_t* map, uint16_t* xe, cudaStream_t st) {
    const int d = p.weights.d, e_count = p.weights.num_experts;
    const int64_t exec_rows = executed[e_count];
    auto staged = map_in_.Acquire(exec_rows * 4);
    if (!staged.ok()) return staged.status();
    int32_t* host_map = static_cast<int32_t*>(*staged);
    std::fill(host_map, host_map + exec_rows, -1);
    for (int e = 0; e < e_count; ++e) {
      for (int64_t i = 0; i < counts[e]; ++i) host_map[executed[e] + i] = static_cast<int32_t>(p.host_offsets[e] + i);
    }
    absl::Status s = map_in_.CopyTo(map, exec_rows * 4, st);
    if (!s.ok()) return s;
    CUDA_RETURN_IF_ERROR(cuda::LaunchGatherRows(p.x, p.rows, map, exec_rows, static_cast<int64_t>(d) * 2, xe,
                                                FloatToBf16(p.padding_value), st));
    return absl::OkStatus();
  }

  // Phase: gate+up GEMM per segment, activation, down GEMM (xe -> h -> a -> ye, executed rows).
  absl::Status SwigluProjections(const SwigluParams& p, const std::vector<int64_t>& executed, uint16_t* xe, uint16_t* h,
                                 uint16_t* a, uint16_t* ye, cudaStream_t st) {
    const ExpertWeights& w = p.weights;
    const int d = w.d, f = w.d_ff, e_count = w.num_experts;
    const int64_t exec_rows = executed[e_count];
    CUBLAS_RETURN_IF_ERROR(cublasSetStream(handle_, st));
    int64_t segments = 0;  // experts with rows (exec_rows > 0: at least one)
    for (int e = 0; e < e_count; ++e) segments += executed[e + 1] > executed[e] ? 1 : 0;
    const bool uniform = p.layout.layout == Layout::kPaddedDense;
    const int64_t avg_rows = exec_rows / segments;
    if (sm90_ && !uniform && (sm90_forced_ || avg_rows <= kSm90MaxAvgRows) &&
        cuda::GroupedSm90Supported(e_count, d, f) && Aligned16({xe, ye, w.w_gate_up, w.w_down})) {
      return Sm90Projections(p, executed, avg_rows, xe, a, ye, st);
    }
    // cuBLAS: a GEMM problem a segment (the lists reused from call to call).
    std::vector<Problem>& up = up_;
    std::vector<Problem>& down = down_;
    up.clear();
    down.clear();
    for (int e = 0; e < e_count; ++e) {
      const int64_t m = executed[e + 1] - executed[e];
      if (m == 0) continue;
      up.push_back({static_cast<int>(m), 2 * f, d, xe + executed[e] * d,
                    w.w_gate_up + static_cast<int64_t>(e) * 2 * f * d, h + executed[e] * 2 * f});
      down.push_back({static_cast<int>(m), d, f, a + executed[e] * f, w.w_down + static_cast<int64_t>(e) * d * f,
                      ye + executed[e] * d});
    }
    const bool chains = !uniform && !force_grouped_ && side_ok_ &&
                        (loop_gemm_ || up.size() <= 8 || avg_rows * 2 * f * static_cast<int64_t>(d) >= kChainWork);
    if (chains) {
      // Few or large segments: one chain (gate+up GEMM, activation, down GEMM) per expert, the
      // chains spread over side streams so one expert's memory-bound activation overlaps
      // another's GEMMs and small GEMMs share the GPU.
      // Measured on the H200 (bench/RESULTS.md): a few experts gain from overlapping one
      // expert's activation with another's GEMMs; many large GEMMs (1024+ rows) fill the GPU
      // alone and only contend when concurrent; many smaller ones share it.
      const bool many_large = up.size() > 8 && avg_rows >= 1024;
      const int streams = chain_streams_forced_ > 0 ? chain_streams_forced_ : (many_large ? 1 : kSideStreams);
      return Chains(up, down, f, streams, st);
    }
    absl::Status s = uniform ? StridedBatched(up, st) : Grouped(up, st);
    if (!s.ok()) return s;
    CUDA_RETURN_IF_ERROR(cuda::LaunchSwigluActivation(h, exec_rows, f, a, st));
    return uniform ? StridedBatched(down, st) : Grouped(down, st);
  }

  // TMA reads and the Hopper kernels' 16-byte stores need 16-byte aligned operands; others take
  // cuBLAS or the decode kernels.
  static bool Aligned16(std::initializer_list<const void*> ptrs) {
    for (const void* p : ptrs) {
      if ((reinterpret_cast<uintptr_t>(p) & 15) != 0) return false;
    }
    return true;
  }

  // Whether the decode path runs `rows` rows over the experts on the Hopper kernels.
  // gemm=sm90 takes it at any rows an expert (side-by-side measurements of the rule).
  bool Sm90Decode(int num_experts, int d, int d_ff, int64_t rows) const {
    return sm90_ && num_experts > 0 && (sm90_forced_ || rows >= kSm90DecodeRowsPerExpert * num_experts) &&
           cuda::GroupedSm90Supported(num_experts, d, d_ff);
  }

  // The Hopper kernels' schedule for segments of `avg_rows` rows on average (sm90_tile forces one):
  // 64-row tiles for short segments. Up to kSm90EpilogueWarpsRows, ping-pong where the K loops
  // are short (d <= 2048, d_ff <= 1024: each tile's epilogue is a large share of it, and
  // ping-pong runs one warpgroup's epilogue under the other's MMAs; wide gate/up tiles where 96
  // divides d_ff), else cooperative 128-row tiles. From there on the cooperative 128-row tiles
  // whose epilogues run on the producer warpgroup's idle warps (rows128_epi), except the gate/up
  // kernel of short K loops below kSm90CooperativeUpRows, which keeps the wide ping-pong tile
  // (where 96 divides d_ff; else ping-pong for both, as before the epilogue warps' tiles). One
  // H200, ncu cycles of gate/up + down (bench/RESULTS.md, 2026-12-04, thirty-ninth session):
  // E128 d2048 f768 T = 1024 (64 rows an expert) wide ping-pong + ping-pong 521k, wide +
  // epilogue warps 518k but 0.7-0.9% slower in time; T = 2048 617k, 606k, rows128_epi 626k;
  // T = 8192 1597k, 1555k, 1541k; E32 d7168 f2048 T = 4096 rows128 6230k, rows128_epi 6023k;
  // E8 d4096 f14336 T = 8192 11.97M, 11.54M.
  cuda::Sm90Schedule Sm90ScheduleFor(int64_t avg_rows, int d, int d_ff) const {
    switch (sm90_tile_) {
      case CudaTuning::Sm90Tile::kRows64:
        return cuda::Sm90Schedule::kRows64;
      case CudaTuning::Sm90Tile::kRows128:
        return cuda::Sm90Schedule::kRows128;
      case CudaTuning::Sm90Tile::kPingPong:
        return cuda::Sm90Schedule::kPingPong;
      case CudaTuning::Sm90Tile::kPingPongWide:
        return PingPongFor(d_ff);
      case CudaTuning::Sm90Tile::kRows128Epi:
        return cuda::Sm90Schedule::kRows128Epi;
      case CudaTuning::Sm90Tile::kWideEpiDown:
        return cuda::GroupedSm90WideSupported(d_ff) ? cuda::Sm90Schedule::kWideEpiDown
                                                    : cuda::Sm90Schedule::kRows128Epi;
      case CudaTuning::Sm90Tile::kAuto:
        break;
    }
    if (avg_rows < kSm90SmallTileRows) return cuda::Sm90Schedule::kRows64;
    const bool short_k = d <= 2048 && d_ff <= 1024;
    if (avg_rows < kSm90EpilogueWarpsRows) return short_k ? PingPongFor(d_ff) : cuda::Sm90Schedule::kRows128;
    if (!short_k || avg_rows >= kSm90CooperativeUpRows) return cuda::Sm90Schedule::kRows128Epi;
    return cuda::GroupedSm90WideSupported(d_ff) ? cuda::Sm90Schedule::kWideEpiDown : cuda::Sm90Schedule::kPingPong;
  }

  // Ping-pong, with (wide) 96 activation columns a gate/up tile where they divide d_ff: one MMA of
  // 192 columns a K step instead of 128, 17% fewer bytes a FLOP through L2 and shared memory.
  // One H200, E128 d2048 f768, BF16 experts sustained at the power limit, µs: T = 8192 1244 ->
  // 1211, 4096 728 -> 709, 2048 484 -> 475, 1024 366 -> 359 (bench/RESULTS.md, 2026-12-04,
  // thirty-eighth session).
  static cuda::Sm90Schedule PingPongFor(int d_ff) {
    return cuda::GroupedSm90WideSupported(d_ff) ? cuda::Sm90Schedule::kPingPongWide : cuda::Sm90Schedule::kPingPong;
  }

  // Both projections on the Hopper grouped kernels: the executed offsets go to the device in one
  // copy; the gate/up kernel writes the activation (no h), the down kernel the rows.
  absl::Status Sm90Projections(const SwigluParams& p, const std::vector<int64_t>& executed, int64_t avg_rows,
                               const uint16_t* xe, uint16_t* a, uint16_t* ye, cudaStream_t st) {
    const ExpertWeights& w = p.weights;
    const int e_count = w.num_experts;
    auto offsets = OffsetsToDevice(executed.data(), e_count, st);
    if (!offsets.ok()) return offsets.status();
    CUDA_RETURN_IF_ERROR(cuda::LaunchGroupedSm90Swiglu(xe, executed[e_count], *offsets, e_count, w.d, w.d_ff,
                                                       w.w_gate_up, w.w_down, a, ye,
                                                       Sm90ScheduleFor(avg_rows, w.d, w.d_ff), st));
    return absl::OkStatus();
  }

  // Phase: only useful rows leave the runner.
  absl::Status GatherFromExecuted(const SwigluParams& p, const std::vector<int64_t>& counts,
                                  const std::vector<int64_t>& executed, int32_t* map, const uint16_t* ye,
                                  cudaStream_t st) {
    const int d = p.weights.d, e_count = p.weights.num_experts;
    const int64_t exec_rows = executed[e_count];
    // The second map goes after the first in device scratch (exec_rows >= rows entries).
    int32_t* out_map = map + exec_rows;
    auto staged = map_out_.Acquire(p.rows * 4);
    if (!staged.ok()) return staged.status();
    int32_t* host_map = static_cast<int32_t*>(*staged);
    std::fill(host_map, host_map + p.rows, -1);
    for (int e = 0; e < e_count; ++e) {
      for (int64_t i = 0; i < counts[e]; ++i) host_map[p.host_offsets[e] + i] = static_cast<int32_t>(executed[e] + i);
    }
    absl::Status s = map_out_.CopyTo(out_map, p.rows * 4, st);
    if (!s.ok()) return s;
    CUDA_RETURN_IF_ERROR(
        cuda::LaunchGatherRows(ye, exec_rows, out_map, p.rows, static_cast<int64_t>(d) * 2, p.y, 0, st));
    return absl::OkStatus();
  }

  // Row-major C = A B^T is column-major C^T = B A^T: cuBLAS(transa = T on B, transb = N on A).
  absl::Status GemmOn(cublasHandle_t handle, const Problem& q) {
    const float alpha = 1.0f, beta = 0.0f;
    CUBLAS_RETURN_IF_ERROR(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, q.n, q.m, q.k, &alpha, q.b, CUDA_R_16BF, q.k,
                                        q.a, CUDA_R_16BF, q.k, &beta, q.c, CUDA_R_16BF, q.n, CUBLAS_COMPUTE_32F,
                                        CUBLAS_GEMM_DEFAULT));
    return absl::OkStatus();
  }

  absl::Status Chains(const std::vector<Problem>& up, const std::vector<Problem>& down, int f, int max_streams,
                      cudaStream_t st) {
    const int streams = static_cast<int>(std::min<size_t>(max_streams, up.size()));
    CUDA_RETURN_IF_ERROR(cudaEventRecord(fork_, st));
    for (int i = 0; i < streams; ++i) CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(side_[i], fork_, 0));
    for (size_t i = 0; i < up.size(); ++i) {
      const int sid = static_cast<int>(i % streams);
      absl::Status s = GemmOn(side_handle_[sid], up[i]);
      if (!s.ok()) return s;
      CUDA_RETURN_IF_ERROR(cuda::LaunchSwigluActivation(static_cast<const uint16_t*>(up[i].c), up[i].m, f,
                                                        const_cast<uint16_t*>(static_cast<const uint16_t*>(down[i].a)),
                                                        side_[sid]));
      s = GemmOn(side_handle_[sid], down[i]);
      if (!s.ok()) return s;
    }
    for (int i = 0; i < streams; ++i) {
      CUDA_RETURN_IF_ERROR(cudaEventRecord(side_done_[i], side_[i]));
      CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(st, side_done_[i], 0));
    }
    return absl::OkStatus();
  }

  absl::Status StridedBatched(const std::vector<Problem>& ps, cudaStream_t) {
    if (ps.empty()) return absl::OkStatus();
    const Problem& q = ps.front();
    const float alpha = 1.0f, beta = 0.0f;
    const int64_t stride_b = static_cast<int64_t>(q.n) * q.k;
    const int64_t stride_a = static_cast<int64_t>(q.m) * q.k;
    const int64_t stride_c = static_cast<int64_t>(q.m) * q.n;
    CUBLAS_RETURN_IF_ERROR(
        cublasGemmStridedBatchedEx(handle_, CUBLAS_OP_T, CUBLAS_OP_N, q.n, q.m, q.k, &alpha, q.b, CUDA_R_16BF, q.k,
                                   stride_b, q.a, CUDA_R_16BF, q.k, stride_a, &beta, q.c, CUDA_R_16BF, q.n, stride_c,
                                   static_cast<int>(ps.size()), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    return absl::OkStatus();
  }

  absl::Status Grouped(const std::vector<Problem>& ps, cudaStream_t st) {
    if (ps.empty()) return absl::OkStatus();
    if (ps.size() == 1 || loop_gemm_) {
      for (const Problem& q : ps) {
        absl::Status s = GemmOn(handle_, q);
        if (!s.ok()) return s;
      }
      return absl::OkStatus();
    }
    const int g = static_cast<int>(ps.size());
    trans_a_.assign(g, CUBLAS_OP_T);
    trans_b_.assign(g, CUBLAS_OP_N);
    m_.resize(g);
    n_.resize(g);
    k_.resize(g);
    lda_.resize(g);
    ldb_.resize(g);
    ldc_.resize(g);
    ones_.assign(g, 1);
    alpha_.assign(g, 1.0f);
    beta_.assign(g, 0.0f);
    auto staged = ptr_staging_.Acquire(3 * g * sizeof(void*));
    if (!staged.ok()) return staged.status();
    const void** ptrs = static_cast<const void**>(*staged);
    for (int i = 0; i < g; ++i) {
      const Problem& q = ps[i];
      m_[i] = q.n;
      n_[i] = q.m;
      k_[i] = q.k;
      lda_[i] = q.k;
      ldb_[i] = q.k;
      ldc_[i] = q.n;
      ptrs[i] = q.b;
      ptrs[g + i] = q.a;
      ptrs[2 * g + i] = q.c;
    }
    // NOTE: cuBLAS reads the device pointer table when the GEMM runs; the next call's copy into
    // the same table is ordered after this GEMM by the stream (one stream per kernels object).
    auto dev = ptr_scratch_.Get(3 * g * sizeof(void*));
    if (!dev.ok()) return dev.status();
    void** d_ptrs = static_cast<void**>(*dev);
    absl::Status copied = ptr_staging_.CopyTo(d_ptrs, 3 * g * sizeof(void*), st);
    if (!copied.ok()) return copied;
    const cublasStatus_t rc = cublasGemmGroupedBatchedEx(
        handle_, trans_a_.data(), trans_b_.data(), m_.data(), n_.data(), k_.data(), alpha_.data(), d_ptrs, CUDA_R_16BF,
        lda_.data(), d_ptrs + g, CUDA_R_16BF, ldb_.data(), beta_.data(), d_ptrs + 2 * g, CUDA_R_16BF, ldc_.data(), g,
        ones_.data(), CUBLAS_COMPUTE_32F);
    if (rc == CUBLAS_STATUS_NOT_SUPPORTED) {
      loop_gemm_ = true;  // this cuBLAS cannot group BF16: fall back to one GEMM per problem
      return Grouped(ps, st);
    }
    CUBLAS_RETURN_IF_ERROR(rc);
    return absl::OkStatus();
  }

  cublasHandle_t handle_;
  int device_;  // the device current when the object was created; every call binds it
  bool loop_gemm_ = false;
  bool force_grouped_ = false;
  bool sm90_ = true;                // the Hopper grouped kernels where supported (gemm=auto or sm90)
  bool sm90_forced_ = false;        // gemm=sm90: also for long segments
  CudaTuning::Sm90Tile sm90_tile_;  // CudaTuning::sm90_tile
  // Measured on an H200 (bench/RESULTS.md, issue 19): segments averaging fewer rows than this
  // run faster with the 64-row tile (E128 T=128: 348 against 384 us a layer; E32 T=128: 735
  // against 767), from 64 on the 128-row tile wins or ties. With the epilogue warps' tiles the
  // Hopper kernels also beat cuBLAS's grouped or chained GEMMs on long segments (sustained BF16
  // experts, E32 T=4096, 1024 rows an expert: 4728 -> 4643 us; E8 T=8192, 2048 rows: 9108 ->
  // 8767; before them cuBLAS was 5-7% faster there): they take segments of up to
  // kSm90MaxAvgRows on average, the longest measured.
  static constexpr int64_t kSm90SmallTileRows = 64;
  static constexpr int64_t kSm90MaxAvgRows = 2048;
  // From this many rows an expert on average the gate/up kernel of d <= 2048, d_ff <= 1024 runs
  // the epilogue warps' cooperative tile as well (E128 T = 8192, 512 rows: 989k cycles against
  // the wide ping-pong tile's 1003k; T = 4096, 256 rows: 579k against 575k).
  static constexpr int64_t kSm90CooperativeUpRows = 512;
  // From this many rows an expert on average the down kernel runs the epilogue warps' tiles
  // (E128 T = 1024, 64 rows: 190.0k cycles against ping-pong's 188.0k; T = 2048, 128 rows:
  // 223.7k against 234.7k).
  static constexpr int64_t kSm90EpilogueWarpsRows = 128;
  // The decode path (device offsets) takes the Hopper kernels from this many rows an expert on
  // average (its capacity over the experts): E128 T=64 (4 an expert) 348 against 416 us a layer,
  // E32 T=16 (4) 693 against 785, E8 T=128 (32) 717 against 2095; E128 T=16 (1) stays on the
  // decode kernels (196 against 232).
  static constexpr int64_t kSm90DecodeRowsPerExpert = 4;
  // Segments whose gate+up GEMM has at least this many multiply-adds run as per-expert chains;
  // below it one grouped call wins (measured on the H200, bench/RESULTS.md).
  static constexpr int64_t kChainWork = 4'000'000'000;
  static constexpr int kSideStreams = 4;
  int chain_streams_forced_ = 0;  // CudaTuning::chain_streams (side-by-side runs)
  bool side_ok_ = true;
  cudaStream_t side_[kSideStreams] = {};
  cublasHandle_t side_handle_[kSideStreams] = {};
  cudaEvent_t side_done_[kSideStreams] = {};
  cudaEvent_t fork_ = nullptr;
  void* workspace_ = nullptr;  // handle_'s cuBLAS workspace (the padded decode runner sets it)
  std::mutex find_mu_;         // the NaN/Inf scan's result word
  // Swiglu's host tables, kept from call to call (the calls on one object are serial, as the
  // scratch above assumes): segment sizes, executed offsets, cuBLAS's problem lists.
  std::vector<int64_t> counts_, executed_;
  std::vector<Problem> up_, down_;
  unsigned long long* find_first_ = nullptr;
  unsigned long long* find_host_ = nullptr;
  cudaEvent_t find_done_ = nullptr;
  std::mutex bounce_mu_;  // one large pageable copy at a time through bounce_
  BounceBuffers bounce_;
  Scratch scratch_, ptr_scratch_, route_scratch_, offsets_scratch_, rank_scratch_;
  PinnedStaging map_in_, map_out_, ptr_staging_, offsets_in_;
  std::vector<cublasOperation_t> trans_a_, trans_b_;
  std::vector<int> m_, n_, k_, lda_, ldb_, ldc_, ones_;
  std::vector<float> alpha_, beta_;
  // LocalLayer: the fused kernels' scratch ([done counter][a][y]); CudaTuning::fused_layer =
  // false runs every step in stages (side-by-side measurements). Last, so its buffers go first.
  bool fused_layer_ = true;
  // SwigluFp8 on the Hopper kernels: the activation quantized in the gate/up epilogue
  // (CudaTuning::fp8_epilogue_quant; false: written in BF16 and quantized by a kernel after).
  bool fp8_epilogue_quant_ = true;
  Scratch layer_scratch_;
  uint64_t layer_zeroed_ = 0;  // the allocation of layer_scratch_ whose counter was zeroed
  uint64_t route_zeroed_ = 0;  // the allocation of route_scratch_ whose ticket was zeroed
  LocalLayerScratch layer_stages_;
  // Recorded work (BeginCapture): its stream, and the memory epoch, which moves whenever kernel
  // memory that recorded work may name is freed or replaced.
  cudaStream_t capture_stream_ = nullptr;
  // Branches of the recording (ForkCapture: the NaN/Inf scan, a lone decode step's read-back),
  // each forked and joined through its two events; CudaTuning::capture_branches of them.
  struct CaptureBranch {
    cudaStream_t stream = nullptr;
    cudaEvent_t fork = nullptr, join = nullptr;
    bool pending = false;  // forked in the capture under way
  };
  std::array<CaptureBranch, CudaTuning::kMaxCaptureBranches> branches_{};
  int capture_branches_ = CudaTuning::kMaxCaptureBranches;
  bool capturing_ = false;
  uint64_t capture_epoch_ = 0;
  std::atomic<uint64_t> freed_{0};  // Free may be called from a thread other than the steps'
  uint64_t MemoryEpoch() const {
    return freed_.load(std::memory_order_acquire) + scratch_.allocations() + ptr_scratch_.allocations() +
           route_scratch_.allocations() + offsets_scratch_.allocations() + rank_scratch_.allocations() +
           layer_scratch_.allocations();
  }
};

}  // namespace

absl::StatusOr<std::unique_ptr<ExpertKernels>> CreateCudaKernels() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    return absl::UnavailableError("no CUDA device is available");
  }
  int device = 0;
  CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  const CudaTuning tuning = GetCudaTuning();
  if (tuning.blocking_sync) {  // once a process: later kernels objects find it set
    unsigned int flags = 0;
    if (cudaGetDeviceFlags(&flags) != cudaSuccess ||
        ((flags & cudaDeviceScheduleMask) != cudaDeviceScheduleBlockingSync &&
         cudaSetDeviceFlags(cudaDeviceScheduleBlockingSync) != cudaSuccess)) {
      const cudaError_t e = cudaGetLastError();
      return absl::FailedPreconditionError(
          absl::StrCat("cuda tuning: blocking_sync=1: the device's scheduling flags: ", cudaGetErrorString(e)));
    }
  }
  cublasHandle_t handle;
  CUBLAS_RETURN_IF_ERROR(cublasCreate(&handle));
  cuda::SetLaunchSwitches(tuning.pdl, tuning.mma_wide, tuning.down_preload);
  return std::unique_ptr<ExpertKernels>(new CudaKernels(handle, device, tuning));
}

}  // namespace moe::kernels
