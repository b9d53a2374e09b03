#include "control/trace.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

#include "runtime/plan/route_plan.h"
#include "runtime/status.h"

namespace moe {

using json::Json;

namespace {

// Sizes and indices of a trace, before they are narrowed to int: a larger value is refused, not
// wrapped (2^32 would become 0 and divide by it).
constexpr int64_t kMaxTraceDim = int64_t{1} << 20;  // d, d_ff, ranks, route slots
constexpr int64_t kMaxTraceExperts = 65536;         // kMaxLogicalExperts

absl::Status CheckRange(int64_t v, const std::string& path, int64_t lo, int64_t hi) {
  if (v < lo || v > hi) return json::Invalid(path, absl::StrCat(v, " outside [", lo, ", ", hi, "]"));
  return absl::OkStatus();
}

absl::StatusOr<Topology> ParseTopology(const Json& doc) {
  ASSIGN_OR_RETURN(const Json* topo, json::Member(doc, "", "topology"));
  ASSIGN_OR_RETURN(const Json* nodes_json, json::Member(*topo, "topology", "nodes"));
  ASSIGN_OR_RETURN(nodes_json, json::Array(*nodes_json, "topology.nodes"));
  std::vector<std::string> nodes;
  for (size_t i = 0; i < nodes_json->size(); ++i) {
    ASSIGN_OR_RETURN(std::string n, json::String((*nodes_json)[i], absl::StrCat("topology.nodes[", i, "]")));
    nodes.push_back(n);
  }
  ASSIGN_OR_RETURN(const Json* ranks_json, json::Member(*topo, "topology", "ranks"));
  ASSIGN_OR_RETURN(ranks_json, json::Array(*ranks_json, "topology.ranks"));
  std::vector<RankInfo> ranks;
  for (size_t i = 0; i < ranks_json->size(); ++i) {
    const Json& r = (*ranks_json)[i];
    const std::string path = absl::StrCat("topology.ranks[", i, "]");
    RankInfo info;
    ASSIGN_OR_RETURN(const Json* rank, json::Member(r, path, "rank"));
    ASSIGN_OR_RETURN(int64_t rank_value, json::Int(*rank, path + ".rank"));
    RETURN_IF_ERROR(CheckRange(rank_value, path + ".rank", 0, kMaxTraceDim));
    info.rank = Rank(static_cast<int32_t>(rank_value));
    ASSIGN_OR_RETURN(const Json* node, json::Member(r, path, "node"));
    ASSIGN_OR_RETURN(std::string node_name, json::String(*node, path + ".node"));
    auto it = std::find(nodes.begin(), nodes.end(), node_name);
    if (it == nodes.end()) return json::Invalid(path + ".node", absl::StrCat("unknown node '", node_name, "'"));
    info.node = TopologyDomainId(static_cast<int32_t>(it - nodes.begin()));
    ASSIGN_OR_RETURN(int64_t local, json::IntOr(r, path, "local_rank", 0));
    info.local_rank = static_cast<int32_t>(local);
    ASSIGN_OR_RETURN(info.nic, json::StringOr(r, path, "nic", ""));
    if (r.contains("relay")) {
      ASSIGN_OR_RETURN(info.node_relay, json::Bool(r.at("relay"), path + ".relay"));
    }
    ranks.push_back(info);
  }
  return Topology::Create(std::move(ranks), std::move(nodes));
}

absl::StatusOr<ProcessGroup> ParseGroup(const Json& doc, const Topology& topology) {
  const Json empty = Json::object();
  const Json& g = doc.contains("process_group") ? doc.at("process_group") : empty;
  ASSIGN_OR_RETURN(std::string id, json::StringOr(g, "process_group", "id", "ep-group-0"));
  ASSIGN_OR_RETURN(int64_t epoch, json::IntOr(g, "process_group", "epoch", 0));
  if (!g.contains("peers"))
    return ProcessGroup::Identity(ProcessGroupId(id), ProcessGroupEpoch(epoch), topology.num_ranks());
  ASSIGN_OR_RETURN(const Json* peers_json, json::Array(g.at("peers"), "process_group.peers"));
  std::vector<Rank> peers;
  for (size_t i = 0; i < peers_json->size(); ++i) {
    ASSIGN_OR_RETURN(int64_t r, json::Int((*peers_json)[i], absl::StrCat("process_group.peers[", i, "]")));
    if (!topology.HasRank(Rank(static_cast<int32_t>(r)))) {
      return json::Invalid(absl::StrCat("process_group.peers[", i, "]"),
                           absl::StrCat("rank ", r, " is not in the topology"));
    }
    peers.push_back(Rank(static_cast<int32_t>(r)));
  }
  return ProcessGroup::Create(ProcessGroupId(id), ProcessGroupEpoch(epoch), std::move(peers));
}

absl::StatusOr<std::shared_ptr<const PlacementManifest>> ParsePlacement(const Json& doc, const Topology& topology,
                                                                        const ProcessGroup& group, int num_experts) {
  ASSIGN_OR_RETURN(const Json* p, json::Member(doc, "", "placement"));
  ManifestOptions o;
  ASSIGN_OR_RETURN(int64_t version, json::IntOr(*p, "placement", "version", 1));
  o.version = PlacementVersion(version);
  ASSIGN_OR_RETURN(std::string checkpoint, json::StringOr(*p, "placement", "checkpoint", "checkpoint-0000"));
  o.checkpoint = CheckpointVersion(checkpoint);
  o.process_group = group.id();
  o.epoch = group.epoch();
  o.num_experts = num_experts;
  ASSIGN_OR_RETURN(const Json* slots_json, json::Member(*p, "placement", "slots"));
  ASSIGN_OR_RETURN(slots_json, json::Array(*slots_json, "placement.slots"));
  std::vector<SlotRecord> slots;
  std::map<int, int> copies;
  for (size_t i = 0; i < slots_json->size(); ++i) {
    const Json& s = (*slots_json)[i];
    const std::string path = absl::StrCat("placement.slots[", i, "]");
    SlotRecord rec;
    rec.slot = PhysicalSlotId(static_cast<int32_t>(i));
    ASSIGN_OR_RETURN(rec.name, json::StringOr(s, path, "id", absl::StrCat("q", i)));
    ASSIGN_OR_RETURN(const Json* e, json::Member(s, path, "logical_expert"));
    ASSIGN_OR_RETURN(int64_t expert, json::Int(*e, path + ".logical_expert"));
    if (expert < 0 || expert >= num_experts) {
      return json::Invalid(path + ".logical_expert", absl::StrCat(expert, " outside [0, ", num_experts, ")"));
    }
    rec.expert = LogicalExpertId(static_cast<int32_t>(expert));
    rec.replica = ReplicaId(copies[static_cast<int>(expert)]++);
    ASSIGN_OR_RETURN(rec.replica_name, json::StringOr(s, path, "replica", ""));
    ASSIGN_OR_RETURN(const Json* rank_json, json::Member(s, path, "rank"));
    ASSIGN_OR_RETURN(int64_t rank, json::Int(*rank_json, path + ".rank"));
    RETURN_IF_ERROR(CheckRange(rank, path + ".rank", 0, kMaxTraceDim));
    if (!topology.HasRank(Rank(static_cast<int32_t>(rank)))) {
      return json::Invalid(path + ".rank", absl::StrCat("rank ", rank, " is not in the topology"));
    }
    rec.rank = Rank(static_cast<int32_t>(rank));
    std::string domain_default = topology.NodeName(topology.NodeOf(rec.rank));
    ASSIGN_OR_RETURN(std::string domain, json::StringOr(s, path, "domain", domain_default));
    const int d = topology.FindNode(domain);
    if (d < 0) return json::Invalid(path + ".domain", absl::StrCat("unknown node '", domain, "'"));
    rec.domain = TopologyDomainId(d);
    ASSIGN_OR_RETURN(std::string ckpt, json::StringOr(s, path, "checkpoint", checkpoint));
    rec.checkpoint = CheckpointVersion(ckpt);
    ASSIGN_OR_RETURN(std::string digest,
                     json::StringOr(s, path, "parameter_digest", absl::StrCat("expert-", expert, "-", checkpoint)));
    rec.parameter_digest = ParameterDigest(digest);
    slots.push_back(std::move(rec));
  }
  return PlacementManifest::Create(o, std::move(slots), topology);
}

absl::StatusOr<std::vector<float>> ParseRow(const Json& v, const std::string& path, int d) {
  ASSIGN_OR_RETURN(const Json* row, json::Array(v, path));
  if (static_cast<int>(row->size()) != d) {
    return json::Invalid(path, absl::StrCat("expected ", d, " values (d), got ", row->size()));
  }
  std::vector<float> out;
  for (size_t c = 0; c < row->size(); ++c) {
    ASSIGN_OR_RETURN(double x, json::Number((*row)[c], absl::StrCat(path, "[", c, "]")));
    out.push_back(static_cast<float>(x));
  }
  return out;
}

// The trace's scalar header: sizes and the route handoff's scope.
struct TraceHeader {
  int64_t num_experts = 0;
  int64_t top_k = 0;  // 0: the largest route slot + 1
  int64_t scope = 0;
};

// d, d_ff, num_experts, top_k and execution_scope; fills t->d and t->d_ff.
absl::StatusOr<TraceHeader> ParseHeader(const Json& doc, Trace* t) {
  TraceHeader header;
  ASSIGN_OR_RETURN(const Json* d_json, json::Member(doc, "", "d"));
  ASSIGN_OR_RETURN(int64_t d, json::Int(*d_json, "d"));
  RETURN_IF_ERROR(CheckRange(d, "d", 1, kMaxTraceDim));
  t->d = static_cast<int>(d);
  ASSIGN_OR_RETURN(int64_t d_ff, json::IntOr(doc, "", "d_ff", 4));
  RETURN_IF_ERROR(CheckRange(d_ff, "d_ff", 1, kMaxTraceDim));
  t->d_ff = static_cast<int>(d_ff);
  ASSIGN_OR_RETURN(const Json* e_json, json::Member(doc, "", "num_experts"));
  ASSIGN_OR_RETURN(header.num_experts, json::Int(*e_json, "num_experts"));
  RETURN_IF_ERROR(CheckRange(header.num_experts, "num_experts", 1, kMaxTraceExperts));
  ASSIGN_OR_RETURN(header.top_k, json::IntOr(doc, "", "top_k", 0));
  RETURN_IF_ERROR(CheckRange(header.top_k, "top_k", 0, kMaxTraceExperts));
  ASSIGN_OR_RETURN(header.scope, json::IntOr(doc, "", "execution_scope", 0));
  return header;
}

// Hidden rows per source rank: {"0": [[...], ...], ...}; absent ranks own no tokens.
absl::StatusOr<PartitionRows> ParseHidden(const Json& doc, int p_count, int d) {
  PartitionRows hidden(p_count);
  if (!doc.contains("hidden")) return hidden;
  const Json& h = doc.at("hidden");
  if (!h.is_object()) return json::Invalid("hidden", "expected an object keyed by source rank");
  for (auto it = h.begin(); it != h.end(); ++it) {
    int rank = -1;
    if (!absl::SimpleAtoi(it.key(), &rank) || rank < 0 || rank >= p_count) {
      return json::Invalid(absl::StrCat("hidden.", it.key()), "key must be a rank of the topology");
    }
    ASSIGN_OR_RETURN(const Json* rows, json::Array(it.value(), absl::StrCat("hidden.", it.key())));
    for (size_t i = 0; i < rows->size(); ++i) {
      ASSIGN_OR_RETURN(std::vector<float> row, ParseRow((*rows)[i], absl::StrCat("hidden.", it.key(), "[", i, "]"), d));
      hidden[rank].insert(hidden[rank].end(), row.begin(), row.end());
    }
  }
  return hidden;
}

// A route's physical_slot (appended to t->slots), checked against the route's optional replica
// and destination (0x03A1: they must agree with the manifest).
absl::Status ParseRouteSlot(const Json& r, const std::string& path, Trace* t) {
  ASSIGN_OR_RETURN(std::string slot_name, json::String(r.at("physical_slot"), path + ".physical_slot"));
  const int q = t->manifest->FindSlot(slot_name);
  if (q < 0) return json::Invalid(path + ".physical_slot", absl::StrCat("no slot '", slot_name, "' in the placement"));
  t->slots.push_back(PhysicalSlotId(q));
  const SlotRecord& slot = t->manifest->slot(PhysicalSlotId(q));
  if (r.contains("replica")) {
    ASSIGN_OR_RETURN(std::string replica, json::String(r.at("replica"), path + ".replica"));
    if (replica != slot.replica_name) {
      return absl::FailedPreconditionError(absl::StrCat(path, ".replica: '", replica, "' but slot ", slot_name,
                                                        " holds replica '", slot.replica_name, "'"));
    }
  }
  if (r.contains("destination_rank")) {
    ASSIGN_OR_RETURN(int64_t dst, json::Int(r.at("destination_rank"), path + ".destination_rank"));
    if (dst != slot.rank.value()) {
      return absl::FailedPreconditionError(absl::StrCat(path, ".destination_rank: ", dst, " but slot ", slot_name,
                                                        " lives on rank ", slot.rank.value()));
    }
  }
  return absl::OkStatus();
}

// routes[i]: appended to t->routes (and its name, and its slot when it names one). Returns the
// route slot.
absl::StatusOr<int64_t> ParseRoute(const Json& r, size_t i, Trace* t) {
  const int p_count = t->topology->num_ranks();
  const std::string path = absl::StrCat("routes[", i, "]");
  ASSIGN_OR_RETURN(std::string name, json::StringOr(r, path, "id", absl::StrCat("r", i)));
  ASSIGN_OR_RETURN(const Json* src_json, json::Member(r, path, "source_rank"));
  ASSIGN_OR_RETURN(int64_t src, json::Int(*src_json, path + ".source_rank"));
  if (src < 0 || src >= p_count)
    return json::Invalid(path + ".source_rank", absl::StrCat(src, " is not a rank of the topology"));
  ASSIGN_OR_RETURN(const Json* tok_json, json::Member(r, path, "token"));
  ASSIGN_OR_RETURN(int64_t token, json::Int(*tok_json, path + ".token"));
  const int64_t tokens = static_cast<int64_t>(t->hidden[src].size() / t->d);
  if (token < 0 || token >= tokens) {
    return json::Invalid(path + ".token",
                         absl::StrCat(token, " but source rank ", src, " has ", tokens, " hidden rows"));
  }
  ASSIGN_OR_RETURN(int64_t route_slot, json::IntOr(r, path, "route_slot", 0));
  RETURN_IF_ERROR(CheckRange(route_slot, path + ".route_slot", 0, kMaxTraceExperts - 1));
  ASSIGN_OR_RETURN(const Json* e_json, json::Member(r, path, "logical_expert"));
  ASSIGN_OR_RETURN(int64_t expert, json::Int(*e_json, path + ".logical_expert"));
  ASSIGN_OR_RETURN(const Json* g_json, json::Member(r, path, "gate"));
  ASSIGN_OR_RETURN(double gate, json::Number(*g_json, path + ".gate"));
  bool admitted = true;
  if (r.contains("admitted")) {
    ASSIGN_OR_RETURN(admitted, json::Bool(r.at("admitted"), path + ".admitted"));
  }
  t->routes.Add(Rank(static_cast<int32_t>(src)), static_cast<int32_t>(token), static_cast<int32_t>(route_slot),
                LogicalExpertId(static_cast<int32_t>(expert)), static_cast<float>(gate), admitted);
  t->route_names.push_back(name);
  if (r.contains("physical_slot")) RETURN_IF_ERROR(ParseRouteSlot(r, path, t));
  return route_slot;
}

// The routes into t->routes, then the handoff's checks: slots for every route or none, top_k,
// experts in range, and SemanticHandoff::Validate.
absl::Status ParseRoutes(const Json& doc, const TraceHeader& header, Trace* t) {
  ASSIGN_OR_RETURN(const Json* routes_json, json::Member(doc, "", "routes"));
  ASSIGN_OR_RETURN(routes_json, json::Array(*routes_json, "routes"));
  SemanticHandoff& h = t->routes;
  h.scope = ExecutionScopeId(header.scope);
  h.num_experts = static_cast<int32_t>(header.num_experts);
  h.num_partitions = t->topology->num_ranks();
  int max_slot = 0;
  for (size_t i = 0; i < routes_json->size(); ++i) {
    ASSIGN_OR_RETURN(int64_t route_slot, ParseRoute((*routes_json)[i], i, t));
    max_slot = std::max<int>(max_slot, static_cast<int>(route_slot));
  }
  const int with_slot = static_cast<int>(t->slots.size());
  if (with_slot != 0 && with_slot != h.size()) {
    return json::Invalid("routes", "physical_slot must be given for every route or for none");
  }
  h.top_k = header.top_k > 0 ? static_cast<int32_t>(header.top_k) : max_slot + 1;
  for (int32_t r = 0; r < h.size(); ++r) {
    if (h.expert[r].value() < 0 || h.expert[r].value() >= header.num_experts) {
      return json::Invalid(absl::StrCat("routes[", r, "].logical_expert"),
                           absl::StrCat(h.expert[r].value(), " outside [0, ", header.num_experts, ")"));
    }
  }
  return h.Validate();
}

// expert_scale: one scalar per logical expert; e + 1 when absent.
absl::StatusOr<std::vector<float>> ParseExpertScale(const Json& doc, int64_t num_experts) {
  std::vector<float> scale;
  if (!doc.contains("expert_scale")) {
    for (int e = 0; e < num_experts; ++e) scale.push_back(static_cast<float>(e + 1));
    return scale;
  }
  ASSIGN_OR_RETURN(const Json* s, json::Array(doc.at("expert_scale"), "expert_scale"));
  if (static_cast<int64_t>(s->size()) != num_experts) {
    return json::Invalid("expert_scale", absl::StrCat("expected ", num_experts, " values, got ", s->size()));
  }
  for (size_t i = 0; i < s->size(); ++i) {
    ASSIGN_OR_RETURN(double x, json::Number((*s)[i], absl::StrCat("expert_scale[", i, "]")));
    scale.push_back(static_cast<float>(x));
  }
  return scale;
}

// The optional runner and widths objects into t.
absl::Status ParseRunnerAndWidths(const Json& doc, Trace* t) {
  const Json empty = Json::object();
  const Json& runner = doc.contains("runner") ? doc.at("runner") : empty;
  ASSIGN_OR_RETURN(t->capacity, json::IntOr(runner, "runner", "capacity", 0));
  ASSIGN_OR_RETURN(t->alignment, json::IntOr(runner, "runner", "alignment", 1));
  ASSIGN_OR_RETURN(t->block_rows, json::IntOr(runner, "runner", "block_rows", 128));
  ASSIGN_OR_RETURN(int64_t block_cols, json::IntOr(runner, "runner", "block_cols", 0));
  RETURN_IF_ERROR(CheckRange(block_cols, "runner.block_cols", 0, t->d_ff));
  t->block_cols = static_cast<int>(block_cols);
  if (t->alignment <= 0) return json::Invalid("runner.alignment", "must be positive");
  if (t->block_rows <= 0) return json::Invalid("runner.block_rows", "must be positive");
  if (t->block_cols < 0 || (t->block_cols > 0 && t->d_ff % t->block_cols != 0)) {
    return json::Invalid("runner.block_cols", absl::StrCat("must divide d_ff=", t->d_ff));
  }
  const Json& widths = doc.contains("widths") ? doc.at("widths") : empty;
  ASSIGN_OR_RETURN(int64_t wa, json::IntOr(widths, "widths", "activation", 2));
  ASSIGN_OR_RETURN(int64_t wo, json::IntOr(widths, "widths", "output", 2));
  if (wa <= 0 || wo <= 0) return json::Invalid("widths", "element widths must be positive");
  RETURN_IF_ERROR(CheckRange(wa, "widths.activation", 1, 64));
  RETURN_IF_ERROR(CheckRange(wo, "widths.output", 1, 64));
  t->widths.activation = static_cast<int>(wa);
  t->widths.output = static_cast<int>(wo);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Trace> ParseTrace(const Json& doc) {
  if (!doc.is_object()) return json::Invalid("trace", "expected a JSON object");
  Trace t;
  ASSIGN_OR_RETURN(const TraceHeader header, ParseHeader(doc, &t));
  ASSIGN_OR_RETURN(Topology topology, ParseTopology(doc));
  ASSIGN_OR_RETURN(ProcessGroup group, ParseGroup(doc, topology));
  ASSIGN_OR_RETURN(t.manifest, ParsePlacement(doc, topology, group, static_cast<int>(header.num_experts)));
  t.topology = std::move(topology);
  t.group = std::move(group);
  ASSIGN_OR_RETURN(t.hidden, ParseHidden(doc, t.topology->num_ranks(), t.d));
  RETURN_IF_ERROR(ParseRoutes(doc, header, &t));
  ASSIGN_OR_RETURN(t.expert_scale, ParseExpertScale(doc, header.num_experts));
  RETURN_IF_ERROR(ParseRunnerAndWidths(doc, &t));
  return t;
}

namespace {

Json RouteNames(const Trace& t, const std::vector<int32_t>& ids) {
  Json out = Json::array();
  for (int32_t r : ids) out.push_back(t.route_names[r]);
  return out;
}

Json LedgerJson(const RunnerLedger& l) {
  return Json{{"layout", RunnerKindName(l.kind)},
              {"useful_rows", l.useful_rows},
              {"capacity_rows", l.capacity_rows},
              {"executed_rows", l.executed_rows},
              {"row_utilization", l.utilization},
              {"input_values", l.input_values},
              {"intermediate_values", l.intermediate_values},
              {"matmul_flops", l.matmul_flops},
              {"useful_flops", l.useful_flops},
              {"state", l.state},
              {"state_bytes", l.state_bytes}};
}

// The block-sparse layout's ledger also names its block shape and topology: the fixture's B_r = 2
// is a teaching size, not MegaBlocks' 128 (0x04D), and the output says which ran.
Json LedgerJson(const RunnerLedger& l, const RunnerLayoutParams& runner, int block_cols) {
  Json j = LedgerJson(l);
  if (runner.kind == RunnerKind::kBlockSparse) {
    j["block_rows"] = runner.block_rows;
    j["block_cols"] = block_cols;
    j["row_blocks"] = l.row_blocks;
    j["nonzero_blocks"] = l.nonzero_blocks;
  }
  return j;
}

// The plan's identity: digest, placement, process group, how replicas were selected and the
// slot each admitted route went to.
void AddPlanIdentity(const Trace& t, const FrozenHandoff& frozen, const std::vector<PhysicalSlotId>& slots,
                     const std::string& selection, Json* report) {
  const ProcessGroup& group = *t.group;
  const PlacementManifest& m = *t.manifest;
  absl::StatusOr<Sha256> digest = frozen.Digest();
  (*report)["semantic_digest"] = digest.ok() ? HexDigest(*digest) : std::string(digest.status().message());
  (*report)["placement_version"] = m.VersionName();
  (*report)["process_group"] = {{"id", group.id().value()}, {"epoch", group.epoch().value()}};
  Json peers = Json::array();
  for (Rank r : group.peers()) peers.push_back(r.value());
  (*report)["process_group"]["peers"] = peers;
  (*report)["replica_selection"] = selection;
  Json assignment = Json::object();
  for (int32_t r = 0; r < t.routes.size(); ++r) {
    if (t.routes.admitted[r]) assignment[t.route_names[r]] = m.slot(slots[r]).name;
  }
  (*report)["physical_slots"] = assignment;
}

// The route plan: count matrix, both sides' splits, offsets and orders, and every admitted
// route's inverse coordinates.
void AddRoutePlan(const Trace& t, const ClusterPlan& plan, Json* report) {
  const int p_count = plan.num_ranks;
  Json count = Json::array();
  for (int s = 0; s < p_count; ++s) {
    Json row = Json::array();
    for (int u = 0; u < p_count; ++u) row.push_back(plan.Count(Rank(s), Rank(u)));
    count.push_back(row);
  }
  (*report)["count_matrix"] = count;
  Json send_splits = Json::array(), send_offsets = Json::array(), send_order = Json::array();
  Json recv_splits = Json::array(), recv_order = Json::array(), expert_order = Json::array();
  Json expert_counts = Json::array(), expert_offsets = Json::array();
  for (int u = 0; u < p_count; ++u) {
    send_splits.push_back(plan.source[u].send_splits);
    send_offsets.push_back(plan.source[u].send_offsets);
    std::vector<int32_t> ids;
    for (int32_t i : plan.source[u].send_order) ids.push_back(plan.source_routes[u][i]);
    send_order.push_back(RouteNames(t, ids));
    recv_splits.push_back(plan.destination[u].recv_splits);
    recv_order.push_back(RouteNames(t, plan.receive_routes[u]));
    expert_order.push_back(RouteNames(t, plan.ExpertRoutes(Rank(u))));
    expert_counts.push_back(plan.destination[u].expert_counts);
    expert_offsets.push_back(plan.destination[u].expert_offsets);
  }
  (*report)["send_splits"] = send_splits;
  (*report)["send_offsets"] = send_offsets;
  (*report)["send_order"] = send_order;
  (*report)["recv_splits"] = recv_splits;
  (*report)["receive_order"] = recv_order;
  (*report)["expert_order"] = expert_order;
  (*report)["expert_counts"] = expert_counts;
  (*report)["expert_offsets"] = expert_offsets;
  Json inverse = Json::object();
  for (int32_t r = 0; r < t.routes.size(); ++r) {
    if (!t.routes.admitted[r]) continue;
    inverse[t.route_names[r]] = {{"source_send_position", plan.send_position[r]},
                                 {"destination_rank", plan.destination_rank[r]},
                                 {"destination_receive_position", plan.receive_position[r]},
                                 {"local_expert_position", plan.expert_position[r]},
                                 {"origin_partition", t.routes.origin[r].value()},
                                 {"origin_token", t.routes.token[r]},
                                 {"route_slot", t.routes.route_slot[r]},
                                 {"gate", t.routes.gate[r]}};
  }
  (*report)["inverse"] = inverse;
}

// The three runner layouts the trace is executed and accounted under.
std::vector<RunnerLayoutParams> TraceRunners(const Trace& t, const LoadLedger& loads) {
  const int64_t max_count = *std::max_element(loads.physical_slot_rows.begin(), loads.physical_slot_rows.end());
  const int64_t capacity = t.capacity > 0 ? t.capacity : std::max<int64_t>(max_count, 1);
  return {
      {RunnerKind::kPaddedDense, capacity, t.alignment, t.block_rows},
      {RunnerKind::kGrouped, 0, 1, t.block_rows},
      {RunnerKind::kBlockSparse, 0, 1, t.block_rows},
  };
}

// Outputs through every runner layout, checked against the semantic computation (INTERNAL when
// one differs); the grouped runner's rows are reported, rounded to FP32's decimal precision.
absl::Status AddOutputs(const Trace& t, const ClusterPlan& plan, const FrozenHandoff& frozen,
                        const std::vector<RunnerLayoutParams>& runners, const PartitionRows& semantic, Json* report) {
  Json parity = Json::object();
  PartitionRows grouped_out;
  for (const RunnerLayoutParams& runner : runners) {
    ASSIGN_OR_RETURN(PartitionRows out,
                     PhysicalOutputs(plan, frozen, *t.manifest, t.hidden, t.d, t.expert_scale, runner));
    double max_diff = 0;
    for (size_t p = 0; p < out.size(); ++p) {
      for (size_t i = 0; i < out[p].size(); ++i) {
        const double diff = std::abs(static_cast<double>(out[p][i]) - semantic[p][i]);
        max_diff = std::isnan(diff) ? INFINITY : std::max(max_diff, diff);
      }
    }
    parity[RunnerKindName(runner.kind)] = max_diff;
    if (max_diff != 0) {
      return absl::InternalError(absl::StrCat("runner ", RunnerKindName(runner.kind),
                                              " disagrees with the semantic computation by ", max_diff));
    }
    if (runner.kind == RunnerKind::kGrouped) grouped_out = std::move(out);
  }
  Json outputs = Json::array();
  for (int p = 0; p < plan.num_ranks; ++p) {
    Json rows = Json::array();
    for (size_t i = 0; i < grouped_out[p].size(); i += t.d) {
      Json row = Json::array();
      for (int c = 0; c < t.d; ++c) {
        // Rounded to FP32's decimal precision so 1.35 prints as 1.35.
        row.push_back(std::stod(absl::StrFormat("%.7g", grouped_out[p][i + c])));
      }
      rows.push_back(row);
    }
    outputs.push_back(rows);
  }
  (*report)["outputs"] = outputs;
  (*report)["runner_parity_max_abs_diff"] = parity;
  return absl::OkStatus();
}

Json ByteLedgerJson(const ByteLedger& b) {
  return Json{{"staging_dispatch", b.staging_dispatch},
              {"staging_combine", b.staging_combine},
              {"remote_routes", b.remote_routes},
              {"remote_dispatch", b.remote_dispatch},
              {"remote_combine", b.remote_combine},
              {"dispatch_metadata", b.dispatch_meta},
              {"combine_metadata", b.combine_meta},
              {"route_handle", b.route_handle},
              {"count_matrix", b.count_matrix},
              {"send_offsets", b.send_offsets},
              {"recv_splits", b.recv_splits},
              {"expert_offsets", b.expert_offsets},
              {"remote_logical_excluding_protocol", b.remote_logical},
              {"uniform_padded_per_direction", b.padded_per_direction},
              {"uniform_padded_round_trip", b.padded_round_trip},
              {"useful_staging_round_trip", b.useful_round_trip}};
}

// The layer step's buffers and their lifetimes, checked against its event schedule.
absl::StatusOr<Json> LifetimesJson(const Trace& t, const ByteLedger& b) {
  auto buffers = LayerStepBuffers(b, t.d, t.widths);
  ASSIGN_OR_RETURN(LifetimeReport life, CheckLifetimes(LayerStepEvents(), buffers));
  Json buffer_rows = Json::array();
  for (const BufferLifetime& buf : buffers) {
    buffer_rows.push_back(
        {{"buffer", buf.name}, {"bytes", buf.bytes}, {"live", {buf.begin, buf.end}}, {"last_reader", buf.last_reader}});
  }
  return Json{{"buffers", buffer_rows},
              {"total_bytes", life.total_bytes},
              {"peak_bytes", life.peak_bytes},
              {"peak_epoch", life.peak_epoch},
              {"live_by_epoch", life.live_by_epoch}};
}

absl::StatusOr<Json> RunnerLedgersJson(const Trace& t, const LoadLedger& loads,
                                       const std::vector<RunnerLayoutParams>& runners) {
  Json runner_ledgers = Json::object();
  const int block_cols = t.block_cols > 0 ? t.block_cols : t.d_ff;
  for (const RunnerLayoutParams& runner : runners) {
    ASSIGN_OR_RETURN(RunnerLayout layout_all, MakeRunnerLayout(loads.physical_slot_rows, runner));
    ASSIGN_OR_RETURN(RunnerLedger l, ComputeRunnerLedger(layout_all, t.d, t.d_ff, block_cols));
    runner_ledgers[RunnerKindName(runner.kind)] = LedgerJson(l, runner, block_cols);
  }
  return runner_ledgers;
}

Json RouteClassesJson(const Trace& t, const RouteClassLedger& classes) {
  Json class_json = Json::object();
  for (int c = 0; c < 3; ++c) {
    class_json[RouteClassName(c)] = {{"rows", classes.rows[c]},
                                     {"routes", RouteNames(t, classes.routes[c])},
                                     {"dispatch_bytes", classes.dispatch_bytes[c]},
                                     {"round_trip_bytes", classes.round_trip_bytes[c]},
                                     {"directed_pairs", classes.directed_pairs[c]}};
  }
  return class_json;
}

Json RelayLedgerJson(const RelayLedger& relay) {
  return Json{{"dispatch_source_to_relay", relay.dispatch_to_source_relay},
              {"dispatch_relay_to_relay", relay.dispatch_relay_to_relay},
              {"dispatch_relay_to_final", relay.dispatch_relay_to_final},
              {"combine_expert_to_relay", relay.combine_to_expert_relay},
              {"combine_relay_to_relay", relay.combine_relay_to_relay},
              {"combine_relay_to_origin", relay.combine_relay_to_origin},
              {"inter_node_round_trip_bytes", relay.inter_node_round_trip_bytes},
              {"added_relay_bytes", relay.added_relay_bytes},
              {"flat_inter_node_pairs", relay.flat_inter_node_pairs},
              {"hierarchical_inter_node_pairs", relay.hierarchical_inter_node_pairs}};
}

// Every ledger of the step: load, row slots, bytes, buffer lifetimes, runners, route classes
// and the hierarchical relay.
absl::StatusOr<Json> Ledgers(const Trace& t, const ClusterPlan& plan, const FrozenHandoff& frozen,
                             const LoadLedger& loads, const std::vector<RunnerLayoutParams>& runners) {
  Json ledgers;
  ledgers["load"] = {{"logical_expert_rows", loads.logical_expert_rows},
                     {"physical_slot_rows", loads.physical_slot_rows},
                     {"destination_rank_rows", loads.destination_rank_rows}};
  ByteLedger b = ComputeByteLedger(plan, frozen, t.d, t.widths);
  ledgers["row_slots"] = {{"useful_rows", b.routes},
                          {"max_split", b.max_split},
                          {"uniform_padded_rows", b.padded_rows},
                          {"padding_rows", b.padding_rows}};
  ledgers["bytes"] = ByteLedgerJson(b);
  ASSIGN_OR_RETURN(const PrecisionPayloads precision, ComputePrecisionPayloads(b.remote_routes, t.d));
  ledgers["precision_payloads"] = {{"remote_rows", precision.remote_rows},
                                   {"bf16", precision.bf16},
                                   {"fp8_row_scale", precision.fp8_row_scale},
                                   {"fp8_block128_scales", precision.fp8_block_scales}};
  ASSIGN_OR_RETURN(ledgers["lifetimes"], LifetimesJson(t, b));
  ASSIGN_OR_RETURN(ledgers["runners"], RunnerLedgersJson(t, loads, runners));
  ledgers["route_classes"] = RouteClassesJson(t, ComputeRouteClasses(plan, frozen, *t.topology, t.d, t.widths));
  ledgers["hierarchical_relay"] = RelayLedgerJson(ComputeRelayLedger(plan, frozen, *t.topology, t.d, t.widths));
  return ledgers;
}

}  // namespace

absl::StatusOr<Json> PlanTrace(const Trace& t, SelectorPolicy selector) {
  const Topology& topo = *t.topology;
  const ProcessGroup& group = *t.group;
  std::vector<PhysicalSlotId> slots = t.slots;
  std::string selection = "trace";
  if (slots.empty()) {
    slots.resize(t.routes.size());
    RETURN_IF_ERROR(
        ReplicaSelector::Create(selector)->Select(t.routes, *t.manifest, group, topo, {}, absl::MakeSpan(slots)));
    selection = SelectorPolicyName(selector);
  }
  ASSIGN_OR_RETURN(FrozenHandoff frozen, Freeze(t.routes));
  ASSIGN_OR_RETURN(PlanLayout layout, PlanLayout::Create(t.manifest, group));
  ASSIGN_OR_RETURN(ClusterPlan plan, PlanCluster(frozen, slots, layout, topo));

  Json report;
  AddPlanIdentity(t, frozen, slots, selection, &report);
  AddRoutePlan(t, plan, &report);
  // Outputs through all three runner layouts, checked against the semantic computation.
  ASSIGN_OR_RETURN(PartitionRows semantic, SemanticOutputs(t.routes, t.hidden, t.d, t.expert_scale));
  const LoadLedger loads = ComputeLoadLedger(plan, frozen, *t.manifest);
  const std::vector<RunnerLayoutParams> runners = TraceRunners(t, loads);
  RETURN_IF_ERROR(AddOutputs(t, plan, frozen, runners, semantic, &report));
  ASSIGN_OR_RETURN(report["ledgers"], Ledgers(t, plan, frozen, loads, runners));
  return report;
}

namespace {

std::string Vec(const Json& a) {
  std::vector<std::string> parts;
  for (const Json& v : a) parts.push_back(v.is_string() ? v.get<std::string>() : v.dump());
  return absl::StrCat("[", absl::StrJoin(parts, ", "), "]");
}

}  // namespace

std::string RenderPlanText(const Json& r) {
  std::ostringstream o;
  const int p = static_cast<int>(r["count_matrix"].size());
  o << "placement " << r["placement_version"].get<std::string>() << ", process group "
    << r["process_group"]["id"].get<std::string>() << " epoch " << r["process_group"]["epoch"].dump() << ", peer order "
    << Vec(r["process_group"]["peers"]) << "\n";
  o << "semantic digest " << r["semantic_digest"].get<std::string>() << "\n";
  o << "replica selection: " << r["replica_selection"].get<std::string>() << "\n\n";
  o << "count matrix C[source][destination] (global ranks)\n";
  for (int s = 0; s < p; ++s) o << "  rank " << s << ": " << Vec(r["count_matrix"][s]) << "\n";
  o << "\nsource side (peer-slot order)\n";
  for (int s = 0; s < p; ++s) {
    o << "  rank " << s << ": splits " << Vec(r["send_splits"][s]) << "  offsets " << Vec(r["send_offsets"][s])
      << "  send order " << Vec(r["send_order"][s]) << "\n";
  }
  o << "\ndestination side\n";
  for (int u = 0; u < p; ++u) {
    o << "  rank " << u << ": recv splits " << Vec(r["recv_splits"][u]) << "  receive " << Vec(r["receive_order"][u])
      << "  expert-major " << Vec(r["expert_order"][u]) << "  counts " << Vec(r["expert_counts"][u]) << "  offsets "
      << Vec(r["expert_offsets"][u]) << "\n";
  }
  o << "\ncombined outputs (checked against the semantic computation; max |diff| per runner: ";
  std::vector<std::string> parity;
  for (auto it = r["runner_parity_max_abs_diff"].begin(); it != r["runner_parity_max_abs_diff"].end(); ++it) {
    parity.push_back(absl::StrCat(it.key(), " ", it.value().dump()));
  }
  o << absl::StrJoin(parity, ", ") << ")\n";
  for (int s = 0; s < p; ++s) {
    for (size_t t = 0; t < r["outputs"][s].size(); ++t) {
      o << "  p" << s << ".t" << t << " -> " << Vec(r["outputs"][s][t]) << "\n";
    }
  }
  const Json& l = r["ledgers"];
  o << "\nload ledger\n  logical expert rows " << Vec(l["load"]["logical_expert_rows"]) << "\n  physical slot rows  "
    << Vec(l["load"]["physical_slot_rows"]) << "\n  destination rank rows " << Vec(l["load"]["destination_rank_rows"])
    << "\n";
  o << "\nrow slots: useful " << l["row_slots"]["useful_rows"] << ", uniform padded "
    << l["row_slots"]["uniform_padded_rows"] << " (" << l["row_slots"]["padding_rows"] << " padding)\n";
  o << "\nbyte ledger (representation-level, excluding protocol)\n";
  for (auto it = l["bytes"].begin(); it != l["bytes"].end(); ++it) {
    o << absl::StrFormat("  %-36s %s\n", it.key(), it.value().dump());
  }
  o << "\nbuffer lifetimes (half-open epochs)\n";
  for (const Json& b : l["lifetimes"]["buffers"]) {
    o << absl::StrFormat("  %-34s %6s B  [%s, %s)  last reader %s\n", b["buffer"].get<std::string>(), b["bytes"].dump(),
                         b["live"][0].dump(), b["live"][1].dump(), b["last_reader"].get<std::string>());
  }
  o << "  sum " << l["lifetimes"]["total_bytes"] << " B, peak " << l["lifetimes"]["peak_bytes"] << " B at epoch "
    << l["lifetimes"]["peak_epoch"] << "\n";
  o << "\nrunner ledgers (global physical-slot order)\n";
  o << absl::StrFormat("  %-24s %9s %9s %11s %7s %12s %10s %s\n", "layout", "executed", "useful", "utilization",
                       "input", "intermediate", "flops", "state");
  for (auto it = l["runners"].begin(); it != l["runners"].end(); ++it) {
    const Json& x = it.value();
    o << absl::StrFormat("  %-24s %9s %9s %10.1f%% %7s %12s %10s %s (%s B)\n", it.key(), x["executed_rows"].dump(),
                         x["useful_rows"].dump(), 100.0 * x["row_utilization"].get<double>(), x["input_values"].dump(),
                         x["intermediate_values"].dump(), x["matmul_flops"].dump(), x["state"].get<std::string>(),
                         x["state_bytes"].dump());
  }
  const Json& precision = l["precision_payloads"];
  o << absl::StrFormat(
      "\nremote dispatch payload of %s rows by precision (data + scales, 0x0AB): BF16 %s B, FP8 + a scale a row %s B, "
      "FP8 + a scale per 128 values %s B\n",
      precision["remote_rows"].dump(), precision["bf16"].dump(), precision["fp8_row_scale"].dump(),
      precision["fp8_block128_scales"].dump());
  o << "\nroute classes\n";
  for (auto it = l["route_classes"].begin(); it != l["route_classes"].end(); ++it) {
    const Json& x = it.value();
    o << absl::StrFormat("  %-22s rows %s %s  dispatch %s B  round trip %s B  directed pairs %s\n", it.key(),
                         x["rows"].dump(), Vec(x["routes"]), x["dispatch_bytes"].dump(), x["round_trip_bytes"].dump(),
                         x["directed_pairs"].dump());
  }
  o << "\nhierarchical relay ledger\n";
  for (auto it = l["hierarchical_relay"].begin(); it != l["hierarchical_relay"].end(); ++it) {
    o << absl::StrFormat("  %-32s %s\n", it.key(), it.value().dump());
  }
  return o.str();
}

}  // namespace moe
