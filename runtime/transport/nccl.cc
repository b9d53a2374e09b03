#include "runtime/transport/nccl.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "runtime/status.h"
#include "runtime/transport/file_rendezvous.h"
#include "runtime/transport/gpu_checks.h"
#include "runtime/transport/shm_channel.h"
#include "runtime/transport/step_gather.h"

namespace moe {
namespace {

bool IsDevice(const void* p) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();  // plain host memory on older runtimes
    return false;
  }
  return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
}

class NcclTransport final : public Transport {
 public:
  NcclTransport(NcclOptions options, ncclComm_t comm, cudaStream_t stream)
      : options_(std::move(options)), comm_(comm), stream_(stream) {}
  ~NcclTransport() override {
    if (staging_ != nullptr) cudaFree(staging_);
    if (pinned_ != nullptr) cudaFreeHost(pinned_);
    if (comm_ != nullptr) (broken_ ? ncclCommAbort(comm_) : ncclCommDestroy(comm_));
    cudaStreamDestroy(stream_);
  }
  const char* name() const override { return "nccl"; }
  int slot() const override { return options_.slot; }
  int size() const override { return options_.size; }
  bool accepts_device_memory() const override { return true; }
  bool failed() const override { return broken_; }
  NcclHandles handles() const { return {broken_ ? nullptr : comm_, stream_, options_.device}; }

  // The step agreement over shared memory when every member is on this host: member 0 creates the
  // segment named after the group's unique id, the others open it, and an all-gather of who
  // could decides for the whole group (members on another host cannot open it, and then every
  // member keeps the NCCL all-gather). Member 0 removes the name once everyone has answered.
  absl::Status SetUpHostAgreement(const char* id, size_t id_bytes, absl::Duration timeout) {
    uint64_t h = 0x6d6f652d61677265ull;
    for (size_t i = 0; i < id_bytes; ++i) h = (h ^ static_cast<uint8_t>(id[i])) * 0x100000001b3ull;
    const std::string name = absl::StrCat("/moe-agree-", absl::Hex(h, absl::kZeroPad16));
    absl::StatusOr<std::unique_ptr<ShmStepChannel>> channel =
        slot() == 0 ? ShmStepChannel::Create(name, size())
                    : ShmStepChannel::Open(name, slot(), size(), std::min(timeout, absl::Seconds(3)));
    const uint8_t mine = channel.ok() ? 1 : 0;
    std::vector<uint8_t> all(size(), 0);
    absl::Status s = AllGather(0, &mine, 1, all.data(), timeout);
    if (slot() == 0 && channel.ok()) ShmStepChannel::Unlink(name);
    if (!s.ok()) return s;
    bool everyone = true;
    for (uint8_t a : all) everyone = everyone && a == 1;
    if (everyone) {
      agree_ = std::move(*channel);
      agree_->set_interrupted([this] { return interrupted(); });
      backlog_.from.assign(size(), {});
    }
    return absl::OkStatus();
  }
  bool host_agreement() const { return agree_ != nullptr; }

  absl::Status StepGather(uint64_t step, const void* in, int64_t bytes, void* out, absl::Duration timeout) override {
    if (agree_ == nullptr) return AllGather(step, in, bytes, out, timeout);
    if (broken_) return absl::UnavailableError("nccl: communicator aborted by an earlier failure");
    return RunStepGather(*agree_, backlog_, slot(), size(), step, in, bytes, out, timeout);
  }
  void AbandonStep(uint64_t step) override {
    if (agree_ != nullptr && !broken_) AbandonStepGather(*agree_, slot(), size(), step);
  }
  absl::Status WaitStream(uint64_t seq, absl::Duration timeout) {
    if (broken_) return absl::UnavailableError("nccl: communicator aborted by an earlier failure");
    return Wait(seq, timeout);
  }

  absl::Status AllGather(uint64_t seq, const void* in, int64_t bytes, void* out, absl::Duration timeout) override {
    if (broken_) return absl::UnavailableError("nccl: communicator aborted by an earlier failure");
    // Callers may be any thread (gRPC handlers start on device 0): bind the communicator's device.
    CUDART_RETURN_IF_ERROR(cudaSetDevice(options_.device));
    return WithDevice(seq, timeout, in, bytes, out, bytes * size(), [&](const void* din, void* dout) -> absl::Status {
      NCCL_RETURN_IF_ERROR(ncclAllGather(din, dout, bytes, ncclUint8, comm_, stream_));
      return absl::OkStatus();
    });
  }

