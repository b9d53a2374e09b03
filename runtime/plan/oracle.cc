#include "runtime/plan/oracle.h"

#include <cstring>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"

#include "runtime/plan/combine.h"
#include "runtime/status.h"

namespace moe {
namespace {

absl::Status CheckInputs(const SemanticHandoff& routes, const PartitionRows& hidden, int d,
                         const std::vector<float>& expert_scale) {
  if (d <= 0) return absl::InvalidArgumentError("d: must be positive");
  if (static_cast<int>(hidden.size()) != routes.num_partitions) {
    return absl::InvalidArgumentError(
        absl::StrCat("hidden: ", hidden.size(), " partitions, routes name ", routes.num_partitions));
  }
  for (size_t p = 0; p < hidden.size(); ++p) {
    if (hidden[p].size() % d != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("hidden[", p, "]: ", hidden[p].size(), " values, not a multiple of d=", d));
    }
  }
  if (static_cast<int>(expert_scale.size()) != routes.num_experts) {
    return absl::InvalidArgumentError(
        absl::StrCat("expert_scale: ", expert_scale.size(), " values for ", routes.num_experts, " experts"));
  }
  std::vector<int64_t> per_partition(hidden.size(), 0);
  for (int32_t r = 0; r < routes.size(); ++r) {
    const int64_t tokens = hidden[routes.origin[r].value()].size() / d;
    if (routes.token[r] >= tokens) {
      return absl::InvalidArgumentError(absl::StrCat("routes[", r, "].token: ", routes.token[r], " but partition ",
                                                     routes.origin[r].value(), " has ", tokens, " rows"));
    }
    ++per_partition[routes.origin[r].value()];
  }
  // 0x0CD: accepted + dropped = T x top_k for each partition. With (p, t, j) unique and in range
  // (SemanticHandoff::Validate), the count proves every token has all of its k routes.
  for (size_t p = 0; p < hidden.size(); ++p) {
    const int64_t tokens = static_cast<int64_t>(hidden[p].size()) / d;
    if (per_partition[p] != tokens * routes.top_k) {
      return absl::InvalidArgumentError(absl::StrCat("routes: partition ", p, " has ", per_partition[p],
                                                     " routes (accepted and dropped) for ", tokens, " tokens x top_k ",
                                                     routes.top_k, " (0x0CD)"));
    }
  }
  return absl::OkStatus();
}

PartitionRows ZeroOutputs(const PartitionRows& hidden) {
  PartitionRows out(hidden.size());
  for (size_t p = 0; p < hidden.size(); ++p) out[p].assign(hidden[p].size(), 0.0f);
  return out;
}

}  // namespace

absl::StatusOr<PartitionRows> SemanticOutputs(const SemanticHandoff& routes, const PartitionRows& hidden, int d,
                                              const std::vector<float>& expert_scale) {
  RETURN_IF_ERROR(CheckInputs(routes, hidden, d, expert_scale));
  PartitionRows out = ZeroOutputs(hidden);
  for (int32_t r = 0; r < routes.size(); ++r) {
    if (!routes.admitted[r]) continue;
    const int p = routes.origin[r].value();
    const float s = expert_scale[routes.expert[r].value()];
    const float* h = hidden[p].data() + static_cast<int64_t>(routes.token[r]) * d;
    float* y = out[p].data() + static_cast<int64_t>(routes.token[r]) * d;
    for (int c = 0; c < d; ++c) y[c] += routes.gate[r] * (s * h[c]);
  }
  return out;
}

