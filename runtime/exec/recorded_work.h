// Work a step enqueues on the kernels, recorded once (ExpertKernels::BeginCapture: a CUDA graph)
// and launched again for later steps with the same key: one launch instead of a launch per kernel
// and copy, with the host's per-call work (argument checks, driver calls) done once.
//
// The key must name everything the recorded calls were given that the work depends on:
// pointers, sizes, events, the runner's choices. The cache never reads memory through it.
// A key's first step runs eagerly (which sizes the kernels' scratch, so the recording allocates
// nothing); its second is recorded and launched; later ones launch the recording. When the
// kernels have freed or replaced memory since a recording (LaunchCaptured answers false), the
// recording is dropped and the key starts again with an eager step. A recording that fails
// (a call that cannot be captured) runs the step eagerly; after two failures a key stays eager.
// Kernels that record nothing (the CPU reference) run every step eagerly.
//
// At most `capacity` keys are kept. A new key takes the place of the least recently used one only
// when that one has not run for 2 x capacity steps; otherwise the new key's step runs eagerly and
// nothing is dropped. So an engine cycling through more keys than are kept gets the kept ones
// launched and the rest eager (least recently used eviction would drop each key just before its
// turn comes again, and nothing would ever launch), and keys that stopped being used make room.
#ifndef MOE_RUNTIME_EXEC_RECORDED_WORK_H_
#define MOE_RUNTIME_EXEC_RECORDED_WORK_H_

#include <array>
#include <cstdint>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"

#include "kernels/api.h"

namespace moe {

class RecordedWork {
 public:
  static constexpr int kKeyWords = 28;  // unused words stay zero
  using Key = std::array<uint64_t, kKeyWords>;

  struct Stats {
    int64_t launches = 0;  // steps run by launching a recording
    int64_t recorded = 0;  // recordings made
    int64_t eager = 0;     // steps run eagerly (first of a key, after a failure, or no recording)
    int64_t stale = 0;     // recordings dropped because the kernels' memory changed
    int64_t failed = 0;    // recordings that failed (the step then ran eagerly)
    int64_t evicted = 0;   // recordings dropped to make room for another key
    int64_t full = 0;      // steps run eagerly because every kept key had run recently
    std::string last_failure;
  };

  // At most `capacity` keys (see above). `kernels` must outlive this.
  RecordedWork(kernels::ExpertKernels* kernels, int capacity);
  ~RecordedWork();
  RecordedWork(const RecordedWork&) = delete;
  RecordedWork& operator=(const RecordedWork&) = delete;

  // Runs `enqueue` for `key`'s step on the kernels' default stream (the null stream), eagerly
  // or as a recording of it. `enqueue` enqueues only on the stream it is given and must do the
  // same thing each time it is called with the same key.
  // `*launched` (when given): whether the step ran as a launch of a recording.
  absl::Status Run(const Key& key, absl::FunctionRef<absl::Status(kernels::Stream)> enqueue, bool* launched = nullptr);

  const Stats& stats() const { return stats_; }
  int size() const { return static_cast<int>(entries_.size()); }

 private:
  struct Entry {
    void* work = nullptr;
    int eager_runs = 0;
    int failures = 0;
    uint64_t used = 0;
  };
  absl::Status Eager(absl::FunctionRef<absl::Status(kernels::Stream)> enqueue);
  void Drop(Entry& e);

  kernels::ExpertKernels* const kernels_;
  const int capacity_;
  bool supported_ = true;
  uint64_t clock_ = 0;
  absl::flat_hash_map<Key, Entry> entries_;
  Stats stats_;
};

}  // namespace moe

#endif  // MOE_RUNTIME_EXEC_RECORDED_WORK_H_
