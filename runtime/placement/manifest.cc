#include "runtime/placement/manifest.h"

#include <algorithm>
#include <unordered_set>

#include "absl/strings/str_cat.h"

#include "runtime/status.h"

namespace moe {

absl::StatusOr<std::shared_ptr<const PlacementManifest>> PlacementManifest::Create(ManifestOptions options,
                                                                                   std::vector<SlotRecord> slots,
                                                                                   const Topology& topology) {
  if (options.num_experts <= 0) return absl::InvalidArgumentError("placement.num_experts: must be positive");
  if (slots.empty()) return absl::InvalidArgumentError("placement.slots: must not be empty");
  // The expert tables are sized by num_experts (per layer): bounded, so a request naming 2^31
  // experts and one slot cannot make the rank allocate gigabytes.
  if (options.num_experts > kMaxLogicalExperts) {
    return absl::InvalidArgumentError(
        absl::StrCat("placement.num_experts: ", options.num_experts, " above ", kMaxLogicalExperts));
  }
  for (size_t i = 0; i < options.layers.size(); ++i) {
    if (options.layers[i] < 0 || (i > 0 && options.layers[i] <= options.layers[i - 1])) {
      return absl::InvalidArgumentError(
          absl::StrCat("placement.layers[", i, "]: ", options.layers[i], " (layers are distinct, ascending, >= 0)"));
    }
  }
  auto m = std::shared_ptr<PlacementManifest>(new PlacementManifest());
  m->options_ = std::move(options);
  const int q_count = static_cast<int>(slots.size());
  m->slots_.resize(q_count);
  std::vector<bool> seen(q_count, false);
  std::unordered_set<std::string> names;
  for (SlotRecord& s : slots) {
    const int q = s.slot.value();
    if (q < 0 || q >= q_count || seen[q]) {
      return absl::InvalidArgumentError(
          absl::StrCat("placement.slots: physical_slot_id ", q, " is duplicated or outside [0, ", q_count, ")"));
    }
    if (s.name.empty()) s.name = absl::StrCat("q", q);
    if (!names.insert(s.name).second) {
      return absl::InvalidArgumentError(absl::StrCat("placement.slots[", q, "].name: duplicate slot name ", s.name));
    }
    if (s.expert.value() < 0 || s.expert.value() >= m->options_.num_experts) {
      return absl::InvalidArgumentError(absl::StrCat("placement.slots[", s.name, "].logical_expert_id: ",
                                                     s.expert.value(), " outside [0, ", m->options_.num_experts, ")"));
    }
    if (!topology.HasRank(s.rank)) {
      return absl::InvalidArgumentError(absl::StrCat("placement.slots[", s.name, "].destination_rank: rank ",
                                                     s.rank.value(), " is not in the topology"));
    }
    if (s.domain.value() < 0 || s.domain.value() >= topology.num_nodes()) {
      return absl::InvalidArgumentError(
          absl::StrCat("placement.slots[", s.name, "].topology_domain_id: unknown domain ", s.domain.value()));
    }
    if (!s.layer_digests.empty() && s.layer_digests.size() != m->options_.layers.size()) {
      return absl::InvalidArgumentError(absl::StrCat("placement.slots[", s.name,
                                                     "].layer_digests: ", s.layer_digests.size(), " digests for ",
                                                     m->options_.layers.size(), " layers"));
    }
    if (s.replica_name.empty()) s.replica_name = absl::StrCat("e", s.expert.value(), "-r", s.replica.value());
    seen[q] = true;
    m->slots_[q] = std::move(s);
  }

  // rho_v(e), ordered by (replica id, slot id): a counting pass over experts.
  const int e_count = m->options_.num_experts;
  m->expert_begin_.assign(e_count + 1, 0);
  for (const SlotRecord& s : m->slots_) ++m->expert_begin_[s.expert.value() + 1];
  for (int e = 0; e < e_count; ++e) m->expert_begin_[e + 1] += m->expert_begin_[e];
  m->expert_slots_.resize(q_count);
  std::vector<int32_t> fill(m->expert_begin_.begin(), m->expert_begin_.end() - 1);
  for (const SlotRecord& s : m->slots_) m->expert_slots_[fill[s.expert.value()]++] = s.slot;
  for (int e = 0; e < e_count; ++e) {
    std::stable_sort(m->expert_slots_.begin() + m->expert_begin_[e], m->expert_slots_.begin() + m->expert_begin_[e + 1],
                     [&](PhysicalSlotId a, PhysicalSlotId b) {
                       return m->slots_[a.value()].replica < m->slots_[b.value()].replica;
                     });
    // An expert's m_e copies are its replicas 0..m_e-1, each once (0x08C3 phyrank): rho_v(e)
    // orders by them, so a repeated or missing one would make the copy order ambiguous.
    for (int32_t i = m->expert_begin_[e]; i < m->expert_begin_[e + 1]; ++i) {
      const SlotRecord& s = m->slots_[m->expert_slots_[i].value()];
      if (s.replica.value() != i - m->expert_begin_[e]) {
        return absl::InvalidArgumentError(absl::StrCat(
            "placement.slots[", s.name, "].replica_id: ", s.replica.value(), " for logical expert ", e, ", which has ",
            m->expert_begin_[e + 1] - m->expert_begin_[e], " copies: its replica ids must be 0..",
            m->expert_begin_[e + 1] - m->expert_begin_[e] - 1, ", each once"));
      }
    }
  }

  m->local_slots_.assign(topology.num_ranks(), {});
  m->local_index_.assign(q_count, -1);
  for (const SlotRecord& s : m->slots_) {
    auto& local = m->local_slots_[s.rank.value()];
    m->local_index_[s.slot.value()] = static_cast<int32_t>(local.size());
    local.push_back(s.slot);
  }
  return std::shared_ptr<const PlacementManifest>(std::move(m));
}

absl::StatusOr<std::shared_ptr<const PlacementManifest>> PlacementManifest::CreateLayered(
    ManifestOptions options, std::vector<std::vector<SlotRecord>> layer_slots, const Topology& topology) {
  if (options.layers.empty() || layer_slots.size() != options.layers.size()) {
    return absl::InvalidArgumentError(absl::StrCat("placement.layer_slots: ", layer_slots.size(), " slot tables for ",
                                                   options.layers.size(), " layers"));
  }
  if (options.num_experts > 0 &&
      static_cast<int64_t>(layer_slots.size()) > kMaxLayeredExpertEntries / options.num_experts) {
    return absl::InvalidArgumentError(absl::StrCat("placement.layers: ", layer_slots.size(), " layers x ",
                                                   options.num_experts, " experts above ", kMaxLayeredExpertEntries,
                                                   " (layer, expert) entries"));
  }
  std::vector<std::shared_ptr<const PlacementManifest>> tables;
  for (size_t i = 0; i < layer_slots.size(); ++i) {
    ManifestOptions one = options;
    one.layers = {options.layers[i]};
    for (SlotRecord& s : layer_slots[i]) s.layer_digests.clear();
    auto table = Create(one, layer_slots[i], topology);
    if (!table.ok()) {
      return absl::Status(table.status().code(),
                          absl::StrCat("layer ", options.layers[i], ": ", table.status().message()));
    }
    if (!tables.empty()) {
      const PlacementManifest& first = *tables.front();
      if ((*table)->num_slots() != first.num_slots()) {
        return absl::InvalidArgumentError(absl::StrCat("placement.layer_slots[", options.layers[i],
                                                       "]: ", (*table)->num_slots(), " slots, layer ",
                                                       options.layers[0], " has ", first.num_slots()));
      }
      for (int q = 0; q < first.num_slots(); ++q) {
        if ((*table)->slot(PhysicalSlotId(q)).rank != first.slot(PhysicalSlotId(q)).rank) {
          return absl::InvalidArgumentError(absl::StrCat("placement.layer_slots[", options.layers[i], "]: slot ", q,
                                                         " is on another rank than in layer ", options.layers[0]));
        }
      }
    }
    tables.push_back(*std::move(table));
  }
  ASSIGN_OR_RETURN(std::shared_ptr<const PlacementManifest> root,
                   Create(std::move(options), layer_slots.front(), topology));
  std::const_pointer_cast<PlacementManifest>(root)->layer_manifests_ = std::move(tables);
  return root;
}

absl::StatusOr<std::shared_ptr<const PlacementManifest>> PlacementManifest::Rebound(const ProcessGroup& group,
                                                                                    const Topology& topology) const {
  ManifestOptions options = options_;
  options.process_group = group.id();
  options.epoch = group.epoch();
  const auto rebind = [&](const PlacementManifest& table) -> absl::StatusOr<std::vector<SlotRecord>> {
    std::vector<SlotRecord> slots = table.slots();
    std::vector<bool> served(table.num_experts(), false);
    for (SlotRecord& s : slots) {
      if (!topology.HasRank(s.rank)) {
        return absl::FailedPreconditionError(
            absl::StrCat(VersionName(), " slot ", s.name, ": rank ", s.rank.value(), " is not in the topology"));
      }
      s.domain = topology.NodeOf(s.rank);
      if (group.Contains(s.rank)) served[s.expert.value()] = true;
    }
    // Slots on ranks outside the group stay (they are no route's destination: the replica
    // selector takes compatible slots only), as long as every expert keeps a copy on a member.
    for (int e = 0; e < table.num_experts(); ++e) {
      if (served[e]) continue;
      const std::string where = table.layers().size() == 1 ? absl::StrCat(" layer ", table.layers()[0]) : "";
      return absl::FailedPreconditionError(
          absl::StrCat(VersionName(), where, ": logical expert ", e, " has no replica on a member of process group ",
                       group.id().value(), " epoch ", group.epoch().value(), " (its slots are on ranks outside it)"));
    }
    return slots;
  };
  if (!per_layer()) {
    ASSIGN_OR_RETURN(std::vector<SlotRecord> slots, rebind(*this));
    return Create(std::move(options), std::move(slots), topology);
  }
  std::vector<std::vector<SlotRecord>> tables;
  for (const auto& table : layer_manifests_) {
    ASSIGN_OR_RETURN(std::vector<SlotRecord> slots, rebind(*table));
    tables.push_back(std::move(slots));
  }
  return CreateLayered(std::move(options), std::move(tables), topology);
}

std::shared_ptr<const PlacementManifest> PlacementManifest::ForLayer(int64_t layer) const {
  if (layer_manifests_.empty()) return shared_from_this();
  auto it = std::lower_bound(options_.layers.begin(), options_.layers.end(), layer);
  if (it == options_.layers.end() || *it != layer) return shared_from_this();
  return layer_manifests_[it - options_.layers.begin()];
}

const PlacementManifest& PlacementManifest::LayerAt(int index) const {
  return layer_manifests_.empty() ? *this : *layer_manifests_.at(index);
}

std::string PlacementManifest::VersionName() const { return absl::StrCat("placement-v", options_.version.value()); }

absl::Span<const PhysicalSlotId> PlacementManifest::SlotsOf(LogicalExpertId e) const {
  if (e.value() < 0 || e.value() >= options_.num_experts) return {};
  return absl::MakeConstSpan(expert_slots_.data() + expert_begin_[e.value()],
                             expert_begin_[e.value() + 1] - expert_begin_[e.value()]);
}

absl::Span<const PhysicalSlotId> PlacementManifest::LocalSlots(Rank r) const {
  if (r.value() < 0 || r.value() >= num_ranks()) return {};
  return local_slots_[r.value()];
}

bool PlacementManifest::ServesLayer(int64_t layer) const {
  return options_.layers.empty() || std::binary_search(options_.layers.begin(), options_.layers.end(), layer);
}

int PlacementManifest::FindSlot(const std::string& name) const {
  for (const SlotRecord& s : slots_) {
    if (s.name == name) return s.slot.value();
  }
  return -1;
}

const char* IncompatibilityName(Incompatibility reason) {
  switch (reason) {
    case Incompatibility::kNone:
      return "compatible";
    case Incompatibility::kWrongExpert:
      return "slot stores another logical expert";
    case Incompatibility::kStaleCheckpoint:
      return "replica checkpoint differs from the generation's checkpoint";
    case Incompatibility::kRankOutsideGroup:
      return "destination rank is outside the process group";
    case Incompatibility::kDomainMismatch:
      return "topology domain does not own the destination rank";
  }
  return "unknown";
}

Incompatibility CheckCompatible(LogicalExpertId e, PhysicalSlotId q, const PlacementManifest& manifest,
                                const ProcessGroup& group, const Topology& topology) {
  const SlotRecord& s = manifest.slot(q);
  if (s.expert != e) return Incompatibility::kWrongExpert;
  if (s.checkpoint != manifest.checkpoint()) return Incompatibility::kStaleCheckpoint;
  if (!group.Contains(s.rank)) return Incompatibility::kRankOutsideGroup;
  if (!topology.HasRank(s.rank) || topology.NodeOf(s.rank) != s.domain) return Incompatibility::kDomainMismatch;
  return Incompatibility::kNone;
}

absl::Status VerifyForPublish(const PlacementManifest& manifest, const ProcessGroup& group, const Topology& topology) {
  if (manifest.per_layer()) {
    for (size_t i = 0; i < manifest.layers().size(); ++i) {
      absl::Status s = VerifyForPublish(manifest.LayerAt(static_cast<int>(i)), group, topology);
      if (!s.ok()) return absl::Status(s.code(), absl::StrCat("layer ", manifest.layers()[i], ": ", s.message()));
    }
  }
  if (manifest.process_group() != group.id() || manifest.epoch() != group.epoch()) {
    return absl::FailedPreconditionError(
        absl::StrCat(manifest.VersionName(), " is bound to process group ", manifest.process_group().value(), " epoch ",
                     manifest.epoch().value(), ", not ", group.id().value(), " epoch ", group.epoch().value()));
  }
  for (const SlotRecord& s : manifest.slots()) {
    const Incompatibility why = CheckCompatible(s.expert, s.slot, manifest, group, topology);
    if (why != Incompatibility::kNone) {
      return absl::FailedPreconditionError(
          absl::StrCat(manifest.VersionName(), " slot ", s.name, ": ", IncompatibilityName(why)));
    }
  }
  for (int e = 0; e < manifest.num_experts(); ++e) {
    const auto copies = manifest.SlotsOf(LogicalExpertId(e));
    if (copies.empty()) {
      // 0x08B: every logical expert has m_e >= 1 copies, or its routes have no slot (0x01D1).
      return absl::FailedPreconditionError(
          absl::StrCat(manifest.VersionName(), ": logical expert ", e, " has no slot (every expert needs a copy)"));
    }
    for (PhysicalSlotId q : copies) {
      if (manifest.slot(q).parameter_digest != manifest.slot(copies.front()).parameter_digest) {
        return absl::FailedPreconditionError(absl::StrCat(manifest.VersionName(), " slot ", manifest.slot(q).name,
                                                          ": parameter digest differs from the other replicas of "
                                                          "logical expert ",
                                                          e));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace moe
