#include "runtime/placement/eplb.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "absl/strings/str_cat.h"

namespace moe {

void BalancedPacking(const std::vector<float>& weight, int rows, int n, int num_packs, std::vector<int64_t>* pack_index,
                     std::vector<int64_t>* rank_in_pack) {
  const int per_pack = n / num_packs;
  pack_index->assign(static_cast<size_t>(rows) * n, -1);
  rank_in_pack->assign(static_cast<size_t>(rows) * n, -1);
  if (per_pack == 1) {
    for (int i = 0; i < rows; ++i) {
      for (int j = 0; j < n; ++j) {
        (*pack_index)[static_cast<size_t>(i) * n + j] = j;
        (*rank_in_pack)[static_cast<size_t>(i) * n + j] = 0;
      }
    }
    return;
  }
  std::vector<int> order(n);
  std::vector<float> pack_weight(num_packs);
  std::vector<int> pack_items(num_packs);
  for (int i = 0; i < rows; ++i) {
    const float* w = weight.data() + static_cast<size_t>(i) * n;
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [w](int a, int b) { return w[a] > w[b]; });
    std::fill(pack_weight.begin(), pack_weight.end(), 0.0f);
    std::fill(pack_items.begin(), pack_items.end(), 0);
    for (int item : order) {
      int pack = -1;
      for (int p = 0; p < num_packs; ++p) {
        if (pack_items[p] < per_pack && (pack < 0 || pack_weight[p] < pack_weight[pack])) pack = p;
      }
      (*pack_index)[static_cast<size_t>(i) * n + item] = pack;
      (*rank_in_pack)[static_cast<size_t>(i) * n + item] = pack_items[pack];
      pack_weight[pack] += w[item];
      ++pack_items[pack];
    }
  }
}

void ReplicateExperts(const std::vector<float>& weight, int rows, int num_log, int num_phy,
                      std::vector<int64_t>* phy2log, std::vector<int64_t>* rank, std::vector<int64_t>* logcnt) {
  phy2log->assign(static_cast<size_t>(rows) * num_phy, 0);
  rank->assign(static_cast<size_t>(rows) * num_phy, 0);
  logcnt->assign(static_cast<size_t>(rows) * num_log, 1);
  for (int i = 0; i < rows; ++i) {
    int64_t* p2l = phy2log->data() + static_cast<size_t>(i) * num_phy;
    int64_t* rk = rank->data() + static_cast<size_t>(i) * num_phy;
    int64_t* cnt = logcnt->data() + static_cast<size_t>(i) * num_log;
    const float* w = weight.data() + static_cast<size_t>(i) * num_log;
    for (int p = 0; p < num_phy; ++p) p2l[p] = p;  // first num_log copies: identity
    for (int p = num_log; p < num_phy; ++p) {
      int best = 0;
      float best_v = w[0] / static_cast<float>(cnt[0]);
      for (int e = 1; e < num_log; ++e) {
        const float v = w[e] / static_cast<float>(cnt[e]);
        if (v > best_v) {  // strict: the first maximum wins
          best_v = v;
          best = e;
        }
      }
      p2l[p] = best;
      rk[p] = cnt[best];
      ++cnt[best];
    }
  }
}

