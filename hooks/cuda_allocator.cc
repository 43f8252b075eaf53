#include "hooks/cuda_allocator.h"

#include "allocator/errors.h"
#include "allocator/speculative.h"

#if defined(SPILLWAY_TORCH_CUDA_ALLOCATOR)

#include <c10/core/Allocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cassert>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "hooks/c10_convert.h"
#include "hooks/torch_compat.h"
#include "offload/engine.h"

namespace spillway::torch_layer {
namespace {

using Base = cca::CUDAAllocator;

[[noreturn]] void Unsupported(const char* feature) {
  TORCH_CHECK(false, "Spillway's CUDA allocator does not support ", feature,
              " yet. Use PyTorch's native allocator for this program (do not call "
              "spillway.install(), or unset SPILLWAY_ALLOC_CONF / backend:spillway).");
}

[[noreturn]] void UnsupportedPools() {
  Unsupported("private memory pools (CUDA graph capture, torch.cuda.MemPool)");
}

void CheckDefaultPool(const MempoolId& id) {
  if (id.first != 0 || id.second != 0) UnsupportedPools();
}

c10::DeviceIndex CurrentDevice() { return c10::cuda::current_device(); }

// c10's own streams (each device's default stream and its pool streams) are created once and
// never destroyed, so their identity is remembered per thread (CachingAllocator::
// ResolveLastingStream): no device guard, cudaGetDevice or cudaStreamGetId per malloc, save or
// unpack. An external stream (torch.cuda.ExternalStream, whose c10 id is its handle: an even,
// non-zero id, in c10's encoding since torch 2.0) may be destroyed and its handle reused for
// another stream: it is resolved every time.
StreamRef ResolveC10Stream(CachingAllocator& alloc, const c10::cuda::CUDAStream& stream) {
  const auto handle = static_cast<StreamHandle>(stream.stream());
  const c10::StreamId id = stream.id();
  if (id != 0 && (id & 1) == 0) {
    return alloc.backend().resolve_stream(stream.device_index(), handle);
  }
  return alloc.ResolveLastingStream(stream.device_index(), handle);
}

class SpillwayCudaAllocator final : public Base {
 public:
  // Announces an out-of-memory error met inside an offload engine operation (see Guard).
  void AnnounceOutOfMemory(const OutOfMemoryError& error) { NotifyOom(error); }
  explicit SpillwayCudaAllocator(CachingAllocator& allocator) : alloc_(allocator) {}

  static SpillwayCudaAllocator* instance;
  void set_empty_cache(std::function<void()> fn) { empty_cache_ = std::move(fn); }

  // --- c10::Allocator ---
  c10::DataPtr allocate(size_t size) {
    const c10::DeviceIndex device = CurrentDevice();
    void* ptr = Malloc(size, device, c10::cuda::getCurrentCUDAStream(device));
    return {ptr, ptr, &RawDeleteFn, c10::Device(c10::DeviceType::CUDA, device)};
  }
  c10::DeleterFnPtr raw_deleter() const { return &RawDeleteFn; }
  void copy_data(void* dest, const void* src, std::size_t count) const {
    C10_CUDA_CHECK(cudaMemcpy(dest, src, count, cudaMemcpyDeviceToDevice));
  }

  // --- raw allocation ---
  void* raw_alloc(size_t nbytes) {
    const c10::DeviceIndex device = CurrentDevice();
    return Malloc(nbytes, device, c10::cuda::getCurrentCUDAStream(device));
  }
  void* raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) {
    return Malloc(nbytes, CurrentDevice(), stream);
  }
  void raw_delete(void* ptr) {
    if (ptr == nullptr) return;
    try {
      alloc_.Free(ptr);
    } catch (const Error& e) {
      TORCH_CHECK(false, "Spillway: ", e.what());
    }
  }

  // --- lifecycle ---
  void init(int device_count) {
    TORCH_CHECK(device_count <= alloc_.device_count(), "Spillway serves ", alloc_.device_count(),
                " CUDA devices but PyTorch initializes ", device_count);
    initialized_ = true;
  }
  bool initialized() { return initialized_; }
  void enable(bool value) {
    if (!value) Unsupported("disabling the caching allocator (enable(false))");
  }
  bool isEnabled() const { return true; }
  std::string name() { return "spillway"; }

