// Hugging Face model directories (runtime/checkpoint/hf_checkpoint.h): every naming scheme,
// dtype and sharding the loader reads gives back the experts it was written from; FP8 block
// scales dequantize as an independent decoder says; bad files and configs are named.
#include "runtime/checkpoint/hf_checkpoint.h"

#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <sys/stat.h>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

#include "kernels/api.h"
#include "kernels/numeric.h"
#include "runtime/checkpoint/hf_writer.h"
#include "runtime/checkpoint/mapped_safetensors.h"
#include "runtime/checkpoint/safetensors.h"

namespace moe {
namespace {

// A fresh directory path under the test's temporary directory (whatever was there removed).
std::string TempDir(const std::string& name) {
  const std::string dir = absl::StrCat(std::getenv("TEST_TMPDIR"), "/", name);
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  EXPECT_FALSE(ec) << "removing " << dir << ": " << ec.message();
  return dir;
}

struct Expert {
  std::vector<uint16_t> gu, dn;
};

Expert Read(const HfCheckpoint& c, int layer, int expert) {
  const ExpertShape s = c.shape();
  Expert x;
  x.gu.resize(2 * static_cast<size_t>(s.d_ff) * s.d);
  x.dn.resize(static_cast<size_t>(s.d) * s.d_ff);
  const absl::Status st = c.ReadExpert(layer, expert, x.gu.data(), x.dn.data());
  EXPECT_TRUE(st.ok()) << st;
  return x;
}

struct Case {
  const char* name;
  HfFamily family;
  ExpertNaming naming;
  const char* dtype;
  int64_t max_shard_bytes;
  std::vector<int> want_layers;
};

class HfRoundTrip : public ::testing::TestWithParam<Case> {};

TEST_P(HfRoundTrip, EveryExpertOfEveryMoeLayerReadsBackAsWritten) {
  const Case& k = GetParam();
  HfModelSpec spec;
  spec.family = k.family;
  spec.naming = k.naming;
  spec.dtype = k.dtype;
  spec.hidden_size = 48;
  spec.moe_intermediate_size = 40;
  spec.num_experts = 5;
  spec.num_hidden_layers = 4;
  spec.first_k_dense_replace = 1;
  spec.mlp_only_layers = {2};
  spec.max_shard_bytes = k.max_shard_bytes;
  spec.version = "ckpt-rt";
  const ExpertSource source = SyntheticExpertSource(spec.hidden_size, spec.moe_intermediate_size, 11);
  const std::string dir = TempDir(k.name);
  ASSERT_TRUE(WriteHfModel(dir, spec, source).ok());
  auto c = HfCheckpoint::Open(dir);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ((*c)->config().moe_layers, k.want_layers);
  EXPECT_EQ((*c)->naming(), k.naming);
  EXPECT_EQ((*c)->version(), "ckpt-rt");
  EXPECT_EQ((*c)->weight_dtype(), k.dtype);
  if (k.max_shard_bytes > 0) {
    EXPECT_GT((*c)->num_shards(), 1);
  }
  for (int l : k.want_layers) {
    for (int e = 0; e < spec.num_experts; ++e) {
      Expert want;
      source(l, e, &want.gu, &want.dn);
      const Expert got = Read(**c, l, e);
      if (std::string(k.dtype) == "F16") {
        // F16 keeps every BF16 mantissa bit down to its subnormals (step 2^-24).
        for (size_t i = 0; i < want.gu.size(); ++i) {
          ASSERT_LE(std::fabs(kernels::Bf16ToFloat(got.gu[i]) - kernels::Bf16ToFloat(want.gu[i])),
                    std::ldexp(1.0f, -24));
        }
        for (size_t i = 0; i < want.dn.size(); ++i) {
          ASSERT_LE(std::fabs(kernels::Bf16ToFloat(got.dn[i]) - kernels::Bf16ToFloat(want.dn[i])),
                    std::ldexp(1.0f, -24));
        }
      } else {  // BF16 and F32 files round-trip BF16 exactly
        EXPECT_EQ(got.gu, want.gu) << "layer " << l << " expert " << e;
        EXPECT_EQ(got.dn, want.dn) << "layer " << l << " expert " << e;
      }
      EXPECT_EQ((*c)->RecordedDigest(l, e), ExpertDigest(got.gu.data(), got.gu.size(), got.dn.data(), got.dn.size()));
    }
  }
  // Layers whose MLP is dense are the engine's.
  std::vector<uint16_t> gu(2 * 40 * 48), dn(48 * 40);
  for (int l = 0; l < spec.num_hidden_layers; ++l) {
    if (!(*c)->IsMoeLayer(l)) {
      EXPECT_EQ((*c)->ReadExpert(l, 0, gu.data(), dn.data()).code(), absl::StatusCode::kInvalidArgument);
    }
  }
  EXPECT_EQ((*c)->ReadExpert(k.want_layers[0], 5, gu.data(), dn.data()).code(), absl::StatusCode::kInvalidArgument);
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, HfRoundTrip,
    ::testing::Values(
        Case{"mixtral", HfFamily::kMixtral, ExpertNaming::kMixtral, "BF16", 0, {0, 1, 2, 3}},
        Case{"mixtral_fused", HfFamily::kMixtral, ExpertNaming::kFused, "BF16", 0, {0, 1, 2, 3}},
        Case{"qwen2_moe_f32", HfFamily::kQwen2Moe, ExpertNaming::kProjections, "F32", 0, {0, 1, 3}},
        Case{"qwen3_moe_sharded", HfFamily::kQwen3Moe, ExpertNaming::kProjections, "BF16", 20000, {0, 1, 3}},
        Case{"qwen3_moe_fused_f16", HfFamily::kQwen3Moe, ExpertNaming::kFused, "F16", 0, {0, 1, 3}},
        Case{"deepseek_v2", HfFamily::kDeepseekV2, ExpertNaming::kProjections, "BF16", 30000, {1, 2, 3}},
        Case{"deepseek_v3", HfFamily::kDeepseekV3, ExpertNaming::kProjections, "BF16", 0, {1, 2, 3}}),
    [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

// E4M3 decoded from its bit fields, independently of kernels::Fp8E4M3ToFloat.
float DecodeE4M3(uint8_t v) {
  const int sign = v >> 7, exp = (v >> 3) & 15, man = v & 7;
  if (exp == 15 && man == 7) return NAN;
  const float mag = exp == 0 ? std::ldexp(man / 8.0f, -6) : std::ldexp(1.0f + man / 8.0f, exp - 7);
  return sign ? -mag : mag;
}

TEST(HfCheckpointTest, Fp8BlockScaledWeightsDequantizeAsTheReferenceSays) {
  HfModelSpec spec;
  spec.family = HfFamily::kDeepseekV3;
  spec.dtype = "F8_E4M3";
  spec.fp8_block = 16;  // several blocks per matrix, ragged at the edges (40 = 16 + 16 + 8)
  spec.hidden_size = 48;
  spec.moe_intermediate_size = 40;
  spec.num_experts = 3;
  spec.num_hidden_layers = 2;
  spec.first_k_dense_replace = 1;
  const ExpertSource source = SyntheticExpertSource(spec.hidden_size, spec.moe_intermediate_size, 5);
  const std::string dir = TempDir("fp8");
  ASSERT_TRUE(WriteHfModel(dir, spec, source).ok());
  auto c = HfCheckpoint::Open(dir);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ((*c)->config().fp8_block_rows, 16);
  EXPECT_EQ((*c)->weight_dtype(), "F8_E4M3");
  auto file = MappedSafetensors::Open(dir + "/model.safetensors");
  ASSERT_TRUE(file.ok());
  const Expert got = Read(**c, 1, 2);
  Expert orig;
  source(1, 2, &orig.gu, &orig.dn);
  // gate is rows [0, f) of gate_up: the reference dequantization of the stored bytes.
  const TensorRef* w = (*file)->Find("model.layers.1.mlp.experts.2.gate_proj.weight");
  const TensorRef* s = (*file)->Find("model.layers.1.mlp.experts.2.gate_proj.weight_scale_inv");
  ASSERT_NE(w, nullptr);
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->shape, (std::vector<int64_t>{3, 3}));
  kernels::RelativeL2Error vs_orig;
  for (int r = 0; r < 40; ++r) {
    for (int col = 0; col < 48; ++col) {
      float scale;
      std::memcpy(&scale, s->data + 4 * ((r / 16) * 3 + col / 16), 4);
      const float want = DecodeE4M3(w->data[r * 48 + col]) * scale;
      ASSERT_EQ(got.gu[r * 48 + col], kernels::FloatToBf16(want)) << r << "," << col;
      vs_orig.Add(kernels::Bf16ToFloat(got.gu[r * 48 + col]), kernels::Bf16ToFloat(orig.gu[r * 48 + col]));
    }
  }
  EXPECT_LT(vs_orig.Value(), 0.05);  // E4M3 keeps 3 mantissa bits
  EXPECT_GT(vs_orig.Value(), 0.0);   // and it did quantize
  // A missing scale is named.
  SafetensorsFile raw = *ReadSafetensors(dir + "/model.safetensors");
  raw.tensors.erase("model.layers.1.mlp.experts.0.down_proj.weight_scale_inv");
  ASSERT_TRUE(WriteSafetensors(dir + "/model.safetensors", raw).ok());
  auto c2 = HfCheckpoint::Open(dir);
  ASSERT_TRUE(c2.ok());
  std::vector<uint16_t> gu(2 * 40 * 48), dn(48 * 40);
  const absl::Status st = (*c2)->ReadExpert(1, 0, gu.data(), dn.data());
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(st.message().find("down_proj.weight_scale_inv"), std::string::npos) << st;
}

// What an FP8 checkpoint's weights become under --expert_dtype fp8: the loader dequantizes them
// to BF16 (q x scale, rounded), and the executor requantizes those in 128 x 128 blocks. With the
// checkpoint's scales at amax / 448 (DeepSeek-V3's), every requantized byte is the stored one
// (a BF16 rounding moves a value by at most 2^-9, well inside E4M3's 2^-4 spacing) and every
// scale is within 2^-8 of the stored one.
TEST(HfCheckpointTest, Fp8CheckpointRequantizesToItsOwnBytes) {
  HfModelSpec spec;
  spec.family = HfFamily::kDeepseekV3;
  spec.dtype = "F8_E4M3";
  spec.fp8_block = 128;
  spec.hidden_size = 256;
  spec.moe_intermediate_size = 128;
  spec.num_experts = 2;
  spec.num_hidden_layers = 2;
  spec.first_k_dense_replace = 1;
  const std::string dir = TempDir("fp8-requant");
  ASSERT_TRUE(WriteHfModel(dir, spec, SyntheticExpertSource(spec.hidden_size, spec.moe_intermediate_size, 9)).ok());
  auto c = HfCheckpoint::Open(dir);
  ASSERT_TRUE(c.ok()) << c.status();
  auto file = MappedSafetensors::Open(dir + "/model.safetensors");
  ASSERT_TRUE(file.ok());
  auto cpu = kernels::CreateCpuKernels();
  const int d = 256, f = 128;
  for (int e = 0; e < 2; ++e) {
    const Expert got = Read(**c, 1, e);
    std::vector<uint8_t> q(got.gu.size());
    std::vector<float> scales(2 * 2);  // [2 f / 128, d / 128]
    ASSERT_TRUE(
        cpu->Quantize({got.gu.data(), 2 * f, d, kernels::ScaleGranularity::kBlock128x128, q.data(), scales.data(), 4},
                      nullptr)
            .ok());
    for (int half = 0; half < 2; ++half) {  // gate_proj: rows [0, f) of gate_up; up_proj: [f, 2 f)
      const std::string name = absl::StrCat("model.layers.1.mlp.experts.", e, half == 0 ? ".gate_proj" : ".up_proj");
      const TensorRef* w = (*file)->Find(name + ".weight");
      const TensorRef* s = (*file)->Find(name + ".weight_scale_inv");
      ASSERT_NE(w, nullptr);
      ASSERT_NE(s, nullptr);
      for (int i = 0; i < f * d; ++i) ASSERT_EQ(q[half * f * d + i], w->data[i]) << name << " byte " << i;
      for (int b = 0; b < 2; ++b) {
        float stored;
        std::memcpy(&stored, s->data + 4 * b, 4);
        EXPECT_NEAR(scales[half * 2 + b], stored, stored * std::ldexp(1.0f, -8)) << name << " block " << b;
      }
    }
  }
}

TEST(HfConfigTest, MoeLayersPerFamily) {
  auto ds = ParseHfMoeConfig(R"({"model_type":"deepseek_v3","hidden_size":7168,"num_hidden_layers":61,
      "num_experts_per_tok":8,"n_routed_experts":256,"moe_intermediate_size":2048,"first_k_dense_replace":3,
      "moe_layer_freq":1,"quantization_config":{"quant_method":"fp8","fmt":"e4m3","weight_block_size":[128,128]}})");
  ASSERT_TRUE(ds.ok()) << ds.status();
  EXPECT_EQ(ds->moe_layers.size(), 58u);  // the spec's EPLB fixture: 58 MoE layers
  EXPECT_EQ(ds->moe_layers.front(), 3);
  EXPECT_EQ(ds->fp8_block_rows, 128);
  auto qwen = ParseHfMoeConfig(R"({"model_type":"qwen3_moe","hidden_size":2048,"num_hidden_layers":48,
      "num_experts_per_tok":8,"num_local_experts":128,"moe_intermediate_size":768,"decoder_sparse_step":2,
      "mlp_only_layers":[3]})");
  ASSERT_TRUE(qwen.ok()) << qwen.status();
  EXPECT_EQ(qwen->num_experts, 128);
  EXPECT_EQ(qwen->moe_layers.size(), 23u);  // odd layers but 3
  EXPECT_EQ(qwen->moe_layers[0], 1);
  EXPECT_EQ(qwen->moe_layers[1], 5);
}

TEST(HfConfigTest, BadConfigsNameTheKey) {
  const std::pair<const char*, const char*> cases[] = {
      {"not json", "not JSON"},
      {R"({"model_type":"llama"})", "model_type"},
      {R"({"model_type":"mixtral","hidden_size":64,"num_hidden_layers":2,"num_experts_per_tok":2})",
       "num_local_experts"},
      {R"({"model_type":"mixtral","hidden_size":-4,"num_hidden_layers":2})", "hidden_size"},
      {R"({"model_type":"mixtral","hidden_size":64,"num_hidden_layers":2,"num_experts_per_tok":9,"num_local_experts":8,
          "intermediate_size":8})",
       "num_experts_per_tok"},
      {R"({"model_type":"qwen3_moe","hidden_size":64,"num_hidden_layers":2,"num_experts_per_tok":2,"num_experts":8,
          "moe_intermediate_size":8,"mlp_only_layers":[7]})",
       "mlp_only_layers"},
      {R"({"model_type":"deepseek_v3","hidden_size":64,"num_hidden_layers":2,"num_experts_per_tok":2,
          "n_routed_experts":8,"moe_intermediate_size":8,"first_k_dense_replace":2})",
       "no MoE layer"},
      {R"({"model_type":"deepseek_v3","hidden_size":64,"num_hidden_layers":2,"num_experts_per_tok":2,
          "n_routed_experts":8,"moe_intermediate_size":8,"quantization_config":{"quant_method":"awq"}})",
       "quant_method"},
      {R"({"model_type":"qwen3_moe","hidden_size":64,"num_hidden_layers":1000000,"num_experts_per_tok":2,
          "num_experts":8,"moe_intermediate_size":8})",
       "num_hidden_layers"},
      {R"({"model_type":"deepseek_v3","hidden_size":64,"num_hidden_layers":2,"num_experts_per_tok":2,
          "n_routed_experts":8,"moe_intermediate_size":8,"quantization_config":{"quant_method":1}})",
       "quant_method' must be a string"},
      {R"({"model_type":"mixtral","hidden_size":1,"num_hidden_layers":2,"num_experts_per_tok":2,
          "num_local_experts":1073741824,"intermediate_size":1})",
       "1073741824 routed experts, at most 65536"},
  };
  for (const auto& [text, want] : cases) {
    auto c = ParseHfMoeConfig(text);
    ASSERT_FALSE(c.ok()) << text;
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(c.status().message().find(want), std::string::npos) << c.status() << " for " << text;
  }
}

