#include "control/eplb_io.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "runtime/status.h"

namespace moe {

using json::Json;

absl::StatusOr<EplbProblem> ParseEplbProblem(const Json& doc) {
  if (!doc.is_object()) return json::Invalid("input", "expected a JSON object");
  EplbProblem p;
  ASSIGN_OR_RETURN(const Json* weight, json::Member(doc, "", "weight"));
  ASSIGN_OR_RETURN(weight, json::Array(*weight, "weight"));
  if (weight->empty()) return json::Invalid("weight", "needs at least one layer");
  p.layers = static_cast<int>(weight->size());
  for (size_t l = 0; l < weight->size(); ++l) {
    const std::string path = absl::StrCat("weight[", l, "]");
    ASSIGN_OR_RETURN(const Json* row, json::Array((*weight)[l], path));
    if (l == 0) p.experts = static_cast<int>(row->size());
    if (static_cast<int>(row->size()) != p.experts) {
      return json::Invalid(path, absl::StrCat("expected ", p.experts, " values like weight[0], got ", row->size()));
    }
    for (size_t e = 0; e < row->size(); ++e) {
      ASSIGN_OR_RETURN(double w, json::Number((*row)[e], absl::StrCat(path, "[", e, "]")));
      if (!(std::abs(w) <= std::numeric_limits<float>::max())) {  // NaN too; the cast would be UB
        return json::Invalid(absl::StrCat(path, "[", e, "]"), "must be a finite load within float range");
      }
      p.weight.push_back(static_cast<float>(w));
    }
  }
  auto field = [&](const char* key, int* out) -> absl::Status {
    ASSIGN_OR_RETURN(const Json* v, json::Member(doc, "", key));
    ASSIGN_OR_RETURN(int64_t x, json::Int(*v, key));
    if (x <= 0 || x > (1 << 24)) return json::Invalid(key, "must be a positive integer");
    *out = static_cast<int>(x);
    return absl::OkStatus();
  };
  RETURN_IF_ERROR(field("num_replicas", &p.num_replicas));
  RETURN_IF_ERROR(field("num_groups", &p.num_groups));
  RETURN_IF_ERROR(field("num_nodes", &p.num_nodes));
  RETURN_IF_ERROR(field("num_gpus", &p.num_gpus));
  // The solution's tables: layers x replicas (phy2log) and layers x experts x the most copies
  // one expert can get (log2phy); a small file must not ask for gigabytes of them.
  constexpr int64_t kMaxSolutionEntries = int64_t{1} << 26;
  const int64_t copies = std::max<int64_t>(1, int64_t{p.num_replicas} - p.experts + 1);
  if (int64_t{p.layers} * p.num_replicas > kMaxSolutionEntries ||
      int64_t{p.layers} * p.experts * copies > kMaxSolutionEntries) {
    return json::Invalid("num_replicas",
                         absl::StrCat(p.num_replicas, " replicas of ", p.experts, " experts over ", p.layers,
                                      " layers: the solution would hold more than 2^26 "
                                      "entries"));
  }
  return p;
}

Json EplbSolutionJson(const EplbSolution& s) {
  Json phy2log = Json::array(), log2phy = Json::array(), logcnt = Json::array();
  for (int l = 0; l < s.layers; ++l) {
    phy2log.push_back(std::vector<int64_t>(s.phy2log.begin() + static_cast<size_t>(l) * s.replicas,
                                           s.phy2log.begin() + static_cast<size_t>(l + 1) * s.replicas));
    logcnt.push_back(std::vector<int64_t>(s.logcnt.begin() + static_cast<size_t>(l) * s.experts,
                                          s.logcnt.begin() + static_cast<size_t>(l + 1) * s.experts));
    Json layer = Json::array();
    for (int e = 0; e < s.experts; ++e) {
      const size_t b = (static_cast<size_t>(l) * s.experts + e) * s.max_count;
      layer.push_back(std::vector<int64_t>(s.log2phy.begin() + b, s.log2phy.begin() + b + s.max_count));
    }
    log2phy.push_back(layer);
  }
  return Json{{"phy2log", phy2log}, {"log2phy", log2phy}, {"logcnt", logcnt}};
}

}  // namespace moe
