// Translation between runtime placement manifests and their proto form (the edge where proto
// types stop: runtime/ never sees them). FromProto validates every field and names it.
#ifndef MOE_CONTROL_PLACEMENT_PROTO_H_
#define MOE_CONTROL_PLACEMENT_PROTO_H_

#include <memory>

#include "absl/status/statusor.h"
#include "proto/moe/v1/placement.pb.h"
#include "runtime/placement/manifest.h"

namespace moe {

v1::PlacementManifest ManifestToProto(const PlacementManifest& manifest, const Topology& topology);
absl::StatusOr<std::shared_ptr<const PlacementManifest>> ManifestFromProto(const v1::PlacementManifest& proto,
                                                                           const Topology& topology);

}  // namespace moe

#endif  // MOE_CONTROL_PLACEMENT_PROTO_H_
