#include "control/bundle.h"

#include <fstream>
#include <sstream>
#include <vector>

#include <google/protobuf/util/json_util.h>

#include "absl/strings/str_cat.h"

#include "proto/moe/v1/placement.pb.h"
#include "rpc/placement_proto.h"
#include "runtime/checkpoint/checkpoint_reader.h"
#include "runtime/checkpoint/expert_loader.h"
#include "runtime/checkpoint/safetensors.h"
#include "runtime/checkpoint/sha256.h"
#include "runtime/status.h"

namespace moe {

namespace {

absl::StatusOr<std::string> ReadText(const std::string& path, const std::string& flag) {
  std::ifstream in(path);
  if (!in) return absl::InvalidArgumentError(absl::StrCat(flag, " ", path, ": cannot read"));
  std::stringstream buf;
  buf << in.rdbuf();
  return buf.str();
}

// The bundle's placement as a manifest read against `topology`.
absl::StatusOr<std::shared_ptr<const PlacementManifest>> BundleManifest(const json::Json& placement,
                                                                        const Topology& topology) {
  v1::PlacementManifest proto;
  if (auto s = google::protobuf::util::JsonStringToMessage(placement.dump(), &proto); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("placement: ", s.ToString()));
  }
  auto m = ManifestFromProto(proto, topology);
  if (!m.ok()) return absl::Status(m.status().code(), absl::StrCat("placement: ", m.status().message()));
  return m;
}

}  // namespace

std::string BundleDigest(const json::Json& bundle) {
  json::Json body = bundle;
  body.erase("digest");
  // nlohmann::json keeps object keys sorted: its dump is the canonical form.
  const std::string canonical = nlohmann::json::parse(body.dump()).dump();
  Sha256Hex h;
  h.Update(canonical.data(), canonical.size());
  return absl::StrCat("sha256:", h.Finish());
}

absl::StatusOr<json::Json> MakeBundle(const BundleInputs& in) {
  if (in.release_id.empty()) return absl::InvalidArgumentError("--release: required");
  if (in.world <= 0) return absl::InvalidArgumentError("--world: must be positive");
  if (in.decode_bucket_tokens <= 0 || in.decode_bucket_slot_routes <= 0) {
    return absl::InvalidArgumentError("--decode_bucket_tokens, --decode_bucket_slot_routes: must be positive");
  }
  if (in.dtype != "BF16" && in.dtype != "FP8") {
    return absl::InvalidArgumentError(absl::StrCat("--expert_dtype: '", in.dtype, "' (bf16 or fp8)"));
  }
  if (in.decode_runner != "kernels" && in.decode_runner != "padded" && in.decode_runner != "auto") {
    return absl::InvalidArgumentError(
        absl::StrCat("--decode_runner: '", in.decode_runner, "' (kernels, padded, auto)"));
  }
  std::unique_ptr<SafetensorsFile> storage;
  auto ckpt = OpenCheckpoint(in.checkpoint_path, &storage);
  if (!ckpt.ok()) return absl::InvalidArgumentError(absl::StrCat("--checkpoint: ", ckpt.status().message()));
  const CheckpointReader& c = **ckpt;
  if (c.layers().empty()) {
    return absl::InvalidArgumentError(
        "--checkpoint: a Hugging Face model directory (the single-file checkpoint has "
        "no per-layer digests)");
  }
  json::Json digests = json::Json::object();
  for (int64_t layer : c.layers()) {
    json::Json per = json::Json::array();
    for (int e = 0; e < c.shape().num_experts; ++e) {
      const std::string d = c.RecordedDigest(layer, e);
      if (d.empty()) {
        return absl::InvalidArgumentError(absl::StrCat("--checkpoint ", in.checkpoint_path, ": no digest recorded for ",
                                                       "layer ", layer, " expert ", e,
                                                       " (moectl checkpoint digest records them)"));
      }
      per.push_back(d);
    }
    digests[std::to_string(layer)] = per;
  }
  ASSIGN_OR_RETURN(const std::string manifest_text, ReadText(in.manifest_path, "--manifest"));
  auto placement = json::Parse(manifest_text, "--manifest " + in.manifest_path);
  if (!placement.ok()) return placement.status();
  json::Json b;
  b["format"] = kBundleFormat;
  b["release_id"] = in.release_id;
  if (!in.prior_release.empty()) b["prior_release"] = in.prior_release;
  b["checkpoint"] = {{"path", in.checkpoint_path},
                     {"version", c.version()},
                     {"layers", c.layers()},
                     {"experts", c.shape().num_experts},
                     {"digests", digests}};
  b["placement"] = *placement;
  b["runtime"] = {{"decode_runner", in.decode_runner},
                  {"decode_bucket_tokens", in.decode_bucket_tokens},
                  {"decode_bucket_slot_routes", in.decode_bucket_slot_routes},
                  {"dtype", in.dtype},
                  {"kernel_build", in.kernel_build}};
  b["topology"] = {{"world", in.world}};
  if (!in.nodes.empty()) b["topology"]["nodes"] = in.nodes;
  if (absl::Status s = ParseBundleTopology(b).status(); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--nodes: ", s.message()));
  }
  b["digest"] = BundleDigest(b);
  return b;
}

