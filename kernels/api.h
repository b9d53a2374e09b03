// Expert-execution kernels: one C++ API, two implementations (CPU reference, CUDA).
//
// Everything here is raw pointers, sizes, an opaque stream and a params struct; no runtime or
// RPC types. Each call validates what it can see on the host (offsets monotone with the right
// sentinel, segment sizes within capacities, scale counts matching the payload, dtypes) and
// returns INVALID_ARGUMENT / FAILED_PRECONDITION naming the field *before* launching anything.
//
// Precision roles (spec 0x0AE): BF16 activations, weights and returned rows; FP32 gates and
// token accumulation; FP8 E4M3 payloads carry FP32 scales per row or per 128 values. The gate
// is applied once, in Combine, after the expert.
//
// Pointers: the CPU implementation takes host pointers; the CUDA implementation takes device
// pointers, except the fields named host_* which are always host memory. Calls on the CUDA
// implementation are asynchronous on `stream` unless documented otherwise.
// Thread-safety: one ExpertKernels object per stream / thread (it owns scratch buffers).
#ifndef MOE_KERNELS_API_H_
#define MOE_KERNELS_API_H_

#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace moe::kernels {

using Stream = void*;  // cudaStream_t for the CUDA implementation; ignored on the CPU

enum class DType { kBF16, kFP32, kFP8E4M3 };
int DTypeBytes(DType t);

// Runner layouts (spec 0x04B-0x04D).
enum class Layout { kPaddedDense, kGrouped, kBlockSparse };
const char* LayoutName(Layout l);

struct LayoutParams {
  Layout layout = Layout::kGrouped;
  int64_t capacity = 0;      // padded: rows admitted per expert (C); must be >= every segment
  int64_t alignment = 1;     // padded: C_exec = alignment * ceil(C / alignment)
  int64_t block_rows = 128;  // block-sparse: each segment rounds up to this multiple
};

// Executed segment offsets [E + 1] of a layout for useful segment sizes `counts`.
// FAILED_PRECONDITION when a segment exceeds the padded capacity (never a silent drop).
absl::Status ExecutedOffsets(const LayoutParams& p, absl::Span<const int64_t> counts, std::vector<int64_t>* out);
// The same checks for the segments of monotone `offsets` (E + 1 entries), computing nothing.
absl::Status CheckExecutedLayout(const LayoutParams& p, absl::Span<const int64_t> offsets);

// Checks segment offsets: E + 1 entries, offsets[0] == 0, monotone, offsets[E] == rows.
absl::Status ValidateOffsets(absl::Span<const int64_t> offsets, int64_t rows, const char* field);

// kPerBlock128: one scale per row and 128 values (activations, dispatch payloads);
// kBlock128x128: one per 128 x 128 block, [ceil(rows / 128), ceil(d / 128)] row-major (weights,
// as DeepSeek-V3's checkpoints and Fp8ExpertWeights carry them; Quantize and Dequantize only).
enum class ScaleGranularity { kNone, kPerRow, kPerBlock128, kBlock128x128 };
// Number of FP32 scales a [rows, d] FP8 payload carries.
int64_t ScaleCount(ScaleGranularity g, int64_t rows, int d);

// out[i, :] = in[index[i], :]; index -1 writes zeros (padding). With FP8 payloads the scales
// are permuted with their rows.
struct GatherParams {
  DType dtype = DType::kBF16;
  int d = 0;
  const void* in = nullptr;
  int64_t in_rows = 0;
  const int32_t* index = nullptr;  // [n]
  int64_t n = 0;
  void* out = nullptr;  // [n, d]
  ScaleGranularity scales = ScaleGranularity::kNone;
  const float* in_scales = nullptr;
  int64_t in_scale_count = 0;
  float* out_scales = nullptr;
};

// Scatter, BF16 rows: out[dest[i * fanout + j], :] = in[i, :] for every i < in_rows and j <
// fanout whose dest lies in [0, out_rows); other entries are skipped, and rows of out that no
// entry names are left as they are. The inverse of a Gather whose index names each source row up
// to `fanout` times (token -> the rows of its k routes in expert order): each source row is read
// once instead of once a copy. Every pointer is kernel memory; in_rows * fanout and out_rows
// < 2^31; destinations should be distinct (two entries naming one row: either row wins).
struct ScatterParams {
  int d = 0;
  const uint16_t* in = nullptr;  // [in_rows, d]
  int64_t in_rows = 0;
  const int32_t* dest = nullptr;  // [in_rows, fanout]
  int fanout = 0;
  uint16_t* out = nullptr;  // [out_rows, d]
  int64_t out_rows = 0;
  // Words between output rows (0: d): rows written into a wider packed row (an FP8 row's bytes
  // and scales side by side, each scattered as 2-byte words).
  int64_t out_ld = 0;
};

