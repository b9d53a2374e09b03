// The typed checkpoint view (runtime/checkpoint/expert_checkpoint.h) over what synthetic.h writes.
#include "runtime/checkpoint/expert_checkpoint.h"

#include "gtest/gtest.h"

#include "runtime/checkpoint/synthetic.h"

namespace moe {
namespace {

TEST(ExpertCheckpointTest, ReadsWhatTheSyntheticCheckpointWrites) {
  const SafetensorsFile file = SyntheticCheckpoint({3, 16, 24}, 7, "checkpoint-7");
  auto view = ExpertCheckpoint::Open(file);
  ASSERT_TRUE(view.ok()) << view.status();
  EXPECT_EQ(view->version(), "checkpoint-7");
  EXPECT_EQ(view->num_experts(), 3);
  EXPECT_EQ(view->d(), 16);
  EXPECT_EQ(view->d_ff(), 24);
  for (int e = 0; e < 3; ++e) {
    auto t = view->Expert(e);
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_EQ(t->gate_up->shape, (std::vector<int64_t>{48, 16}));
    EXPECT_EQ(t->down->shape, (std::vector<int64_t>{16, 24}));
    std::vector<uint16_t> gu, dn;
    SyntheticExpert(e, view->shape(), 7, &gu, &dn);
    auto digest = view->Digest(e);
    ASSERT_TRUE(digest.ok());
    EXPECT_EQ(*digest, ExpertDigest(gu, dn));
  }
  EXPECT_EQ(checkpoint_keys::GateUp(2), "experts.2.w_gate_up");
  EXPECT_EQ(checkpoint_keys::Down(2), "experts.2.w_down");
  EXPECT_EQ(checkpoint_keys::Digest(2), "digest.2");
}

TEST(ExpertCheckpointTest, MissingOrBadMetadataNamesTheKey) {
  for (const char* key :
       {checkpoint_keys::kVersion, checkpoint_keys::kNumExperts, checkpoint_keys::kD, checkpoint_keys::kDff}) {
    SafetensorsFile file = SyntheticCheckpoint({2, 8, 8}, 1, "c");
    file.metadata.erase(key);
    auto view = ExpertCheckpoint::Open(file);
    ASSERT_FALSE(view.ok()) << key;
    EXPECT_EQ(view.status().code(), absl::StatusCode::kDataLoss);
    EXPECT_NE(view.status().message().find(std::string("'") + key + "'"), std::string::npos) << view.status();
  }
  SafetensorsFile file = SyntheticCheckpoint({2, 8, 8}, 1, "c");
  file.metadata[checkpoint_keys::kD] = "-8";
  EXPECT_EQ(ExpertCheckpoint::Open(file).status().code(), absl::StatusCode::kDataLoss);
  // Sizes the tensors cannot hold (a loader would size its buffers from them).
  for (const char* big : {"2147483647", "4096"}) {
    file.metadata[checkpoint_keys::kD] = big;
    file.metadata[checkpoint_keys::kDff] = big;
    const absl::Status s = ExpertCheckpoint::Open(file).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << big;
    EXPECT_NE(s.message().find("larger than the file"), std::string::npos) << s;
  }
  // An expert count the file's tensors cannot hold (the identity would size a table by it).
  file = SyntheticCheckpoint({2, 8, 8}, 1, "c");
  file.metadata[checkpoint_keys::kNumExperts] = "2147483647";
  const absl::Status many = ExpertCheckpoint::Open(file).status();
  EXPECT_EQ(many.code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(many.message().find("2147483647 experts, the file holds 4 tensors"), std::string::npos) << many;
}

TEST(ExpertCheckpointTest, AbsentOrMisshapenExpertNamesIt) {
  SafetensorsFile file = SyntheticCheckpoint({2, 8, 8}, 1, "c");
  file.tensors.erase(checkpoint_keys::Down(1));
  file.tensors[checkpoint_keys::GateUp(0)].data.resize(10);
  file.metadata.erase(checkpoint_keys::Digest(1));
  auto view = ExpertCheckpoint::Open(file);
  ASSERT_TRUE(view.ok());
  EXPECT_NE(view->Expert(1).status().message().find("no tensors for expert 1"), std::string::npos);
  EXPECT_NE(view->Expert(0).status().message().find("expert 0 tensors have the wrong shape"), std::string::npos);
  EXPECT_EQ(view->Expert(5).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(view->Digest(1).status().message().find("no digest for expert 1"), std::string::npos);
  // The right byte count under another dtype or shape is refused, not read as BF16.
  SafetensorsFile other = SyntheticCheckpoint({2, 8, 8}, 1, "c");
  other.tensors[checkpoint_keys::GateUp(1)].dtype = "F32";
  other.tensors[checkpoint_keys::GateUp(1)].shape = {8, 8};  // 4 x 64 bytes, as BF16 [16, 8]
  other.tensors[checkpoint_keys::Down(0)].shape = {64};
  auto typed = ExpertCheckpoint::Open(other);
  ASSERT_TRUE(typed.ok()) << typed.status();
  EXPECT_NE(typed->Expert(1).status().message().find("experts.1.w_gate_up: F32 [8, 8], expected BF16 [16, 8]"),
            std::string::npos)
      << typed->Expert(1).status();
  EXPECT_NE(typed->Expert(0).status().message().find("experts.0.w_down: BF16 [64], expected BF16 [8, 8]"),
            std::string::npos)
      << typed->Expert(0).status();
}

}  // namespace
}  // namespace moe