  absl::Status AllToAllV(uint64_t seq, const void* send, absl::Span<const int64_t> send_bytes, void* recv,
                         absl::Span<const int64_t> recv_bytes, absl::Duration timeout) override {
    if (broken_) return absl::UnavailableError("nccl: communicator aborted by an earlier failure");
    // Callers may be any thread (gRPC handlers start on device 0): bind the communicator's device.
    CUDART_RETURN_IF_ERROR(cudaSetDevice(options_.device));
    if (static_cast<int>(send_bytes.size()) != size() || static_cast<int>(recv_bytes.size()) != size()) {
      return absl::InvalidArgumentError("split vectors must have one entry per peer slot");
    }
    int64_t send_total = 0, recv_total = 0;
    for (int i = 0; i < size(); ++i) {
      send_total += send_bytes[i];
      recv_total += recv_bytes[i];
    }
    return WithDevice(
        seq, timeout, send, send_total, recv, recv_total, [&](const void* dsend, void* drecv) -> absl::Status {
          NCCL_RETURN_IF_ERROR(ncclGroupStart());
          // The group is ended on every path: NCCL's group depth is per thread, and a group left
          // open would swallow this thread's later calls (queued, never launched).
          absl::Status s = [&]() -> absl::Status {
            int64_t so = 0, ro = 0;
            for (int i = 0; i < size(); ++i) {
              if (send_bytes[i] > 0) {
                NCCL_RETURN_IF_ERROR(
                    ncclSend(static_cast<const char*>(dsend) + so, send_bytes[i], ncclUint8, i, comm_, stream_));
              }
              if (recv_bytes[i] > 0) {
                NCCL_RETURN_IF_ERROR(
                    ncclRecv(static_cast<char*>(drecv) + ro, recv_bytes[i], ncclUint8, i, comm_, stream_));
              }
              so += send_bytes[i];
              ro += recv_bytes[i];
            }
            return absl::OkStatus();
          }();
          const absl::Status end = [&]() -> absl::Status {
            NCCL_RETURN_IF_ERROR(ncclGroupEnd());
            return absl::OkStatus();
          }();
          return s.ok() ? end : s;
        });
  }