// counts[b] = #{i : keys[i] == b}; offsets = exclusive prefix with sentinel. Keys < 0 (dropped
// routes) are ignored. On CUDA both outputs are device memory and nothing returns to the host.
struct HistogramParams {
  const int32_t* keys = nullptr;
  int64_t n = 0;
  int num_bins = 0;
  int64_t* counts = nullptr;   // [num_bins]
  int64_t* offsets = nullptr;  // [num_bins + 1]
};

// Expert-major layout of T x k routes on one rank: per-expert counts and offsets, each route's
// row in the layout (row_of_route[t * k + j]; -1 for ids outside [0, E), i.e. dropped routes),
// and the source token of each row (token_of_row, [offsets[E]] entries). On CUDA everything is
// computed and kept on the device (no host round trip); rows within one expert's segment may
// come in any order (the combine sums per token in slot order, so results do not depend on it).
// num_tokens x k must be below 2^31 (rows are 32-bit; INVALID_ARGUMENT otherwise).
struct RouteRowsParams {
  const int32_t* topk = nullptr;  // [num_tokens, k]
  int64_t num_tokens = 0;
  int k = 0;
  int num_experts = 0;
  int64_t* counts = nullptr;        // [E]
  int64_t* offsets = nullptr;       // [E + 1]
  int32_t* row_of_route = nullptr;  // [num_tokens, k]
  int32_t* token_of_row = nullptr;  // [num_tokens * k] (only offsets[E] entries are written)
};

// Device-side route planning (the layer executor's device plan of prefill steps: spec 0x03B's
// stable send order computed where the routing lives, so the host touches no per-route data).
//
// SealRoutes keys a rank's routes. For route i (token-major, i = t * k + j) that `admitted`
// admits (null: every route): keys[i] = key_of_expert[ids[i]] and gates_out[i] = gates[i]; an
// unadmitted route gets key -1 and gate 0. status[0] = the first admitted route whose id is
// outside [0, num_experts) or whose gate is NaN, infinite or negative, status[1] = the first
// admitted valid route whose expert has key -1 (no slot to take it); -1 when there is none.
// Every pointer is kernel memory; status is written on `stream` like the rest. With `local`, the
// same pass also composes each route's local index (ComposeIndex of local_of_key and keys):
// local[i] = local_of_key[keys[i]] where keys[i] is in [0, num_keys), else -1.
struct SealRoutesParams {
  const int32_t* ids = nullptr;       // [routes]
  const float* gates = nullptr;       // [routes]
  const uint8_t* admitted = nullptr;  // [routes], or null
  int64_t routes = 0;
  int num_experts = 0;
  const int32_t* key_of_expert = nullptr;  // [num_experts], -1: no key
  int32_t* keys = nullptr;                 // [routes]
  float* gates_out = nullptr;              // [routes]
  int64_t* status = nullptr;               // [2]
  const int32_t* local_of_key = nullptr;   // [num_keys], with `local`
  int num_keys = 0;
  int32_t* local = nullptr;  // [routes], or null
};

// RankByKey is a stable counting sort. Element i's key is raw[i], or key_map[raw[i]] with a map
// (raw -1: no key); elements without a key (< 0) are not placed. position[i] = the element's
// place in the order (key, i) over the placed elements, -1 for the others; order[position[i]] =
// i / order_divisor (optional); values[position[i]] = key_values[key] (optional; values needs
// key_values). counts [num_keys] and offsets [num_keys + 1] (exclusive, with the total as
// sentinel) are written too. status[0] = the first element whose key is >= num_keys, whose raw
// value is outside [-1, map_size) or maps to -1 (-1: none); the other outputs are then
// unspecified. Every pointer is kernel memory; n < 2^31.
inline constexpr int kRankByKeyMaxKeys = 12 * 1024;  // CUDA keeps a count per key in shared memory
struct RankByKeyParams {
  const int32_t* raw = nullptr;  // [n]
  int64_t n = 0;
  const int32_t* key_map = nullptr;  // optional [map_size]
  int map_size = 0;
  int num_keys = 0;
  int32_t* position = nullptr;  // [n]
  int32_t* order = nullptr;     // optional [placed]
  int order_divisor = 1;
  const int32_t* key_values = nullptr;  // optional [num_keys]
  int32_t* values = nullptr;            // optional [placed]
  int64_t* counts = nullptr;            // [num_keys]
  int64_t* offsets = nullptr;           // [num_keys + 1]
  int64_t* status = nullptr;            // [1]
};

