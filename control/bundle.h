// Release bundles (spec 0x0C; docs/cli.md "Release bundles"): one JSON document that binds a release's
// coordinates together, with its own digest over all of them.
//
//   {
//     "format": "moe.release.bundle/v1",
//     "release_id": "release-v2", "prior_release": "release-v1",          (prior: optional)
//     "checkpoint": {"path": "/models/m", "version": "checkpoint-0001",
//                    "layers": [1, 2, 3], "experts": 16,
//                    "digests": {"1": ["<expert 0's digest>", ...], ...}},   (per MoE layer)
//     "placement": { PlacementManifest JSON },
//     "runtime": {"decode_runner": "kernels", "decode_bucket_tokens": 8,
//                 "decode_bucket_slot_routes": 16, "dtype": "BF16",
//                 "kernel_build": "cuda:<16 hex>"},                       ("": any build)
//     "topology": {"world": 4,
//                  "nodes": ["host-a", "host-a", "host-b", "host-b"]},      (per rank; optional: any)
//     "digest": "sha256:<hex>"
//   }
//
// The digest is SHA-256 over the canonical JSON (keys sorted, no whitespace) of everything but
// "digest". Verification recomputes it, re-reads every expert of every layer from the checkpoint
// directory and compares each expert's digest, and checks that every slot of the placement
// expects the digests the bundle records for its expert. Any difference is FAILED_PRECONDITION
// naming the field (e.g. checkpoint.digests["2"][5]).
#ifndef MOE_CONTROL_BUNDLE_H_
#define MOE_CONTROL_BUNDLE_H_

#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

#include "control/json_util.h"
#include "runtime/placement/topology.h"

namespace moe {

inline constexpr char kBundleFormat[] = "moe.release.bundle/v1";

struct BundleInputs {
  std::string release_id;
  std::string prior_release;    // "" when none
  std::string checkpoint_path;  // a Hugging Face model directory with recorded digests
  std::string manifest_path;    // PlacementManifest JSON (moectl placement synth / rebalance --out)
  std::string decode_runner = "kernels";
  int64_t decode_bucket_tokens = 8;
  int64_t decode_bucket_slot_routes = 16;
  std::string dtype = "BF16";  // the ranks' expert precision: BF16, or FP8 (moe-rankd --expert_dtype fp8)
  std::string kernel_build;    // "" : any build (the ranks report theirs in moectl status)
  int world = 0;
  std::vector<std::string> nodes;  // per rank (moectl group status); empty: any node
};

// A bundle with its digest. The checkpoint's digests are the ones recorded beside its weights
// (moectl checkpoint digest); INVALID_ARGUMENT naming the input when one is missing or the
// placement does not parse.
absl::StatusOr<json::Json> MakeBundle(const BundleInputs& in);

// The bundle's runtime coordinates, each field checked (INVALID_ARGUMENT naming it).
struct BundleRuntime {
  std::string decode_runner;
  int64_t decode_bucket_tokens = 0;
  int64_t decode_bucket_slot_routes = 0;
  std::string dtype;         // BF16 or FP8 ("": any)
  std::string kernel_build;  // "": any
};
absl::StatusOr<BundleRuntime> ParseBundleRuntime(const json::Json& bundle);

// The topology the bundle expects: `world` ranks, and the node of each rank when `nodes` is not
// empty (INVALID_ARGUMENT naming topology.world / topology.nodes[i]).
struct BundleTopology {
  int64_t world = 0;
  std::vector<std::string> nodes;  // empty: any node
};
absl::StatusOr<BundleTopology> ParseBundleTopology(const json::Json& bundle);

// `expected` against the nodes the ranks are on (`node_of_rank`, per global rank):
// FAILED_PRECONDITION naming topology.world or the first topology.nodes[r] that differs.
absl::Status CheckBundleNodes(const BundleTopology& expected, const std::vector<std::string>& node_of_rank);

// "sha256:<hex>" over the canonical JSON of `bundle` without its "digest" member.
std::string BundleDigest(const json::Json& bundle);

// Everything the bundle claims, checked: its format and fields (INVALID_ARGUMENT naming them), its
// digest, the checkpoint's experts re-read and hashed, and the placement's slot digests
// (FAILED_PRECONDITION naming the first difference). `topology(world)`: the ranks' topology the
// placement is read against.
absl::Status VerifyBundle(const json::Json& bundle, const std::function<Topology(int)>& topology);

}  // namespace moe

#endif  // MOE_CONTROL_BUNDLE_H_
