// Heap allocations of the calling thread, for a binary that links //bench:alloc_counter: the
// library replaces the global operator new and delete (every form), so every allocation of the
// binary counts, the executor's and its libraries' alike.
#ifndef MOE_BENCH_ALLOC_COUNTER_H_
#define MOE_BENCH_ALLOC_COUNTER_H_

#include <cstdint>

namespace moe::bench {

// operator new calls this thread has made so far.
int64_t ThreadAllocations();

// While on, each operator new of this thread writes its size and the call stack to stderr
// (raw frames, `binary(+offset)`, for addr2line; names where the binary exports them): where a
// step's allocations come from.
void TraceThreadAllocations(bool on);

}  // namespace moe::bench

#endif  // MOE_BENCH_ALLOC_COUNTER_H_