// ComposeIndex: out[i] = a[b[i]] for i < n, index tables composed where they are (a lone
// member gathers its rows straight into expert order and combines straight from the expert
// rows). An entry of b outside [0, a_n) gives -1 (b's -1: not sent). Every pointer is kernel
// memory; n and a_n < 2^31.
struct ComposeIndexParams {
  const int32_t* a = nullptr;  // [a_n]
  int64_t a_n = 0;
  const int32_t* b = nullptr;  // [n]
  int64_t n = 0;
  int32_t* out = nullptr;  // [n]
};

// Expert parameters, BF16, nn.Linear layout ([out, in], row-major).
struct ExpertWeights {
  const uint16_t* w_gate_up = nullptr;  // [E, 2 d_ff, d]: rows [0, d_ff) gate, [d_ff, 2 d_ff) up
  const uint16_t* w_down = nullptr;     // [E, d, d_ff]
  int num_experts = 0;
  int d = 0;
  int d_ff = 0;
};

// y_q = (SiLU(x_q Wg_q^T) * (x_q Wu_q^T)) Wd_q^T for every local expert segment q, in the
// chosen layout. x and y are expert-major useful rows; padding and fringe rows exist only
// inside the runner and never reach y.
struct SwigluParams {
  LayoutParams layout;
  ExpertWeights weights;
  const uint16_t* x = nullptr;  // [rows, d] BF16
  int64_t rows = 0;
  const int64_t* host_offsets = nullptr;  // [E + 1], host memory
  // Decode path: when host_offsets is null the offsets are read where the kernels run (device
  // memory on CUDA) and nothing returns to the host; offsets[E] may then be below `rows`, which
  // is the capacity of x and y. x and y stay expert-major useful rows in either layout it
  // takes: grouped (the decode kernels, one pass over an expert's weights per 8 or 16 rows) or
  // padded (every expert computed at layout.capacity rows by tensor-core GEMMs of fixed shape,
  // for long segments; the capacity must hold every segment: a row past it comes out NaN on
  // CUDA, FAILED_PRECONDITION on the CPU).
  const int64_t* device_offsets = nullptr;
  // Optional bound on any segment's length on the decode path (e.g. the token count when a
  // token's k routes go to distinct experts); 0 = unknown. Only speed depends on it.
  int64_t max_segment_rows = 0;
  // Optional, decode path: layout row r is read from x[x_row_index[r]] (x is then the source,
  // e.g. the token rows of the hidden state, and `x_rows` its row count): the gather into
  // expert-major order is fused into the expert kernel's operand load.
  const int32_t* x_row_index = nullptr;
  int64_t x_rows = 0;
  uint16_t* y = nullptr;  // [rows, d] BF16
  // Value written into padding / fringe input rows (tests poison them with NaN).
  float padding_value = 0.0f;
};

// FP8 experts in DeepSeek-V3's checkpoint format: E4M3 weights with one FP32 scale per 128 x 128
// block. The rows are quantized per (row, 128 values) on the fly (as Quantize does), and so is
// the activation before the down projection. Products accumulate in FP32 and the gate and up
// values round to BF16 as in Swiglu. Expert-major rows in the grouped layout; the segment
// offsets are read where the kernels run (device memory on CUDA, host memory on the CPU).
struct Fp8ExpertWeights {
  const uint8_t* w_gate_up = nullptr;     // [E, 2 d_ff, d] E4M3, rows as in ExpertWeights
  const float* gate_up_scales = nullptr;  // [E, 2 d_ff / 128, d / 128]
  const uint8_t* w_down = nullptr;        // [E, d, d_ff] E4M3
  const float* down_scales = nullptr;     // [E, d / 128, d_ff / 128]
  int num_experts = 0;
  int d = 0;     // a multiple of 128
  int d_ff = 0;  // a multiple of 128
};

