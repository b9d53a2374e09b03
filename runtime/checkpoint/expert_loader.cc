#include "runtime/checkpoint/expert_loader.h"

#include <algorithm>
#include <atomic>
#include <fstream>
#include <string>
#include <thread>

#include <sys/mman.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"

#include "runtime/checkpoint/hf_checkpoint.h"
#include "runtime/status.h"

namespace moe {

namespace {

// Transparent huge pages for a large destination buffer: 512x fewer page faults to fill it.
void AdviseHugePages(void* p, size_t bytes) {
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(p) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + bytes) & ~(kHuge - 1);
  if (end > begin) ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
}

}  // namespace

int64_t AvailableHostBytes() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  int64_t kb = 0;
  std::string unit;
  while (in >> key >> kb >> unit) {
    if (key == "MemAvailable:") return kb * 1024;
  }
  return 0;
}

absl::StatusOr<int64_t> LocalExpertBytes(const CheckpointReader& ckpt, const PlacementManifest& m, Rank rank) {
  int64_t n = 0;
  if (__builtin_mul_overflow(static_cast<int64_t>(m.LocalSlots(rank).size()), ckpt.expert_bytes(), &n) ||
      __builtin_mul_overflow(n, static_cast<int64_t>(ckpt.num_layers()), &n)) {
    return absl::InvalidArgumentError("checkpoint: the rank's expert bytes overflow");
  }
  return n;
}

std::string ExpectedLayerDigest(const PlacementManifest& m, PhysicalSlotId q, int li) {
  if (m.per_layer() || m.layers().empty()) return m.LayerAt(li).slot(q).parameter_digest.value();
  const std::vector<std::string>& per_layer = m.slot(q).layer_digests;
  return li < static_cast<int>(per_layer.size()) ? per_layer[li] : "";
}

absl::Status CheckSlotDigests(const PlacementManifest& m, PhysicalSlotId q, const std::vector<std::string>& computed,
                              const std::vector<std::string>& how) {
  for (size_t li = 0; li < computed.size(); ++li) {
    const std::string want = ExpectedLayerDigest(m, q, static_cast<int>(li));
    if (want.empty() || want == computed[li]) continue;
    const SlotRecord& slot = m.LayerAt(static_cast<int>(li)).slot(q);
    return absl::FailedPreconditionError(absl::StrCat(
        "slot ", slot.name, " (expert ", slot.expert.value(), ")",
        m.layers().empty() ? std::string() : absl::StrCat(" layer ", m.layers()[li]), ": parameter digest ",
        computed[li].substr(0, 12), "... (", how[li], ") does not match the manifest's ", want.substr(0, 12)));
  }
  const SlotRecord& slot = m.slot(q);
  if (m.per_layer() || m.layers().empty() || slot.parameter_digest.empty()) return absl::OkStatus();
  const std::string got = CombinedDigest(computed);
  if (got != slot.parameter_digest.value()) {
    return absl::FailedPreconditionError(
        absl::StrCat("slot ", slot.name, ": combined parameter digest ", got.substr(0, 12), "... (", how.front(),
                     ") does not match the manifest's ", slot.parameter_digest.value().substr(0, 12)));
  }
  return absl::OkStatus();
}

