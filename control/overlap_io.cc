#include "control/overlap_io.h"

#include <map>

#include "absl/strings/str_cat.h"

#include "runtime/status.h"

namespace moe {

using json::Json;

namespace {

constexpr size_t kMaxEntries = size_t{1} << 16;  // tasks, buffers, names waited for or consumed

absl::StatusOr<std::vector<std::string>> Names(const Json& v, const std::string& path) {
  ASSIGN_OR_RETURN(const Json* a, json::Array(v, path));
  if (a->size() > kMaxEntries) return json::Invalid(path, absl::StrCat("at most ", kMaxEntries, " names"));
  std::vector<std::string> out;
  for (size_t i = 0; i < a->size(); ++i) {
    ASSIGN_OR_RETURN(std::string s, json::String((*a)[i], absl::StrCat(path, "[", i, "]")));
    out.push_back(std::move(s));
  }
  return out;
}

// Member `key` of object `obj` (at `path`), required: a string, or an integer.
absl::StatusOr<std::string> RequiredString(const Json& obj, const std::string& path, const std::string& key) {
  ASSIGN_OR_RETURN(const Json* v, json::Member(obj, path, key));
  return json::String(*v, absl::StrCat(path, ".", key));
}
absl::StatusOr<int64_t> RequiredInt(const Json& obj, const std::string& path, const std::string& key) {
  ASSIGN_OR_RETURN(const Json* v, json::Member(obj, path, key));
  return json::Int(*v, absl::StrCat(path, ".", key));
}

// {"name": [a, b], ...} in the order of `names` (every one present, no other).
absl::StatusOr<std::vector<std::pair<int64_t, int64_t>>> Pairs(const Json& v, const std::string& path,
                                                               const std::vector<std::string>& names) {
  if (!v.is_object()) return json::Invalid(path, "expected an object of [start, end] pairs by name");
  std::vector<std::pair<int64_t, int64_t>> out;
  for (const std::string& n : names) {
    ASSIGN_OR_RETURN(const Json* p, json::Member(v, path, n));
    const std::string at = absl::StrCat(path, ".", n);
    ASSIGN_OR_RETURN(const Json* a, json::Array(*p, at));
    if (a->size() != 2) return json::Invalid(at, "expected [start, end]");
    ASSIGN_OR_RETURN(int64_t s, json::Int((*a)[0], at + "[0]"));
    ASSIGN_OR_RETURN(int64_t e, json::Int((*a)[1], at + "[1]"));
    out.emplace_back(s, e);
  }
  if (v.size() != names.size()) return json::Invalid(path, "names an entry that is not listed");
  return out;
}

Json SpansJson(const std::vector<OverlapTask>& tasks, const std::vector<TaskSpan>& spans) {
  Json out = Json::object();
  for (size_t i = 0; i < tasks.size(); ++i) out[tasks[i].name] = {spans[i].start, spans[i].end};
  return out;
}

}  // namespace

absl::StatusOr<OverlapInput> ParseOverlapInput(const Json& doc) {
  if (!doc.is_object()) return json::Invalid("input", "expected a JSON object");
  OverlapInput in;
  ASSIGN_OR_RETURN(const Json* tasks, json::Member(doc, "", "tasks"));
  ASSIGN_OR_RETURN(tasks, json::Array(*tasks, "tasks"));
  if (tasks->empty() || tasks->size() > kMaxEntries) {
    return json::Invalid("tasks", absl::StrCat("1 to ", kMaxEntries, " tasks"));
  }
  for (size_t i = 0; i < tasks->size(); ++i) {
    const Json& t = (*tasks)[i];
    const std::string path = absl::StrCat("tasks[", i, "]");
    if (!t.is_object()) return json::Invalid(path, "expected an object");
    OverlapTask task;
    ASSIGN_OR_RETURN(task.name, RequiredString(t, path, "name"));
    ASSIGN_OR_RETURN(task.units, RequiredInt(t, path, "units"));
    ASSIGN_OR_RETURN(task.stream, RequiredString(t, path, "stream"));
    if (t.contains("waits_for")) {
      ASSIGN_OR_RETURN(task.waits_for, Names(t["waits_for"], path + ".waits_for"));
    }
    in.tasks.push_back(std::move(task));
  }
  if (absl::Status s = CheckTasks(in.tasks); !s.ok()) return s;
  if (doc.contains("buffers")) {
    ASSIGN_OR_RETURN(const Json* buffers, json::Array(doc["buffers"], "buffers"));
    if (buffers->size() > kMaxEntries) return json::Invalid("buffers", absl::StrCat("at most ", kMaxEntries));
    for (size_t i = 0; i < buffers->size(); ++i) {
      const Json& b = (*buffers)[i];
      const std::string path = absl::StrCat("buffers[", i, "]");
      if (!b.is_object()) return json::Invalid(path, "expected an object");
      OverlapBuffer buf;
      ASSIGN_OR_RETURN(buf.name, RequiredString(b, path, "name"));
      ASSIGN_OR_RETURN(buf.producer, RequiredString(b, path, "producer"));
      if (b.contains("from_producer_start")) {
        ASSIGN_OR_RETURN(buf.from_producer_start, json::Bool(b["from_producer_start"], path + ".from_producer_start"));
      }
      ASSIGN_OR_RETURN(const Json* consumers, json::Member(b, path, "consumers"));
      ASSIGN_OR_RETURN(buf.consumers, Names(*consumers, path + ".consumers"));
      in.buffers.push_back(std::move(buf));
    }
  }
  if (doc.contains("overlap_streams")) {
    ASSIGN_OR_RETURN(const Json* pair, json::Array(doc["overlap_streams"], "overlap_streams"));
    if (pair->size() != 2) return json::Invalid("overlap_streams", "expected two lists of streams");
    ASSIGN_OR_RETURN(std::vector<std::string> a, Names((*pair)[0], "overlap_streams[0]"));
    ASSIGN_OR_RETURN(std::vector<std::string> b, Names((*pair)[1], "overlap_streams[1]"));
    in.streams_a = std::set<std::string>(a.begin(), a.end());
    in.streams_b = std::set<std::string>(b.begin(), b.end());
  }
  if (doc.contains("schedule")) {
    std::vector<std::string> names;
    for (const OverlapTask& t : in.tasks) names.push_back(t.name);
    ASSIGN_OR_RETURN(auto pairs, Pairs(doc["schedule"], "schedule", names));
    std::vector<TaskSpan> spans;
    for (const auto& [s, e] : pairs) spans.push_back({s, e});
    in.schedule = std::move(spans);
  }
  if (doc.contains("buffer_lifetimes")) {
    std::vector<std::string> names;
    for (const OverlapBuffer& b : in.buffers) names.push_back(b.name);
    ASSIGN_OR_RETURN(auto pairs, Pairs(doc["buffer_lifetimes"], "buffer_lifetimes", names));
    std::vector<BufferSpan> spans;
    for (const auto& [a, r] : pairs) spans.push_back({a, r});
    in.lifetimes = std::move(spans);
  }
  return in;
}

absl::StatusOr<Json> OverlapReport(const OverlapInput& in) {
  ASSIGN_OR_RETURN(const std::vector<TaskSpan> serialized, SerializedSchedule(in.tasks));
  ASSIGN_OR_RETURN(const std::vector<TaskSpan> overlapped, OverlappedSchedule(in.tasks));
  const std::vector<TaskSpan>& used = in.schedule.has_value() ? *in.schedule : overlapped;
  if (in.schedule.has_value()) RETURN_IF_ERROR(CheckSchedule(in.tasks, *in.schedule));
  ASSIGN_OR_RETURN(const std::vector<BufferSpan> lifetimes, BufferLifetimes(in.tasks, used, in.buffers));
  if (in.lifetimes.has_value()) RETURN_IF_ERROR(CheckBufferLifetimes(in.tasks, used, in.buffers, *in.lifetimes));
  Json buffers = Json::object();
  for (size_t i = 0; i < in.buffers.size(); ++i) {
    buffers[in.buffers[i].name] = {lifetimes[i].allocated, lifetimes[i].released};
  }
  Json report = {{"units", "analytical (spec 0x09C: a dependency argument, not a measured time)"},
                 {"serialized", SpansJson(in.tasks, serialized)},
                 {"overlapped", SpansJson(in.tasks, overlapped)},
                 {"makespan", {{"serialized", Makespan(serialized)}, {"overlapped", Makespan(overlapped)}}},
                 {"hidden_units", Makespan(serialized) - Makespan(overlapped)},
                 {"overlap_units", OverlapUnits(in.tasks, overlapped, in.streams_a, in.streams_b)},
                 {"buffer_lifetimes", buffers}};
  if (in.schedule.has_value()) {
    report["checked"]["schedule"] = {
        {"makespan", Makespan(*in.schedule)},
        {"overlap_units", OverlapUnits(in.tasks, *in.schedule, in.streams_a, in.streams_b)}};
  }
  if (in.lifetimes.has_value()) report["checked"]["buffer_lifetimes"] = "ok";
  return report;
}

}  // namespace moe
