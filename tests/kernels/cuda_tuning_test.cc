// CudaTuning's text form (kernels/api.h): what moe-rankd's --cuda_tuning and the benchmarks'
// MOE_CUDA_TUNING take.
#include "gtest/gtest.h"

#include "kernels/api.h"

namespace moe::kernels {
namespace {

TEST(CudaTuningTest, EmptyIsTheTunedDefaults) {
  auto t = ParseCudaTuning("");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->gemm, CudaTuning::Gemm::kAuto);
  EXPECT_EQ(t->chain_streams, 0);
  EXPECT_TRUE(t->fused_layer);
  EXPECT_TRUE(t->pdl);
  EXPECT_EQ(t->mma_wide, -1);
  EXPECT_EQ(t->down_preload, -1);
  EXPECT_EQ(t->capture_branches, 2);
  EXPECT_FALSE(t->blocking_sync);
  EXPECT_TRUE(t->fp8_epilogue_quant);
}

TEST(CudaTuningTest, EveryKey) {
  auto t = ParseCudaTuning(
      "gemm=loop, chain_streams=2,fused_layer=0,pdl=0,mma_wide=1,sm90_tile=rows64,blocking_sync=1,"
      "capture_branches=1,fp8_epilogue_quant=0,down_preload=1");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->gemm, CudaTuning::Gemm::kLoop);
  EXPECT_EQ(t->chain_streams, 2);
  EXPECT_FALSE(t->fused_layer);
  EXPECT_FALSE(t->pdl);
  EXPECT_EQ(t->mma_wide, 1);
  EXPECT_EQ(t->sm90_tile, CudaTuning::Sm90Tile::kRows64);
  EXPECT_TRUE(t->blocking_sync);
  EXPECT_EQ(t->capture_branches, 1);
  EXPECT_FALSE(t->fp8_epilogue_quant);
  EXPECT_EQ(t->down_preload, 1);
  EXPECT_EQ(ParseCudaTuning("down_preload=0")->down_preload, 0);
  EXPECT_EQ(ParseCudaTuning("capture_branches=0")->capture_branches, 0);
  EXPECT_EQ(ParseCudaTuning("gemm=grouped")->gemm, CudaTuning::Gemm::kGrouped);
  EXPECT_EQ(ParseCudaTuning("gemm=sm90")->gemm, CudaTuning::Gemm::kSm90);
  EXPECT_EQ(ParseCudaTuning("gemm=cublas")->gemm, CudaTuning::Gemm::kCublas);
  EXPECT_EQ(ParseCudaTuning("sm90_tile=rows128")->sm90_tile, CudaTuning::Sm90Tile::kRows128);
  EXPECT_EQ(ParseCudaTuning("sm90_tile=pingpong")->sm90_tile, CudaTuning::Sm90Tile::kPingPong);
  EXPECT_EQ(ParseCudaTuning("sm90_tile=pingpong_wide")->sm90_tile, CudaTuning::Sm90Tile::kPingPongWide);
  EXPECT_EQ(ParseCudaTuning("sm90_tile=rows128_epi")->sm90_tile, CudaTuning::Sm90Tile::kRows128Epi);
  EXPECT_EQ(ParseCudaTuning("sm90_tile=wide_epi")->sm90_tile, CudaTuning::Sm90Tile::kWideEpiDown);
  EXPECT_EQ(ParseCudaTuning("")->sm90_tile, CudaTuning::Sm90Tile::kAuto);
}

TEST(CudaTuningTest, BadInputNamesTheKey) {
  for (const char* bad :
       {"pdl=2", "gemm=fast", "chain_streams=5", "sm90_tile=96", "sm90_tile=", "mma_wide=-2", "fused_layer=", "speed=1",
        "pdl", "blocking_sync=2", "capture_branches=5", "capture_branches=-1", "fp8_epilogue_quant=2",
        "fp8_epilogue_quant=", "down_preload=2", "down_preload=-2"}) {
    auto t = ParseCudaTuning(bad);
    ASSERT_FALSE(t.ok()) << bad;
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    const std::string key = std::string(bad).substr(0, std::string(bad).find('='));
    EXPECT_NE(t.status().message().find(key), std::string::npos) << t.status();
  }
  // A choice key's message lists every choice.
  EXPECT_EQ(ParseCudaTuning("gemm=fast").status().message(),
            "cuda tuning: gemm=fast: want auto, sm90, cublas, loop or grouped");
  EXPECT_EQ(ParseCudaTuning("sm90_tile=96").status().message(),
            "cuda tuning: sm90_tile=96: want auto, rows64, rows128, pingpong, pingpong_wide, rows128_epi or wide_epi");
}

TEST(CudaTuningTest, SetAndGetAreProcessWide) {
  CudaTuning t;
  t.pdl = false;
  t.chain_streams = 3;
  SetCudaTuning(t);
  EXPECT_FALSE(GetCudaTuning().pdl);
  EXPECT_EQ(GetCudaTuning().chain_streams, 3);
  SetCudaTuning(CudaTuning{});
  EXPECT_TRUE(GetCudaTuning().pdl);
}

}  // namespace
}  // namespace moe::kernels
