// DecodeStepGraph on CUDA + NCCL (built under --config=cuda only).
#ifndef MOE_RUNTIME_EXEC_CUDA_DECODE_GRAPH_H_
#define MOE_RUNTIME_EXEC_CUDA_DECODE_GRAPH_H_

#include "runtime/exec/decode_graph.h"
#include "runtime/transport/transport.h"

namespace moe {

// Graphs over `transport`'s NCCL communicator and stream (CreateNcclTransport); each graph owns
// its own kernels object, so its scratch never moves under it. `transport` must outlive them.
DecodeGraphFactory CudaDecodeGraphs(Transport* transport);

}  // namespace moe

#endif  // MOE_RUNTIME_EXEC_CUDA_DECODE_GRAPH_H_
