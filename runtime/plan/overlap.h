// Spec 0x09: communication-compute overlap as a dependency schedule over tasks, streams and
// buffers, in integer analytical units (a replayable argument about dependencies, not a
// measurement: 0x09C). A task runs `units` long on one stream once every task it waits for has
// completed; tasks of one stream never overlap; a buffer lives from its producer until its last
// consumer has completed.
//
// Pure functions over plain data; thread-compatible.
#ifndef MOE_RUNTIME_PLAN_OVERLAP_H_
#define MOE_RUNTIME_PLAN_OVERLAP_H_

#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace moe {

struct OverlapTask {
  std::string name;
  int64_t units = 0;  // > 0
  std::string stream;
  std::vector<std::string> waits_for;  // tasks whose completion this one needs
};

struct TaskSpan {
  int64_t start = 0;  // [start, end)
  int64_t end = 0;
  bool operator==(const TaskSpan& o) const { return start == o.start && end == o.end; }
};

// A buffer written by `producer` (from its start when `from_producer_start`, e.g. a send buffer
// the pack fills; else once it completes) and read by `consumers`.
struct OverlapBuffer {
  std::string name;
  std::string producer;
  bool from_producer_start = false;
  std::vector<std::string> consumers;
};

struct BufferSpan {
  int64_t allocated = 0;  // live on [allocated, released)
  int64_t released = 0;
  bool operator==(const BufferSpan& o) const { return allocated == o.allocated && released == o.released; }
};

// The task graph itself: unique names, positive units (at most 2^40), known tasks waited for,
// each listed after every task it waits for (so the list order is a topological order and the
// graph has no cycle). INVALID_ARGUMENT naming the task.
absl::Status CheckTasks(const std::vector<OverlapTask>& tasks);

// Every task after the one before it, in list order (0x09C's serialized schedule).
absl::StatusOr<std::vector<TaskSpan>> SerializedSchedule(const std::vector<OverlapTask>& tasks);

// List scheduling in list order: each task starts as soon as the tasks it waits for have
// completed and its stream is free (0x09C's overlapped schedule).
absl::StatusOr<std::vector<TaskSpan>> OverlappedSchedule(const std::vector<OverlapTask>& tasks);

// 0x09B's contract of a schedule (spans[i] is tasks[i]'s): end - start = units; a task starts
// no earlier than every task it waits for ends (completion, not launch, owns readiness); no two
// tasks of one stream overlap. FAILED_PRECONDITION naming the first violation.
absl::Status CheckSchedule(const std::vector<OverlapTask>& tasks, const std::vector<TaskSpan>& spans);

// The latest end (0 for no task).
int64_t Makespan(const std::vector<TaskSpan>& spans);

// Units during which some task of a stream in `a` and some task of a stream in `b` both run:
// |union of a's spans  intersected with  union of b's spans|.
int64_t OverlapUnits(const std::vector<OverlapTask>& tasks, const std::vector<TaskSpan>& spans,
                     const std::set<std::string>& a, const std::set<std::string>& b);

// 0x09D: each buffer from its producer's start (or end) to its last consumer's end.
// INVALID_ARGUMENT naming a buffer whose producer or consumer is no task, or that has no consumer.
absl::StatusOr<std::vector<BufferSpan>> BufferLifetimes(const std::vector<OverlapTask>& tasks,
                                                        const std::vector<TaskSpan>& spans,
                                                        const std::vector<OverlapBuffer>& buffers);

// Lifetimes given for `buffers` (given[i] is buffers[i]'s): FAILED_PRECONDITION naming the
// buffer when one is allocated after its producer writes into it, or released before its last
// consumer completes (early reuse: a shape-correct, wrong answer; 0x09D).
absl::Status CheckBufferLifetimes(const std::vector<OverlapTask>& tasks, const std::vector<TaskSpan>& spans,
                                  const std::vector<OverlapBuffer>& buffers, const std::vector<BufferSpan>& given);

// The exact fixture of 0x09B and 0x09D: eleven tasks (two route slots, a shared path, the
// reduction) and nine buffers.
std::vector<OverlapTask> OverlapFixtureTasks();
std::vector<OverlapBuffer> OverlapFixtureBuffers();

}  // namespace moe

#endif  // MOE_RUNTIME_PLAN_OVERLAP_H_
