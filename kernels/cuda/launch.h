// Launchers of the device kernels (device_kernels.cu). Plain C++ with CUDA runtime types only,
// so the .cu file needs no Abseil and the host logic (cuda_kernels.cc) compiles with gcc.
// Every launcher is asynchronous on `stream` and returns the launch error.
#ifndef MOE_KERNELS_CUDA_LAUNCH_H_
#define MOE_KERNELS_CUDA_LAUNCH_H_

#include <cuda_runtime.h>

#include <cstdint>

namespace moe::kernels::cuda {

// The process's launch switches (CudaTuning::pdl, ::mma_wide, ::down_preload in kernels/api.h),
// set by CreateCudaKernels from GetCudaTuning(); read at every launch.
void SetLaunchSwitches(bool pdl, int mma_wide, int down_preload);
int MmaWideForced();      // -1: by expected rows; 0 / 1: forced narrow / wide
int DownPreloadForced();  // -1: the default; 0: off; 1 / 2: beside 2 / 3 gate/up blocks

// out[i] = in[index[i]] for rows of `row_bytes`; index < 0 or >= in_rows writes `fill_bf16`
// repeated (row_bytes must be even when fill is used) or zeros when fill_bf16 == 0.
cudaError_t LaunchGatherRows(const void* in, int64_t in_rows, const int32_t* index, int64_t n, int64_t row_bytes,
                             void* out, uint16_t fill_bf16, cudaStream_t stream);
// Same permutation for per-row scale groups of `per_row` floats (missing rows get 1.0).
cudaError_t LaunchGatherScales(const float* in, int64_t in_rows, const int32_t* index, int64_t n, int64_t per_row,
                               float* out, cudaStream_t stream);

// counts[b] (int64) and the exclusive scan with sentinel, all on the device.
cudaError_t LaunchHistogramScan(const int32_t* keys, int64_t n, int num_bins, int64_t* counts, int64_t* offsets,
                                cudaStream_t stream);

// Route planning (kernels/api.h SealRoutesParams, RankByKeyParams), all on the device.
cudaError_t LaunchSealRoutes(const int32_t* ids, const float* gates, const uint8_t* admitted, int64_t routes,
                             int num_experts, const int32_t* key_of_expert, int32_t* keys, float* gates_out,
                             const int32_t* local_of_key, int num_keys, int32_t* local, int64_t* status,
                             cudaStream_t stream);
// out[dest[i * fanout + j]] = in[i] (BF16 rows of d), entries outside [0, out_rows) skipped:
// kernels/api.h ScatterParams.
cudaError_t LaunchScatterRows(const uint16_t* in, int64_t in_rows, int d, int64_t out_ld, const int32_t* dest,
                              int fanout, int64_t out_rows, uint16_t* out, cudaStream_t stream);

// out[i] = a[b[i]] (-1 where b[i] is outside [0, a_n)): kernels/api.h ComposeIndexParams.
cudaError_t LaunchComposeIndex(const int32_t* a, int64_t a_n, const int32_t* b, int64_t n, int32_t* out,
                               cudaStream_t stream);
// Scratch RankByKey needs (int32 per key and tile of 256 elements); num_keys <= kMaxRankKeys.
constexpr int kMaxRankKeys = 12 * 1024;  // kernels/api.h kRankByKeyMaxKeys
int64_t RankByKeyScratchBytes(int64_t n, int num_keys);
cudaError_t LaunchRankByKey(const int32_t* raw, int64_t n, const int32_t* key_map, int map_size, int num_keys,
                            int32_t* position, int32_t* order, int order_divisor, const int32_t* key_values,
                            int32_t* values, int64_t* counts, int64_t* offsets, int64_t* status, int32_t* scratch,
                            cudaStream_t stream);

// a[r, c] = bf16(silu(h[r, c]) * h[r, f + c]) for h [rows, 2f] BF16.
cudaError_t LaunchSwigluActivation(const uint16_t* h, int64_t rows, int f, uint16_t* a, cudaStream_t stream);

// y[t] = sum_j gate[t, j] rows[row_of_route[t, j]] (FP32), written as FP32 and/or BF16.
cudaError_t LaunchCombine(const uint16_t* rows, int64_t num_rows, int d, const int32_t* row_of_route, const float* gate,
                          int64_t num_tokens, int k, float* out_fp32, uint16_t* out_bf16, cudaStream_t stream);

// *first = the index of the first NaN / infinite value among n BF16 values, ~0 when none.
// `bytes` from `src` to `dst` (device memory, or host memory mapped into the device's address
// space) by the GPU's threads.
cudaError_t LaunchCopyBytes(void* dst, const void* src, int64_t bytes, cudaStream_t stream);
cudaError_t LaunchFindNonFiniteBf16(const uint16_t* x, int64_t n, unsigned long long* first, cudaStream_t stream);

// FP8 E4M3 quantize / dequantize with `group` values per scale (d for per-row, 128 per block);
// block_rows 128 (with group 128): one scale per 128 x 128 block (weights), 1: per row.
// PackFp8Rows (kernels/api.h: PackFp8Params); out 16-byte aligned.
cudaError_t LaunchPackFp8(const uint16_t* x, int64_t tokens, int d, const int32_t* dest, int k, int64_t out_rows,
                          uint8_t* out, cudaStream_t stream);
// scales_rows_ld > 0 (group 128, block_rows 1, d a multiple of 128, x and q 16-byte aligned):
// the scales column-major, [d / 128, scales_rows_ld >= rows] (the Hopper down kernel's layout).
cudaError_t LaunchQuantizeFp8(const uint16_t* x, int64_t rows, int d, int group, uint8_t* q, float* scales,
                              cudaStream_t stream, int block_rows = 1, int64_t scales_rows_ld = 0);
cudaError_t LaunchDequantizeFp8(const uint8_t* q, const float* scales, int64_t rows, int d, int group, uint16_t* x,
                                cudaStream_t stream, int block_rows = 1);
// in [rows, groups] (rows ld >= groups floats apart) into out, column-major [groups, out_ld >= rows].
cudaError_t LaunchTransposeScales(const float* in, int64_t rows, int groups, int64_t ld, float* out, int64_t out_ld,
                                  cudaStream_t stream);

// Local-layer row assignment (kernels/api.h RouteRowsParams): each route (token t, slot j) with
// expert id topk[t * k + j] gets a row of its expert's segment of an expert-major layout
// (row_of_route, -1 for ids outside [0, E)), token_of_row inverts it, counts and offsets (with
// sentinel) stay on the device. Two launches, 1 <= routes < 2^31; `scratch` holds
// RouteRowsScratchBytes(routes, E) bytes whose first 4 are zero on entry (and on return).
int64_t RouteRowsScratchBytes(int64_t routes, int num_experts);
cudaError_t LaunchRouteRows(const int32_t* topk, int64_t num_tokens, int k, int num_experts, int64_t* counts,
                            int64_t* offsets, int32_t* row_of_route, int32_t* token_of_row, void* scratch,
                            cudaStream_t stream);

// The same in one single-block launch for decode-sized inputs (RouteRowsSmall says when).
bool RouteRowsSmall(int64_t routes, int num_experts);
cudaError_t LaunchRouteRowsSmall(const int32_t* topk, int64_t num_tokens, int k, int num_experts, int64_t* counts,
                                 int64_t* offsets, int32_t* row_of_route, int32_t* token_of_row, cudaStream_t stream);

// The padded runner of the decode path (Swiglu with device offsets and the padded layout):
// expert e's rows at [e * C, e * C + count_e) of the padded operands (count_e from the device
// offsets; C >= every count_e, d and f multiples of 8, 16-byte aligned rows).
// x_pad[e * C + i] = x[row_index[offsets[e] + i]] (row_index null: row offsets[e] + i), zeros on
// padding rows.
cudaError_t LaunchGatherPadded(const uint16_t* x, const int32_t* row_index, const int64_t* offsets, int num_experts,
                               int64_t capacity, int d, uint16_t* x_pad, cudaStream_t stream);
// a = bf16(silu(h_gate) * h_up) for h [E * C, 2f], zeros on padding rows.
cudaError_t LaunchSwigluActivationPadded(const uint16_t* h, const int64_t* offsets, int num_experts, int64_t capacity,
                                         int f, uint16_t* a, cudaStream_t stream);
// y[offsets[e] + i] = y_pad[e * C + i] for the useful rows (at most `rows`); a row past its
// expert's capacity is written as NaN (the contract broken, never a silent drop).
cudaError_t LaunchScatterPadded(const uint16_t* y_pad, const int64_t* offsets, int num_experts, int64_t capacity, int d,
                                int64_t rows, uint16_t* y, cudaStream_t stream);

// The Hopper grouped kernels (grouped_sm90.cu): both projections of the experts over the
// expert-major rows x [rows, d] with device offsets [num_experts + 1]; a [rows, f] receives the
// activation (SwiGLU fused into the gate/up epilogue), y [rows, d] the down projection. Rows
// outside every segment are not written. Schedules: cooperative 64- or 128-row tiles (both
// consumer warpgroups on one tile), or ping-pong 128-row tiles (one warpgroup's epilogue under
// the other's MMAs; kPingPongWide: gate/up tiles of 96 activation columns, where
// GroupedSm90WideSupported(f), else cudaErrorInvalidValue). kRows128Epi: cooperative 128-row
// tiles whose epilogues run on the producer warpgroup's idle warps (the same bits as kRows128);
// kWideEpiDown: kPingPongWide's gate/up tiles, kRows128Epi's down tiles.
enum class Sm90Schedule { kRows64, kRows128, kPingPong, kPingPongWide, kRows128Epi, kWideEpiDown };
bool GroupedSm90Supported(int num_experts, int d, int f);
// Whether kPingPongWide's gate/up tiles divide f (on top of GroupedSm90Supported).
bool GroupedSm90WideSupported(int f);
cudaError_t LaunchGroupedSm90Swiglu(const uint16_t* x, int64_t rows, const int64_t* offsets, int num_experts, int d,
                                    int f, const uint16_t* w_gate_up, const uint16_t* w_down, uint16_t* a, uint16_t* y,
                                    Sm90Schedule schedule, cudaStream_t stream);

// FP8 (E4M3) experts on the Hopper kernels: x quantized per (row, 128 values) into xq /
// x_scales [rows, d / 128]; weights with one FP32 scale per 128 x 128 block (gate_up_scales
// [E, 2f / 128, d / 128], down_scales [E, d / 128, f / 128]). The activation [rows, f] reaches
// the down kernel quantized per (row, 128 values) in aq [rows, f] and a_scales, column-major
// [f / 128, Fp8ActivationScaleRows(rows)] in Fp8ActivationScaleFloats(rows, f) floats (a tile's
// 128 scales of one block contiguous, one bulk copy; the decode GEMVs keep [rows, f / 128] in the
// same scratch): with
// `quantize_in_epilogue` the gate/up kernel's SwiGLU epilogue quantizes it in registers and `a`
// is not touched (may be null); without, the epilogue writes it to a (BF16) and a quantization
// kernel reads it back. The same bytes either way. y [rows, d] BF16. Scratch x_scales_t (the
// rows' scales column-major, Fp8ActivationScaleFloats(rows, d) floats: the kernels' layout,
// copied there from x_scales; x_scales null: the caller wrote them there, e.g. by
// LaunchQuantizeFp8's scales_rows_ld), a, aq, a_scales belongs to the caller, each 16-byte
// aligned.
bool GroupedSm90Fp8Supported(int num_experts, int d, int f);
// Floats between the 128-column blocks of the Hopper FP8 kernels' activation scales: rows
// rounded up to 16 bytes. a_scales (f / 128 blocks) and x_scales_t (d / 128) hold that many
// floats a block and 132 floats of padding (the kernels' copies of a row tile's scales start at
// 16-byte boundaries and may read past the last block's end).
inline int64_t Fp8ActivationScaleRows(int64_t rows) { return (rows + 3) / 4 * 4; }
inline int64_t Fp8ActivationScaleFloats(int64_t rows, int f) { return Fp8ActivationScaleRows(rows) * (f / 128) + 132; }
// The FP8 launchers' row operands: fewer than 2^31 rows, xq rows at least d bytes apart on
// 16-byte boundaries, x_scales rows at least d / 128 floats apart.
inline bool Fp8RowOperandsValid(int64_t rows, int d, int64_t xq_ld, int64_t x_scales_ld) {
  return rows < (int64_t{1} << 31) && xq_ld >= d && xq_ld % 16 == 0 && x_scales_ld >= d / 128;
}
// xq_ld: bytes between rows of xq (a multiple of 16, >= d); x_scales_ld: floats between rows of
// x_scales (>= d / 128).
cudaError_t LaunchGroupedSm90SwigluFp8(const uint8_t* xq, int64_t xq_ld, const float* x_scales, int64_t x_scales_ld,
                                       int64_t rows, const int64_t* offsets, int num_experts, int d, int f,
                                       const uint8_t* w_gate_up, const float* gate_up_scales, const uint8_t* w_down,
                                       const float* down_scales, float* x_scales_t, uint16_t* a, uint8_t* aq,
                                       float* a_scales, uint16_t* y, cudaStream_t stream, bool quantize_in_epilogue);

// Decode-sized FP8 experts (small_batch_fp8.cu): tensor-core GEMVs over device-side segment
// offsets with the operands of LaunchGroupedSm90SwigluFp8 (d and f multiples of 128; xq, the
// weights and the scratch 16-byte aligned). Any segment size is correct; SmallBatchFp8Takes says
// whether a step of `rows` rows is decode-sized (a few rows an expert), where these beat the
// Hopper kernels' 128-row tiles.
bool SmallBatchFp8Takes(int64_t rows, int num_experts);
cudaError_t LaunchSmallBatchSwigluFp8(const uint8_t* xq, int64_t xq_ld, const float* x_scales, int64_t x_scales_ld,
                                      int64_t rows, const int64_t* offsets, int num_experts, int d, int f,
                                      const uint8_t* w_gate_up, const float* gate_up_scales, const uint8_t* w_down,
                                      const float* down_scales, uint16_t* a, uint8_t* aq, float* a_scales, uint16_t* y,
                                      cudaStream_t stream);

// Decode-sized SwiGLU over device-side segment offsets (small_batch.cu): any segment size is
// correct; it is fast while segments are a few rows. `a` is scratch of [rows, f] BF16; `rows`
// (the layout's capacity) and the optional bound on any segment (0 = none) pick the chunk size.
bool SmallBatchSupported(int d, int f);
// With x_row_index, layout row r reads x[x_row_index[r]] (the gather fused into the load).
cudaError_t LaunchSmallBatchSwiglu(const uint16_t* x, const int32_t* x_row_index, const int64_t* offsets,
                                   int num_experts, int d, int f, const uint16_t* w_gate_up, const uint16_t* w_down,
                                   uint16_t* a, uint16_t* y, int64_t rows, int64_t max_segment_rows,
                                   cudaStream_t stream);
// Where a step of `rows` with one row an expert (the streaming kernels) loads the down weights
// into shared memory while the gate/up kernel runs, under the current switches
// (DownPreloadForced): the gate/up blocks an SM beside each down block; 0 where the down kernel
// streams its weights afterwards. The launch's own decision, for tests and benchmarks.
int SmallBatchDownPreloadBeside(int num_experts, int d, int f, int64_t rows);

// The fused local layer (LocalLayerParams in kernels/api.h) for decode-sized steps: two kernels,
// each block routing from topk itself, the down kernel's last block combining. `a` [routes, f]
// and `y` [routes, d] BF16 and `done` (one counter) are scratch; no alignment beyond 16 bytes
// for x and the outputs. FusedLocalLayerSupported says which steps it takes.
bool FusedLocalLayerSupported(int64_t tokens, int k, int num_experts, int d, int f);
cudaError_t LaunchFusedLocalLayer(const uint16_t* x, const int32_t* topk, const float* gate, int64_t tokens, int k,
                                  int num_experts, int d, int f, const uint16_t* w_gate_up, const uint16_t* w_down,
                                  uint16_t* a, uint16_t* y, unsigned int* done, float* out_fp32, uint16_t* out_bf16,
                                  cudaStream_t stream);

}  // namespace moe::kernels::cuda

#endif  // MOE_KERNELS_CUDA_LAUNCH_H_