  // --- cache and limits ---
  // As spillway.empty_cache(): the pinned host chunks no spilled data uses go back too.
  void emptyCache() {
    Guard([&] { empty_cache_ ? empty_cache_() : alloc_.EmptyCache(); });
  }
  void emptyCache(MempoolId id) {
    CheckDefaultPool(id);
    emptyCache();
  }
  void setMemoryFraction(double fraction, c10::DeviceIndex device) {
    TORCH_CHECK(fraction >= 0.0 && fraction <= 1.0, "invalid fraction ", fraction,
                ": expected a value in [0, 1]");
    Guard([&] { alloc_.SetMemoryFraction(fraction, device); });
  }
  double getMemoryFraction(c10::DeviceIndex device) {
    // PyTorch reports the whole device, 1.0, while no fraction was set.
    return Guard([&] { return alloc_.memory_fraction(device); }).value_or(1.0);
  }
  void cacheInfo(c10::DeviceIndex device, size_t* largest_block) {
    // PyTorch's contract: a zero *largest_block asks for a first guess (the device's free bytes),
    // then the largest cached free block counts if larger.
    if (*largest_block == 0) {
      size_t total = 0;
      c10::cuda::CUDAGuard guard(device);
      C10_CUDA_CHECK(cudaMemGetInfo(largest_block, &total));
    }
    *largest_block =
        std::max(*largest_block, Guard([&] { return alloc_.LargestFreeBlock(device); }));
  }
  void* getBaseAllocation(void* ptr, size_t* size) {
    const auto range = alloc_.SegmentOf(ptr);
    TORCH_CHECK(range.has_value(), "Spillway: ", ptr, " is not in memory Spillway allocated");
    if (size != nullptr) *size = range->size;
    return range->base;
  }

  // --- streams ---
  using Base::recordStream;
  void recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) {
    // Like PyTorch's: storages not allocated here (null, or another allocator's) are ignored.
    if (ptr.get() == nullptr || ptr.get_deleter() != &RawDeleteFn) return;
    // The stream may be another device's, as PyTorch allows (its free then waits on the host).
    Guard([&] {
      alloc_.RecordStream(ptr.get(), ResolveC10Stream(alloc_, stream), stream.device_index());
    });
  }

  // --- statistics ---
  cca::DeviceStats getDeviceStats(c10::DeviceIndex device) {
    return ToC10Stats(Guard([&] { return alloc_.stats(device); }), alloc_.config().max_split_size);
  }
  void resetAccumulatedStats(c10::DeviceIndex device) {
    Guard([&] { alloc_.ResetAccumulatedStats(device); });
  }
  void resetPeakStats(c10::DeviceIndex device) {
    Guard([&] { alloc_.ResetPeakStats(device); });
  }