absl::StatusOr<BundleRuntime> ParseBundleRuntime(const json::Json& b) {
  if (!b.is_object()) return absl::InvalidArgumentError("bundle: not a JSON object");
  ASSIGN_OR_RETURN(const json::Json* r, json::Member(b, "bundle", "runtime"));
  if (!r->is_object()) return absl::InvalidArgumentError("runtime: not an object");
  // A coordinate this runtime does not read (expert tensor parallelism, say) must not be served
  // as if the bundle had not asked for it (0x0BE).
  RETURN_IF_ERROR(json::OnlyMembers(
      *r, "runtime", {"decode_runner", "decode_bucket_tokens", "decode_bucket_slot_routes", "dtype", "kernel_build"}));
  BundleRuntime out;
  ASSIGN_OR_RETURN(const json::Json* runner, json::Member(*r, "runtime", "decode_runner"));
  ASSIGN_OR_RETURN(out.decode_runner, json::String(*runner, "runtime.decode_runner"));
  ASSIGN_OR_RETURN(const json::Json* tokens, json::Member(*r, "runtime", "decode_bucket_tokens"));
  ASSIGN_OR_RETURN(out.decode_bucket_tokens, json::Int(*tokens, "runtime.decode_bucket_tokens"));
  ASSIGN_OR_RETURN(const json::Json* routes, json::Member(*r, "runtime", "decode_bucket_slot_routes"));
  ASSIGN_OR_RETURN(out.decode_bucket_slot_routes, json::Int(*routes, "runtime.decode_bucket_slot_routes"));
  ASSIGN_OR_RETURN(out.dtype, json::StringOr(*r, "runtime", "dtype", ""));
  if (!out.dtype.empty() && out.dtype != "BF16" && out.dtype != "FP8") {
    return absl::InvalidArgumentError(
        absl::StrCat("runtime.dtype: '", out.dtype, "' is not an expert precision (BF16, FP8)"));
  }
  ASSIGN_OR_RETURN(out.kernel_build, json::StringOr(*r, "runtime", "kernel_build", ""));
  if (out.decode_bucket_tokens <= 0 || out.decode_bucket_slot_routes <= 0) {
    return absl::InvalidArgumentError(
        "runtime.decode_bucket_tokens, runtime.decode_bucket_slot_routes: must be positive");
  }
  return out;
}

