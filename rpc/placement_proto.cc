#include "rpc/placement_proto.h"

#include <openssl/evp.h>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace moe {

namespace {

void SlotToProto(const SlotRecord& s, const Topology& topology, v1::PhysicalSlot* out) {
  out->set_physical_slot_id(s.slot.value());
  out->set_name(s.name);
  out->set_logical_expert_id(s.expert.value());
  out->set_replica_id(s.replica.value());
  out->set_replica_name(s.replica_name);
  out->set_destination_rank(s.rank.value());
  out->set_topology_domain(topology.NodeName(s.domain));
  out->set_checkpoint_version(s.checkpoint.value());
  out->set_parameter_digest(s.parameter_digest.value());
  for (const std::string& d : s.layer_digests) out->add_layer_digests(d);
}

absl::StatusOr<std::vector<SlotRecord>> SlotsFromProto(const google::protobuf::RepeatedPtrField<v1::PhysicalSlot>& in,
                                                       const Topology& topology, const std::string& field) {
  std::vector<SlotRecord> slots;
  for (int i = 0; i < in.size(); ++i) {
    const v1::PhysicalSlot& s = in.Get(i);
    SlotRecord r;
    r.slot = PhysicalSlotId(s.physical_slot_id());
    r.name = s.name();
    r.expert = LogicalExpertId(s.logical_expert_id());
    r.replica = ReplicaId(s.replica_id());
    r.replica_name = s.replica_name();
    r.rank = Rank(s.destination_rank());
    const int domain = topology.FindNode(s.topology_domain());
    if (domain < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, "[", i, "].topology_domain: unknown node '", s.topology_domain(), "'"));
    }
    r.domain = TopologyDomainId(domain);
    r.checkpoint = CheckpointVersion(s.checkpoint_version());
    r.parameter_digest = ParameterDigest(s.parameter_digest());
    r.layer_digests.assign(s.layer_digests().begin(), s.layer_digests().end());
    slots.push_back(std::move(r));
  }
  return slots;
}

}  // namespace

v1::PlacementManifest ManifestToProto(const PlacementManifest& m, const Topology& topology) {
  v1::PlacementManifest p;
  p.set_version(m.version().value());
  p.set_process_group_id(m.process_group().value());
  p.set_process_group_epoch(m.epoch().value());
  p.set_checkpoint_version(m.checkpoint().value());
  p.set_num_logical_experts(m.num_experts());
  for (const SlotRecord& s : m.slots()) SlotToProto(s, topology, p.add_slots());
  for (int64_t l : m.layers()) p.add_layers(l);
  if (m.per_layer()) {
    for (size_t i = 0; i < m.layers().size(); ++i) {
      v1::LayerSlots* table = p.add_layer_slots();
      table->set_layer(m.layers()[i]);
      for (const SlotRecord& s : m.LayerAt(static_cast<int>(i)).slots()) SlotToProto(s, topology, table->add_slots());
    }
  }
  return p;
}

