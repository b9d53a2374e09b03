#include "control/trace.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

#include "control/eplb_io.h"

namespace moe {
namespace {

using json::Json;
using ::testing::HasSubstr;

Json Load(const std::string& name) {
  auto doc = json::ParseFile("deploy/examples/" + name);
  EXPECT_TRUE(doc.ok()) << doc.status();
  return *doc;
}

absl::StatusOr<Json> PlanDoc(const Json& doc, SelectorPolicy selector = SelectorPolicy::kLocalityFirst) {
  auto trace = ParseTrace(doc);
  if (!trace.ok()) return trace.status();
  return PlanTrace(*trace, selector);
}

TEST(TraceTest, EightRouteExampleReproducesSpec) {
  auto report = PlanDoc(Load("trace-eight-routes.json"));
  ASSERT_TRUE(report.ok()) << report.status();
  const Json& r = *report;
  EXPECT_EQ(r["count_matrix"], Json::parse("[[1,2,1,0],[1,1,1,1],[0,0,0,0],[0,0,0,0]]"));
  EXPECT_EQ(r["send_offsets"][0], Json::parse("[0,1,3,4,4]"));
  EXPECT_EQ(r["send_order"][1], Json::parse(R"(["r05","r07","r06","r04"])"));
  EXPECT_EQ(r["recv_splits"][1], Json::parse("[2,1,0,0]"));
  EXPECT_EQ(r["expert_offsets"][1], Json::parse("[0,2,3]"));
  EXPECT_EQ(r["outputs"][0], Json::parse("[[1.35,13.5,135],[3.2,32,320]]"));
  EXPECT_EQ(r["outputs"][1], Json::parse("[[8.22,82.2,822],[6.2,62,620]]"));
  EXPECT_EQ(r["ledgers"]["lifetimes"]["peak_bytes"], 904);
  EXPECT_EQ(r["ledgers"]["bytes"]["remote_logical_excluding_protocol"], 144);
  EXPECT_EQ(r["ledgers"]["runners"]["capacity-padded dense"]["matmul_flops"], 1728);
  // 0x04D: B_r = 2 (the fixture's teaching size, named), 12 executed rows, 864 FLOPs, six row
  // blocks of two nonzero 2x2 column blocks each, and the 172-byte topology.
  const Json& blocks = r["ledgers"]["runners"]["block sparse"];
  EXPECT_EQ(blocks["block_rows"], 2);
  EXPECT_EQ(blocks["block_cols"], 2);
  EXPECT_EQ(blocks["executed_rows"], 12);
  EXPECT_EQ(blocks["matmul_flops"], 864);
  EXPECT_EQ(blocks["row_blocks"], 6);
  EXPECT_EQ(blocks["nonzero_blocks"], 12);
  EXPECT_EQ(blocks["state_bytes"], 172);
  EXPECT_EQ(r["ledgers"]["hierarchical_relay"]["added_relay_bytes"], 36);
  EXPECT_EQ(r["ledgers"]["precision_payloads"], Json::parse(R"({"remote_rows": 6, "bf16": 36, "fp8_row_scale": 42,
                                                                "fp8_block128_scales": 42})"));
  EXPECT_THAT(RenderPlanText(r), HasSubstr("BF16 36 B, FP8 + a scale a row 42 B"));
  EXPECT_EQ(r["inverse"]["r06"]["local_expert_position"], 0);
  EXPECT_THAT(RenderPlanText(r), HasSubstr("p1.t0 -> [8.22, 82.2, 822.0]"));
}

TEST(TraceTest, PeerOrderExampleUsesPeerSlots) {
  auto report = PlanDoc(Load("trace-peer-order.json"));
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ((*report)["send_splits"][0], Json::parse("[1,1,0,2]"));
  EXPECT_EQ((*report)["send_splits"][1], Json::parse("[1,1,1,1]"));
  EXPECT_EQ((*report)["recv_splits"][1], Json::parse("[0,2,0,1]"));
  EXPECT_EQ((*report)["outputs"][1], Json::parse("[[8.22,82.2,822],[6.2,62,620]]"));
}

TEST(TraceTest, SelectorFillsMissingSlots) {
  Json doc = Load("trace-eight-routes.json");
  for (Json& r : doc["routes"]) r.erase("physical_slot");
  doc["runner"].erase("capacity");  // a selector may load one slot past the fixture's capacity 3
  for (SelectorPolicy p : {SelectorPolicy::kLocalityFirst, SelectorPolicy::kLeastLoad, SelectorPolicy::kRoundRobin,
                           SelectorPolicy::kHash}) {
    auto report = PlanDoc(doc, p);
    ASSERT_TRUE(report.ok()) << report.status();
    EXPECT_EQ((*report)["replica_selection"], SelectorPolicyName(p));
    // Replica choice changes physical traffic, never the combined outputs.
    EXPECT_EQ((*report)["outputs"][1], Json::parse("[[8.22,82.2,822],[6.2,62,620]]"));
    EXPECT_EQ((*report)["ledgers"]["load"]["logical_expert_rows"], Json::parse("[4,2,1,1]"));
  }
}

void ExpectError(Json doc, absl::StatusCode code, const std::string& field) {
  auto report = PlanDoc(doc);
  ASSERT_FALSE(report.ok()) << field;
  EXPECT_EQ(report.status().code(), code) << report.status();
  EXPECT_THAT(std::string(report.status().message()), HasSubstr(field));
}

TEST(TraceTest, BadInputNamesTheField) {
  const Json base = Load("trace-eight-routes.json");
  Json doc = base;
  doc["hidden"]["0"][1] = Json::parse("[2,20]");
  ExpectError(doc, absl::StatusCode::kInvalidArgument, "hidden.0[1]");
  doc = base;
  doc["routes"][3]["gate"] = "high";
  ExpectError(doc, absl::StatusCode::kInvalidArgument, "routes[3].gate");
  doc = base;
  doc["routes"][3]["token"] = 5;
  ExpectError(doc, absl::StatusCode::kInvalidArgument, "routes[3].token");
  doc = base;
  doc["routes"][2]["physical_slot"] = "q9";
  ExpectError(doc, absl::StatusCode::kInvalidArgument, "routes[2].physical_slot");
  doc = base;
  doc["routes"][4]["logical_expert"] = 7;
  ExpectError(doc, absl::StatusCode::kInvalidArgument, "routes[4].logical_expert");
  doc = base;
  doc.erase("placement");
  ExpectError(doc, absl::StatusCode::kInvalidArgument, "placement");
  doc = base;
  doc["placement"]["slots"][0]["rank"] = 8;
  ExpectError(doc, absl::StatusCode::kInvalidArgument, "placement.slots[0].rank");
  doc = base;
  doc["process_group"]["peers"] = Json::parse("[0,1,1,3]");
  ExpectError(doc, absl::StatusCode::kInvalidArgument, "process_group.peers");
  doc = base;
  doc["routes"][0]["replica"] = "e0-r1";
  ExpectError(doc, absl::StatusCode::kFailedPrecondition, "routes[0].replica");
  doc = base;
  doc["routes"][0]["physical_slot"] = "q2";  // q2 stores expert 1, r00 wants expert 0
  ExpectError(doc, absl::StatusCode::kFailedPrecondition, "another logical expert");
  EXPECT_EQ(json::Parse("{\"d\": 3,", "trace").status().code(), absl::StatusCode::kInvalidArgument);
}

// Operator and network JSON (bundles, traces): a number out of range is malformed input, not an
// exception; nesting past kMaxNesting is refused before anything recursive touches it.
TEST(TraceTest, HostileJsonIsInvalidArgumentNamingTheInput) {
  const auto number = json::Parse("{\"a\": 1e999}", "bundle_json");
  EXPECT_EQ(number.status().code(), absl::StatusCode::kInvalidArgument) << number.status();
  EXPECT_NE(number.status().message().find("bundle_json"), std::string::npos) << number.status();
  const std::string deep = "{\"x\":" + std::string(1000000, '[') + std::string(1000000, ']') + "}";
  const auto nested = json::Parse(deep, "bundle_json");
  EXPECT_EQ(nested.status().code(), absl::StatusCode::kInvalidArgument) << nested.status();
  EXPECT_NE(nested.status().message().find("nested deeper than"), std::string::npos) << nested.status();
  // At the limit it parses; brackets inside strings do not count.
  const std::string at_limit = std::string(json::kMaxNesting, '[') + std::string(json::kMaxNesting, ']');
  EXPECT_TRUE(json::Parse(at_limit, "t").ok());
  EXPECT_TRUE(json::Parse("{\"s\": \"" + std::string(200, '[') + "\\\"\"}", "t").ok());
}

TEST(TraceTest, RouteToExpertNoSlotHoldsIsRejected) {
  Json doc = Load("trace-eight-routes.json");
  doc["placement"]["slots"].erase(5);  // drop q5, the only copy of expert 3
  for (Json& r : doc["routes"]) r.erase("physical_slot");
  ExpectError(doc, absl::StatusCode::kFailedPrecondition, "logical expert 3");
}

TEST(TraceTest, SlotOutsideTheProcessGroupIsRejected) {
  Json doc = Load("trace-eight-routes.json");
  doc["process_group"]["peers"] = Json::parse("[0,1,2]");  // rank 3 (q5) outside the group
  ExpectError(doc, absl::StatusCode::kFailedPrecondition, "outside the process group");
}

TEST(EplbIoTest, RoundTripsTheFixture) {
  auto problem = ParseEplbProblem(Load("eplb-fixture.json"));
  ASSERT_TRUE(problem.ok());
  Json out = EplbSolutionJson(*RebalanceExperts(*problem));
  EXPECT_EQ(out["phy2log"], Json::parse("[[1,0,0,0,2,2,3,3]]"));
  EXPECT_EQ(out["log2phy"], Json::parse("[[[2,3,1],[0,-1,-1],[4,5,-1],[6,7,-1]]]"));
  EXPECT_EQ(out["logcnt"], Json::parse("[[3,1,2,2]]"));
  Json bad = Load("eplb-fixture.json");
  bad["weight"] = Json::parse("[[4,2,1,1],[1,1]]");
  EXPECT_THAT(std::string(ParseEplbProblem(bad).status().message()), HasSubstr("weight[1]"));
  bad = Load("eplb-fixture.json");
  bad.erase("num_gpus");
  EXPECT_THAT(std::string(ParseEplbProblem(bad).status().message()), HasSubstr("num_gpus"));
  bad = Load("eplb-fixture.json");
  bad["weight"][0][1] = 1e300;  // no float holds it
  EXPECT_THAT(std::string(ParseEplbProblem(bad).status().message()), HasSubstr("weight[0][1]"));
  // A few hundred bytes must not ask for gigabytes of solution: 100 layers x 2^24 replicas.
  bad = Load("eplb-fixture.json");
  bad["weight"] = Json::array();
  for (int l = 0; l < 100; ++l) bad["weight"].push_back(Json::parse("[1]"));
  bad["num_replicas"] = 1 << 24;
  bad["num_groups"] = 1;
  bad["num_nodes"] = 1;
  bad["num_gpus"] = 1;
  const absl::Status big = ParseEplbProblem(bad).status();
  EXPECT_EQ(big.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(big.message()), HasSubstr("num_replicas: 16777216 replicas of 1 experts over 100 layers"));
}

}  // namespace
}  // namespace moe
