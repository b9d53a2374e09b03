// Spec 0x09B-0x09F: the overlap fixture's serialized and overlapped schedules, makespans, the
// units where compute and communication overlap, the nine buffer lifetimes, and the failure
// lab's mistakes refused by name.
#include "runtime/plan/overlap.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe {
namespace {

using ::testing::HasSubstr;

size_t At(const std::vector<OverlapTask>& tasks, const std::string& name) {
  for (size_t i = 0; i < tasks.size(); ++i) {
    if (tasks[i].name == name) return i;
  }
  ADD_FAILURE() << "no task " << name;
  return 0;
}

// 0x09C's table, task by task: serialized [s, e) and overlapped [s, e).
TEST(OverlapTest, TheFixturesSchedulesAreTheSpecsTable) {
  const std::vector<OverlapTask> tasks = OverlapFixtureTasks();
  ASSERT_EQ(tasks.size(), 11u);
  auto serialized = SerializedSchedule(tasks);
  auto overlapped = OverlappedSchedule(tasks);
  ASSERT_TRUE(serialized.ok()) << serialized.status();
  ASSERT_TRUE(overlapped.ok()) << overlapped.status();
  const std::vector<std::pair<std::string, std::pair<TaskSpan, TaskSpan>>> table = {
      {"route_plan", {{0, 1}, {0, 1}}},    {"pack_0", {{1, 2}, {1, 2}}},       {"pack_1", {{2, 3}, {2, 3}}},
      {"dispatch_0", {{3, 6}, {2, 5}}},    {"dispatch_1", {{6, 9}, {5, 8}}},   {"shared_path", {{9, 14}, {1, 6}}},
      {"expert_0", {{14, 18}, {6, 10}}},   {"expert_1", {{18, 20}, {10, 12}}}, {"combine_0", {{20, 22}, {10, 12}}},
      {"combine_1", {{22, 24}, {12, 14}}}, {"reduce", {{24, 25}, {14, 15}}},
  };
  for (const auto& [name, want] : table) {
    const size_t i = At(tasks, name);
    EXPECT_EQ((*serialized)[i], want.first) << name;
    EXPECT_EQ((*overlapped)[i], want.second) << name;
  }
  EXPECT_EQ(Makespan(*serialized), 25);
  EXPECT_EQ(Makespan(*overlapped), 15);
  EXPECT_EQ(Makespan(*serialized) - Makespan(*overlapped), 10);  // H_optimistic
  // Compute and communication overlap for eight units (not all ten hidden units: 0x09C).
  EXPECT_EQ(OverlapUnits(tasks, *overlapped, {"compute"}, {"communication"}), 8);
  EXPECT_EQ(OverlapUnits(tasks, *serialized, {"compute"}, {"communication"}), 0);
  EXPECT_TRUE(CheckSchedule(tasks, *serialized).ok());
  EXPECT_TRUE(CheckSchedule(tasks, *overlapped).ok());
}

// 0x09D's nine half-open lifetimes on the overlapped schedule.
TEST(OverlapTest, TheFixturesBufferLifetimesAreTheSpecsTable) {
  const std::vector<OverlapTask> tasks = OverlapFixtureTasks();
  const std::vector<OverlapBuffer> buffers = OverlapFixtureBuffers();
  auto spans = *OverlappedSchedule(tasks);
  auto life = BufferLifetimes(tasks, spans, buffers);
  ASSERT_TRUE(life.ok()) << life.status();
  const std::vector<std::pair<std::string, BufferSpan>> table = {
      {"send_0", {1, 5}},
      {"send_1", {2, 8}},
      {"receive_0", {5, 10}},
      {"receive_1", {8, 12}},
      {"expert_output_0", {10, 12}},
      {"expert_output_1", {12, 14}},
      {"shared_output", {6, 15}},
      {"combined_segment_0", {12, 15}},
      {"combined_segment_1", {14, 15}},
  };
  ASSERT_EQ(life->size(), table.size());
  for (size_t i = 0; i < table.size(); ++i) {
    EXPECT_EQ(buffers[i].name, table[i].first);
    EXPECT_EQ((*life)[i], table[i].second) << table[i].first;
  }
  EXPECT_TRUE(CheckBufferLifetimes(tasks, spans, buffers, *life).ok());
}

// 0x09F: each mistake refused, naming what it broke.
TEST(OverlapTest, TheFailureLabsMistakesAreRefused) {
  const std::vector<OverlapTask> tasks = OverlapFixtureTasks();
  const std::vector<TaskSpan> good = *OverlappedSchedule(tasks);

  // Expert 0 starts when dispatch 0 is launched (unit 2), not when it completes (5).
  std::vector<TaskSpan> early = good;
  early[At(tasks, "expert_0")] = {2, 6};
  absl::Status s = CheckSchedule(tasks, early);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("expert_0 starts at 2, before dispatch_0 completes at 5"));

