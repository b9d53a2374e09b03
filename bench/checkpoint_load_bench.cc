// Loads one rank's experts of a checkpoint (runtime/checkpoint/expert_loader.h) the way
// moe-rankd does at start-up, and reports the wall time, the rate over the bytes the load read
// from the files, and the process's peak RSS against the rank's own expert bytes. The rate to
// compare with is reading the same files with `cat` (bench/gpu/hf_models.sh does both, page
// cache dropped before each with posix_fadvise).
//
//   checkpoint_load_bench --checkpoint DIR [--world P --rank R --extra_replicas N --threads T]
#include <cstdio>

#include <sys/resource.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/time/clock.h"

#include "runtime/checkpoint/checkpoint_reader.h"
#include "runtime/checkpoint/expert_loader.h"
#include "runtime/checkpoint/hf_checkpoint.h"
#include "runtime/placement/default_placement.h"

ABSL_FLAG(std::string, checkpoint, "", "a Hugging Face model directory (or the single-file checkpoint)");
ABSL_FLAG(int, world, 1, "ranks of the default placement");
ABSL_FLAG(int, rank, 0, "the rank whose experts are loaded");
ABSL_FLAG(int, extra_replicas, 0, "extra replicas of the default placement");
ABSL_FLAG(int, threads, 8, "loader threads");

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  std::unique_ptr<moe::SafetensorsFile> storage;
  auto ckpt = moe::OpenCheckpoint(absl::GetFlag(FLAGS_checkpoint), &storage);
  if (!ckpt.ok()) {
    std::fprintf(stderr, "--checkpoint: %s\n", std::string(ckpt.status().message()).c_str());
    return 2;
  }
  const moe::CheckpointReader& c = **ckpt;
  const int world = absl::GetFlag(FLAGS_world);
  moe::CheckpointIdentity id = c.Identity();
  const moe::Topology topology = moe::TwoNodeTopology(world);
  const moe::ProcessGroup group = moe::LocalClusterGroup(world, 1);
  auto m = moe::DefaultPlacement(moe::PlacementVersion(1), c.shape().num_experts, absl::GetFlag(FLAGS_extra_replicas),
                                 topology, group, id);
  if (!m.ok()) {
    std::fprintf(stderr, "placement: %s\n", std::string(m.status().message()).c_str());
    return 2;
  }
  const moe::Rank rank(absl::GetFlag(FLAGS_rank));
  moe::LoadOptions o;
  o.threads = absl::GetFlag(FLAGS_threads);
  const absl::Time start = absl::Now();
  auto local = moe::LoadLocalExperts(c, **m, rank, o);
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  if (!local.ok()) {
    std::fprintf(stderr, "load: %s\n", std::string(local.status().message()).c_str());
    return 1;
  }
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  const double held = static_cast<double>(local->w_gate_up.size() + local->w_down.size()) * 2;
  const int64_t slots = static_cast<int64_t>((*m)->LocalSlots(rank).size());
  // What the load read from the files: this rank's experts in their stored dtype.
  const auto* hf = dynamic_cast<const moe::HfCheckpoint*>(&c);
  const double read = hf != nullptr ? static_cast<double>(hf->expert_source_bytes()) * slots * c.num_layers() : held;
  const double rss = static_cast<double>(ru.ru_maxrss) * 1024;
  std::printf(
      "load rank %d of %d: %lld slots x %d layers, %.3f GB held (BF16), %.3f GB read in %.3f s = %.2f GB/s with %d "
      "threads; peak RSS %.3f GB = held + %.3f GB\n",
      rank.value(), world, static_cast<long long>(slots), c.num_layers(), held / 1e9, read / 1e9, seconds,
      read / seconds / 1e9, o.threads, rss / 1e9, (rss - held) / 1e9);
  return 0;
}