absl::StatusOr<BundleTopology> ParseBundleTopology(const json::Json& b) {
  if (!b.is_object()) return absl::InvalidArgumentError("bundle: not a JSON object");
  ASSIGN_OR_RETURN(const json::Json* topo, json::Member(b, "bundle", "topology"));
  if (!topo->is_object()) return absl::InvalidArgumentError("topology: not an object");
  RETURN_IF_ERROR(json::OnlyMembers(*topo, "topology", {"world", "nodes"}));
  BundleTopology out;
  ASSIGN_OR_RETURN(const json::Json* world_field, json::Member(*topo, "topology", "world"));
  ASSIGN_OR_RETURN(out.world, json::Int(*world_field, "topology.world"));
  if (out.world <= 0 || out.world > 4096) return absl::InvalidArgumentError("topology.world: must be in [1, 4096]");
  auto nodes = topo->find("nodes");
  if (nodes == topo->end()) return out;
  if (!nodes->is_array() || static_cast<int64_t>(nodes->size()) != out.world) {
    return absl::InvalidArgumentError(absl::StrCat("topology.nodes: not a list of ", out.world, " node names"));
  }
  for (size_t r = 0; r < nodes->size(); ++r) {
    const std::string field = absl::StrCat("topology.nodes[", r, "]");
    ASSIGN_OR_RETURN(std::string node, json::String((*nodes)[r], field));
    if (node.empty() || node.size() > 253) return absl::InvalidArgumentError(field + ": must be 1 to 253 characters");
    out.nodes.push_back(std::move(node));
  }
  return out;
}

absl::Status CheckBundleNodes(const BundleTopology& expected, const std::vector<std::string>& node_of_rank) {
  if (static_cast<int64_t>(node_of_rank.size()) != expected.world) {
    return absl::FailedPreconditionError(absl::StrCat("topology.world: the bundle expects ", expected.world,
                                                      " ranks, the process group has ", node_of_rank.size()));
  }
  for (size_t r = 0; r < expected.nodes.size(); ++r) {
    if (expected.nodes[r] != node_of_rank[r]) {
      return absl::FailedPreconditionError(
          absl::StrCat("topology.nodes[", r, "]: the bundle expects node ", expected.nodes[r], ", rank ", r, " is on ",
                       node_of_rank[r].empty() ? "no node (not in the group)" : node_of_rank[r]));
    }
  }
  return absl::OkStatus();
}

