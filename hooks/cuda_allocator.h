// Spillway as PyTorch's CUDA allocator: a c10::cuda::CUDACachingAllocator::CUDAAllocator over the
// core allocator, installed into the atomic that torch.cuda.memory.change_current_allocator sets.
// Through it torch.cuda.memory works as with the native allocator: memory_allocated/reserved,
// memory_stats, reset_peak_memory_stats, empty_cache, set_per_process_memory_fraction,
// Tensor.record_stream, memory._snapshot() and _record_memory_history (torch's own stack
// recorder), and out-of-memory raises torch.cuda.OutOfMemoryError with Spillway's message.
//
// Built only against a CUDA build of torch 2.4 or newer (torch 1.13 has no CUDAAllocator class).
// The class's member set changed in almost every torch release (see torch_compat.h); the members
// below carry no `override` on purpose: each is declared in the spelling of every release that
// had it, and whichever spellings the torch at hand declares virtual are the ones that override.
// A release that adds a pure virtual we do not declare fails to compile here, loudly.
#pragma once

#include <functional>

#include "allocator/caching_allocator.h"
#include "allocator/errors.h"

namespace c10 {
struct Allocator;
}  // namespace c10

namespace spillway::torch_layer {

// True when this build contains the adapter (a CUDA torch >= 2.4).
bool HasCudaAllocator();
// The current c10 stream of CUDA device `device`, resolved as the adapter resolves the streams
// of its allocations: PyTorch's own remembered per thread, an external one each time. Throws
// InvalidArgumentError in a build without CUDA.
StreamRef CurrentCudaStream(CachingAllocator& allocator, int device);
// Runs the adapter's out-of-memory observers (PyTorch's, which may be Python) for `error`, which
// an allocation inside an offload engine operation (a reload) met: the adapter leaves those to the
// engine's caller, to call once the operation is over. Nothing without an adapter.
void NotifyOutOfMemory(const OutOfMemoryError& error);
// Stores the adapter over `allocator` as PyTorch's CUDA allocator (process lifetime); its
// empty_cache() runs `empty_cache` when given (the allocator's and the offload engine's caches:
// the adapter knows no engine, so the benchmark can link it without the Python runtime), else the
// allocator's EmptyCache. Throws InvalidArgumentError when CUDA was already initialized
// (PyTorch's allocator is then in use and cannot be swapped) or when this build has no adapter.
void InstallCudaAllocator(CachingAllocator& allocator,
                          const std::function<void()>& empty_cache = {});
// The adapter over `allocator` (a c10::cuda::CUDACachingAllocator::CUDAAllocator), created on
// first call, process lifetime, not installed by this call: the native-vs-Spillway benchmark
// drives it next to PyTorch's own. Later calls return the same adapter whatever `allocator`.
// Throws InvalidArgumentError when this build has no adapter.
c10::Allocator* CudaAllocatorAdapter(CachingAllocator& allocator);

}  // namespace spillway::torch_layer