namespace {

struct HierarchicalResult {
  std::vector<int64_t> phy2log, phyrank, logcnt;
};

HierarchicalResult Hierarchical(const std::vector<float>& weight, int layers, int experts, int num_phy, int groups,
                                int nodes, int gpus) {
  const int group_size = experts / groups;
  const int groups_per_node = groups / nodes;
  const int phy_per_gpu = num_phy / gpus;
  const int log_per_node = experts / nodes;
  const int phy_per_node = num_phy / nodes;

  // Step 1: pack groups to nodes.
  std::vector<float> group_load(static_cast<size_t>(layers) * groups, 0.0f);
  for (int l = 0; l < layers; ++l) {
    for (int g = 0; g < groups; ++g) {
      float s = 0.0f;
      for (int j = 0; j < group_size; ++j) s += weight[static_cast<size_t>(l) * experts + g * group_size + j];
      group_load[static_cast<size_t>(l) * groups + g] = s;
    }
  }
  std::vector<int64_t> gpack, grank;
  BalancedPacking(group_load, layers, groups, nodes, &gpack, &grank);
  std::vector<int64_t> log2mlog(static_cast<size_t>(layers) * experts), mlog2log(log2mlog.size());
  for (int l = 0; l < layers; ++l) {
    for (int g = 0; g < groups; ++g) {
      const size_t gi = static_cast<size_t>(l) * groups + g;
      for (int j = 0; j < group_size; ++j) {
        const int64_t m = (gpack[gi] * groups_per_node + grank[gi]) * group_size + j;
        log2mlog[static_cast<size_t>(l) * experts + g * group_size + j] = m;
        mlog2log[static_cast<size_t>(l) * experts + m] = g * group_size + j;
      }
    }
  }

  // Step 2: replicate experts inside each node. Rows are (layer, node).
  const int rows = layers * nodes;
  std::vector<float> mlog_load(static_cast<size_t>(rows) * log_per_node);
  for (int l = 0; l < layers; ++l) {
    for (int m = 0; m < experts; ++m) {
      mlog_load[static_cast<size_t>(l) * experts + m] =
          weight[static_cast<size_t>(l) * experts + mlog2log[static_cast<size_t>(l) * experts + m]];
    }
  }
  std::vector<int64_t> phy2mlog, phyrank, mlogcnt;
  ReplicateExperts(mlog_load, rows, log_per_node, phy_per_node, &phy2mlog, &phyrank, &mlogcnt);

  // Step 3: pack physical copies to GPUs inside each node.
  std::vector<float> phy_load(static_cast<size_t>(rows) * phy_per_node);
  for (int r = 0; r < rows; ++r) {
    for (int p = 0; p < phy_per_node; ++p) {
      const int64_t m = phy2mlog[static_cast<size_t>(r) * phy_per_node + p];
      phy_load[static_cast<size_t>(r) * phy_per_node + p] =
          mlog_load[static_cast<size_t>(r) * log_per_node + m] /
          static_cast<float>(mlogcnt[static_cast<size_t>(r) * log_per_node + m]);
    }
  }
  std::vector<int64_t> pack, rank_in_pack;
  BalancedPacking(phy_load, rows, phy_per_node, gpus / nodes, &pack, &rank_in_pack);

  HierarchicalResult out;
  out.phy2log.assign(static_cast<size_t>(layers) * num_phy, 0);
  out.phyrank.assign(static_cast<size_t>(layers) * num_phy, 0);
  out.logcnt.assign(static_cast<size_t>(layers) * experts, 0);
  for (int r = 0; r < rows; ++r) {
    const int l = r / nodes;
    const int node = r % nodes;
    for (int p = 0; p < phy_per_node; ++p) {
      const size_t i = static_cast<size_t>(r) * phy_per_node + p;
      const int64_t pphy = pack[i] * phy_per_gpu + rank_in_pack[i];  // phy2pphy
      const int64_t mlog = phy2mlog[i] + static_cast<int64_t>(node) * log_per_node;
      const size_t o = static_cast<size_t>(l) * num_phy + node * phy_per_node + pphy;
      out.phy2log[o] = mlog2log[static_cast<size_t>(l) * experts + mlog];
      out.phyrank[o] = phyrank[i];
    }
  }
  for (int l = 0; l < layers; ++l) {
    for (int e = 0; e < experts; ++e) {
      const int64_t m = log2mlog[static_cast<size_t>(l) * experts + e];
      // mlogcnt viewed as [layers, experts]: row (l, m / log_per_node), column m % log_per_node.
      out.logcnt[static_cast<size_t>(l) * experts + e] = mlogcnt[static_cast<size_t>(l) * experts + m];
    }
  }
  return out;
}

}  // namespace