struct SwigluFp8Params {
  Fp8ExpertWeights weights;
  const uint16_t* x = nullptr;  // [rows, d] BF16
  int64_t rows = 0;
  // [E + 1], offsets[0] >= 0, monotone, offsets[E] <= rows. On CUDA they live in device memory
  // and are not checked (as on the decode path): RouteRows and HistogramScan produce them so.
  const int64_t* offsets = nullptr;
  uint16_t* y = nullptr;  // [rows, d] BF16; rows outside every segment are left alone
  // Or, instead of x, the rows already in E4M3 with one FP32 scale per 128 values, as Quantize
  // writes them ([rows, d] and [rows, d / 128]): an FP8 dispatch's payload, quantized once a
  // token on its sender instead of once a route here. x is then null.
  const uint8_t* xq = nullptr;
  const float* x_scales = nullptr;
  // With xq: bytes between rows of xq (0: d; else at least d and a multiple of 16) and floats
  // between rows of x_scales (0: d / 128): packed rows that carry a row's scales after its bytes
  // (an FP8 dispatch's payload, kernels/api.h Fp8PackedRowBytes).
  int64_t xq_ld = 0;
  int64_t x_scales_ld = 0;
  // x (or xq), y and the weights 16-byte aligned (TMA and the kernels' 16-byte stores); rows < 2^31.
};

// Bytes of a packed FP8 row of d values (d a multiple of 128): the d E4M3 bytes, then the d / 128
// FP32 scales, padded to 16 bytes (TMA's row stride).
inline int64_t Fp8PackedRowBytes(int d) { return (static_cast<int64_t>(d) + 4 * (d / 128) + 15) / 16 * 16; }

// An FP8 dispatch's payload in one pass: each of `tokens` BF16 rows quantized per 128 values
// (Quantize's kPerBlock128: the same bytes and scales) and written as a packed row of
// Fp8PackedRowBytes(d) bytes (the d E4M3 bytes, the d / 128 FP32 scales, zeros to the 16-byte
// boundary) to out row dest[t * k + j], for every j < k whose dest lies in [0, out_rows); rows of
// out that no entry names are left as they are. What Quantize and two Scatters (bytes, scales)
// compute, without the intermediate rows, and with the padding written. d a multiple of 128;
// tokens * k and out_rows < 2^31; every pointer kernel memory, out 16-byte aligned.
struct PackFp8Params {
  const uint16_t* x = nullptr;  // [tokens, d] BF16
  int64_t tokens = 0;
  int d = 0;
  const int32_t* dest = nullptr;  // [tokens, k]
  int k = 0;
  uint8_t* out = nullptr;  // [out_rows, Fp8PackedRowBytes(d)]
  int64_t out_rows = 0;
};

// y[t, :] = sum_j gate[t, j] * rows[row_of_route[t, j], :] in FP32, j in order (deterministic);
// row -1 (a dropped route) contributes nothing.
struct CombineParams {
  const uint16_t* rows = nullptr;  // [num_rows, d] BF16 returned expert rows
  int64_t num_rows = 0;
  int d = 0;
  const int32_t* row_of_route = nullptr;  // [num_tokens, k]
  const float* gate = nullptr;            // [num_tokens, k] FP32
  int64_t num_tokens = 0;
  int k = 0;
  float* out_fp32 = nullptr;     // optional [num_tokens, d]
  uint16_t* out_bf16 = nullptr;  // optional [num_tokens, d]
};

// The whole MoE layer of a step whose experts all live where the kernels run (one device, no
// exchange): out[t] = sum_j gate[t, j] * SwiGLU_{topk[t, j]}(x[t]) in FP32, j in order; ids
// outside [0, E) are dropped routes and contribute nothing. Equals RouteRows, then Swiglu on
// the decode path (grouped layout, device offsets, x_row_index = token_of_row), then Combine,
// bit for bit. The CUDA implementation runs decode-sized steps eagerly (one token, at most 32
// routes, d <= 2048) as two kernels that each derive the routing from topk in every block, the
// last block of the second one doing the combine; other steps, and every call made while the
// stream is being captured into a CUDA graph, run those three stages. Scratch is owned by the
// kernels object and grows on first use at a size: warm a size up before capturing the call.
struct LocalLayerParams {
  ExpertWeights weights;
  const uint16_t* x = nullptr;    // [num_tokens, d] BF16
  const int32_t* topk = nullptr;  // [num_tokens, k]
  const float* gate = nullptr;    // [num_tokens, k] FP32
  int64_t num_tokens = 0;
  int k = 0;
  float* out_fp32 = nullptr;     // optional [num_tokens, d]
  uint16_t* out_bf16 = nullptr;  // optional [num_tokens, d]
  // > 0: the experts run Swiglu's padded runner with this capacity instead of the decode
  // kernels (the caller knows every expert's routes, e.g. from host-side ids, and passes their
  // maximum: a segment above it is the contract broken, NaN rows on CUDA, FAILED_PRECONDITION on
  // the CPU). 0: the decode kernels.
  int64_t padded_capacity = 0;
};

