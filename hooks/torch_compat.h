// Every difference between the torch releases Spillway builds against (2.4–2.15; the suites run
// on 2.13) lives in this one header, as small macros.
#pragma once

#include <torch/version.h>

#define SPILLWAY_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||           \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

#if !SPILLWAY_TORCH_AT_LEAST(2, 4)
#error "Spillway supports torch 2.4 and newer"
#endif

// The c10 CUDA allocator adapter (hooks/cuda_allocator.cc), torch 2.4 and newer. Built and run
// against torch 2.11.0+cu130 on an H200 (2026-11-29). Compiled (syntax only) against Debian's
// real torch 2.6.0 and 2.14.1 headers (scripts/check_torch_headers, in scripts/test), and against
// the CUDAAllocator class of 2.7-2.11 from stored copies of those headers (2026-12-01; hooks/README
// says which). The adapter declares every release's spelling of a changed member without
// `override`, so only members a release makes pure virtual need a macro:
// shareIpcHandle: pure virtual from 2.5 (PR #130890, IPC for expandable segments).
#define SPILLWAY_TORCH_HAS_SHARE_IPC SPILLWAY_TORCH_AT_LEAST(2, 5)
// getExpandableSegmentSizes and StreamSegmentSize: from 2.10 (absent in 2.9).
#define SPILLWAY_TORCH_HAS_EXPANDABLE_SIZES SPILLWAY_TORCH_AT_LEAST(2, 10)
// attachOomRejectionObserver and OomRejectionObserver: from 2.12.
#define SPILLWAY_TORCH_HAS_OOM_REJECTION_OBSERVER SPILLWAY_TORCH_AT_LEAST(2, 12)
// TraceEntry gained a MempoolId_t argument (before the time) in torch 2.8.
#if SPILLWAY_TORCH_AT_LEAST(2, 8)
#define SPILLWAY_MAKE_TRACE_ENTRY(action, device, addr, size, stream, mempool, context)       \
  c10::cuda::CUDACachingAllocator::TraceEntry(action, device, addr, size, stream, mempool, 0, \
                                              context)
#else
#define SPILLWAY_MAKE_TRACE_ENTRY(action, device, addr, size, stream, mempool, context) \
  c10::cuda::CUDACachingAllocator::TraceEntry(action, device, addr, size, stream, 0, context)
#endif

// Not macros, as where they came in is unverified between 2.6 (neither) and 2.13 (both): the
// TraceEntry members compile_context_ and user_metadata_, and SnapshotInfo::external_annotations
// (2.6 has it), are set where they exist, tested by requires-expressions in the adapter
// (hooks/cuda_allocator.cc SetLabels, AddAnnotations); checked against 2.6, 2.13 and 2.14.

// A storage's Python object holds a strong reference to it whenever another one exists, from
// torch 2.10 (PR #167564, "Rework PyObject preservation (v2)"); hooks/torch_storage.h Holders.
#define SPILLWAY_TORCH_STORAGE_PYOBJECT_HOLDS SPILLWAY_TORCH_AT_LEAST(2, 10)
