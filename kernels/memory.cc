// Host-memory defaults of ExpertKernels' memory calls, KernelBuffer and RegisteredHostBuffer.
#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"

#include "kernels/api.h"

namespace moe::kernels {

absl::StatusOr<void*> ExpertKernels::Allocate(int64_t bytes) {
  if (bytes < 0) return absl::InvalidArgumentError(absl::StrCat("allocate: ", bytes, " bytes"));
  void* p = std::malloc(bytes > 0 ? static_cast<size_t>(bytes) : 1);
  if (p == nullptr) return absl::ResourceExhaustedError(absl::StrCat("allocate: ", bytes, " bytes of host memory"));
  return p;
}

void ExpertKernels::Free(void* p) { std::free(p); }

absl::Status ExpertKernels::CopyToKernel(void* dst, const void* src, int64_t bytes, Stream) {
  if (bytes > 0) std::memcpy(dst, src, static_cast<size_t>(bytes));
  return absl::OkStatus();
}

absl::Status ExpertKernels::CopyToHost(void* dst, const void* src, int64_t bytes, Stream) {
  if (bytes > 0) std::memcpy(dst, src, static_cast<size_t>(bytes));
  return absl::OkStatus();
}

absl::Status ExpertKernels::StartFindNonFiniteBf16(const uint16_t* x, int64_t n, Stream) {
  if (n < 0) return absl::InvalidArgumentError(absl::StrCat("find_non_finite: ", n, " values"));
  host_first_non_finite_ = -1;
  for (int64_t i = 0; i < n; ++i) {
    if ((x[i] & 0x7f80) == 0x7f80) {  // exponent all ones: NaN or infinity
      host_first_non_finite_ = i;
      break;
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> ExpertKernels::FinishFindNonFiniteBf16() { return host_first_non_finite_; }

absl::StatusOr<ExpertKernels::IpcMapping> ExpertKernels::OpenIpcMemory(const std::string&) {
  return absl::FailedPreconditionError(
      absl::StrCat("device memory from another process needs device kernels; this rank runs ", name()));
}

absl::StatusOr<void*> ExpertKernels::OpenIpcEvent(const std::string&) {
  return absl::FailedPreconditionError(
      absl::StrCat("events from another process need device kernels; this rank runs ", name()));
}

absl::StatusOr<bool> ExpertKernels::EventDone(void*) {
  return absl::FailedPreconditionError(absl::StrCat("events need device kernels; this rank runs ", name()));
}

absl::StatusOr<void*> ExpertKernels::CreateIpcEvent(std::string*) {
  return absl::FailedPreconditionError(
      absl::StrCat("events for another process need device kernels; this rank runs ", name()));
}

absl::Status ExpertKernels::RecordEvent(void*, Stream) {
  return absl::FailedPreconditionError(absl::StrCat("events need device kernels; this rank runs ", name()));
}

absl::StatusOr<Stream> ExpertKernels::BeginCapture() {
  return absl::UnimplementedError(absl::StrCat("recorded work needs device kernels; this rank runs ", name()));
}

absl::StatusOr<void*> ExpertKernels::EndCapture(Stream) {
  return absl::FailedPreconditionError("end_capture: no capture was begun");
}

absl::StatusOr<bool> ExpertKernels::LaunchCaptured(void*, Stream) {
  return absl::FailedPreconditionError(absl::StrCat("recorded work needs device kernels; this rank runs ", name()));
}

RegisteredHostBuffer::~RegisteredHostBuffer() { Release(); }

void RegisteredHostBuffer::Release() {
  if (ptr_ == nullptr) return;
  if (registered_) kernels_->UnregisterHostMemory(ptr_);
  std::free(ptr_);
  ptr_ = nullptr;
  size_ = 0;
  registered_ = false;
}

absl::Status RegisteredHostBuffer::Reserve(ExpertKernels* kernels, int64_t bytes) {
  if (ptr_ != nullptr && kernels != kernels_) {
    return absl::InternalError("registered host buffer: reserved through a different kernels object");
  }
  kernels_ = kernels;
  if (bytes < 0 || bytes > (int64_t{1} << 40)) {
    return absl::InvalidArgumentError(absl::StrCat("registered host buffer: ", bytes, " bytes"));
  }
  if (bytes <= size_ && ptr_ != nullptr) return absl::OkStatus();
  constexpr int64_t kPage = 4096;
  // Grow by at least half again (registering costs far more than a step), whole pages.
  const int64_t want = (std::max<int64_t>({bytes, size_ + size_ / 2, kPage}) + kPage - 1) / kPage * kPage;
  Release();
  ptr_ = std::aligned_alloc(kPage, static_cast<size_t>(want));
  if (ptr_ == nullptr) return absl::ResourceExhaustedError(absl::StrCat("registered host buffer: ", want, " bytes"));
  size_ = want;
  registered_ = kernels_->RegisterHostMemory(ptr_, want).ok();
  return absl::OkStatus();
}

absl::Status ExpertKernels::CopyToHostAsync(void* dst, const void* src, int64_t bytes, Stream stream) {
  return CopyToHost(dst, src, bytes, stream);
}

KernelBuffer::~KernelBuffer() {
  if (ptr_ != nullptr) kernels_->Free(ptr_);
}

absl::Status KernelBuffer::Reserve(ExpertKernels* kernels, int64_t bytes) {
  if (ptr_ != nullptr && kernels != kernels_) {
    return absl::InternalError("kernel buffer: reserved through a different kernels object");
  }
  kernels_ = kernels;
  if (bytes <= size_ && ptr_ != nullptr) return absl::OkStatus();
  // Grow by at least half again, so steps of slowly rising size reallocate rarely.
  const int64_t want = std::max<int64_t>(bytes, size_ + size_ / 2);
  if (ptr_ != nullptr) kernels_->Free(ptr_);
  ptr_ = nullptr;
  size_ = 0;
  auto p = kernels_->Allocate(std::max<int64_t>(want, 256));
  if (!p.ok()) return p.status();
  ptr_ = *p;
  size_ = std::max<int64_t>(want, 256);
  return absl::OkStatus();
}

}  // namespace moe::kernels