// The capacity worth giving LocalLayerParams::padded_capacity for a step whose experts receive
// `counts` routes, or 0 when the decode kernels are the better runner: the padded runner reads
// every expert's weights once, the decode kernels only the hit experts' but once per 8 or 16
// rows, and each costs launches. Padded when at least 90% of the experts are hit, they get two
// rows or more on average, the padding stays within 8x the routes, and the experts' weights
// come to 256 MB or more (below it the padded runner's extra launches cost more than its reads
// save: an eager one-GPU decode step of 4 tokens over 8 experts of d=2048, d_ff=768, 75 MB,
// took 175-210 us of executor time padded against 160-185 with the decode kernels).
int64_t PaddedDecodeCapacity(absl::Span<const int64_t> counts, int d, int d_ff);

// FP8 E4M3 with FP32 scales over the row or the 128-value block: scale = a / 448 and
// q = satfinite_rne(x * (448 / a)), a = max(amax, kFp8MinAmax); scale 1 when the amax is 0
// (DeepSeek-V3's multiply by the inverse scale; kernels/numeric.h).
struct QuantizeParams {
  const uint16_t* x = nullptr;  // [rows, d] BF16
  int64_t rows = 0;
  int d = 0;
  ScaleGranularity granularity = ScaleGranularity::kPerRow;
  uint8_t* q = nullptr;  // [rows, d]
  float* scales = nullptr;
  int64_t scale_count = 0;  // must equal ScaleCount(granularity, rows, d)
};

struct DequantizeParams {
  const uint8_t* q = nullptr;
  const float* scales = nullptr;
  int64_t scale_count = 0;  // must equal ScaleCount(granularity, rows, d): checked before compute
  int64_t rows = 0;
  int d = 0;
  ScaleGranularity granularity = ScaleGranularity::kPerRow;
  uint16_t* x = nullptr;  // [rows, d] BF16
};

class ExpertKernels {
 public:
  virtual ~ExpertKernels() = default;
  virtual const char* name() const = 0;
  virtual absl::Status Gather(const GatherParams& p, Stream stream) = 0;
  virtual absl::Status HistogramScan(const HistogramParams& p, Stream stream) = 0;
  virtual absl::Status RouteRows(const RouteRowsParams& p, Stream stream) = 0;
  virtual absl::Status Swiglu(const SwigluParams& p, Stream stream) = 0;
  virtual absl::Status Combine(const CombineParams& p, Stream stream) = 0;
  virtual absl::Status Quantize(const QuantizeParams& p, Stream stream) = 0;
  virtual absl::Status Dequantize(const DequantizeParams& p, Stream stream) = 0;
  virtual absl::Status LocalLayer(const LocalLayerParams& p, Stream stream) = 0;
  // FP8 experts (SwigluFp8Params). CUDA: the Hopper grouped kernels, UNIMPLEMENTED for shapes
  // they do not take (d a multiple of 256, d_ff of 128).
  virtual absl::Status SwigluFp8(const SwigluFp8Params& p, Stream stream) = 0;
  // Whether these kernels' decode path (Swiglu with device offsets in the grouped layout) runs
  // `routes` rows over the experts faster than the padded runner would, so that a caller choosing
  // a runner (the layer executor's --decode_runner auto) need not ask PaddedDecodeCapacity. CUDA:
  // where the Hopper grouped kernels take the step; the CPU reference: never.
  virtual bool DecodeGemmBeatsPadded(int num_experts, int d, int d_ff, int64_t routes) const { return false; }
  // Route planning on the kernels' memory (SealRoutesParams, RankByKeyParams). The defaults are
  // the CPU reference on host memory; CUDA runs them on `stream` without a host round trip.
  virtual absl::Status SealRoutes(const SealRoutesParams& p, Stream stream);
  virtual absl::Status RankByKey(const RankByKeyParams& p, Stream stream);
  virtual absl::Status ComposeIndex(const ComposeIndexParams& p, Stream stream);
  // ScatterParams. The default: host memory (the CPU reference); CUDA on `stream`.
  virtual absl::Status Scatter(const ScatterParams& p, Stream stream);
  // PackFp8Params. The default: host memory (the CPU reference); CUDA on `stream`.
  virtual absl::Status PackFp8Rows(const PackFp8Params& p, Stream stream);

