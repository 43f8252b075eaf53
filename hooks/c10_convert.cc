#include "hooks/c10_convert.h"

#if defined(SPILLWAY_TORCH_CUDA_ALLOCATOR)

#include <cuda_runtime_api.h>

#include <ctime>
#include <memory>
#include <optional>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "hooks/torch_compat.h"
#include "hooks/trace_context.h"

namespace spillway::torch_layer {
namespace {

// torch's action for `action`, or none where that release's TraceEntry has no such action: its
// ANNOTATE came with 2.14 (a template, so that the test is a constraint rather than an error).
template <typename Entry>
std::optional<typename Entry::Action> C10Action(TraceAction action) {
  switch (action) {
    case TraceAction::kAlloc:
      return Entry::ALLOC;
    case TraceAction::kFreeRequested:
      return Entry::FREE_REQUESTED;
    case TraceAction::kFreeCompleted:
      return Entry::FREE_COMPLETED;
    case TraceAction::kSegmentAlloc:
      return Entry::SEGMENT_ALLOC;
    case TraceAction::kSegmentFree:
      return Entry::SEGMENT_FREE;
    case TraceAction::kOom:
      return Entry::OOM;
    case TraceAction::kSnapshot:
      return Entry::SNAPSHOT;
    case TraceAction::kAnnotate:
      if constexpr (requires { Entry::ANNOTATE; }) return Entry::ANNOTATE;
      return std::nullopt;
  }
  return std::nullopt;
}

// What a c10 trace entry carries of the recording thread's labels: compile_context_ and
// user_metadata_, which torch's TraceEntry has only from the release that added each (neither in
// torch 2.6; both in 2.13 and 2.14), so each is set where the member exists (a template, for the
// same reason as C10Action). "N/A" for no compile context, as PyTorch's record_trace writes it.
// An annotation's user metadata is the annotation (CachingAllocator::AnnotateMemory).
template <typename Entry>
void SetLabels(Entry& entry, const TraceLabels* labels) {
  if constexpr (requires { entry.compile_context_ = std::string(); }) {
    entry.compile_context_ =
        labels != nullptr && !labels->compile_context.empty() ? labels->compile_context : "N/A";
  }
  if constexpr (requires { entry.user_metadata_ = std::string(); }) {
    if (labels != nullptr) entry.user_metadata_ = labels->user_metadata;
  }
}

// The snapshot's external_annotations, in torch's AnnotationEntry (its time in microseconds in
// t_, as snapshot() hands trace times out). A template for the same reason as SetLabels.
template <typename Info>
void AddAnnotations(Info& out, const std::vector<AnnotationEntry>& annotations) {
  if constexpr (requires { out.external_annotations; }) {
    using C10Annotation = typename decltype(out.external_annotations)::value_type;
    for (const AnnotationEntry& a : annotations) {
      C10Annotation entry(static_cast<c10::DeviceIndex>(a.device), 0);
      for (const auto& [name, value] : a.metadata) entry.recordUserMetadata(name, value);
      entry.time_.t_ = static_cast<time_t>(a.time_us);
      out.external_annotations.push_back(std::move(entry));
    }
  }
}

template <typename C10Stat>
void CopyStat(const Stat& from, C10Stat& to) {
  to.current = from.current;
  to.peak = from.peak;
  to.allocated = from.allocated;
  to.freed = from.freed;
}

template <typename C10StatArray>
void CopyStatArray(const StatArray& from, C10StatArray& to) {
  for (size_t i = 0; i < from.by_pool.size(); ++i) CopyStat(from.by_pool[i], to[i]);
}

}  // namespace

TraceContext WrapC10Context(std::shared_ptr<c10::GatheredContext> context) {
  if (context == nullptr) return nullptr;
  auto wrapped = std::make_shared<TorchTraceContext>();
  wrapped->torch_context = std::move(context);
  return wrapped;
}

std::shared_ptr<c10::GatheredContext> AsC10Context(const TraceContext& context) {
  const TorchTraceContext* t = AsTorchContext(context);
  if (t == nullptr || t->torch_context == nullptr) return nullptr;
  // Only WrapC10Context stores a torch_context, and it stores a GatheredContext.
  return std::static_pointer_cast<c10::GatheredContext>(t->torch_context);
}

cca::DeviceStats ToC10Stats(const DeviceStats& s, size_t max_split_size) {
  cca::DeviceStats out;
  CopyStatArray(s.allocation, out.allocation);
  CopyStatArray(s.segment, out.segment);
  CopyStatArray(s.active, out.active);
  CopyStatArray(s.inactive_split, out.inactive_split);
  CopyStatArray(s.allocated_bytes, out.allocated_bytes);
  CopyStatArray(s.reserved_bytes, out.reserved_bytes);
  CopyStatArray(s.active_bytes, out.active_bytes);
  CopyStatArray(s.inactive_split_bytes, out.inactive_split_bytes);
  CopyStatArray(s.requested_bytes, out.requested_bytes);
  CopyStat(s.oversize_allocations, out.oversize_allocations);
  CopyStat(s.oversize_segments, out.oversize_segments);
  out.num_alloc_retries = s.num_alloc_retries;
  out.num_ooms = s.num_ooms;
  out.num_sync_all_streams = s.num_sync_all_streams;
  out.num_device_alloc = s.num_device_alloc;
  out.num_device_free = s.num_device_free;
  out.max_split_size = static_cast<int64_t>(max_split_size);
  return out;
}

cca::SnapshotInfo ToC10Snapshot(const Snapshot& snap, const AllocatorConfig& config,
                                const std::unordered_set<std::string>& skip_actions) {
  cca::SnapshotInfo out;
  for (const SegmentSnapshot& s : snap.segments) {
    cca::SegmentInfo seg;
    seg.device = static_cast<c10::DeviceIndex>(s.device);
    seg.address = s.address;
    seg.total_size = s.total_size;
    seg.requested_size = s.requested_size;
    seg.allocated_size = s.allocated_size;
    seg.active_size = s.active_size;
    seg.stream = reinterpret_cast<decltype(seg.stream)>(snap.StreamValue(s.stream));
    seg.is_large = s.pool == PoolKind::kLarge;
    for (const BlockSnapshot& b : s.blocks) {
      cca::BlockInfo block;
      block.size = b.size;
      block.requested_size = b.requested_size;
      block.allocated = b.state == BlockState::kActiveAllocated;
      block.active = b.state != BlockState::kInactive;
      block.context_when_allocated = AsC10Context(b.context);
      seg.blocks.push_back(std::move(block));
    }
    out.segments.push_back(std::move(seg));
  }
  const MempoolId default_pool{0, 0};
  for (size_t device = 0; device < snap.device_traces.size(); ++device) {
    std::vector<cca::TraceEntry> trace;
    for (const TraceEntry& e : snap.device_traces[device]) {
      const auto action = C10Action<cca::TraceEntry>(e.action);
      if (!action || skip_actions.contains(std::string(TraceActionName(e.action)))) continue;
      trace.push_back(
          SPILLWAY_MAKE_TRACE_ENTRY(*action, static_cast<c10::DeviceIndex>(device), e.addr, e.size,
                                    reinterpret_cast<cudaStream_t>(snap.StreamValue(e.stream)),
                                    default_pool, AsC10Context(e.context)));
      // PyTorch's snapshot() hands out times already converted to microseconds in t_.
      trace.back().time_.t_ = static_cast<time_t>(e.time_us);
      SetLabels(trace.back(), e.labels.get());
    }
    out.device_traces.push_back(std::move(trace));
  }
  AddAnnotations(out, snap.external_annotations);
  out.config_metadata.garbage_collection_threshold = config.garbage_collection_threshold;
  out.config_metadata.max_split_size = config.max_split_size;
  out.config_metadata.expandable_segments = false;
  out.config_metadata.last_allocator_settings = "backend:spillway";
  return out;
}

}  // namespace spillway::torch_layer

#endif  // SPILLWAY_TORCH_CUDA_ALLOCATOR