absl::Status RequireSlotDigests(const PlacementManifest& m, PhysicalSlotId q, int num_layers) {
  // A shared multi-layer table's combined digest verifies every layer's copy together
  // (CheckSlotDigests), with or without the per-layer ones.
  if (!m.per_layer() && !m.layers().empty() && !m.slot(q).parameter_digest.empty()) return absl::OkStatus();
  for (int li = 0; li < num_layers; ++li) {
    if (!ExpectedLayerDigest(m, q, li).empty()) continue;
    const SlotRecord& slot = m.LayerAt(li).slot(q);
    return absl::FailedPreconditionError(absl::StrCat(
        "manifest.slots: slot ", slot.name, " (expert ", slot.expert.value(), ")",
        m.layers().empty() ? std::string() : absl::StrCat(" layer ", m.layers()[li]),
        " has no parameter digest, so its copy cannot be verified before it serves (record the checkpoint's digests: "
        "moectl checkpoint digest)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<LocalExperts> LoadLocalExperts(const CheckpointReader& ckpt, const PlacementManifest& m, Rank rank,
                                              const LoadOptions& options) {
  if (m.layers() != ckpt.layers()) {
    return absl::FailedPreconditionError(absl::StrCat("placement-v", m.version().value(), " serves layers [",
                                                      absl::StrJoin(m.layers(), ","), "], checkpoint ", ckpt.version(),
                                                      " has MoE layers [", absl::StrJoin(ckpt.layers(), ","), "]"));
  }
  const ExpertShape shape = ckpt.shape();
  if (m.num_experts() > shape.num_experts) {
    return absl::FailedPreconditionError(absl::StrCat("placement-v", m.version().value(), " has ", m.num_experts(),
                                                      " logical experts, the checkpoint ", shape.num_experts));
  }
  ASSIGN_OR_RETURN(const int64_t bytes, LocalExpertBytes(ckpt, m, rank));
  if (options.max_bytes > 0 && bytes > options.max_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("rank ", rank.value(), " would hold ", bytes,
                                                     " bytes of experts (", m.LocalSlots(rank).size(), " slots x ",
                                                     ckpt.num_layers(), " layers x ", ckpt.expert_bytes(),
                                                     " bytes), more than the ", options.max_bytes, " bytes available"));
  }
  const auto slots = m.LocalSlots(rank);
  const int64_t l_count = static_cast<int64_t>(slots.size());
  const int layers = ckpt.num_layers();
  const size_t gu_n = static_cast<size_t>(2) * shape.d_ff * shape.d, dn_n = static_cast<size_t>(shape.d) * shape.d_ff;
  LocalExperts out;
  out.d = shape.d;
  out.d_ff = shape.d_ff;
  out.layers = ckpt.layers();
  out.w_gate_up.resize(gu_n * l_count * layers);  // left unwritten: the workers fault the pages in
  out.w_down.resize(dn_n * l_count * layers);
  AdviseHugePages(out.w_gate_up.data(), out.w_gate_up.size() * 2);
  AdviseHugePages(out.w_down.data(), out.w_down.size() * 2);
  // Items in layer-major order; digests[slot][layer].
  const int64_t items = l_count * layers;
  std::vector<std::vector<std::string>> digests(l_count, std::vector<std::string>(layers));
  std::vector<std::atomic<int>> layer_left(layers);
  for (auto& left : layer_left) left.store(static_cast<int>(l_count));
  std::atomic<int64_t> next{0};
  std::atomic<bool> failed{false};
  absl::Mutex mu;
  absl::Status first_error;
  LoadProgress progress;
  progress.layers_total = layers;
  progress.bytes_total = bytes;
  const absl::Time start = absl::Now();
  auto worker = [&] {
    for (int64_t i = next++; i < items && !failed.load(); i = next++) {
      const int li = static_cast<int>(i / std::max<int64_t>(l_count, 1));
      const int64_t j = i % l_count;
      const SlotRecord& slot = m.LayerAt(li).slot(slots[j]);  // the layer's own table in a per-layer generation
      uint16_t* gu = out.w_gate_up.data() + (li * l_count + j) * gu_n;
      uint16_t* dn = out.w_down.data() + (li * l_count + j) * dn_n;
      const int64_t layer = out.layers.empty() ? 0 : out.layers[li];
      absl::Status s = ckpt.ReadExpertWithDigest(layer, slot.expert.value(), gu, dn, &digests[j][li]);
      if (!s.ok()) s = absl::Status(s.code(), absl::StrCat("slot ", slot.name, ": ", s.message()));
      if (!s.ok()) {
        absl::MutexLock lock(&mu);
        if (first_error.ok()) first_error = s;
        failed.store(true);
        return;
      }
      if (--layer_left[li] == 0 && options.progress) {
        absl::MutexLock lock(&mu);
        ++progress.layers_done;
        progress.bytes_done += l_count * ckpt.expert_bytes();
        progress.seconds = absl::ToDoubleSeconds(absl::Now() - start);
        options.progress(progress);
      }
    }
  };
  const int threads = static_cast<int>(std::clamp<int64_t>(options.threads, 1, std::max<int64_t>(items, 1)));
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(worker);
  worker();
  for (std::thread& t : pool) t.join();
  RETURN_IF_ERROR(first_error);
  const std::vector<std::string> how(layers, "checkpoint load");
  for (int64_t j = 0; j < l_count; ++j) RETURN_IF_ERROR(CheckSlotDigests(m, slots[j], digests[j], how));
  return out;
}

absl::StatusOr<LocalExperts> LoadLocalExperts(const SafetensorsFile& checkpoint, const PlacementManifest& manifest,
                                              Rank rank) {
  ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> reader, SingleFileReader(checkpoint));
  LoadOptions o;
  o.threads = 1;
  return LoadLocalExperts(*reader, manifest, rank, o);
}

}  // namespace moe