void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

std::string Header(const std::string& json) {
  std::string h = json;
  std::string len(8, '\0');
  for (int i = 0; i < 8; ++i) len[i] = static_cast<char>((h.size() >> (8 * i)) & 0xff);
  return len + h;
}

TEST(MappedSafetensorsTest, HostileHeadersAreRefusedNamingTheTensor) {
  const std::string dir = TempDir("hostile");
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  ASSERT_FALSE(ec) << "creating " << dir << ": " << ec.message();
  const std::string path = dir + "/x.safetensors";
  const std::pair<std::string, std::string> cases[] = {
      {Header(
           R"({"a":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]},"b":{"dtype":"BF16","shape":[2],"data_offsets":[2,6]}})") +
           std::string(6, 'x'),
       "overlap"},
      {Header(R"({"a":{"dtype":"BF16","shape":[4611686018427387904,4],"data_offsets":[0,4]}})") + std::string(4, 'x'),
       "tensor a"},
      {Header(R"({"a":{"dtype":"BF16","shape":[-2,-2],"data_offsets":[0,8]}})") + std::string(8, 'x'), "tensor a"},
      {Header(R"({"a":{"dtype":"BF16","shape":[2],"data_offsets":[0,40]}})") + std::string(4, 'x'), "outside"},
      {Header(R"({"a":{"dtype":"Q4","shape":[2],"data_offsets":[0,2]}})") + std::string(2, 'x'), "dtype"},
      {std::string("\xff\xff\xff\xff\0\0\0\0", 8), "header length"},
      {Header("[0]"), "not a JSON object"},
      {Header("5"), "not a JSON object"},
      {Header(R"({"__metadata__":{"k":1}})"), "__metadata__"},
  };
  // Both readers (the mapped one and the whole-file copy) refuse each alike.
  for (const auto& [bytes, want] : cases) {
    WriteFile(path, bytes);
    auto f = MappedSafetensors::Open(path);
    ASSERT_FALSE(f.ok()) << want;
    EXPECT_EQ(f.status().code(), absl::StatusCode::kDataLoss);
    EXPECT_NE(f.status().message().find(want), std::string::npos) << f.status();
    auto whole = ReadSafetensors(path);
    ASSERT_FALSE(whole.ok()) << want;
    EXPECT_EQ(whole.status().code(), absl::StatusCode::kDataLoss);
    EXPECT_NE(whole.status().message().find(want), std::string::npos) << whole.status();
  }
  // An empty tensor inside another's extent overlaps nothing.
  WriteFile(
      path,
      Header(
          R"({"a":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]},"e":{"dtype":"BF16","shape":[0],"data_offsets":[2,2]}})") +
          std::string(4, 'x'));
  EXPECT_TRUE(MappedSafetensors::Open(path).ok());
  // No regular file (a path a release bundle may name): refused before a byte is read.
  for (const char* special : {"/dev/zero", "/dev/null"}) {
    EXPECT_EQ(MappedSafetensors::Open(special).status().code(), absl::StatusCode::kFailedPrecondition) << special;
    EXPECT_EQ(ReadSafetensors(special).status().code(), absl::StatusCode::kFailedPrecondition) << special;
  }
  const std::string fifo = dir + "/fifo.safetensors";
  ::unlink(fifo.c_str());
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const absl::Status fs = ReadSafetensors(fifo).status();  // no writer: nothing to wait for
  EXPECT_EQ(fs.code(), absl::StatusCode::kFailedPrecondition) << fs;
  EXPECT_NE(fs.message().find("not a regular file"), std::string::npos) << fs;
  ::unlink(fifo.c_str());
}

