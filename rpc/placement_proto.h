// Translation between runtime placement manifests and their proto form (the edge where proto
// types stop: runtime/ never sees them). FromProto validates every field and names it.
#ifndef MOE_RPC_PLACEMENT_PROTO_H_
#define MOE_RPC_PLACEMENT_PROTO_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"

#include "proto/moe/v1/placement.pb.h"
#include "runtime/placement/manifest.h"

namespace moe {

v1::PlacementManifest ManifestToProto(const PlacementManifest& manifest, const Topology& topology);
absl::StatusOr<std::shared_ptr<const PlacementManifest>> ManifestFromProto(const v1::PlacementManifest& proto,
                                                                           const Topology& topology);

// "sha256:<hex>" over a canonical serialization of the placement itself: version, process group
// id, checkpoint and every slot in slot order (name, expert, replica, rank, checkpoint, digests;
// per layer for layered generations), integers as 8-byte little-endian, strings prefixed by
// their length. Not the generation's binding to a group epoch: the epoch and the slots' topology
// domains change when the process group re-forms (PlacementManifest::Rebound) and the placement
// stays the same one. The rank agents report it for each generation they hold and the controller
// computes it over the manifest it recorded for the release: equal digests mean the ranks
// verified their weights against the same slots and parameter digests (the promotion gate's
// HashOK).
std::string PlacementDigest(const PlacementManifest& manifest);

}  // namespace moe

#endif  // MOE_RPC_PLACEMENT_PROTO_H_
