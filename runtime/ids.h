// Strong identity types, one per namespace (spec 0x01A0).
//
// An integer such as 3 can mean logical expert 3, physical slot 3, rank 3, replica 3 or the
// fourth peer of a communicator. Each namespace gets its own type; the types do not convert
// into each other and are unwrapped (`.value()`) only at array indexing and the kernel ABI.
//
// Thread-safety: value types, freely copyable.
#ifndef MOE_RUNTIME_IDS_H_
#define MOE_RUNTIME_IDS_H_

#include <cstdint>
#include <functional>
#include <ostream>
#include <string>
#include <utility>

namespace moe {

template <typename Tag, typename T = int32_t>
class StrongId {
 public:
  using ValueType = T;

  constexpr StrongId() = default;
  constexpr explicit StrongId(T value) : value_(value) {}

  constexpr T value() const { return value_; }

  friend constexpr bool operator==(StrongId a, StrongId b) { return a.value_ == b.value_; }
  friend constexpr bool operator!=(StrongId a, StrongId b) { return a.value_ != b.value_; }
  friend constexpr bool operator<(StrongId a, StrongId b) { return a.value_ < b.value_; }
  friend constexpr bool operator<=(StrongId a, StrongId b) { return a.value_ <= b.value_; }
  friend constexpr bool operator>(StrongId a, StrongId b) { return a.value_ > b.value_; }
  friend constexpr bool operator>=(StrongId a, StrongId b) { return a.value_ >= b.value_; }

  template <typename H>
  friend H AbslHashValue(H h, StrongId id) {
    return H::combine(std::move(h), id.value_);
  }
  friend std::ostream& operator<<(std::ostream& os, StrongId id) { return os << id.value_; }

 private:
  T value_{};
};

// A string-valued identity (process-group ids, checkpoint versions, replica names).
template <typename Tag>
class StrongName {
 public:
  StrongName() = default;
  explicit StrongName(std::string value) : value_(std::move(value)) {}

  const std::string& value() const { return value_; }
  bool empty() const { return value_.empty(); }

  friend bool operator==(const StrongName& a, const StrongName& b) { return a.value_ == b.value_; }
  friend bool operator!=(const StrongName& a, const StrongName& b) { return a.value_ != b.value_; }
  friend bool operator<(const StrongName& a, const StrongName& b) { return a.value_ < b.value_; }

  template <typename H>
  friend H AbslHashValue(H h, const StrongName& n) {
    return H::combine(std::move(h), n.value_);
  }
  friend std::ostream& operator<<(std::ostream& os, const StrongName& n) { return os << n.value_; }

 private:
  std::string value_;
};

// Logical expert: model architecture + checkpoint identity. Never changed by the runtime.
using LogicalExpertId = StrongId<struct LogicalExpertTag>;
// Physical slot: index of a slot inside one placement generation. The full key is
// (PlacementVersion, PhysicalSlotId).
using PhysicalSlotId = StrongId<struct PhysicalSlotTag>;
// Replica: rank of a copy among the copies of one logical expert (EPLB's phyrank).
using ReplicaId = StrongId<struct ReplicaTag>;
// Global rank inside one process-group epoch.
using Rank = StrongId<struct RankTag>;
// Position of a rank in a communicator's peer order. Split vectors are indexed by this.
using PeerSlot = StrongId<struct PeerSlotTag>;
// Topology domain (a node / NVLink domain).
using TopologyDomainId = StrongId<struct TopologyDomainTag>;
// Placement generation number ("placement-v17" is generation 17).
using PlacementVersion = StrongId<struct PlacementVersionTag, int64_t>;
// Communicator membership epoch.
using ProcessGroupEpoch = StrongId<struct ProcessGroupEpochTag, int64_t>;
// Execution scope of one layer invocation (one semantic handoff).
using ExecutionScopeId = StrongId<struct ExecutionScopeTag, int64_t>;
// Dispatch handle identity.
using HandleId = StrongId<struct HandleTag, int64_t>;

using ProcessGroupId = StrongName<struct ProcessGroupIdTag>;
using CheckpointVersion = StrongName<struct CheckpointVersionTag>;
using ParameterDigest = StrongName<struct ParameterDigestTag>;

}  // namespace moe

namespace std {
template <typename Tag, typename T>
struct hash<moe::StrongId<Tag, T>> {
  size_t operator()(moe::StrongId<Tag, T> id) const noexcept { return std::hash<T>()(id.value()); }
};
template <typename Tag>
struct hash<moe::StrongName<Tag>> {
  size_t operator()(const moe::StrongName<Tag>& n) const noexcept { return std::hash<std::string>()(n.value()); }
};
}  // namespace std

#endif  // MOE_RUNTIME_IDS_H_
