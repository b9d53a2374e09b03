#include "runtime/semantic.h"

#include <cmath>
#include <type_traits>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

#include "runtime/ids.h"
#include "tests/runtime/fixtures.h"

namespace moe {
namespace {

// Identity namespaces do not convert into each other (0x01A0).
static_assert(!std::is_convertible_v<Rank, PeerSlot>);
static_assert(!std::is_convertible_v<LogicalExpertId, PhysicalSlotId>);
static_assert(!std::is_convertible_v<int, Rank>);
static_assert(!std::is_convertible_v<PlacementVersion, ProcessGroupEpoch>);
static_assert(!std::is_convertible_v<CheckpointVersion, ProcessGroupId>);

TEST(SemanticTest, DigestIsCanonicalAndSensitiveToEveryField) {
  const SemanticHandoff base = fixture::EightRoutes();
  const Sha256 d0 = SemanticDigest(base);
  EXPECT_EQ(d0, SemanticDigest(fixture::EightRoutes()));
  EXPECT_EQ(HexDigest(d0).size(), 64u);
  auto mutated = [&](auto f) {
    SemanticHandoff h = fixture::EightRoutes();
    f(h);
    return SemanticDigest(h);
  };
  EXPECT_NE(d0, mutated([](SemanticHandoff& h) { h.expert[0] = LogicalExpertId(1); }));
  EXPECT_NE(d0, mutated([](SemanticHandoff& h) { h.gate[0] = std::nextafter(h.gate[0], 1.0f); }));
  EXPECT_NE(d0, mutated([](SemanticHandoff& h) { h.token[2] = 0; }));
  EXPECT_NE(d0, mutated([](SemanticHandoff& h) { h.route_slot[0] = 1; }));
  EXPECT_NE(d0, mutated([](SemanticHandoff& h) { h.origin[7] = Rank(0); }));
  EXPECT_NE(d0, mutated([](SemanticHandoff& h) { h.admitted[3] = 0; }));
  EXPECT_NE(d0, mutated([](SemanticHandoff& h) { h.scope = ExecutionScopeId(2); }));
  EXPECT_NE(d0, mutated([](SemanticHandoff& h) { h.top_k = 3; }));
}

TEST(SemanticTest, FrozenHandoffDetectsMutation) {
  FrozenHandoff f = *Freeze(fixture::EightRoutes());
  EXPECT_TRUE(VerifyFrozen(f).ok());
  f.routes.expert[4] = LogicalExpertId(2);
  EXPECT_EQ(VerifyFrozen(f).code(), absl::StatusCode::kFailedPrecondition);
  FrozenHandoff g = *Freeze(fixture::EightRoutes());
  g.routes.gate[1] = 0.36f;
  EXPECT_EQ(VerifyFrozen(g).code(), absl::StatusCode::kFailedPrecondition);
}

// The digest of a frozen handoff is the canonical SHA-256 of what was sealed, computed on first
// use; once the routes are mutated it is refused rather than computed over the mutation.
TEST(SemanticTest, FrozenDigestIsTheSealedRoutesSha256) {
  FrozenHandoff f = *Freeze(fixture::EightRoutes());
  absl::StatusOr<Sha256> d = f.Digest();
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(*d, SemanticDigest(fixture::EightRoutes()));
  FrozenHandoff g = *Freeze(fixture::EightRoutes());
  g.routes.gate[2] = 0.5f;
  absl::StatusOr<Sha256> mutated = g.Digest();
  EXPECT_EQ(mutated.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(std::string(mutated.status().message()).find("mutated after freeze"), std::string::npos);
}

// VerifyFrozen compares the fingerprint, not the digest: every field, and any one value of a
// large handoff (each lane of the fingerprint and the tail of each column), is covered.
TEST(SemanticTest, FingerprintCatchesEveryMutation) {
  const SemanticHandoff base = fixture::EightRoutes();
  const uint64_t f0 = SemanticFingerprint(base);
  auto mutated = [&](auto f) {
    SemanticHandoff h = base;
    f(h);
    return SemanticFingerprint(h);
  };
  EXPECT_NE(f0, mutated([](SemanticHandoff& h) { h.expert[0] = LogicalExpertId(1); }));
  EXPECT_NE(f0, mutated([](SemanticHandoff& h) { h.gate[7] = std::nextafter(h.gate[7], 1.0f); }));
  EXPECT_NE(f0, mutated([](SemanticHandoff& h) { h.token[2] = 0; }));
  EXPECT_NE(f0, mutated([](SemanticHandoff& h) { h.route_slot[0] = 1; }));
  EXPECT_NE(f0, mutated([](SemanticHandoff& h) { h.origin[7] = Rank(0); }));
  EXPECT_NE(f0, mutated([](SemanticHandoff& h) { h.admitted[3] = 0; }));
  EXPECT_NE(f0, mutated([](SemanticHandoff& h) { h.scope = ExecutionScopeId(2); }));
  EXPECT_NE(f0, mutated([](SemanticHandoff& h) { h.top_k = 3; }));
  EXPECT_NE(f0, mutated([](SemanticHandoff& h) { h.num_experts = 9; }));
  EXPECT_NE(f0, mutated([](SemanticHandoff& h) { h.num_partitions = 3; }));
  EXPECT_NE(f0, mutated([](SemanticHandoff& h) { h.contract_version += "x"; }));
  // Moving a value from one column's end to the next column's start changes it too (lengths).
  EXPECT_NE(f0, mutated([](SemanticHandoff& h) { h.admitted.pop_back(); }));

  SemanticHandoff big;
  big.num_experts = 128;
  big.top_k = 8;
  big.num_partitions = 1;
  for (int t = 0; t < 1001; ++t) {
    for (int j = 0; j < 8; ++j) big.Add(Rank(0), t, j, LogicalExpertId((t * 8 + j) % 128), 0.125f);
  }
  FrozenHandoff frozen = *Freeze(big);
  for (int i : {0, 1, 2, 3, 4, 5, 6, 7, 4000, 8000, 8005, 8006, 8007}) {
    FrozenHandoff m = frozen;
    m.routes.gate[i] = 0.25f;
    EXPECT_EQ(VerifyFrozen(m).code(), absl::StatusCode::kFailedPrecondition) << i;
    FrozenHandoff a = frozen;
    a.routes.admitted[i] = 0;
    EXPECT_EQ(VerifyFrozen(a).code(), absl::StatusCode::kFailedPrecondition) << i;
  }
  EXPECT_TRUE(VerifyFrozen(frozen).ok());
}

TEST(SemanticTest, ValidationNamesTheField) {
  auto expect_invalid = [](auto f, const char* field) {
    SemanticHandoff h = fixture::EightRoutes();
    f(h);
    auto frozen = Freeze(h);
    ASSERT_EQ(frozen.status().code(), absl::StatusCode::kInvalidArgument) << field;
    EXPECT_THAT(std::string(frozen.status().message()), ::testing::HasSubstr(field));
  };
  expect_invalid([](SemanticHandoff& h) { h.gate[2] = std::nanf(""); }, "gate");
  expect_invalid([](SemanticHandoff& h) { h.gate[2] = -0.1f; }, "gate");
  expect_invalid([](SemanticHandoff& h) { h.route_slot[0] = 2; }, "route_slot");
  expect_invalid([](SemanticHandoff& h) { h.expert[0] = LogicalExpertId(4); }, "logical_expert");
  expect_invalid([](SemanticHandoff& h) { h.origin[0] = Rank(4); }, "source_rank");
  expect_invalid([](SemanticHandoff& h) { h.route_slot[1] = 0; }, "duplicate");
  expect_invalid([](SemanticHandoff& h) { h.gate.pop_back(); }, "column lengths");
}

}  // namespace
}  // namespace moe
