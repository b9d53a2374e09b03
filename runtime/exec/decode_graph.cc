#include "runtime/exec/decode_graph.h"

#include "absl/strings/str_cat.h"

namespace moe {

bool ChoosePaddedRunner(DecodeRunner runner, int peers, int64_t rank_tokens, int k, int64_t total_slots,
                        bool kernels_beat_padded) {
  if (runner != DecodeRunner::kAuto) return runner == DecodeRunner::kPadded;
  if (kernels_beat_padded) return false;
  return total_slots > 0 && static_cast<int64_t>(peers) * rank_tokens * k >= 2 * total_slots;
}

absl::StatusOr<DecodeRunner> ParseDecodeRunner(const std::string& name) {
  if (name == "auto") return DecodeRunner::kAuto;
  if (name == "kernels") return DecodeRunner::kKernels;
  if (name == "padded") return DecodeRunner::kPadded;
  return absl::InvalidArgumentError(absl::StrCat("decode_runner: '", name, "' is not auto, kernels or padded"));
}

}  // namespace moe