 private:
  // Runs `op` (which enqueues a collective on the stream) on device pointers and waits for it,
  // staging host buffers through one device allocation. Small host buffers (a step agreement,
  // metadata) also go through pinned host staging, so their copies are true async copies: the
  // input copy, the collective and the output copy are enqueued back to back and the stream is
  // waited for once. A larger host output is copied only once the collective is done: a copy to
  // pageable memory queued behind it would block this thread inside CUDA until the collective
  // finished, where no deadline or interrupt is checked (a peer that never joins hangs it).
  // Any failure of `op` itself (NCCL's own error return) leaves the communicator broken, as a
  // failure seen while waiting does.
  template <typename Op>
  absl::Status WithDevice(uint64_t seq, absl::Duration timeout, const void* in, int64_t in_bytes, void* out,
                          int64_t out_bytes, Op&& op) {
    const bool in_dev = in_bytes == 0 || IsDevice(in);
    const bool out_dev = out_bytes == 0 || IsDevice(out);
    auto run = [&](const void* din, void* dout) -> absl::Status {
      absl::Status s = op(din, dout);
      if (!s.ok()) Abandon();
      return s;
    };
    if (in_dev && out_dev) {
      RETURN_IF_ERROR(run(in, out));
      return Wait(seq, timeout);
    }
    if (size() == 1 && !in_dev && !out_dev) {
      // A lone member's collective of host memory is a copy (its step agreement, metadata): no
      // staging round trip through the device and no stream synchronization.
      if (in_bytes != out_bytes) return absl::InvalidArgumentError("one member: send and receive sizes differ");
      if (in_bytes > 0) std::memcpy(out, in, static_cast<size_t>(in_bytes));
      return absl::OkStatus();
    }
    const int64_t in_staged = in_dev ? 0 : (in_bytes + 255) / 256 * 256;
    const size_t need = static_cast<size_t>(in_staged + (out_dev ? 0 : out_bytes)) + 256;
    if (need > staging_bytes_) {
      if (staging_ != nullptr) CUDART_RETURN_IF_ERROR(cudaFree(staging_));
      staging_ = nullptr;
      staging_bytes_ = 0;
      CUDART_RETURN_IF_ERROR(cudaMalloc(&staging_, need));
      staging_bytes_ = need;
    }
    // Pinned host staging for small transfers (both directions fit).
    const bool pinned = need <= kPinnedStagingBytes;
    if (pinned && pinned_ == nullptr) CUDART_RETURN_IF_ERROR(cudaMallocHost(&pinned_, kPinnedStagingBytes));
    char* din = in_dev ? const_cast<char*>(static_cast<const char*>(in)) : static_cast<char*>(staging_);
    char* dout = out_dev ? static_cast<char*>(out) : static_cast<char*>(staging_) + in_staged;
    char* hin = pinned ? static_cast<char*>(pinned_) : nullptr;
    char* hout = pinned ? static_cast<char*>(pinned_) + in_staged : nullptr;
    if (!in_dev && in_bytes > 0) {
      const void* src = in;
      if (pinned) {
        std::memcpy(hin, in, static_cast<size_t>(in_bytes));
        src = hin;
      }
      CUDART_RETURN_IF_ERROR(cudaMemcpyAsync(din, src, in_bytes, cudaMemcpyHostToDevice, stream_));
    }
    RETURN_IF_ERROR(run(din, dout));
    if (pinned && !out_dev && out_bytes > 0) {
      CUDART_RETURN_IF_ERROR(cudaMemcpyAsync(hout, dout, out_bytes, cudaMemcpyDeviceToHost, stream_));
    }
    RETURN_IF_ERROR(Wait(seq, timeout));
    if (!out_dev && out_bytes > 0) {
      if (pinned) {
        std::memcpy(out, hout, static_cast<size_t>(out_bytes));
      } else {
        // The collective is done: this copy waits on nothing but itself.
        CUDART_RETURN_IF_ERROR(cudaMemcpyAsync(out, dout, out_bytes, cudaMemcpyDeviceToHost, stream_));
        RETURN_IF_ERROR(Wait(seq, timeout));
      }
    }
    return absl::OkStatus();
  }

  // Marks the communicator broken and aborts it without making the caller wait: ncclCommAbort
  // stops this member's NCCL kernels, but it can then block until every CUDA graph that captured
  // operations on the communicator is destroyed (the decode graphs live until their generation
  // is retired), so a detached thread finishes it. Seen on the H200s: an in-line abort held a
  // step past its deadline until the engine's own 30 s deadline, after a peer was killed.
  void Abandon() {
    broken_ = true;
    if (comm_ == nullptr) return;
    ncclComm_t comm = comm_;
    comm_ = nullptr;
    const int device = options_.device;
    std::thread([comm, device] {
      cudaSetDevice(device);
      ncclCommAbort(comm);
    }).detach();
  }

  absl::Status Wait(uint64_t seq, absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    while (true) {
      const cudaError_t q = cudaStreamQuery(stream_);
      if (q == cudaSuccess) return absl::OkStatus();
      if (q != cudaErrorNotReady) {
        broken_ = true;
        return absl::InternalError(absl::StrCat("nccl: stream failed: ", cudaGetErrorString(q)));
      }
      ncclResult_t async = ncclSuccess;
      ncclCommGetAsyncError(comm_, &async);
      if (async != ncclSuccess && async != ncclInProgress) {
        Abandon();
        return absl::UnavailableError(
            absl::StrCat("nccl: communicator error ", ncclGetErrorString(async), " (seq ", seq, ")"));
      }
      if (interrupted()) {
        Abandon();
        return InterruptedError(seq);
      }
      if (absl::Now() > deadline) {
        // NOTE: aborting releases this member from the collective; peers see their own timeout
        // or a communicator error. The communicator is unusable afterwards.
        Abandon();
        return absl::DeadlineExceededError(
            absl::StrCat("nccl: collective (seq ", seq, ") did not finish within ", absl::FormatDuration(timeout)));
      }
      if (options_.wait_poll_us > 0) {
        absl::SleepFor(absl::Microseconds(options_.wait_poll_us));
      } else {
        std::this_thread::yield();
      }
    }
  }