absl::StatusOr<PartitionRows> PhysicalOutputs(const ClusterPlan& plan, const FrozenHandoff& handoff,
                                              const PlacementManifest& manifest, const PartitionRows& hidden, int d,
                                              const std::vector<float>& expert_scale,
                                              const RunnerLayoutParams& runner) {
  const SemanticHandoff& routes = handoff.routes;
  RETURN_IF_ERROR(CheckInputs(routes, hidden, d, expert_scale));
  const int p_count = plan.num_ranks;
  const float kPoison = std::numeric_limits<float>::quiet_NaN();

  // Dispatch: each source packs its rows in send order.
  std::vector<std::vector<float>> send(p_count);
  for (int s = 0; s < p_count; ++s) {
    const SourcePlan& sp = plan.source[s];
    send[s].resize(sp.send_order.size() * d);
    for (size_t pos = 0; pos < sp.send_order.size(); ++pos) {
      const int32_t r = plan.source_routes[s][sp.send_order[pos]];
      std::memcpy(send[s].data() + pos * d, hidden[s].data() + static_cast<int64_t>(routes.token[r]) * d,
                  sizeof(float) * d);
    }
  }
  // Exchange + expert execution + return, per destination.
  std::vector<std::vector<float>> returned(p_count);
  for (int s = 0; s < p_count; ++s) returned[s].assign(send[s].size(), kPoison);
  for (int u = 0; u < p_count; ++u) {
    const DestinationPlan& dp = plan.destination[u];
    const int32_t n = static_cast<int32_t>(dp.expert_order.size());
    // Source-major receive buffer, then expert-major repack.
    std::vector<float> receive(static_cast<size_t>(n) * d);
    for (int32_t pos = 0; pos < n; ++pos) {
      const int32_t r = plan.receive_routes[u][pos];
      const int s = routes.origin[r].value();
      std::memcpy(receive.data() + static_cast<int64_t>(pos) * d,
                  send[s].data() + static_cast<int64_t>(plan.send_position[r]) * d, sizeof(float) * d);
    }
    std::vector<float> expert_in(receive.size()), expert_out(receive.size());
    for (int32_t e = 0; e < n; ++e) {
      std::memcpy(expert_in.data() + static_cast<int64_t>(e) * d,
                  receive.data() + static_cast<int64_t>(dp.expert_order[e]) * d, sizeof(float) * d);
    }
    ASSIGN_OR_RETURN(RunnerLayout layout, MakeRunnerLayout(dp.expert_counts, runner));
    const auto local = manifest.LocalSlots(Rank(u));
    SegmentFn fn = [&](int l, const float* in, int64_t rows, float* out) {
      const float scale = expert_scale[manifest.slot(local[l]).expert.value()];
      for (int64_t i = 0; i < rows * d; ++i) out[i] = scale * in[i];
    };
    RETURN_IF_ERROR(RunLayout(layout, expert_in.data(), d, fn, expert_out.data(), kPoison));
    // Inverse repack and return exchange into the origin's send positions.
    for (int32_t pos = 0; pos < n; ++pos) {
      const int32_t r = plan.receive_routes[u][pos];
      const int s = routes.origin[r].value();
      std::memcpy(returned[s].data() + static_cast<int64_t>(plan.send_position[r]) * d,
                  expert_out.data() + static_cast<int64_t>(dp.expert_position[pos]) * d, sizeof(float) * d);
    }
  }
  // Combine at each origin over the semantic key.
  PartitionRows out = ZeroOutputs(hidden);
  for (int s = 0; s < p_count; ++s) {
    const SourcePlan& sp = plan.source[s];
    const size_t n = sp.send_order.size();
    std::vector<int32_t> token(n);
    std::vector<float> gate(n);
    for (size_t pos = 0; pos < n; ++pos) {
      const int32_t r = plan.source_routes[s][sp.send_order[pos]];
      token[pos] = routes.token[r];
      gate[pos] = routes.gate[r];
    }
    CombineArgs args;
    args.rows = returned[s].data();
    args.token = token.data();
    args.gate = gate.data();
    args.n = static_cast<int64_t>(n);
    args.d = d;
    args.num_tokens = static_cast<int64_t>(hidden[s].size() / d);
    args.out = out[s].data();
    RETURN_IF_ERROR(WeightedScatterAdd(args));
  }
  return out;
}

}  // namespace moe