  // --- history and snapshots ---
  bool isHistoryEnabled() { return alloc_.history_enabled(); }
  // torch <= 2.7
  void recordHistory(bool enabled, cca::CreateContextFn recorder, size_t max_entries,
                     cca::RecordContext when) {
    RecordHistory(enabled, recorder, max_entries, when, false, {});
  }
  // torch 2.8 - 2.10
  void recordHistory(bool enabled, cca::CreateContextFn recorder, size_t max_entries,
                     cca::RecordContext when, bool clear_history) {
    RecordHistory(enabled, recorder, max_entries, when, clear_history, {});
  }
  // torch 2.11
  void recordHistory(bool enabled, cca::CreateContextFn recorder, size_t max_entries,
                     cca::RecordContext when, bool clear_history,
                     const std::vector<std::string>& skip_actions) {
    RecordHistory(enabled, recorder, max_entries, when, clear_history, skip_actions);
  }
  // What torch calls beside the history (its RecordFunction callbacks of
  // torch/csrc/cuda/memory_snapshot.cpp, torch.cuda.memory._set_memory_metadata): forwarded to
  // the core, which keeps the state and the snapshot shows. The spellings of torch 2.13 and 2.14
  // (pushCompileContext takes a non-const reference there); supportsUserMetadata and
  // annotateMemory are 2.14's.
  void recordAnnotation(const std::vector<std::pair<std::string, std::string>>& md) {
    if (alloc_.history_enabled()) alloc_.RecordAnnotation(CurrentDevice(), md);
  }
  void pushCompileContext(std::string& md) { alloc_.PushCompileContext(md); }
  void popCompileContext() { alloc_.PopCompileContext(); }
  bool supportsUserMetadata() { return true; }
  void setUserMetadata(const std::string& metadata) { alloc_.SetUserMetadata(metadata); }
  std::string getUserMetadata() { return alloc_.user_metadata(); }
  // torch 2.14's torch.cuda.memory._annotate_tensor: an "annotate" trace entry for the live
  // allocation at `ptr` (its storage's start), while history is recorded.
  void annotateMemory(const void* ptr, const std::string& metadata) {
    Guard([&] { alloc_.AnnotateMemory(ptr, metadata); });
  }
  cca::SnapshotInfo snapshot() { return Snapshot(); }
  cca::SnapshotInfo snapshot(MempoolId id) {
    CheckDefaultPool(id);
    return Snapshot();
  }
  cca::SnapshotInfo snapshot(MempoolId id, bool /*include_traces*/) {
    CheckDefaultPool(id);
    return Snapshot();
  }
  void attachOutOfMemoryObserver(cca::OutOfMemoryObserver observer) {
    std::lock_guard lock(mutex_);
    oom_observers_.push_back(std::move(observer));
  }
#if SPILLWAY_TORCH_HAS_OOM_REJECTION_OBSERVER
  // PyTorch calls these observers when its throw_on_cudamalloc_oom policy refuses a request
  // before trying cudaMalloc. Spillway has no such policy (a request is refused only after the
  // whole out-of-memory ladder, which the OutOfMemoryObservers hear of): there is never
  // anything to tell them, so they are not kept.
  void attachOomRejectionObserver(cca::OomRejectionObserver /*observer*/) {}
#endif
  void attachAllocatorTraceTracker(cca::AllocatorTraceTracker /*tracker*/) {
    Unsupported("allocator trace trackers (TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK)");
  }

  // --- what Spillway does not support yet: a clear error naming the feature ---
  void beginAllocateToPool(c10::DeviceIndex, MempoolId, std::function<bool(cudaStream_t)>) {
    UnsupportedPools();
  }
  // The pool bookkeeping of MemPool and CUDA graphs, in every release's spelling (each a default
  // that names the call, or absent, in PyTorch's base class): the same clear error.
  void ensureExistsAndIncrefPool(c10::DeviceIndex, MempoolId) { UnsupportedPools(); }
  void createOrIncrefPool(c10::DeviceIndex, MempoolId, Base* /*allocator*/) { UnsupportedPools(); }
  void createOrIncrefPool(c10::DeviceIndex, MempoolId, std::shared_ptr<Base> /*allocator*/) {
    UnsupportedPools();
  }
  int getPoolUseCount(c10::DeviceIndex, MempoolId) { UnsupportedPools(); }
  void setUseOnOOM(c10::DeviceIndex, MempoolId) { UnsupportedPools(); }
  void setUseOnOOM(c10::DeviceIndex, MempoolId, bool) { UnsupportedPools(); }
  void setNoSplit(c10::DeviceIndex, MempoolId) { UnsupportedPools(); }
  bool checkPoolLiveAllocations(c10::DeviceIndex, MempoolId, const std::unordered_set<void*>&) {
    UnsupportedPools();
  }
  // No pool was ever begun (beginAllocateToPool refuses), so there is nothing to end or release;
  // PyTorch calls these on cleanup paths, where an exception would terminate.
  void endAllocateToPool(c10::DeviceIndex, MempoolId) {}
  void releasePool(c10::DeviceIndex, MempoolId) {}
  std::shared_ptr<void> getIpcDevPtr(std::string /*handle*/) {
    Unsupported("CUDA IPC (sharing CUDA tensors between processes)");
  }
#if SPILLWAY_TORCH_HAS_SHARE_IPC
  cca::ShareableHandle shareIpcHandle(void* /*ptr*/) {
    Unsupported("CUDA IPC (sharing CUDA tensors between processes)");
  }
#endif
#if SPILLWAY_TORCH_HAS_EXPANDABLE_SIZES
  // Spillway has no expandable segments, so there are none to report.
  std::vector<cca::StreamSegmentSize> getExpandableSegmentSizes(c10::DeviceIndex /*device*/) {
    return {};
  }
#endif
  std::shared_ptr<cca::AllocatorState> getCheckpointState(c10::DeviceIndex, MempoolId) {
    Unsupported("CUDA graph trees (torch.compile mode=\"reduce-overhead\")");
  }
  cca::CheckpointDelta setCheckpointPoolState(c10::DeviceIndex,
                                              std::shared_ptr<cca::AllocatorState>) {
    Unsupported("CUDA graph trees (torch.compile mode=\"reduce-overhead\")");
  }