// A header longer than MappedSafetensors::kMaxHeaderBytes is refused before it is parsed (its
// JSON tree would cost many times its length); the file is sparse, so this writes almost nothing.
TEST(MappedSafetensorsTest, AnOversizedHeaderIsRefusedUnparsed) {
  const std::string dir = TempDir("oversized");
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/x.safetensors";
  const uint64_t len = MappedSafetensors::kMaxHeaderBytes + 1;
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((len >> (8 * i)) & 0xff);
  WriteFile(path, bytes + "[");
  ASSERT_EQ(::truncate(path.c_str(), static_cast<off_t>(len + 8)), 0);
  for (const absl::Status& s : {MappedSafetensors::Open(path).status(), ReadSafetensors(path).status()}) {
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
    EXPECT_NE(s.message().find("100 MiB"), std::string::npos) << s;
  }
}

// A served checkpoint's shard that shrinks on disk (truncated or rewritten in place) is refused
// with DATA_LOSS naming the file when an expert is read, instead of a SIGBUS from the mapping.
// The project's own writer replaces files by rename, so a checkpoint rewritten under an open
// reader leaves the reader's mapped copy intact.
TEST(HfCheckpointTest, AShardChangedOnDiskIsRefusedOrReadIntact) {
  for (ExpertNaming naming : {ExpertNaming::kMixtral, ExpertNaming::kFused}) {
    HfModelSpec spec;
    spec.family = HfFamily::kMixtral;
    spec.naming = naming;
    spec.hidden_size = 48;
    spec.moe_intermediate_size = 40;
    spec.num_experts = 3;
    spec.num_hidden_layers = 2;
    spec.version = "ckpt-disk";
    const ExpertSource source = SyntheticExpertSource(48, 40, 21);
    const std::string dir = TempDir(naming == ExpertNaming::kFused ? "changed_fused" : "changed");
    ASSERT_TRUE(WriteHfModel(dir, spec, source).ok());
    auto c = HfCheckpoint::Open(dir);
    ASSERT_TRUE(c.ok()) << c.status();
    const Expert before = Read(**c, 1, 2);
    // Rewritten by the writer (another seed): the open reader still reads what it opened.
    ASSERT_TRUE(WriteHfModel(dir, spec, SyntheticExpertSource(48, 40, 22)).ok());
    const Expert kept = Read(**c, 1, 2);
    EXPECT_EQ(kept.gu, before.gu);
    EXPECT_EQ(kept.dn, before.dn);
    // Truncated in place (as `cp` over it does first): refused, naming the file.
    auto reopened = HfCheckpoint::Open(dir);
    ASSERT_TRUE(reopened.ok()) << reopened.status();
    for (const auto& entry : std::filesystem::directory_iterator(dir)) {
      if (entry.path().extension() == ".safetensors") ASSERT_EQ(::truncate(entry.path().c_str(), 16), 0);
    }
    std::vector<uint16_t> gu(2 * 40 * 48), dn(48 * 40);
    const absl::Status s = (*reopened)->ReadExpert(1, 2, gu.data(), dn.data());
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
    EXPECT_NE(s.message().find("truncated or rewritten in place"), std::string::npos) << s;
    EXPECT_NE(s.message().find(".safetensors"), std::string::npos) << s;
  }
}