absl::StatusOr<std::shared_ptr<const PlacementManifest>> ManifestFromProto(const v1::PlacementManifest& p,
                                                                           const Topology& topology) {
  if (p.version() <= 0) return absl::InvalidArgumentError("version: must be positive");
  if (p.process_group_id().empty()) return absl::InvalidArgumentError("process_group_id: must not be empty");
  if (p.checkpoint_version().empty()) return absl::InvalidArgumentError("checkpoint_version: must not be empty");
  ManifestOptions o;
  o.version = PlacementVersion(p.version());
  o.process_group = ProcessGroupId(p.process_group_id());
  o.epoch = ProcessGroupEpoch(p.process_group_epoch());
  o.checkpoint = CheckpointVersion(p.checkpoint_version());
  o.num_experts = p.num_logical_experts();
  o.layers.assign(p.layers().begin(), p.layers().end());
  if (p.layer_slots_size() > 0) {
    if (p.layer_slots_size() != p.layers_size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer_slots: ", p.layer_slots_size(), " tables for ", p.layers_size(), " layers"));
    }
    std::vector<std::vector<SlotRecord>> tables;
    for (int i = 0; i < p.layer_slots_size(); ++i) {
      if (p.layer_slots(i).layer() != p.layers(i)) {
        return absl::InvalidArgumentError(absl::StrCat("layer_slots[", i, "].layer: ", p.layer_slots(i).layer(),
                                                       ", layers[", i, "] is ", p.layers(i)));
      }
      auto slots = SlotsFromProto(p.layer_slots(i).slots(), topology, absl::StrCat("layer_slots[", i, "].slots"));
      if (!slots.ok()) return slots.status();
      tables.push_back(*std::move(slots));
    }
    return PlacementManifest::CreateLayered(o, std::move(tables), topology);
  }
  auto slots = SlotsFromProto(p.slots(), topology, "slots");
  if (!slots.ok()) return slots.status();
  return PlacementManifest::Create(o, *std::move(slots), topology);
}

namespace {

// SHA-256 over a sequence of tagged fields (the canonical form of PlacementDigest).
class CanonicalHasher {
 public:
  CanonicalHasher() : ctx_(EVP_MD_CTX_new()) { EVP_DigestInit_ex(ctx_, EVP_sha256(), nullptr); }
  ~CanonicalHasher() { EVP_MD_CTX_free(ctx_); }
  CanonicalHasher(const CanonicalHasher&) = delete;
  CanonicalHasher& operator=(const CanonicalHasher&) = delete;
  void Int(int64_t v) {
    unsigned char b[8];
    for (int i = 0; i < 8; ++i) b[i] = static_cast<unsigned char>(static_cast<uint64_t>(v) >> (8 * i));
    EVP_DigestUpdate(ctx_, b, sizeof(b));
  }
  void Str(const std::string& s) {
    Int(static_cast<int64_t>(s.size()));
    EVP_DigestUpdate(ctx_, s.data(), s.size());
  }
  std::string Finish() {
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned int len = 0;
    EVP_DigestFinal_ex(ctx_, md, &len);
    return absl::StrCat("sha256:", absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(md), len)));
  }

 private:
  EVP_MD_CTX* ctx_;
};

}  // namespace

std::string PlacementDigest(const PlacementManifest& m) {
  CanonicalHasher h;
  h.Str("moe.v1.PlacementManifest/2");  // the serialization's own version
  h.Int(m.version().value());
  h.Str(m.process_group().value());
  h.Str(m.checkpoint().value());
  h.Int(m.num_experts());
  h.Int(m.num_slots());
  const auto hash_slot = [&h](const SlotRecord& s) {
    h.Int(s.slot.value());
    h.Str(s.name);
    h.Int(s.expert.value());
    h.Int(s.replica.value());
    h.Str(s.replica_name);
    h.Int(s.rank.value());
    h.Str(s.checkpoint.value());
    h.Str(s.parameter_digest.value());
  };
  for (const SlotRecord& s : m.slots()) hash_slot(s);
  // The layer axis (absent from single-layer manifests, whose digests it leaves as they were).
  if (!m.layers().empty()) {
    h.Str("layers");
    h.Int(static_cast<int64_t>(m.layers().size()));
    for (int64_t l : m.layers()) h.Int(l);
    for (const SlotRecord& s : m.slots()) {
      h.Int(static_cast<int64_t>(s.layer_digests.size()));
      for (const std::string& d : s.layer_digests) h.Str(d);
    }
    if (m.per_layer()) {  // every layer's own table
      h.Str("layer_slots");
      for (size_t i = 0; i < m.layers().size(); ++i) {
        for (const SlotRecord& s : m.LayerAt(static_cast<int>(i)).slots()) hash_slot(s);
      }
    }
  }
  return h.Finish();
}

}  // namespace moe