  // Memory the kernels read and write. The defaults are host memory (the CPU implementation);
  // the CUDA implementation allocates device memory and copies on `stream` (a copy from
  // pageable host memory returns when the source may be reused; one to the host returns when
  // the data has arrived).
  virtual bool device_resident() const { return false; }
  // Bytes Allocate can still hand out (free device memory for CUDA); -1 when unbounded or
  // unknown (host memory: the process's own limits apply).
  virtual int64_t AvailableBytes() { return -1; }
  virtual absl::StatusOr<void*> Allocate(int64_t bytes);
  virtual void Free(void* p);
  virtual absl::Status CopyToKernel(void* dst, const void* src, int64_t bytes, Stream stream);
  virtual absl::Status CopyToHost(void* dst, const void* src, int64_t bytes, Stream stream);
  // A copy to host memory ordered on `stream` that may return before the data arrives: complete
  // once Synchronize(stream) returns. `dst` should be registered (RegisterHostMemory), so several
  // small copies cost one wait instead of one each. The host default copies at once.
  virtual absl::Status CopyToHostAsync(void* dst, const void* src, int64_t bytes, Stream stream);
  // Makes host memory [p, p + bytes) that the caller keeps mapped until UnregisterHostMemory
  // reachable by the copies without staging (CUDA: page-locked and registered, so copies from
  // and to it are DMA; a copy from it returns before the data has left, ordered on `stream`).
  // The defaults (host kernels) do nothing.
  virtual absl::Status RegisterHostMemory(void* p, int64_t bytes) { return absl::OkStatus(); }
  virtual void UnregisterHostMemory(void* p) {}
  // Returns when all work enqueued on `stream` has finished (its errors surface here).
  virtual absl::Status Synchronize(Stream stream) { return absl::OkStatus(); }
  // The index of the first NaN or infinite value among `n` BF16 values in kernel memory, -1 when
  // every value is finite, in two halves: Start enqueues the scan on `stream` (after its earlier
  // work) and returns; Finish waits for that scan and returns its answer. One scan at a time per
  // kernels object: every Start is followed by one Finish before the next Start.
  virtual absl::Status StartFindNonFiniteBf16(const uint16_t* x, int64_t n, Stream stream);
  virtual absl::StatusOr<int64_t> FinishFindNonFiniteBf16();
  // Both halves in one call.
  absl::StatusOr<int64_t> FindNonFiniteBf16(const uint16_t* x, int64_t n, Stream stream) {
    if (absl::Status s = StartFindNonFiniteBf16(x, n, stream); !s.ok()) return s;
    return FinishFindNonFiniteBf16();
  }

  // Device memory that another process on this host exported (CUDA IPC: the 64 bytes of a
  // cudaIpcMemHandle_t). The handle names a whole allocation; Open maps it into this process
  // and returns its base and size, CloseIpcMemory(base) unmaps it. The CPU reference has no
  // device memory: FAILED_PRECONDITION; a handle the driver refuses: INVALID_ARGUMENT.
  struct IpcMapping {
    void* base = nullptr;
    int64_t bytes = 0;
  };
  virtual absl::StatusOr<IpcMapping> OpenIpcMemory(const std::string& handle);
  virtual void CloseIpcMemory(void* base) {}
  // An event another process on this host exported (CUDA IPC: the 64 bytes of a
  // cudaIpcEventHandle_t, from an event created interprocess without timing), opened until
  // CloseIpcEvent. EventDone: whether the work before its latest record has finished (a query:
  // it never blocks, so a caller can bound its wait). The CPU reference: FAILED_PRECONDITION.
  virtual absl::StatusOr<void*> OpenIpcEvent(const std::string& handle);
  virtual void CloseIpcEvent(void* event) {}
  virtual absl::StatusOr<bool> EventDone(void* event);
  // An event of this process's for another process on this host to wait on: created
  // interprocess without timing; `handle` receives the 64 bytes of its cudaIpcEventHandle_t.
  // Destroyed with CloseIpcEvent. RecordEvent records an event (this process's or an opened one)
  // on `stream`, after the work enqueued there. The CPU reference: FAILED_PRECONDITION.
  virtual absl::StatusOr<void*> CreateIpcEvent(std::string* handle);
  virtual absl::Status RecordEvent(void* event, Stream stream);