  // --- peer access and copies (plain cudaMalloc memory: PyTorch's rules apply as is) ---
  void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) {
    c10::cuda::CUDAGuard guard(dev);
    const cudaError_t err = cudaDeviceEnablePeerAccess(dev_to_access, 0);
    if (err == cudaErrorPeerAccessAlreadyEnabled) {
      (void)cudaGetLastError();  // clear the sticky-free error state
      return;
    }
    C10_CUDA_CHECK(err);
  }
  cudaError_t memcpyAsync(void* dst, int dst_device, const void* src, int src_device, size_t count,
                          cudaStream_t stream, bool p2p_enabled) {
    if (p2p_enabled || dst_device == src_device) {
      return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
    }
    return cudaMemcpyPeerAsync(dst, dst_device, src, src_device, count, stream);
  }

 private:
  static void RawDeleteFn(void* ptr) { instance->raw_delete(ptr); }

  // Core errors become torch errors; OutOfMemoryError becomes c10::OutOfMemoryError, which
  // Python raises as torch.cuda.OutOfMemoryError.
  template <typename Fn>
  auto Guard(Fn fn) -> decltype(fn()) {
    try {
      return fn();
    } catch (const OutOfMemoryError& e) {
      // A speculative allocation's miss (a prefetch) is no out-of-memory error to announce. One
      // made inside an offload engine operation (a reload for backward, allocated with the
      // engine's lock released while another thread may wait for that reload) is announced by the
      // engine's caller once the operation is over (NotifyOutOfMemory): an observer may be
      // Python, and waiting for the GIL there could deadlock against a thread that holds it.
      if (!SpeculativeAllocations::Active() && !OffloadEngine::InsideEngineOnThisThread()) {
        NotifyOom(e);
      }
      C10_THROW_ERROR(OutOfMemoryError, e.what());
    } catch (const Error& e) {
      TORCH_CHECK(false, "Spillway: ", e.what());
    }
  }

  void* Malloc(size_t size, c10::DeviceIndex device, cudaStream_t stream) {
    return Guard([&] { return alloc_.Malloc(size, device, static_cast<StreamHandle>(stream)); });
  }
  void* Malloc(size_t size, c10::DeviceIndex device, const c10::cuda::CUDAStream& stream) {
    return Guard([&] { return alloc_.Malloc(size, device, ResolveC10Stream(alloc_, stream)); });
  }

  // As PyTorch calls them: the device, the request (PyTorch passes the segment size it tried for
  // it, the same for large requests, 2 MiB for a small one), the memory the process may use (its
  // limit when one is set, else the device's total), and the device's free memory.
  void NotifyOom(const OutOfMemoryError& error) {
    assert(!OffloadEngine::InsideEngineOnThisThread());
    std::vector<cca::OutOfMemoryObserver> observers;
    {
      std::lock_guard lock(mutex_);
      observers = oom_observers_;
    }
    if (observers.empty()) return;
    const int device = error.device();
    const MemInfo info = alloc_.backend().mem_info(device);
    const size_t limit = alloc_.memory_limit(device);
    for (const auto& observer : observers) {
      observer(device, error.requested_bytes(), limit != 0 ? limit : info.total_bytes,
               info.free_bytes);
    }
  }

  void RecordHistory(bool enabled, cca::CreateContextFn recorder, size_t max_entries,
                     cca::RecordContext when, bool clear_history,
                     const std::vector<std::string>& skip_actions) {
    ContextGatherer gatherer;
    if (enabled && recorder != nullptr && when != cca::RecordContext::NEVER) {
      gatherer = [recorder]() -> TraceContext {
        // torch's recorder takes the GIL for Python frames. Reloads allocate inside an offload
        // engine operation, where waiting for the GIL could deadlock against a Python thread that
        // waits for the engine: those allocations carry no context (as in snapshot.cc).
        if (OffloadEngine::InsideEngineOnThisThread()) return nullptr;
        return WrapC10Context(recorder());
      };
    }
    {
      std::lock_guard lock(mutex_);
      skip_actions_ = std::unordered_set<std::string>(skip_actions.begin(), skip_actions.end());
    }
    // ALL gathers at frees too; ALLOC and STATE (the frames of live blocks) at allocations only.
    const bool free_context = when == cca::RecordContext::ALL;
    Guard([&] { alloc_.RecordHistory(enabled, max_entries, std::move(gatherer), free_context); });
    if (clear_history) alloc_.ClearHistory();
  }

  cca::SnapshotInfo Snapshot() {
    const spillway::Snapshot snap = alloc_.TakeSnapshot();
    std::unordered_set<std::string> skip;
    {
      std::lock_guard lock(mutex_);
      skip = skip_actions_;
    }
    return ToC10Snapshot(snap, alloc_.config(), skip);
  }

  CachingAllocator& alloc_;
  // What empty_cache() runs in place of the allocator's EmptyCache alone (the runtime's, which
  // gives back the offload engine's unused pinned host memory too): set once, before the adapter
  // is installed, so never while torch may call it.
  std::function<void()> empty_cache_;
  bool initialized_ = false;
  std::mutex mutex_;
  std::vector<cca::OutOfMemoryObserver> oom_observers_;
  std::unordered_set<std::string> skip_actions_;
};

