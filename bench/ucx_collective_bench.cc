// UCX collective latency by message size: four members in forked processes on this machine
// (loopback; shm/tcp), medians of 600 calls each, as the step agreement and the slot metadata
// exchange use them. Sizes: 120 B and 1100 B (the agreement's former two records), 7168 B (its
// record now), 8192 B (UCX's rendezvous protocol from there), and a 4 x 64 B all-to-all-v (the
// metadata exchange of a decode step). Run: bazel run //bench:ucx_collective_bench
#include <algorithm>
#include <cstdio>
#include <vector>

#include "absl/time/clock.h"

#include "bench/stats.h"
#include "runtime/exec/step_exchange.h"
#include "runtime/transport/transport.h"
#include "tests/transport/process_harness.h"

int main() {
  using namespace moe;
  const int n = 4;
  auto codes = testing::ForkMembers(n, "ucxt", [&](int slot, const std::string& dir) {
    auto t = testing::UcxMemberTransport(dir, slot, n);
    if (!t.ok()) return 2;
    uint64_t seq = 1;
    for (int64_t bytes : {120, 1100, 7168, 8192}) {
      std::vector<char> in(bytes, 1), out(bytes * n);
      std::vector<double> us;
      for (int r = 0; r < 600; ++r) {
        const absl::Time t0 = absl::Now();
        if (!(*t)->AllGather(seq++, in.data(), bytes, out.data(), absl::Seconds(10)).ok()) return 3;
        us.push_back(absl::ToDoubleMicroseconds(absl::Now() - t0));
      }
      if (slot == 0)
        std::printf("allgather %6lld B: p50 %.1f us\n", (long long)bytes, moe::bench::Median(us)), std::fflush(stdout);
    }
    std::vector<int64_t> split(n, 64);
    std::vector<char> in(64 * n, 1), out(64 * n);
    std::vector<double> us;
    for (int r = 0; r < 600; ++r) {
      const absl::Time t0 = absl::Now();
      if (!(*t)->AllToAllV(seq++, in.data(), split, out.data(), split, absl::Seconds(10)).ok()) return 3;
      us.push_back(absl::ToDoubleMicroseconds(absl::Now() - t0));
    }
    if (slot == 0) std::printf("alltoallv 4x64 B: p50 %.1f us\n", moe::bench::Median(us)), std::fflush(stdout);
    return 0;
  });
  for (int c : codes)
    if (c != 0) std::printf("member exit %d\n", c);
}