// config.json's sizes must agree with the experts' tensors before anything is sized from them: a
// hidden_size of 2^17 would have a loader zero-fill gigabytes before reading a byte.
TEST(HfCheckpointTest, ConfigSizesThatDisagreeWithTheTensorsAreRefused) {
  HfModelSpec spec;
  spec.version = "v";
  const std::string dir = TempDir("sizes");
  ASSERT_TRUE(WriteHfModel(dir, spec, SyntheticExpertSource(spec.hidden_size, spec.moe_intermediate_size, 1)).ok());
  ASSERT_TRUE(HfCheckpoint::Open(dir).ok());
  std::ifstream in(dir + "/config.json");
  const std::string config((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::string key = "\"hidden_size\":";
  const size_t at = config.find(key);
  ASSERT_NE(at, std::string::npos) << config;
  const size_t end = config.find_first_of(",}", at);
  WriteFile(dir + "/config.json", config.substr(0, at) + key + " 131072" + config.substr(end));
  auto bad = HfCheckpoint::Open(dir);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kFailedPrecondition) << bad.status();
  EXPECT_NE(bad.status().message().find("config.json's sizes"), std::string::npos) << bad.status();
}

TEST(HfCheckpointTest, BrokenDirectoriesAreNamed) {
  HfModelSpec spec;
  spec.max_shard_bytes = 6000;
  spec.version = "v";
  const std::string dir = TempDir("broken");
  ASSERT_TRUE(WriteHfModel(dir, spec, SyntheticExpertSource(spec.hidden_size, spec.moe_intermediate_size, 1)).ok());
  ASSERT_TRUE(HfCheckpoint::Open(dir).ok());
  // A shard the index names is gone.
  ASSERT_EQ(std::system(("cd '" + dir + "' && mv model-00002-of-*.safetensors gone").c_str()), 0);
  auto missing = HfCheckpoint::Open(dir);
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("model-00002-of-"), std::string::npos) << missing.status();
  ASSERT_EQ(
      std::system(
          ("cd '" + dir + "' && mv gone \"$(ls model-00001-of-*.safetensors | sed s/00001-of/00002-of/)\"").c_str()),
      0);
  // The index points outside the directory.
  std::ifstream in(dir + "/model.safetensors.index.json");
  std::string index((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::string good = index;
  index.replace(index.find("model-00001"), 11, "../../etc/x");
  WriteFile(dir + "/model.safetensors.index.json", index);
  auto escape = HfCheckpoint::Open(dir);
  ASSERT_FALSE(escape.ok());
  EXPECT_EQ(escape.status().code(), absl::StatusCode::kInvalidArgument);
  WriteFile(dir + "/model.safetensors.index.json", good);
  // A sidecar that disagrees with the expert count.
  WriteFile(dir + "/moe_checkpoint.json", R"({"version":"v","digests":{"0":["ab"]}})");
  auto sidecar = HfCheckpoint::Open(dir);
  ASSERT_FALSE(sidecar.ok());
  EXPECT_NE(sidecar.status().message().find("digests[0]"), std::string::npos) << sidecar.status();
  // ... or records an empty digest (read as none, it would skip the loader's check).
  {
    std::string row = "[";
    for (int e = 0; e < spec.num_experts; ++e) absl::StrAppend(&row, e == 0 ? "" : ",", e == 1 ? "\"\"" : "\"ab\"");
    WriteFile(dir + "/moe_checkpoint.json", absl::StrCat(R"({"version":"v","digests":{"0":)", row, "]}}"));
    auto empty = HfCheckpoint::Open(dir);
    ASSERT_FALSE(empty.ok());
    EXPECT_NE(empty.status().message().find("][1]: empty"), std::string::npos) << empty.status();
  }
  // No experts at all under any naming.
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::string file = entry.path().filename().string();
    if (file.find(".safetensors") != std::string::npos || file == "moe_checkpoint.json") {
      ASSERT_TRUE(std::filesystem::remove(entry.path())) << entry.path();
    }
  }
  SafetensorsFile empty;
  empty.tensors["model.embed_tokens.weight"] = TensorBlob{"BF16", {1}, std::string(2, '\0')};
  ASSERT_TRUE(WriteSafetensors(dir + "/model.safetensors", empty).ok());
  auto none = HfCheckpoint::Open(dir);
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.status().message().find("no routed experts"), std::string::npos) << none.status();
}

}  // namespace
}  // namespace moe
