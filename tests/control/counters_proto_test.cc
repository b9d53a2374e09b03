#include "rpc/counters_proto.h"

#include <set>
#include <string>

#include "gtest/gtest.h"

namespace moe {
namespace {

// Every counter a distinct value, so a field written into (or read from) its neighbour shows.
GenerationCounters Distinct() {
  GenerationCounters c;
  c.steps = 101;
  c.failed_steps = 102;
  c.aborted_steps = 103;
  c.canary_steps = 104;
  c.decode_steps = 105;
  c.fallback_steps = 106;
  c.routes_attempted = 107;
  c.routes_dropped = 108;
  c.shadow_samples = 109;
  c.shadow_mismatches = 110;
  c.shadow_failures = 111;
  c.stale_accepts = 112;
  c.rejected_steps = 113;
  c.count_failures = 114;
  return c;
}

TEST(CountersProtoTest, ToProtoWritesEveryFieldByName) {
  const v1::GenerationCounters p = GenerationCountersToProto(42, Distinct());
  EXPECT_EQ(p.version(), 42);
  EXPECT_EQ(p.steps(), 101);
  EXPECT_EQ(p.failed_steps(), 102);
  EXPECT_EQ(p.aborted_steps(), 103);
  EXPECT_EQ(p.canary_steps(), 104);
  EXPECT_EQ(p.decode_steps(), 105);
  EXPECT_EQ(p.fallback_steps(), 106);
  EXPECT_EQ(p.routes_attempted(), 107);
  EXPECT_EQ(p.routes_dropped(), 108);
  EXPECT_EQ(p.shadow_samples(), 109);
  EXPECT_EQ(p.shadow_mismatches(), 110);
  EXPECT_EQ(p.shadow_failures(), 111);
  EXPECT_EQ(p.stale_accepts(), 112);
  EXPECT_EQ(p.rejected_steps(), 113);
  EXPECT_EQ(p.count_failures(), 114);
  // A counter added to the proto but not to the translation stays 0 here.
  const google::protobuf::Descriptor* d = p.GetDescriptor();
  const google::protobuf::Reflection* r = p.GetReflection();
  std::set<int64_t> seen;
  for (int i = 0; i < d->field_count(); ++i) {
    const google::protobuf::FieldDescriptor* f = d->field(i);
    ASSERT_EQ(f->cpp_type(), google::protobuf::FieldDescriptor::CPPTYPE_INT64) << f->name();
    const int64_t v = r->GetInt64(p, f);
    EXPECT_NE(v, 0) << f->name() << " is not written";
    EXPECT_TRUE(seen.insert(v).second) << f->name() << " repeats another field's value";
  }
}

TEST(CountersProtoTest, RoundTripsThroughWireFormat) {
  std::string wire;
  ASSERT_TRUE(GenerationCountersToProto(7, Distinct()).SerializeToString(&wire));
  v1::GenerationCounters parsed;
  ASSERT_TRUE(parsed.ParseFromString(wire));
  EXPECT_EQ(parsed.version(), 7);
  const GenerationCounters a = Distinct();
  const GenerationCounters b = GenerationCountersFromProto(parsed);
  EXPECT_EQ(b.steps, a.steps);
  EXPECT_EQ(b.failed_steps, a.failed_steps);
  EXPECT_EQ(b.aborted_steps, a.aborted_steps);
  EXPECT_EQ(b.canary_steps, a.canary_steps);
  EXPECT_EQ(b.decode_steps, a.decode_steps);
  EXPECT_EQ(b.fallback_steps, a.fallback_steps);
  EXPECT_EQ(b.routes_attempted, a.routes_attempted);
  EXPECT_EQ(b.routes_dropped, a.routes_dropped);
  EXPECT_EQ(b.shadow_samples, a.shadow_samples);
  EXPECT_EQ(b.shadow_mismatches, a.shadow_mismatches);
  EXPECT_EQ(b.shadow_failures, a.shadow_failures);
  EXPECT_EQ(b.stale_accepts, a.stale_accepts);
  EXPECT_EQ(b.rejected_steps, a.rejected_steps);
  EXPECT_EQ(b.count_failures, a.count_failures);
}

TEST(CountersProtoTest, EmptyProtoIsAllZero) {
  const GenerationCounters c = GenerationCountersFromProto(v1::GenerationCounters());
  EXPECT_EQ(c.steps + c.failed_steps + c.aborted_steps + c.canary_steps + c.decode_steps + c.fallback_steps +
                c.routes_attempted + c.routes_dropped + c.shadow_samples + c.shadow_mismatches + c.shadow_failures +
                c.stale_accepts + c.rejected_steps + c.count_failures,
            0);
}

}  // namespace
}  // namespace moe
