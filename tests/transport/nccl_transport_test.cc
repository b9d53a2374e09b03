// NCCL across the GPUs of this host: one forked process per GPU (NCCL_NVLS_ENABLE=0), the same
// scenarios as the UCX test: random all-to-all-v after the header agreement (host buffers,
// staged), header mismatch and generation split aborting every member, a killed member turning
// into errors on the others within the timeout, a large host exchange a peer never joins ending
// at its timeout, and device-buffer all-to-all-v.
#include <cuda_runtime.h>
#include <unistd.h>

#include <csignal>
#include <cstdlib>
#include <functional>
#include <vector>

#include <sys/wait.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

#include "runtime/status.h"
#include "runtime/transport/nccl.h"
#include "tests/transport/exchange_scenarios.h"
#include "tests/transport/process_harness.h"

namespace moe {
namespace {

// Counted in a child: CUDA must not be initialized in the parent before it forks the members.
int Devices() {
  return testing::ExitCodeOfChild([] {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
  });
}

std::vector<int> RunProcesses(int size, const std::function<absl::Status(Transport&)>& scenario,
                              bool host_agreement = true) {
  return testing::ForkMembers(size, "nccl", [&](int slot, const std::string& dir) {
    setenv("NCCL_NVLS_ENABLE", "0", 1);
    NcclOptions o;
    o.slot = slot;
    o.size = size;
    o.device = slot;
    o.rendezvous_dir = dir;
    o.host_agreement = host_agreement;
    auto t = CreateNcclTransport(o);
    if (!t.ok()) {
      std::fprintf(stderr, "slot %d: %s\n", slot, std::string(t.status().message()).c_str());
      return 2;
    }
    absl::Status s = scenario(**t);
    if (!s.ok()) std::fprintf(stderr, "slot %d: %s\n", slot, std::string(s.message()).c_str());
    return s.ok() ? 0 : 1;
  });
}

TEST(NcclTransportTest, RandomExchangeAcrossGpus) {
  const int n = Devices();
  ASSERT_GE(n, 1) << "no GPU";
  const auto codes = RunProcesses(n, [](Transport& t) { return testing::RandomExchange(t, 4, 9); });
  for (int i = 0; i < n; ++i) EXPECT_EQ(codes[i], 0) << "slot " << i;
}

TEST(NcclTransportTest, HeaderMismatchAbortsEveryMember) {
  const int n = Devices();
  ASSERT_GE(n, 2) << "needs two GPUs (a lone member has no one to disagree with)";
  const auto codes = RunProcesses(n, [n](Transport& t) { return testing::HeaderMismatchAbortsEveryone(t, n - 1); });
  for (int i = 0; i < n; ++i) EXPECT_EQ(codes[i], 0) << "slot " << i;
}

// Members of one host agree over shared memory unless told not to; both ways abort a header
// mismatch everywhere and carry the metadata.
TEST(NcclTransportTest, HostAgreementOnOneHostAndTheNcclAllGatherWithoutIt) {
  const int n = Devices();
  ASSERT_GE(n, 2) << "needs two GPUs";
  for (bool host : {true, false}) {
    const auto codes = RunProcesses(
        n,
        [n, host](Transport& t) -> absl::Status {
          if (NcclHostAgreement(t) != host) return absl::InternalError("host agreement not as asked");
          RETURN_IF_ERROR(testing::HeaderMismatchAbortsEveryone(t, n - 1));
          return testing::MetadataRidesWithTheAgreement(t);
        },
        host);
    for (int i = 0; i < n; ++i) EXPECT_EQ(codes[i], 0) << "slot " << i << (host ? " (host agreement)" : " (nccl)");
  }
}

TEST(NcclTransportTest, GenerationSplitAbortsEveryMember) {
  const int n = Devices();
  ASSERT_GE(n, 2) << "needs two GPUs";
  const auto codes = RunProcesses(n, [n](Transport& t) { return testing::GenerationSplitAbortsEveryone(t, n - 1); });
  for (int i = 0; i < n; ++i) EXPECT_EQ(codes[i], 0) << "slot " << i;
}

TEST(NcclTransportTest, MetadataRidesWithTheAgreement) {
  const int n = Devices();
  ASSERT_GE(n, 1) << "no GPU";
  const auto codes = RunProcesses(n, [](Transport& t) { return testing::MetadataRidesWithTheAgreement(t); });
  for (int i = 0; i < n; ++i) EXPECT_EQ(codes[i], 0) << "slot " << i;
}

TEST(NcclTransportTest, KilledPeerTurnsIntoErrorsWithinTheTimeout) {
  const int n = Devices();
  ASSERT_GE(n, 2) << "needs two GPUs";
  const auto codes = RunProcesses(n, [n](Transport& t) {
    return testing::KilledPeerFailsFast(t, n - 1, absl::Seconds(5), [] { raise(SIGKILL); });
  });
  for (int i = 0; i < n - 1; ++i) EXPECT_EQ(codes[i], 0) << "slot " << i;
  EXPECT_EQ(codes[n - 1], -SIGKILL);
}

// A host-memory exchange past the pinned staging (1 MiB a peer each way) that a peer never joins
// ends at its timeout: the copy into pageable memory is made once the collective is done, not
// queued behind it, where it would hold the thread inside CUDA with no deadline checked. The
// first exchange, which every member joins, sets up the pairs' connections.
TEST(NcclTransportTest, LargeHostExchangeThatAPeerNeverJoinsEndsAtItsTimeout) {
  const int n = Devices();
  ASSERT_GE(n, 2) << "needs two GPUs";
  const auto codes = RunProcesses(n, [n](Transport& t) -> absl::Status {
    const int p = t.size();
    const int64_t per_peer = int64_t{1} << 20;
    std::vector<uint8_t> send(per_peer * p, static_cast<uint8_t>(t.slot() + 1)), recv(per_peer * p, 0);
    std::vector<int64_t> splits(p, per_peer);
    RETURN_IF_ERROR(t.AllToAllV(1, send.data(), splits, recv.data(), splits, absl::Seconds(30)));
    for (int j = 0; j < p; ++j) {
      if (recv[j * per_peer] != j + 1 || recv[(j + 1) * per_peer - 1] != j + 1) {
        return absl::InternalError(absl::StrCat("exchange 1: wrong bytes from slot ", j));
      }
    }
    if (t.slot() == n - 1) {  // never joins the second exchange
      absl::SleepFor(absl::Seconds(10));
      _exit(0);
    }
    const absl::Time start = absl::Now();
    const absl::Status s = t.AllToAllV(2, send.data(), splits, recv.data(), splits, absl::Seconds(1));
    const absl::Duration took = absl::Now() - start;
    if (s.ok()) return absl::InternalError("an exchange a peer never joined succeeded");
    if (took > absl::Seconds(4)) {
      return absl::InternalError(absl::StrCat("the exchange took ", absl::FormatDuration(took), " for a 1 s timeout"));
    }
    if (!t.failed()) return absl::InternalError("the transport is not marked failed after the timeout");
    return absl::OkStatus();
  });
  for (int i = 0; i < n; ++i) EXPECT_EQ(codes[i], 0) << "slot " << i;
}

TEST(NcclTransportTest, DeviceBuffersGoDirect) {
  const int n = Devices();
  ASSERT_GE(n, 1) << "no GPU";
  const auto codes = RunProcesses(n, [](Transport& t) -> absl::Status {
    const int p = t.size();
    const int64_t per_peer = 1 << 20;
    std::vector<uint8_t> host(per_peer * p);
    for (int j = 0; j < p; ++j) {
      for (int64_t i = 0; i < per_peer; ++i) host[j * per_peer + i] = testing::Pattern(t.slot(), j, 77, i);
    }
    void *send, *recv;
    cudaMalloc(&send, host.size());
    cudaMalloc(&recv, host.size());
    cudaMemcpy(send, host.data(), host.size(), cudaMemcpyHostToDevice);
    std::vector<int64_t> splits(p, per_peer);
    absl::Status s = t.AllToAllV(77, send, splits, recv, splits, absl::Seconds(30));
    if (!s.ok()) return s;
    std::vector<uint8_t> got(host.size());
    cudaMemcpy(got.data(), recv, got.size(), cudaMemcpyDeviceToHost);
    for (int j = 0; j < p; ++j) {
      for (int64_t i = 0; i < per_peer; ++i) {
        if (got[j * per_peer + i] != testing::Pattern(j, t.slot(), 77, i)) {
          return absl::InternalError(absl::StrCat("byte ", i, " from slot ", j, " corrupted"));
        }
      }
    }
    cudaFree(send);
    cudaFree(recv);
    return absl::OkStatus();
  });
  for (int i = 0; i < n; ++i) EXPECT_EQ(codes[i], 0) << "slot " << i;
}

}  // namespace
}  // namespace moe
