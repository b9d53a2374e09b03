#include "runtime/checkpoint/expert_checkpoint.h"

#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace moe {

namespace checkpoint_keys {
std::string GateUp(int expert) { return absl::StrCat("experts.", expert, ".w_gate_up"); }
std::string Down(int expert) { return absl::StrCat("experts.", expert, ".w_down"); }
std::string Digest(int expert) { return absl::StrCat("digest.", expert); }
}  // namespace checkpoint_keys

namespace {

absl::Status PositiveInt(const SafetensorsFile& file, const char* key, int* out) {
  auto it = file.metadata.find(key);
  if (it == file.metadata.end() || !absl::SimpleAtoi(it->second, out) || *out <= 0) {
    return absl::DataLossError(absl::StrCat("checkpoint metadata '", key, "' missing or invalid"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ExpertCheckpoint> ExpertCheckpoint::Open(const SafetensorsFile& file) {
  ExpertCheckpoint c;
  c.file_ = &file;
  auto version = file.metadata.find(checkpoint_keys::kVersion);
  if (version == file.metadata.end() || version->second.empty()) {
    return absl::DataLossError(
        absl::StrCat("checkpoint metadata '", checkpoint_keys::kVersion, "' missing or invalid"));
  }
  c.version_ = version->second;
  for (auto [key, out] : {std::pair<const char*, int*>{checkpoint_keys::kNumExperts, &c.shape_.num_experts},
                          {checkpoint_keys::kD, &c.shape_.d},
                          {checkpoint_keys::kDff, &c.shape_.d_ff}}) {
    if (absl::Status s = PositiveInt(file, key, out); !s.ok()) return s;
  }
  // One expert's bytes (3 x d x d_ff BF16) must fit in the file's tensors: d and d_ff are then
  // bounded by the file before anyone sizes a buffer from them.
  uint64_t held = 0;
  for (const auto& [name, t] : file.tensors) held += t.data.size();
  uint64_t expert = 0;
  if (__builtin_mul_overflow(static_cast<uint64_t>(c.shape_.d), static_cast<uint64_t>(c.shape_.d_ff) * 6, &expert) ||
      expert > held) {
    return absl::DataLossError(absl::StrCat("checkpoint metadata: d ", c.shape_.d, " x d_ff ", c.shape_.d_ff,
                                            " makes one expert larger than the file's ", held, " tensor bytes"));
  }
  // And the expert count by the file's tensors (an expert has two): tables sized by it (the
  // checkpoint's identity, a digest per expert) stay within what the file's header holds. An
  // expert whose tensors are missing is named when it is read (Expert).
  if (static_cast<size_t>(c.shape_.num_experts) > file.tensors.size()) {
    return absl::DataLossError(absl::StrCat("checkpoint metadata: '", checkpoint_keys::kNumExperts, "' ",
                                            c.shape_.num_experts, " experts, the file holds ", file.tensors.size(),
                                            " tensors"));
  }
  return c;
}

absl::StatusOr<std::string> ExpertCheckpoint::Digest(int expert) const {
  auto it = file_->metadata.find(checkpoint_keys::Digest(expert));
  if (it == file_->metadata.end()) {
    return absl::FailedPreconditionError(absl::StrCat("checkpoint has no digest for expert ", expert));
  }
  return it->second;
}

absl::StatusOr<ExpertCheckpoint::Tensors> ExpertCheckpoint::Expert(int expert) const {
  auto gu = file_->tensors.find(checkpoint_keys::GateUp(expert));
  auto dn = file_->tensors.find(checkpoint_keys::Down(expert));
  if (gu == file_->tensors.end() || dn == file_->tensors.end()) {
    return absl::FailedPreconditionError(absl::StrCat("checkpoint has no tensors for expert ", expert));
  }
  size_t matrix_bytes = 0;
  const bool overflow =
      __builtin_mul_overflow(static_cast<size_t>(shape_.d), static_cast<size_t>(shape_.d_ff) * 2, &matrix_bytes) ||
      matrix_bytes > SIZE_MAX / 2;
  if (overflow || gu->second.data.size() != 2 * matrix_bytes || dn->second.data.size() != matrix_bytes) {
    return absl::FailedPreconditionError(absl::StrCat("expert ", expert, " tensors have the wrong shape"));
  }
  // The bytes are read as BF16 [2 d_ff, d] and [d, d_ff]: a tensor of another dtype or shape with
  // the same byte count is refused, not reinterpreted.
  auto bf16 = [](const std::string& name, const TensorBlob& t, const std::vector<int64_t>& want) {
    if (t.dtype == "BF16" && t.shape == want) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrCat(name, ": ", t.dtype, " [", absl::StrJoin(t.shape, ", "),
                                                      "], expected BF16 [", absl::StrJoin(want, ", "), "]"));
  };
  absl::Status s = bf16(checkpoint_keys::GateUp(expert), gu->second, {2 * static_cast<int64_t>(shape_.d_ff), shape_.d});
  if (s.ok()) s = bf16(checkpoint_keys::Down(expert), dn->second, {shape_.d, shape_.d_ff});
  if (!s.ok()) return s;
  return Tensors{&gu->second, &dn->second};
}

}  // namespace moe