SpillwayCudaAllocator* SpillwayCudaAllocator::instance = nullptr;

}  // namespace

bool HasCudaAllocator() { return true; }

StreamRef CurrentCudaStream(CachingAllocator& allocator, int device) {
  return ResolveC10Stream(allocator,
                          c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)));
}

void NotifyOutOfMemory(const OutOfMemoryError& error) {
  if (SpillwayCudaAllocator::instance != nullptr)
    SpillwayCudaAllocator::instance->AnnounceOutOfMemory(error);
}

c10::Allocator* CudaAllocatorAdapter(CachingAllocator& allocator) {
  static std::mutex mutex;
  std::lock_guard lock(mutex);
  if (SpillwayCudaAllocator::instance == nullptr) {
    // Leaked on purpose: tensors may be freed during interpreter shutdown.
    SpillwayCudaAllocator::instance = std::make_unique<SpillwayCudaAllocator>(allocator).release();
  }
  return SpillwayCudaAllocator::instance;
}

void InstallCudaAllocator(CachingAllocator& allocator, const std::function<void()>& empty_cache) {
  auto* ours = static_cast<SpillwayCudaAllocator*>(CudaAllocatorAdapter(allocator));
  Base* current = cca::allocator.load();
  if (current == ours) return;  // installed already: a no-op
  if (current != nullptr && current->initialized()) {
    throw InvalidArgumentError(
        "spillway: CUDA is already initialized, so PyTorch's CUDA allocator (" + current->name() +
        ") is in use and cannot be replaced; install Spillway before creating any CUDA tensor "
        "(or set SPILLWAY_ALLOC_CONF before starting Python)");
  }
  ours->set_empty_cache(empty_cache);
  cca::allocator.store(ours);
  // Code that asks c10 for the CUDA allocator by device type (c10::GetAllocator, and
  // c10::getDeviceAllocator in newer torch) must see the same one.
  c10::SetAllocator(c10::DeviceType::CUDA, ours, /*priority=*/255);
}

}  // namespace spillway::torch_layer

#else  // no CUDA torch >= 2.4 in this build

namespace spillway::torch_layer {

bool HasCudaAllocator() { return false; }

StreamRef CurrentCudaStream(CachingAllocator& /*allocator*/, int /*device*/) {
  throw InvalidArgumentError("this build of Spillway's torch layer has no CUDA support");
}

void NotifyOutOfMemory(const OutOfMemoryError& /*error*/) {}

namespace {
[[noreturn]] void NoAdapter() {
  throw InvalidArgumentError(
      "this build of Spillway has no c10 CUDA allocator adapter (it needs a CUDA build of torch "
      "2.4 or newer at build time); use spillway.pluggable_allocator() instead");
}
}  // namespace

void InstallCudaAllocator(CachingAllocator& /*allocator*/,
                          const std::function<void()>& /*empty_cache*/) {
  NoAdapter();
}

c10::Allocator* CudaAllocatorAdapter(CachingAllocator& /*allocator*/) { NoAdapter(); }

}  // namespace spillway::torch_layer

#endif
