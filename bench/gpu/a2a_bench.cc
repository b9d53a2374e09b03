// Dispatch + combine bandwidth of the NCCL transport at DeepEP's normal-kernel shape: 4096
// tokens per rank, hidden 7168, top-8 of 256 experts (uniform), BF16 rows sent once per route
// (the runtime's dispatch layout), device buffers. One process per GPU (fork); prints the
// median time of dispatch (all-to-all-v) and combine (the reverse) and the bytes that crossed
// to other GPUs. bench/gpu/a2a_torch.py moves the same splits with all_to_all_single.
#include <cuda_runtime.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "runtime/transport/nccl.h"

namespace {

constexpr int kTokens = 4096, kHidden = 7168, kTopK = 8, kExperts = 256;

// counts[src * p + dst]: routes from src to dst under uniform top-k (same seed on every member).
std::vector<int64_t> CountMatrix(int p) {
  std::mt19937 rng(1);
  std::vector<int64_t> counts(p * p, 0);
  std::vector<int> perm(kExperts);
  for (int src = 0; src < p; ++src) {
    for (int t = 0; t < kTokens; ++t) {
      for (int e = 0; e < kExperts; ++e) perm[e] = e;
      for (int j = 0; j < kTopK; ++j) {
        std::swap(perm[j], perm[j + rng() % (kExperts - j)]);
        ++counts[src * p + perm[j] / (kExperts / p)];
      }
    }
  }
  return counts;
}

int Member(int slot, int p, const std::string& dir, int reps) {
  setenv("NCCL_NVLS_ENABLE", "0", 1);
  moe::NcclOptions o;
  o.slot = slot;
  o.size = p;
  o.device = slot;
  o.rendezvous_dir = dir;
  auto t = moe::CreateNcclTransport(o);
  if (!t.ok()) {
    std::fprintf(stderr, "%s\n", std::string(t.status().message()).c_str());
    return 2;
  }
  const std::vector<int64_t> counts = CountMatrix(p);
  std::vector<int64_t> send(p), recv(p);
  int64_t send_total = 0, recv_total = 0, remote = 0;
  for (int j = 0; j < p; ++j) {
    send[j] = counts[slot * p + j] * kHidden * 2;
    recv[j] = counts[j * p + slot] * kHidden * 2;
    send_total += send[j];
    recv_total += recv[j];
    if (j != slot) remote += send[j];
  }
  void *a, *b;
  cudaMalloc(&a, send_total);
  cudaMalloc(&b, recv_total);
  cudaMemset(a, 1, send_total);
  std::vector<double> dispatch_us, combine_us;
  for (int r = 0; r < reps + 3; ++r) {
    absl::Time s = absl::Now();
    if (!(*t)->AllToAllV(2 * r, a, send, b, recv, absl::Seconds(60)).ok()) return 1;
    const double d = absl::ToDoubleMicroseconds(absl::Now() - s);
    s = absl::Now();
    if (!(*t)->AllToAllV(2 * r + 1, b, recv, a, send, absl::Seconds(60)).ok()) return 1;
    const double c = absl::ToDoubleMicroseconds(absl::Now() - s);
    if (r >= 3) {
      dispatch_us.push_back(d);
      combine_us.push_back(c);
    }
  }
  std::sort(dispatch_us.begin(), dispatch_us.end());
  std::sort(combine_us.begin(), combine_us.end());
  const double dm = dispatch_us[dispatch_us.size() / 2], cm = combine_us[combine_us.size() / 2];
  std::printf("{\"kind\": \"a2a\", \"impl\": \"moe-runtime nccl\", \"gpus\": %d, \"slot\": %d, \"dispatch_us\": %.1f, "
              "\"combine_us\": %.1f, \"remote_bytes\": %lld, \"dispatch_gbps\": %.1f, \"combine_gbps\": %.1f}\n",
              p, slot, dm, cm, static_cast<long long>(remote), remote / (dm * 1e3), remote / (cm * 1e3));
  std::fflush(stdout);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // Count the GPUs in a child: CUDA must not be initialized here before the members fork.
  int p = 0;
  if (const pid_t pid = fork(); pid == 0) {
    int n = 0;
    _exit(cudaGetDeviceCount(&n) == cudaSuccess ? n : 0);
  } else {
    int status = 0;
    waitpid(pid, &status, 0);
    p = WIFEXITED(status) ? WEXITSTATUS(status) : 0;
  }
  const int reps = argc > 1 ? std::atoi(argv[1]) : 10;
  char tmpl[] = "/tmp/a2a-XXXXXX";
  const std::string dir = mkdtemp(tmpl);
  std::vector<pid_t> pids;
  for (int i = 0; i < p; ++i) {
    const pid_t pid = fork();
    if (pid == 0) _exit(Member(i, p, dir, reps));
    pids.push_back(pid);
  }
  int bad = 0;
  for (pid_t pid : pids) {
    int status = 0;
    waitpid(pid, &status, 0);
    bad += !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  return bad;
}
