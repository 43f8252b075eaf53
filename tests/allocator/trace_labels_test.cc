// What PyTorch's allocator records beside the trace, and the c10 adapter forwards to the core:
// annotations (record_function ranges), the thread's compile context and user metadata, which
// trace entries carry, and annotations of live allocations (torch 2.14's annotateMemory).
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "tests/allocator/sim_fixture.h"

namespace spillway::testing {
namespace {

using Metadata = std::vector<std::pair<std::string, std::string>>;

class TraceLabelsTest : public SimAllocatorTest {
 protected:
  // The labels are the thread's, shared by every allocator (as PyTorch's): leave none behind.
  void TearDown() override {
    allocator_->RecordHistory(true, 8);
    for (int i = 0; i < 8; ++i) allocator_->PopCompileContext();
    allocator_->SetUserMetadata("");
    allocator_->RecordHistory(false);
  }

  std::vector<TraceEntry> Trace() const { return allocator_->TakeSnapshot().device_traces.at(0); }
};

std::string CompileContextOf(const TraceEntry& e) {
  return e.labels != nullptr ? e.labels->compile_context : "";
}
std::string UserMetadataOf(const TraceEntry& e) {
  return e.labels != nullptr ? e.labels->user_metadata : "";
}

TEST_F(TraceLabelsTest, AnnotationsAreKeptInOrderWithTheirDeviceAndTime) {
  allocator_->RecordHistory(true, 64);
  const int64_t before = NowMicros();
  allocator_->RecordAnnotation(0, {{"name", "forward"}, {"stage", "START"}});
  allocator_->Free(Alloc(4096));
  allocator_->RecordAnnotation(3, {{"name", "forward"}, {"stage", "END"}});
  const std::vector<AnnotationEntry> annotations = allocator_->TakeSnapshot().external_annotations;
  ASSERT_EQ(annotations.size(), 2u);
  EXPECT_EQ(annotations[0].device, 0);
  EXPECT_EQ(annotations[0].metadata, (Metadata{{"name", "forward"}, {"stage", "START"}}));
  EXPECT_EQ(annotations[1].device, 3);  // the caller's current device, as given
  EXPECT_EQ(annotations[1].metadata, (Metadata{{"name", "forward"}, {"stage", "END"}}));
  EXPECT_GE(annotations[0].time_us, before);
  EXPECT_LE(annotations[0].time_us, annotations[1].time_us);
  EXPECT_LE(annotations[1].time_us, NowMicros());
}

TEST_F(TraceLabelsTest, AnnotationsAreRecordedOnlyWithTheHistoryAndGoWithIt) {
  allocator_->RecordAnnotation(0, {{"name", "before"}});
  allocator_->RecordHistory(true, 64);
  EXPECT_TRUE(allocator_->TakeSnapshot().external_annotations.empty());
  allocator_->RecordAnnotation(0, {{"name", "a"}});
  allocator_->ClearHistory();
  EXPECT_TRUE(allocator_->TakeSnapshot().external_annotations.empty());
  allocator_->RecordAnnotation(0, {{"name", "b"}});
  ASSERT_EQ(allocator_->TakeSnapshot().external_annotations.size(), 1u);
  allocator_->RecordHistory(false);
  EXPECT_TRUE(allocator_->TakeSnapshot().external_annotations.empty());
  allocator_->RecordAnnotation(0, {{"name", "after"}});
  EXPECT_TRUE(allocator_->TakeSnapshot().external_annotations.empty());
}

// A ring of the history's capacity, as PyTorch's annotation buffer: the newest are kept.
TEST_F(TraceLabelsTest, AnnotationsKeepTheNewestUpToTheHistorysCapacity) {
  allocator_->RecordHistory(true, 3);
  for (int i = 0; i < 5; ++i) allocator_->RecordAnnotation(0, {{"i", std::to_string(i)}});
  std::vector<AnnotationEntry> annotations = allocator_->TakeSnapshot().external_annotations;
  ASSERT_EQ(annotations.size(), 3u);
  EXPECT_EQ(annotations.front().metadata, (Metadata{{"i", "2"}}));
  EXPECT_EQ(annotations.back().metadata, (Metadata{{"i", "4"}}));
  allocator_->RecordHistory(true, 2);  // a smaller ring keeps the newest
  annotations = allocator_->TakeSnapshot().external_annotations;
  ASSERT_EQ(annotations.size(), 2u);
  EXPECT_EQ(annotations.front().metadata, (Metadata{{"i", "3"}}));
}

TEST_F(TraceLabelsTest, TraceEntriesCarryTheTopOfTheThreadsCompileContextStack) {
  allocator_->RecordHistory(true, 64);
  void* outside = Alloc(4096);
  allocator_->PushCompileContext("Torch-Compiled Region: 0/0");
  void* outer = Alloc(4096);
  allocator_->PushCompileContext("Torch-Compiled Region: 1/0");
  void* inner = Alloc(4096);
  allocator_->PopCompileContext();
  allocator_->Free(outer);
  allocator_->PopCompileContext();
  allocator_->Free(inner);
  allocator_->Free(outside);
  std::vector<std::pair<TraceAction, std::string>> seen;
  for (const TraceEntry& e : Trace()) seen.emplace_back(e.action, CompileContextOf(e));
  const std::vector<std::pair<TraceAction, std::string>> expected = {
      {TraceAction::kSegmentAlloc, ""},
      {TraceAction::kAlloc, ""},
      {TraceAction::kAlloc, "Torch-Compiled Region: 0/0"},
      {TraceAction::kAlloc, "Torch-Compiled Region: 1/0"},
      {TraceAction::kFreeRequested, "Torch-Compiled Region: 0/0"},
      {TraceAction::kFreeCompleted, "Torch-Compiled Region: 0/0"},
      {TraceAction::kFreeRequested, ""},
      {TraceAction::kFreeCompleted, ""},
      {TraceAction::kFreeRequested, ""},
      {TraceAction::kFreeCompleted, ""},
  };
  EXPECT_EQ(seen, expected);
}

// As PyTorch's allocator: pushes and pops are ignored while no history is recorded, and a pop
// of an empty stack leaves it empty.
TEST_F(TraceLabelsTest, CompileContextsCountOnlyWhileHistoryIsRecorded) {
  allocator_->PushCompileContext("ignored");
  allocator_->RecordHistory(true, 64);
  allocator_->Free(Alloc(4096));
  for (const TraceEntry& e : Trace()) EXPECT_EQ(CompileContextOf(e), "");
  allocator_->PopCompileContext();  // nothing to pop
  allocator_->PushCompileContext("kept");
  allocator_->RecordHistory(false);
  allocator_->PopCompileContext();  // ignored: "kept" stays
  allocator_->RecordHistory(true, 64);
  allocator_->Free(Alloc(4096));
  const std::vector<TraceEntry> trace = Trace();
  ASSERT_FALSE(trace.empty());
  for (const TraceEntry& e : trace) EXPECT_EQ(CompileContextOf(e), "kept");
}

TEST_F(TraceLabelsTest, CompileContextsAreTheThreads) {
  allocator_->RecordHistory(true, 64);
  allocator_->PushCompileContext("main thread");
  std::thread([&] { allocator_->Free(Alloc(4096)); }).join();
  const std::vector<TraceEntry> trace = Trace();
  ASSERT_FALSE(trace.empty());
  for (const TraceEntry& e : trace) EXPECT_EQ(CompileContextOf(e), "");
}

TEST_F(TraceLabelsTest, TraceEntriesCarryTheThreadsUserMetadataFromWhenItIsSet) {
  allocator_->SetUserMetadata("set before recording");  // kept, as PyTorch keeps it
  EXPECT_EQ(allocator_->user_metadata(), "set before recording");
  allocator_->RecordHistory(true, 64);
  void* first = Alloc(4096);
  allocator_->SetUserMetadata("step 2");
  allocator_->PushCompileContext("region");
  allocator_->Free(first);
  allocator_->PopCompileContext();
  allocator_->SetUserMetadata("");
  EXPECT_EQ(allocator_->user_metadata(), "");
  allocator_->Free(Alloc(4096));
  std::string other_thread_metadata = "unset";
  std::thread([&] { other_thread_metadata = allocator_->user_metadata(); }).join();
  EXPECT_EQ(other_thread_metadata, "");  // per thread

  const std::vector<TraceEntry> trace = Trace();
  ASSERT_EQ(trace.size(), 7u);
  EXPECT_EQ(UserMetadataOf(trace[0]), "set before recording");  // segment_alloc
  EXPECT_EQ(UserMetadataOf(trace[1]), "set before recording");  // alloc
  EXPECT_EQ(UserMetadataOf(trace[2]), "step 2");                // its free
  EXPECT_EQ(CompileContextOf(trace[2]), "region");
  EXPECT_EQ(UserMetadataOf(trace[3]), "step 2");
  for (size_t i = 4; i < trace.size(); ++i) EXPECT_EQ(trace[i].labels, nullptr) << i;
}

// An entry keeps the labels in force when it was recorded, whatever the thread sets later.
TEST_F(TraceLabelsTest, RecordedLabelsDoNotChangeAfterwards) {
  allocator_->RecordHistory(true, 64);
  allocator_->SetUserMetadata("then");
  allocator_->Free(Alloc(4096));
  allocator_->SetUserMetadata("now");
  for (const TraceEntry& e : Trace()) EXPECT_EQ(UserMetadataOf(e), "then");
}

// torch 2.14's annotateMemory: an "annotate" entry for the live allocation, keyed by its address,
// with the annotation as its user metadata (not the thread's), the thread's compile context and
// the frames gathered at the call; the thread's own labels are untouched for what follows.
TEST_F(TraceLabelsTest, AnnotateRecordsAnEntryForTheLiveAllocationWithTheAnnotation) {
  int gathered = 0;
  allocator_->RecordHistory(true, 64,
                            [&]() -> TraceContext { return std::make_shared<int>(++gathered); });
  allocator_->SetUserMetadata("thread's");
  void* p = Alloc(3000);
  allocator_->PushCompileContext("region");
  allocator_->AnnotateMemory(p, "packed for backward");
  allocator_->PopCompileContext();
  allocator_->Free(p);

  const std::vector<TraceEntry> trace = Trace();
  ASSERT_EQ(trace.size(), 5u);  // segment_alloc, alloc, annotate, free_requested, free_completed
  const TraceEntry& alloc = trace[1];
  const TraceEntry& annotate = trace[2];
  EXPECT_EQ(TraceActionName(annotate.action), "annotate");
  EXPECT_EQ(annotate.addr, reinterpret_cast<uintptr_t>(p));
  EXPECT_EQ(annotate.size, 3000u);
  EXPECT_EQ(annotate.stream, alloc.stream);
  EXPECT_EQ(UserMetadataOf(annotate), "packed for backward");
  EXPECT_EQ(CompileContextOf(annotate), "region");
  ASSERT_NE(annotate.context, nullptr);
  EXPECT_EQ(*std::static_pointer_cast<const int>(annotate.context), 2);  // its own frames
  EXPECT_GE(annotate.time_us, alloc.time_us);
  EXPECT_EQ(UserMetadataOf(alloc), "thread's");
  EXPECT_EQ(UserMetadataOf(trace[3]), "thread's");
  EXPECT_EQ(CompileContextOf(trace[3]), "");
  EXPECT_EQ(allocator_->user_metadata(), "thread's");
}

// As in torch: no effect while no history is recorded (not even a check of the pointer), and
// nothing to key an annotation to for a null pointer (an empty or spilled storage's).
TEST_F(TraceLabelsTest, AnnotateDoesNothingWithoutHistoryOrForNull) {
  void* p = Alloc(4096);
  int on_stack = 0;
  EXPECT_NO_THROW(allocator_->AnnotateMemory(p, "before recording"));
  EXPECT_NO_THROW(allocator_->AnnotateMemory(&on_stack, "not ours, not looked at"));
  allocator_->RecordHistory(true, 64);
  EXPECT_NO_THROW(allocator_->AnnotateMemory(nullptr, "null"));
  EXPECT_TRUE(Trace().empty());
  allocator_->Free(p);
}

TEST_F(TraceLabelsTest, AnnotateRejectsWhatIsNotTheStartOfALiveAllocation) {
  allocator_->RecordHistory(true, 64);
  auto* p = static_cast<char*>(Alloc(4096));
  auto* freed = static_cast<char*>(Alloc(4096));
  allocator_->Free(freed);
  int on_stack = 0;
  for (const void* bad : {static_cast<const void*>(p + 512), static_cast<const void*>(freed),
                          static_cast<const void*>(&on_stack)}) {
    try {
      allocator_->AnnotateMemory(bad, "x");
      ADD_FAILURE() << "no error for " << bad;
    } catch (const InvalidArgumentError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("annotate: "), std::string::npos) << what;
      EXPECT_NE(what.find("untyped_storage().data_ptr()"), std::string::npos) << what;
    }
  }
  for (const TraceEntry& e : Trace()) EXPECT_NE(e.action, TraceAction::kAnnotate);
  allocator_->Free(p);
}

}  // namespace
}  // namespace spillway::testing