  // Two communication tasks overlap on the one serialized stream.
  std::vector<TaskSpan> crowded = good;
  crowded[At(tasks, "dispatch_1")] = {3, 6};
  s = CheckSchedule(tasks, crowded);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("dispatch_0 and dispatch_1 overlap on stream communication"));

  // A span of another length than the task's units.
  std::vector<TaskSpan> short_task = good;
  short_task[At(tasks, "reduce")] = {14, 14};
  EXPECT_THAT(CheckSchedule(tasks, short_task).message(), HasSubstr("task reduce"));

  const std::vector<OverlapBuffer> buffers = OverlapFixtureBuffers();
  std::vector<BufferSpan> life = *BufferLifetimes(tasks, good, buffers);
  // The send buffer released after the pack (2): dispatch 1 still reads it until 8.
  std::vector<BufferSpan> send_early = life;
  send_early[1] = {2, 3};
  s = CheckBufferLifetimes(tasks, good, buffers, send_early);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("send_1: released at 3, before its last consumer dispatch_1 completes at 8"));
  // The shared output released when the shared path (FC2) ends: the reduction reads it at 14-15.
  std::vector<BufferSpan> shared_early = life;
  shared_early[6] = {6, 6};
  EXPECT_THAT(CheckBufferLifetimes(tasks, good, buffers, shared_early).message(),
              HasSubstr("shared_output: released at 6, before its last consumer reduce completes at 15"));
  // A receive buffer allocated after the dispatch has written it.
  std::vector<BufferSpan> late = life;
  late[2] = {6, 10};
  EXPECT_THAT(CheckBufferLifetimes(tasks, good, buffers, late).message(), HasSubstr("receive_0: allocated at 6"));
}

// The task graph itself: what a schedule cannot be built from.
TEST(OverlapTest, MalformedTaskGraphsAreRefusedNamingTheTask) {
  std::vector<OverlapTask> tasks = OverlapFixtureTasks();
  std::swap(tasks[0], tasks[1]);  // pack_0 listed before the route plan it waits for
  EXPECT_THAT(OverlappedSchedule(tasks).status().message(), HasSubstr("task pack_0: waits for 'route_plan'"));
  tasks = OverlapFixtureTasks();
  tasks[3].waits_for.push_back("dispatch_0");  // itself
  EXPECT_THAT(CheckTasks(tasks).message(), HasSubstr("which is itself"));
  tasks = OverlapFixtureTasks();
  tasks[4].name = "dispatch_0";
  EXPECT_THAT(CheckTasks(tasks).message(), HasSubstr("listed twice"));
  tasks = OverlapFixtureTasks();
  tasks[5].units = 0;
  EXPECT_EQ(CheckTasks(tasks).code(), absl::StatusCode::kInvalidArgument);
  tasks = OverlapFixtureTasks();
  EXPECT_EQ(CheckSchedule(tasks, {}).code(), absl::StatusCode::kInvalidArgument);
  std::vector<OverlapBuffer> buffers = OverlapFixtureBuffers();
  buffers[0].consumers = {"nobody"};
  EXPECT_THAT(BufferLifetimes(tasks, *OverlappedSchedule(tasks), buffers).status().message(),
              HasSubstr("consumer 'nobody' is no task"));
}

}  // namespace
}  // namespace moe
