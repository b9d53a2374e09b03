// Text renderings for `moectl placement show` (a manifest's slots) and `moectl placement diff`
// (the 0x08F migration plan between two placements, with its peak memory).
#ifndef MOE_CONTROL_PLACEMENT_REPORT_H_
#define MOE_CONTROL_PLACEMENT_REPORT_H_

#include <string>

#include "runtime/placement/manifest.h"
#include "runtime/placement/migration.h"
#include "runtime/placement/topology.h"

namespace moe {

std::string RenderManifest(const PlacementManifest& m, const Topology& topology);
std::string RenderMigration(const PlacementManifest& from, const PlacementManifest& to, const MigrationPlan& plan);

}  // namespace moe

#endif  // MOE_CONTROL_PLACEMENT_REPORT_H_