absl::Status VerifyBundle(const json::Json& b, const std::function<Topology(int)>& topology) {
  if (!b.is_object()) return absl::InvalidArgumentError("bundle: not a JSON object");
  ASSIGN_OR_RETURN(const std::string format, json::StringOr(b, "bundle", "format", ""));
  if (format != kBundleFormat) {
    return absl::InvalidArgumentError(absl::StrCat("format: '", format, "', expected '", kBundleFormat, "'"));
  }
  RETURN_IF_ERROR(json::OnlyMembers(
      b, "", {"format", "release_id", "prior_release", "checkpoint", "placement", "runtime", "topology", "digest"}));
  ASSIGN_OR_RETURN(const json::Json* release_field, json::Member(b, "bundle", "release_id"));
  ASSIGN_OR_RETURN(const std::string release_id, json::String(*release_field, "release_id"));
  if (release_id.empty()) return absl::InvalidArgumentError("release_id: empty");
  ASSIGN_OR_RETURN(const json::Json* digest_field, json::Member(b, "bundle", "digest"));
  ASSIGN_OR_RETURN(const std::string digest, json::String(*digest_field, "digest"));
  const std::string computed = BundleDigest(b);
  if (digest != computed) {
    return absl::FailedPreconditionError(
        absl::StrCat("digest: the bundle says ", digest, ", its contents hash to ", computed));
  }
  ASSIGN_OR_RETURN(const json::Json* ck, json::Member(b, "bundle", "checkpoint"));
  RETURN_IF_ERROR(json::OnlyMembers(*ck, "checkpoint", {"path", "version", "layers", "experts", "digests"}));
  ASSIGN_OR_RETURN(const json::Json* path_field, json::Member(*ck, "checkpoint", "path"));
  ASSIGN_OR_RETURN(const std::string path, json::String(*path_field, "checkpoint.path"));
  ASSIGN_OR_RETURN(const json::Json* version_field, json::Member(*ck, "checkpoint", "version"));
  ASSIGN_OR_RETURN(const std::string version, json::String(*version_field, "checkpoint.version"));
  ASSIGN_OR_RETURN(const json::Json* digests, json::Member(*ck, "checkpoint", "digests"));
  if (!digests->is_object()) return absl::InvalidArgumentError("checkpoint.digests: not an object");
  ASSIGN_OR_RETURN(const BundleTopology expected, ParseBundleTopology(b));
  const int64_t world = expected.world;
  ASSIGN_OR_RETURN(const json::Json* placement, json::Member(b, "bundle", "placement"));
  if (absl::Status s = ParseBundleRuntime(b).status(); !s.ok()) return s;

  // The checkpoint: every expert of every MoE layer re-read and hashed.
  std::unique_ptr<SafetensorsFile> storage;
  auto ckpt = OpenCheckpoint(path, &storage);
  if (!ckpt.ok()) {
    return absl::FailedPreconditionError(absl::StrCat("checkpoint.path ", path, ": ", ckpt.status().message()));
  }
  const CheckpointReader& c = **ckpt;
  if (c.version() != version) {
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint.version: the bundle names ", version, ", ", path, " holds ", c.version()));
  }
  if (c.layers().empty()) {  // as MakeBundle: nothing per layer to re-read and hash
    return absl::FailedPreconditionError(absl::StrCat("checkpoint.path ", path,
                                                      ": a single-file checkpoint records no MoE layers; a release "
                                                      "bundle names a Hugging Face model directory"));
  }
  if (static_cast<int64_t>(digests->size()) != static_cast<int64_t>(c.layers().size())) {
    return absl::FailedPreconditionError(absl::StrCat("checkpoint.digests: ", digests->size(), " layers, ", path,
                                                      " has ", c.layers().size(), " MoE layers"));
  }
  const ExpertShape shape = c.shape();
  std::vector<uint16_t> gate_up(2 * static_cast<size_t>(shape.d_ff) * shape.d),
      down(static_cast<size_t>(shape.d) * shape.d_ff);
  for (int64_t layer : c.layers()) {
    const std::string key = std::to_string(layer);
    const std::string field = absl::StrCat("checkpoint.digests[\"", key, "\"]");
    auto it = digests->find(key);
    if (it == digests->end() || !it->is_array() || static_cast<int>(it->size()) != shape.num_experts) {
      return absl::FailedPreconditionError(
          absl::StrCat(field, ": missing, or not one digest for each of the ", shape.num_experts, " experts"));
    }
    for (int e = 0; e < shape.num_experts; ++e) {
      ASSIGN_OR_RETURN(const std::string want, json::String((*it)[e], absl::StrCat(field, "[", e, "]")));
      std::string got;
      RETURN_IF_ERROR(c.ReadExpertWithDigest(layer, e, gate_up.data(), down.data(), &got));
      if (got != want) {
        return absl::FailedPreconditionError(absl::StrCat(field, "[", e, "]: the bundle records ", want.substr(0, 16),
                                                          "..., the checkpoint's expert hashes to ", got.substr(0, 16),
                                                          "..."));
      }
    }
  }
  // The placement: every slot expects its expert's digests in every layer.
  ASSIGN_OR_RETURN(auto m, BundleManifest(*placement, topology(static_cast<int>(world))));
  if (m->checkpoint().value() != version) {
    return absl::FailedPreconditionError(
        absl::StrCat("placement.checkpoint: ", m->checkpoint().value(), ", the bundle's checkpoint is ", version));
  }
  for (int li = 0; li < static_cast<int>(m->layers().size()); ++li) {
    const std::string key = std::to_string(m->layers()[li]);
    auto it = digests->find(key);
    if (it == digests->end()) {
      return absl::FailedPreconditionError(
          absl::StrCat("placement: serves layer ", key, ", which checkpoint.digests does not record"));
    }
    for (int q = 0; q < m->num_slots(); ++q) {
      const PhysicalSlotId slot(q);
      const std::string want = ExpectedLayerDigest(*m, slot, li);
      const int expert = m->LayerAt(li).slot(slot).expert.value();
      if (expert < 0 || expert >= static_cast<int>(it->size())) {
        return absl::FailedPreconditionError(absl::StrCat("placement: slot q", q, " holds expert ", expert));
      }
      if (!want.empty() && want != (*it)[expert].get<std::string>()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "placement: slot q", q, " (expert ", expert, ") layer ", key, " expects digest ", want.substr(0, 16),
            "..., checkpoint.digests records ", (*it)[expert].get<std::string>().substr(0, 16), "..."));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace moe