  // Work recorded once and launched again (a CUDA graph on CUDA): BeginCapture returns a stream;
  // the calls given that stream until EndCapture(stream) are recorded instead of run (their
  // argument checks still run), and EndCapture returns the work (or, when a call cannot be
  // recorded, an error: nothing was run, and the stream is free again). LaunchCaptured runs the
  // work on `stream`, after the work enqueued there, with the pointers and sizes it was recorded
  // with, and returns true; it runs nothing and returns false once this object has freed or
  // replaced kernel memory (Free, its own scratch) since the recording, which the work may name.
  // DropCaptured releases the work. One capture at a time per kernels object, from the thread
  // that began it; a recorded call must allocate nothing (run it once eagerly first). The CPU
  // reference records nothing: BeginCapture returns UNIMPLEMENTED.
  //
  // ForkCapture(stream), while `stream` is the capture's (or one of its branches): a branch of the
  // recording, a stream whose recorded calls run after what `stream` had recorded so far and beside
  // what it records next; EndCapture waits for every branch. Elsewhere, or when the kernels keep
  // no branch free (CUDA: `capture_branches` in CudaTuning), it returns `stream` itself, so the
  // calls run in order on it.
  virtual absl::StatusOr<Stream> BeginCapture();
  virtual absl::StatusOr<Stream> ForkCapture(Stream stream) { return stream; }
  virtual absl::StatusOr<void*> EndCapture(Stream capture);
  virtual absl::StatusOr<bool> LaunchCaptured(void* work, Stream stream);
  virtual void DropCaptured(void* work) {}

 private:
  int64_t host_first_non_finite_ = -1;  // the host default's StartFindNonFiniteBf16 answer
};

// Kernel memory that only grows, owned by one ExpertKernels object (which must outlive it).
class KernelBuffer {
 public:
  KernelBuffer() = default;
  KernelBuffer(const KernelBuffer&) = delete;
  KernelBuffer& operator=(const KernelBuffer&) = delete;
  ~KernelBuffer();
  // Ensures at least `bytes` (contents are not kept when it grows).
  absl::Status Reserve(ExpertKernels* kernels, int64_t bytes);
  void* data() const { return ptr_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }

 private:
  ExpertKernels* kernels_ = nullptr;
  void* ptr_ = nullptr;
  int64_t size_ = 0;
};

// Host memory registered with one ExpertKernels object (page-locked for CUDA, so copies to and
// from it are DMA instead of the driver's staging) that only grows; contents are not kept when
// it grows. Where registering fails it stays plain host memory, which the copies still take.
class RegisteredHostBuffer {
 public:
  RegisteredHostBuffer() = default;
  RegisteredHostBuffer(const RegisteredHostBuffer&) = delete;
  RegisteredHostBuffer& operator=(const RegisteredHostBuffer&) = delete;
  ~RegisteredHostBuffer();
  absl::Status Reserve(ExpertKernels* kernels, int64_t bytes);
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }

 private:
  void Release();
  ExpertKernels* kernels_ = nullptr;
  void* ptr_ = nullptr;
  int64_t size_ = 0;
  bool registered_ = false;
};

std::unique_ptr<ExpertKernels> CreateCpuKernels();