absl::StatusOr<EplbSolution> RebalanceExperts(const EplbProblem& p) {
  if (p.layers <= 0) return absl::InvalidArgumentError("weight: needs at least one layer");
  if (p.experts <= 0) return absl::InvalidArgumentError("weight: needs at least one logical expert per layer");
  if (p.weight.size() != static_cast<size_t>(p.layers) * p.experts) {
    return absl::InvalidArgumentError(
        absl::StrCat("weight: ", p.weight.size(), " values for ", p.layers, " x ", p.experts));
  }
  for (size_t i = 0; i < p.weight.size(); ++i) {
    if (!std::isfinite(p.weight[i]) || p.weight[i] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("weight[", i / p.experts, "][", i % p.experts, "]: must be finite and non-negative"));
    }
  }
  if (p.num_groups <= 0) return absl::InvalidArgumentError("num_groups: must be positive");
  if (p.num_nodes <= 0) return absl::InvalidArgumentError("num_nodes: must be positive");
  if (p.num_gpus <= 0) return absl::InvalidArgumentError("num_gpus: must be positive");
  if (p.num_replicas <= 0) return absl::InvalidArgumentError("num_replicas: must be positive");
  const bool hierarchical = p.num_groups % p.num_nodes == 0;
  const int groups = hierarchical ? p.num_groups : 1;
  const int nodes = hierarchical ? p.num_nodes : 1;
  if (p.experts % groups != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_groups: ", groups, " does not divide the ", p.experts, " logical experts"));
  }
  if (p.num_gpus % nodes != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_gpus: ", p.num_gpus, " is not a multiple of num_nodes ", nodes));
  }
  if (p.num_replicas % p.num_gpus != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_replicas: ", p.num_replicas, " is not a multiple of num_gpus ", p.num_gpus));
  }
  if (p.num_replicas < p.experts) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_replicas: ", p.num_replicas, " is below the ", p.experts, " logical experts"));
  }
  if (p.num_replicas % nodes != 0 || p.experts % nodes != 0 || p.num_replicas / nodes < p.experts / nodes) {
    return absl::InvalidArgumentError("num_nodes: replicas and experts must divide evenly over nodes");
  }

  HierarchicalResult h = Hierarchical(p.weight, p.layers, p.experts, p.num_replicas, groups, nodes, p.num_gpus);
  EplbSolution s;
  s.layers = p.layers;
  s.experts = p.experts;
  s.replicas = p.num_replicas;
  s.hierarchical = hierarchical;
  s.phy2log = std::move(h.phy2log);
  s.phyrank = std::move(h.phyrank);
  s.logcnt = std::move(h.logcnt);
  s.max_count = static_cast<int>(*std::max_element(s.logcnt.begin(), s.logcnt.end()));
  s.log2phy.assign(static_cast<size_t>(p.layers) * p.experts * s.max_count, -1);
  for (int l = 0; l < p.layers; ++l) {
    for (int q = 0; q < p.num_replicas; ++q) {
      const size_t i = static_cast<size_t>(l) * p.num_replicas + q;
      s.log2phy[(static_cast<size_t>(l) * p.experts + s.phy2log[i]) * s.max_count + s.phyrank[i]] = q;
    }
  }
  return s;
}

std::vector<double> IdealGpuLoads(const EplbProblem& p, const EplbSolution& s, int layer) {
  const int per_gpu = s.replicas / p.num_gpus;
  std::vector<double> loads(p.num_gpus, 0.0);
  for (int q = 0; q < s.replicas; ++q) {
    const int64_t e = s.phy2log[static_cast<size_t>(layer) * s.replicas + q];
    loads[q / per_gpu] += static_cast<double>(p.weight[static_cast<size_t>(layer) * p.experts + e]) /
                          static_cast<double>(s.logcnt[static_cast<size_t>(layer) * p.experts + e]);
  }
  return loads;
}

double Imbalance(const std::vector<double>& loads) {
  if (loads.empty()) return 1.0;
  double max = 0, sum = 0;
  for (double v : loads) {
    max = std::max(max, v);
    sum += v;
  }
  return sum == 0 ? 1.0 : max / (sum / loads.size());
}

}  // namespace moe