  NcclOptions options_;
  ncclComm_t comm_;
  cudaStream_t stream_;
  bool broken_ = false;
  void* staging_ = nullptr;
  size_t staging_bytes_ = 0;
  std::unique_ptr<ShmStepChannel> agree_;  // the step agreement's channel, when the group is on one host
  StepGatherBacklog backlog_;
  // Pinned host staging of small collectives (allocated on first use).
  static constexpr size_t kPinnedStagingBytes = size_t{1} << 20;
  void* pinned_ = nullptr;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Transport>> CreateNcclTransport(const NcclOptions& options) {
  if (options.size <= 0 || options.slot < 0 || options.slot >= options.size) {
    return absl::InvalidArgumentError("nccl: slot must be in [0, size)");
  }
  CUDART_RETURN_IF_ERROR(cudaSetDevice(options.device));
  // Member 0 makes the group's unique id and publishes it; the others read it.
  ncclUniqueId id;
  if (!options.unique_id.empty()) {
    if (options.unique_id.size() != sizeof(id.internal)) {
      return absl::InvalidArgumentError(
          absl::StrCat("nccl: unique id of ", options.unique_id.size(), " bytes, not an id's ", sizeof(id.internal)));
    }
    std::memcpy(id.internal, options.unique_id.data(), sizeof(id.internal));
  } else if (options.slot == 0) {
    NCCL_RETURN_IF_ERROR(ncclGetUniqueId(&id));
    absl::Status s =
        PublishFile(options.rendezvous_dir, "nccl.id", absl::string_view(id.internal, sizeof(id.internal)));
    if (!s.ok()) return absl::Status(s.code(), absl::StrCat("nccl: member 0's id: ", s.message()));
  } else {
    auto published = AwaitFiles(options.rendezvous_dir, {"nccl.id"}, options.connect_timeout);
    if (!published.ok()) {
      return absl::Status(published.status().code(),
                          absl::StrCat("nccl: member 0's id: ", published.status().message()));
    }
    const std::string& bytes = (*published)[0];
    if (bytes.size() != sizeof(id.internal)) {
      return absl::DataLossError(absl::StrCat("nccl: ", options.rendezvous_dir, "/nccl.id holds ", bytes.size(),
                                              " bytes, not an id's ", sizeof(id.internal)));
    }
    std::memcpy(id.internal, bytes.data(), sizeof(id.internal));
  }
  ncclComm_t comm;
  NCCL_RETURN_IF_ERROR(ncclCommInitRank(&comm, options.size, id, options.slot));
  cudaStream_t stream;
  CUDART_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  auto transport = std::unique_ptr<NcclTransport>(new NcclTransport(options, comm, stream));
  if (options.host_agreement && options.size > 1) {
    RETURN_IF_ERROR(transport->SetUpHostAgreement(id.internal, sizeof(id.internal), options.connect_timeout));
  }
  return std::unique_ptr<Transport>(std::move(transport));
}

absl::StatusOr<std::string> NewNcclUniqueId() {
  ncclUniqueId id;
  NCCL_RETURN_IF_ERROR(ncclGetUniqueId(&id));
  return std::string(id.internal, sizeof(id.internal));
}

NcclHandles NativeNcclHandles(Transport& transport) {
  auto* nccl = dynamic_cast<NcclTransport*>(&transport);
  return nccl == nullptr ? NcclHandles{} : nccl->handles();
}

bool NcclHostAgreement(Transport& transport) {
  auto* nccl = dynamic_cast<NcclTransport*>(&transport);
  return nccl != nullptr && nccl->host_agreement();
}

absl::Status WaitNcclStream(Transport& transport, uint64_t seq, absl::Duration timeout) {
  auto* nccl = dynamic_cast<NcclTransport*>(&transport);
  if (nccl == nullptr) return absl::FailedPreconditionError("not an NCCL transport");
  return nccl->WaitStream(seq, timeout);
}

}  // namespace moe
