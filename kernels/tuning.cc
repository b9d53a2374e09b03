// CudaTuning: parsing its text form and the process-wide value (kernels/api.h).
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"

#include "kernels/api.h"

namespace moe::kernels {
namespace {

absl::Mutex tuning_mu;
CudaTuning& TuningSlot() {
  static CudaTuning tuning;
  return tuning;
}

absl::Status ParseInt(absl::string_view key, absl::string_view value, int lo, int hi, int* out) {
  int v = 0;
  if (!absl::SimpleAtoi(value, &v) || v < lo || v > hi) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda tuning: ", key, "=", value, ": want an integer in [", lo, ", ", hi, "]"));
  }
  *out = v;
  return absl::OkStatus();
}

// A key whose value names one of a few choices.
template <typename E>
struct Choice {
  absl::string_view name;
  E value;
};
template <typename E, size_t N>
absl::Status ParseChoice(absl::string_view key, absl::string_view value, const Choice<E> (&choices)[N], E* out) {
  std::string want;
  for (size_t i = 0; i < N; ++i) {
    if (value == choices[i].name) {
      *out = choices[i].value;
      return absl::OkStatus();
    }
    absl::StrAppend(&want, i == 0 ? "" : (i + 1 == N ? " or " : ", "), choices[i].name);
  }
  return absl::InvalidArgumentError(absl::StrCat("cuda tuning: ", key, "=", value, ": want ", want));
}

}  // namespace

absl::StatusOr<CudaTuning> ParseCudaTuning(absl::string_view spec) {
  CudaTuning t;
  for (absl::string_view item : absl::StrSplit(spec, ',', absl::SkipWhitespace())) {
    const std::pair<absl::string_view, absl::string_view> kv = absl::StrSplit(item, absl::MaxSplits('=', 1));
    const absl::string_view key = absl::StripAsciiWhitespace(kv.first), value = absl::StripAsciiWhitespace(kv.second);
    int v = 0;
    absl::Status s;
    if (key == "gemm") {
      static constexpr Choice<CudaTuning::Gemm> kGemm[] = {{"auto", CudaTuning::Gemm::kAuto},
                                                           {"sm90", CudaTuning::Gemm::kSm90},
                                                           {"cublas", CudaTuning::Gemm::kCublas},
                                                           {"loop", CudaTuning::Gemm::kLoop},
                                                           {"grouped", CudaTuning::Gemm::kGrouped}};
      s = ParseChoice(key, value, kGemm, &t.gemm);
    } else if (key == "sm90_tile") {
      using Tile = CudaTuning::Sm90Tile;
      static constexpr Choice<Tile> kTiles[] = {{"auto", Tile::kAuto},
                                                {"rows64", Tile::kRows64},
                                                {"rows128", Tile::kRows128},
                                                {"pingpong", Tile::kPingPong},
                                                {"pingpong_wide", Tile::kPingPongWide},
                                                {"rows128_epi", Tile::kRows128Epi},
                                                {"wide_epi", Tile::kWideEpiDown}};
      s = ParseChoice(key, value, kTiles, &t.sm90_tile);
    } else if (key == "chain_streams") {
      s = ParseInt(key, value, 0, 4, &t.chain_streams);
    } else if (key == "fused_layer") {
      s = ParseInt(key, value, 0, 1, &v);
      t.fused_layer = v == 1;
    } else if (key == "pdl") {
      s = ParseInt(key, value, 0, 1, &v);
      t.pdl = v == 1;
    } else if (key == "capture_branches") {
      s = ParseInt(key, value, 0, CudaTuning::kMaxCaptureBranches, &t.capture_branches);
    } else if (key == "fp8_epilogue_quant") {
      s = ParseInt(key, value, 0, 1, &v);
      t.fp8_epilogue_quant = v == 1;
    } else if (key == "mma_wide") {
      s = ParseInt(key, value, -1, 1, &t.mma_wide);
    } else if (key == "down_preload") {
      s = ParseInt(key, value, -1, 1, &t.down_preload);
    } else if (key == "blocking_sync") {
      s = ParseInt(key, value, 0, 1, &v);
      t.blocking_sync = v == 1;
    } else {
      s = absl::InvalidArgumentError(absl::StrCat(
          "cuda tuning: unknown key '", key,
          "' (gemm, sm90_tile, chain_streams, fused_layer, pdl, mma_wide, down_preload, fp8_epilogue_quant, "
          "capture_branches, blocking_sync)"));
    }
    if (!s.ok()) return s;
  }
  return t;
}

void SetCudaTuning(const CudaTuning& tuning) {
  absl::MutexLock lock(&tuning_mu);
  TuningSlot() = tuning;
}

CudaTuning GetCudaTuning() {
  absl::MutexLock lock(&tuning_mu);
  return TuningSlot();
}

}  // namespace moe::kernels
