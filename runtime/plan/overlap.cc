#include "runtime/plan/overlap.h"

#include <algorithm>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"

#include "runtime/status.h"

namespace moe {

namespace {

constexpr int64_t kMaxUnits = int64_t{1} << 40;  // sums of up to 2^20 tasks stay far from overflow
constexpr size_t kMaxTasks = size_t{1} << 20;

// Task name -> position (CheckTasks has passed).
std::map<std::string, size_t> IndexOf(const std::vector<OverlapTask>& tasks) {
  std::map<std::string, size_t> index;
  for (size_t i = 0; i < tasks.size(); ++i) index.emplace(tasks[i].name, i);
  return index;
}

// [start, end) intervals merged into a sorted, disjoint union.
std::vector<std::pair<int64_t, int64_t>> Union(std::vector<std::pair<int64_t, int64_t>> v) {
  std::sort(v.begin(), v.end());
  std::vector<std::pair<int64_t, int64_t>> out;
  for (const auto& [s, e] : v) {
    if (s >= e) continue;
    if (!out.empty() && s <= out.back().second) {
      out.back().second = std::max(out.back().second, e);
    } else {
      out.emplace_back(s, e);
    }
  }
  return out;
}

absl::Status CheckSpans(const std::vector<OverlapTask>& tasks, const std::vector<TaskSpan>& spans) {
  if (spans.size() != tasks.size()) {
    return absl::InvalidArgumentError(absl::StrCat("schedule: ", spans.size(), " spans for ", tasks.size(), " tasks"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckTasks(const std::vector<OverlapTask>& tasks) {
  if (tasks.size() > kMaxTasks) {
    return absl::InvalidArgumentError(absl::StrCat("tasks: ", tasks.size(), " tasks; at most ", kMaxTasks));
  }
  std::map<std::string, size_t> seen;
  for (size_t i = 0; i < tasks.size(); ++i) {
    const OverlapTask& t = tasks[i];
    const std::string where = absl::StrCat("tasks[", i, "]");
    if (t.name.empty()) return absl::InvalidArgumentError(absl::StrCat(where, ".name: required"));
    if (t.stream.empty()) return absl::InvalidArgumentError(absl::StrCat("task ", t.name, ": stream required"));
    if (t.units <= 0 || t.units > kMaxUnits) {
      return absl::InvalidArgumentError(absl::StrCat("task ", t.name, ": units ", t.units, " must be in [1, 2^40]"));
    }
    for (const std::string& w : t.waits_for) {
      if (seen.count(w) == 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "task ", t.name, ": waits for '", w, "', which is ",
            w == t.name ? "itself" : "not a task listed before it (list every task after the tasks it waits for)"));
      }
    }
    if (!seen.emplace(t.name, i).second) {
      return absl::InvalidArgumentError(absl::StrCat(where, ".name: '", t.name, "' is listed twice"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<TaskSpan>> SerializedSchedule(const std::vector<OverlapTask>& tasks) {
  RETURN_IF_ERROR(CheckTasks(tasks));
  std::vector<TaskSpan> spans;
  int64_t t = 0;
  for (const OverlapTask& task : tasks) {
    spans.push_back({t, t + task.units});
    t += task.units;
  }
  return spans;
}

absl::StatusOr<std::vector<TaskSpan>> OverlappedSchedule(const std::vector<OverlapTask>& tasks) {
  RETURN_IF_ERROR(CheckTasks(tasks));
  const std::map<std::string, size_t> index = IndexOf(tasks);
  std::map<std::string, int64_t> stream_free;
  std::vector<TaskSpan> spans;
  for (const OverlapTask& task : tasks) {
    int64_t start = stream_free[task.stream];
    for (const std::string& w : task.waits_for) start = std::max(start, spans[index.at(w)].end);
    spans.push_back({start, start + task.units});
    stream_free[task.stream] = start + task.units;
  }
  return spans;
}

absl::Status CheckSchedule(const std::vector<OverlapTask>& tasks, const std::vector<TaskSpan>& spans) {
  RETURN_IF_ERROR(CheckTasks(tasks));
  RETURN_IF_ERROR(CheckSpans(tasks, spans));
  const std::map<std::string, size_t> index = IndexOf(tasks);
  for (size_t i = 0; i < tasks.size(); ++i) {
    const OverlapTask& t = tasks[i];
    const TaskSpan& s = spans[i];
    int64_t length = 0;
    if (s.start < 0 || s.start > kMaxUnits * static_cast<int64_t>(kMaxTasks) ||
        __builtin_sub_overflow(s.end, s.start, &length) || length != t.units) {
      return absl::FailedPreconditionError(
          absl::StrCat("task ", t.name, ": [", s.start, ", ", s.end, ") is not ", t.units, " units from a start >= 0"));
    }
    for (const std::string& w : t.waits_for) {
      const TaskSpan& p = spans[index.at(w)];
      if (s.start < p.end) {
        return absl::FailedPreconditionError(absl::StrCat("task ", t.name, " starts at ", s.start, ", before ", w,
                                                          " completes at ", p.end,
                                                          ": completion, not launch, owns readiness (0x09B)"));
      }
    }
  }
  for (size_t i = 0; i < tasks.size(); ++i) {
    for (size_t j = i + 1; j < tasks.size(); ++j) {
      if (tasks[i].stream != tasks[j].stream) continue;
      if (spans[i].start < spans[j].end && spans[j].start < spans[i].end) {
        return absl::FailedPreconditionError(absl::StrCat("tasks ", tasks[i].name, " and ", tasks[j].name,
                                                          " overlap on stream ", tasks[i].stream,
                                                          ", which runs one task at a time (0x09B)"));
      }
    }
  }
  return absl::OkStatus();
}

int64_t Makespan(const std::vector<TaskSpan>& spans) {
  int64_t m = 0;
  for (const TaskSpan& s : spans) m = std::max(m, s.end);
  return m;
}

int64_t OverlapUnits(const std::vector<OverlapTask>& tasks, const std::vector<TaskSpan>& spans,
                     const std::set<std::string>& a, const std::set<std::string>& b) {
  std::vector<std::pair<int64_t, int64_t>> in_a, in_b;
  for (size_t i = 0; i < tasks.size() && i < spans.size(); ++i) {
    if (a.count(tasks[i].stream) != 0) in_a.emplace_back(spans[i].start, spans[i].end);
    if (b.count(tasks[i].stream) != 0) in_b.emplace_back(spans[i].start, spans[i].end);
  }
  const auto ua = Union(std::move(in_a)), ub = Union(std::move(in_b));
  int64_t units = 0;
  size_t i = 0, j = 0;
  while (i < ua.size() && j < ub.size()) {
    const int64_t s = std::max(ua[i].first, ub[j].first), e = std::min(ua[i].second, ub[j].second);
    if (s < e) units += e - s;
    if (ua[i].second < ub[j].second) {
      ++i;
    } else {
      ++j;
    }
  }
  return units;
}

absl::StatusOr<std::vector<BufferSpan>> BufferLifetimes(const std::vector<OverlapTask>& tasks,
                                                        const std::vector<TaskSpan>& spans,
                                                        const std::vector<OverlapBuffer>& buffers) {
  RETURN_IF_ERROR(CheckTasks(tasks));
  RETURN_IF_ERROR(CheckSpans(tasks, spans));
  const std::map<std::string, size_t> index = IndexOf(tasks);
  std::vector<BufferSpan> out;
  for (const OverlapBuffer& b : buffers) {
    auto p = index.find(b.producer);
    if (p == index.end()) {
      return absl::InvalidArgumentError(absl::StrCat("buffer ", b.name, ": producer '", b.producer, "' is no task"));
    }
    if (b.consumers.empty()) return absl::InvalidArgumentError(absl::StrCat("buffer ", b.name, ": no consumer"));
    BufferSpan s;
    s.allocated = b.from_producer_start ? spans[p->second].start : spans[p->second].end;
    s.released = s.allocated;
    for (const std::string& c : b.consumers) {
      auto q = index.find(c);
      if (q == index.end()) {
        return absl::InvalidArgumentError(absl::StrCat("buffer ", b.name, ": consumer '", c, "' is no task"));
      }
      s.released = std::max(s.released, spans[q->second].end);
    }
    out.push_back(s);
  }
  return out;
}

absl::Status CheckBufferLifetimes(const std::vector<OverlapTask>& tasks, const std::vector<TaskSpan>& spans,
                                  const std::vector<OverlapBuffer>& buffers, const std::vector<BufferSpan>& given) {
  ASSIGN_OR_RETURN(const std::vector<BufferSpan> need, BufferLifetimes(tasks, spans, buffers));
  if (given.size() != buffers.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("buffer lifetimes: ", given.size(), " for ", buffers.size(), " buffers"));
  }
  const std::map<std::string, size_t> index = IndexOf(tasks);
  for (size_t i = 0; i < buffers.size(); ++i) {
    const OverlapBuffer& b = buffers[i];
    if (given[i].allocated > need[i].allocated) {
      return absl::FailedPreconditionError(absl::StrCat("buffer ", b.name, ": allocated at ", given[i].allocated,
                                                        ", after ", b.producer, " writes into it at ",
                                                        need[i].allocated));
    }
    if (given[i].released < need[i].released) {
      std::string last;
      for (const std::string& c : b.consumers) {
        if (spans[index.at(c)].end == need[i].released) last = c;
      }
      return absl::FailedPreconditionError(absl::StrCat("buffer ", b.name, ": released at ", given[i].released,
                                                        ", before its last consumer ", last, " completes at ",
                                                        need[i].released, " (0x09D: early reuse)"));
    }
  }
  return absl::OkStatus();
}

std::vector<OverlapTask> OverlapFixtureTasks() {
  return {
      {"route_plan", 1, "control", {}},
      {"pack_0", 1, "pack", {"route_plan"}},
      {"pack_1", 1, "pack", {"route_plan"}},
      {"dispatch_0", 3, "communication", {"pack_0"}},
      {"dispatch_1", 3, "communication", {"pack_1"}},
      {"shared_path", 5, "compute", {"route_plan"}},
      {"expert_0", 4, "compute", {"dispatch_0"}},
      {"expert_1", 2, "compute", {"dispatch_1"}},
      {"combine_0", 2, "communication", {"expert_0"}},
      {"combine_1", 2, "communication", {"expert_1"}},
      {"reduce", 1, "compute", {"combine_0", "combine_1", "shared_path"}},
  };
}

std::vector<OverlapBuffer> OverlapFixtureBuffers() {
  return {
      {"send_0", "pack_0", true, {"dispatch_0"}},
      {"send_1", "pack_1", true, {"dispatch_1"}},
      {"receive_0", "dispatch_0", false, {"expert_0"}},
      {"receive_1", "dispatch_1", false, {"expert_1"}},
      {"expert_output_0", "expert_0", false, {"combine_0"}},
      {"expert_output_1", "expert_1", false, {"combine_1"}},
      {"shared_output", "shared_path", false, {"reduce"}},
      {"combined_segment_0", "combine_0", false, {"reduce"}},
      {"combined_segment_1", "combine_1", false, {"reduce"}},
  };
}

}  // namespace moe