// Switches of the CUDA kernels for side-by-side measurements; the defaults are the tuned
// choices (docs/kernels.md, bench/RESULTS.md). Process-wide: a binary's main sets them once,
// before it creates kernels (kernels created earlier keep what they were made with; the launch
// switches `pdl` and `mma_wide` apply from the next CreateCudaKernels on). The text form, what
// mains take from --cuda_tuning or MOE_CUDA_TUNING, is comma-separated key=value:
// "gemm=auto|sm90|cublas|loop|grouped,sm90_tile=auto|rows64|rows128|pingpong|pingpong_wide|rows128_epi|wide_epi,
// chain_streams=1..4,fused_layer=0|1,pdl=0|1,mma_wide=-1|0|1,down_preload=-1|0|1,blocking_sync=0|1".
struct CudaTuning {
  // auto: the Hopper grouped kernels (grouped_sm90.cu) where the shape allows and segments
  // average at most 2048 rows, else cuBLAS as `cublas` picks; sm90: the Hopper kernels wherever
  // the shape allows; cublas: cuBLAS only (chains or one grouped call by the work); loop: one
  // cuBLAS GEMM per expert; grouped: always one grouped cuBLAS call.
  enum class Gemm { kAuto, kSm90, kCublas, kLoop, kGrouped };
  Gemm gemm = Gemm::kAuto;
  // The Hopper kernels' schedule: auto (by the segments), rows64 / rows128 (cooperative tiles
  // of 64 or 128 rows), pingpong (128-row tiles, one per consumer warpgroup) or pingpong_wide
  // (the same with gate/up tiles of 96 activation columns where 96 divides d_ff, else pingpong);
  // rows128_epi: cooperative 128-row tiles whose epilogues run on the producer warpgroup's idle
  // warps (as the FP8 kernels' do), wide_epi: pingpong_wide's gate/up with rows128_epi's down
  // (rows128_epi where 96 does not divide d_ff).
  enum class Sm90Tile { kAuto, kRows64, kRows128, kPingPong, kPingPongWide, kRows128Epi, kWideEpiDown };
  Sm90Tile sm90_tile = Sm90Tile::kAuto;
  int chain_streams = 0;    // side streams for chained GEMMs; 0: the kernels' choice
  bool fused_layer = true;  // LocalLayer's fused one-token kernels (false: always in stages)
  bool pdl = true;          // programmatic dependent launch between consecutive kernels
  int mma_wide = -1;        // small-batch MMA: -1 by expected rows an expert, 0 narrow, 1 wide
  // One-row-an-expert decode steps: the down kernel's blocks load their weights into shared
  // memory while the gate/up kernel runs, where they fit (small_batch.cu). 0: off (the down
  // kernel streams its weights after the gate/up kernel); 1 or -1 (the default): on, a down
  // block an SM beside two gate/up blocks.
  int down_preload = -1;
  // FP8 experts on the Hopper kernels: the activation quantized in the gate/up kernel's epilogue
  // (false: written in BF16 and quantized by a kernel of its own; the same bytes, for A/B runs).
  bool fp8_epilogue_quant = true;
  // Branches a recording may fork (ExpertKernels::ForkCapture), at most kMaxCaptureBranches; past
  // them, forked calls run in order on the stream they were forked from. The NaN/Inf scan forks
  // first, a lone decode step's read-back second.
  static constexpr int kMaxCaptureBranches = 4;
  int capture_branches = 2;
  // Host threads waiting for the GPU block in the driver instead of spinning
  // (cudaDeviceScheduleBlockingSync), so that the process's CPU time counts its host work only:
  // for measuring host work (bench/step_host_bench.cc). Set before the process's first CUDA
  // context; waits then cost a wake-up each.
  bool blocking_sync = false;
};
// INVALID_ARGUMENT naming the key for an unknown key or a value out of range; "" is the defaults.
absl::StatusOr<CudaTuning> ParseCudaTuning(absl::string_view spec);
void SetCudaTuning(const CudaTuning& tuning);
CudaTuning GetCudaTuning();
// UNIMPLEMENTED in a build without --config=cuda; UNAVAILABLE without a usable GPU.
absl::StatusOr<std::unique_ptr<ExpertKernels>> CreateCudaKernels();

// Host-side checks shared by both implementations (called before any launch).
absl::Status CheckGather(const GatherParams& p);
absl::Status CheckHistogram(const HistogramParams& p);
absl::Status CheckRouteRows(const RouteRowsParams& p);
absl::Status CheckSealRoutes(const SealRoutesParams& p);
absl::Status CheckRankByKey(const RankByKeyParams& p);
absl::Status CheckComposeIndex(const ComposeIndexParams& p);
absl::Status CheckScatter(const ScatterParams& p);
absl::Status CheckPackFp8(const PackFp8Params& p);
absl::Status CheckSwiglu(const SwigluParams& p);
absl::Status CheckSwigluFp8(const SwigluFp8Params& p);  // what the host sees (not device offsets)
absl::Status CheckCombine(const CombineParams& p);
absl::Status CheckQuantize(const QuantizeParams& p);
absl::Status CheckDequantize(const DequantizeParams& p);
absl::Status CheckLocalLayer(const LocalLayerParams& p);

// LocalLayer as its three stages (RouteRows, Swiglu on the decode path, Combine) on `kernels`,
// with the routing tables and expert rows in `scratch` (kernel memory of that object). Where the
// kernels' decode GEMMs take the step (DecodeGemmBeatsPadded: whole tiles of rows, which read a
// gathered copy), the tokens' rows are scattered into expert order first (`expert_in`), each
// read once; otherwise the experts read them through token_of_row.
struct LocalLayerScratch {
  KernelBuffer counts, offsets, row_of_route, token_of_row, rows, expert_in;
};
absl::Status RunLocalLayerInStages(ExpertKernels* kernels, const LocalLayerParams& p, LocalLayerScratch* scratch,
                                   Stream stream);
// Grows `scratch` to what RunLocalLayerInStages needs for `p` (its only allocations).
absl::Status ReserveLocalLayerScratch(ExpertKernels* kernels, const LocalLayerParams& p, LocalLayerScratch* scratch);

}  // namespace moe::kernels

#endif  // MOE_KERNELS_API_H_
