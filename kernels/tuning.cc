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

}  // namespace

absl::StatusOr<CudaTuning> ParseCudaTuning(absl::string_view spec) {
  CudaTuning t;
  for (absl::string_view item : absl::StrSplit(spec, ',', absl::SkipWhitespace())) {
    const std::pair<absl::string_view, absl::string_view> kv = absl::StrSplit(item, absl::MaxSplits('=', 1));
    const absl::string_view key = absl::StripAsciiWhitespace(kv.first), value = absl::StripAsciiWhitespace(kv.second);
    int v = 0;
    absl::Status s;
    if (key == "gemm") {
      if (value == "auto") {
        t.gemm = CudaTuning::Gemm::kAuto;
      } else if (value == "sm90") {
        t.gemm = CudaTuning::Gemm::kSm90;
      } else if (value == "cublas") {
        t.gemm = CudaTuning::Gemm::kCublas;
      } else if (value == "loop") {
        t.gemm = CudaTuning::Gemm::kLoop;
      } else if (value == "grouped") {
        t.gemm = CudaTuning::Gemm::kGrouped;
      } else {
        s = absl::InvalidArgumentError(
            absl::StrCat("cuda tuning: gemm=", value, ": want auto, sm90, cublas, loop or grouped"));
      }
    } else if (key == "sm90_tile") {
      if (value == "auto") {
        t.sm90_tile = CudaTuning::Sm90Tile::kAuto;
      } else if (value == "rows64") {
        t.sm90_tile = CudaTuning::Sm90Tile::kRows64;
      } else if (value == "rows128") {
        t.sm90_tile = CudaTuning::Sm90Tile::kRows128;
      } else if (value == "pingpong") {
        t.sm90_tile = CudaTuning::Sm90Tile::kPingPong;
      } else if (value == "pingpong_wide") {
        t.sm90_tile = CudaTuning::Sm90Tile::kPingPongWide;
      } else if (value == "rows128_epi") {
        t.sm90_tile = CudaTuning::Sm90Tile::kRows128Epi;
      } else if (value == "wide_epi") {
        t.sm90_tile = CudaTuning::Sm90Tile::kWideEpiDown;
      } else {
        s = absl::InvalidArgumentError(
            absl::StrCat("cuda tuning: sm90_tile=", value,
                         ": want auto, rows64, rows128, pingpong, pingpong_wide, rows128_epi or wide_epi"));
      }
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
    } else if (key == "blocking_sync") {
      s = ParseInt(key, value, 0, 1, &v);
      t.blocking_sync = v == 1;
    } else {
      s = absl::InvalidArgumentError(absl::StrCat(
          "cuda tuning: unknown key '", key,
          "' (gemm, sm90_tile, chain_streams, fused_layer, pdl, mma_wide, fp8_epilogue_quant, capture_branches, "
          "blocking_sync)"));
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
