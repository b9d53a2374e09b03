#include "runtime/checkpoint/checkpoint_reader.h"

#include <cstring>

#include <openssl/evp.h>
#include <sys/stat.h>

#include "absl/strings/str_cat.h"

#include "runtime/checkpoint/hf_checkpoint.h"
#include "runtime/checkpoint/sha256.h"
#include "runtime/status.h"

namespace moe {

int64_t CheckpointReader::expert_bytes() const {
  const ExpertShape s = shape();
  return int64_t{3} * s.d * s.d_ff * 2;
}

absl::Status CheckpointReader::ReadExpertWithDigest(int64_t layer, int expert, uint16_t* gate_up, uint16_t* down,
                                                    std::string* digest) const {
  RETURN_IF_ERROR(ReadExpert(layer, expert, gate_up, down));
  const ExpertShape s = shape();
  *digest = ExpertDigest(gate_up, 2 * static_cast<size_t>(s.d_ff) * s.d, down, static_cast<size_t>(s.d) * s.d_ff);
  return absl::OkStatus();
}

CheckpointIdentity CheckpointReader::Identity() const {
  CheckpointIdentity id;
  id.version = version();
  id.layers = layers();
  const std::vector<int64_t> one = {0};
  const std::vector<int64_t>& ls = layers().empty() ? one : layers();
  id.digests.resize(shape().num_experts);
  for (int e = 0; e < shape().num_experts; ++e) {
    for (int64_t l : ls) id.digests[e].push_back(RecordedDigest(l, e));
  }
  return id;
}

namespace {

class SingleFile final : public CheckpointReader {
 public:
  explicit SingleFile(ExpertCheckpoint view) : view_(std::move(view)) {}
  const std::string& version() const override { return view_.version(); }
  ExpertShape shape() const override { return view_.shape(); }
  const std::vector<int64_t>& layers() const override { return layers_; }
  absl::Status ReadExpert(int64_t, int expert, uint16_t* gate_up, uint16_t* down) const override {
    if (expert < 0 || expert >= view_.num_experts()) {
      return absl::InvalidArgumentError(absl::StrCat("expert: ", expert, " outside [0, ", view_.num_experts(), ")"));
    }
    ASSIGN_OR_RETURN(const ExpertCheckpoint::Tensors t, view_.Expert(expert));
    std::memcpy(gate_up, t.gate_up->data.data(), t.gate_up->data.size());
    std::memcpy(down, t.down->data.data(), t.down->data.size());
    return absl::OkStatus();
  }
  std::string RecordedDigest(int64_t, int expert) const override {
    auto d = view_.Digest(expert);
    return d.ok() ? *d : "";
  }
  std::string Describe() const override {
    return absl::StrCat("single-file checkpoint ", view_.version(), " (", view_.num_experts(), " experts, d ",
                        view_.d(), ", d_ff ", view_.d_ff(), ")");
  }

 private:
  ExpertCheckpoint view_;
  std::vector<int64_t> layers_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<CheckpointReader>> SingleFileReader(const SafetensorsFile& file) {
  ASSIGN_OR_RETURN(ExpertCheckpoint view, ExpertCheckpoint::Open(file));
  return std::unique_ptr<CheckpointReader>(new SingleFile(std::move(view)));
}

absl::StatusOr<std::unique_ptr<CheckpointReader>> OpenCheckpoint(const std::string& path,
                                                                 std::unique_ptr<SafetensorsFile>* storage) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return absl::NotFoundError(absl::StrCat(path, ": no such file or directory"));
  if (S_ISDIR(st.st_mode)) {
    ASSIGN_OR_RETURN(std::unique_ptr<HfCheckpoint> hf, HfCheckpoint::Open(path));
    return std::unique_ptr<CheckpointReader>(std::move(hf));
  }
  ASSIGN_OR_RETURN(SafetensorsFile file, ReadSafetensors(path));
  *storage = std::make_unique<SafetensorsFile>(std::move(file));
  return SingleFileReader(**storage);
}

std::string CombinedDigest(const std::vector<std::string>& layer_digests) {
  Sha256Hex h;
  for (const std::string& d : layer_digests) {
    if (d.empty()) return "";
    h.Update(d.data(), d.size());
    h.Update("\n", 1);
  }
  return h.Finish();
}

}  // namespace moe
