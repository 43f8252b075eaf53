// PyTorch's native CUDA caching allocator and Spillway's, side by side in one process, both
// driven through c10's allocator interface (what every CUDA tensor allocation goes through):
// `allocate` returns a DataPtr whose deleter frees; `recordStream` marks a side stream.
//
//  - CachedMallocFree/<allocator>/4KiB: a malloc+free pair from the cache. Time per pair.
//  - RandomAllocations/<allocator>/<live>: RMM-style churn with 1k/10k/100k live allocations of
//    1 B .. 64 KiB; per_op is time per operation (a free or a malloc).
//  - MultiStreamRecordStream/<allocator>/64KiB: malloc, record_stream on a second stream, free.
//  - TraceReplay/<allocator>/<trace>/<cold|warm>: the traces in bench/traces/; per-op time and
//    fragmentation (1 - peak allocated / peak reserved, from the allocator's own
//    getDeviceStats). Cold: empty_cache before each replay, so the replay takes its segments
//    (and Spillway regrows its bookkeeping); warm: each replay finds the cache the last one left,
//    as a training step finds the previous step's.
//
// <allocator> is "native" or "spillway". Each case runs kRepetitions times and reports the
// median (and the spread) of them, the two allocators one after the other for each case, so that
// a drift of the machine's speed over the run falls on both alike. bench/compare_native.py turns
// the JSON output into a table of both columns and their ratio. Built only against a CUDA torch
// >= 2.4; needs a GPU.
//
// Before timing anything, both allocators go through the same correctness check of
// record_stream (a block used by a busy side stream must not be handed out again until that
// stream is done); the native allocator is the control. The exit status is non-zero when
// Spillway fails it.
#include <benchmark/benchmark.h>
#include <c10/core/Allocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "allocator/config.h"
#include "bench/random_churn.h"
#include "bench/trace_file.h"
#include "capi/process_allocator.h"
#include "hooks/cuda_allocator.h"

namespace spillway {
namespace {

namespace cca = c10::cuda::CUDACachingAllocator;

constexpr size_t kKiB = size_t{1} << 10;
// Medians of this many runs: single runs of the same case moved by 10-50% between two runs of the
// benchmark on the H200 (2026-12-04).
constexpr int kRepetitions = 5;

benchmark::Counter PerOp(double ops) {
  return benchmark::Counter(
      ops, benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
}

void CachedMallocFree(benchmark::State& state, cca::CUDAAllocator* alloc, size_t size) {
  { c10::DataPtr warm = alloc->allocate(size); }
  for (auto _ : state) {
    c10::DataPtr p = alloc->allocate(size);
    benchmark::DoNotOptimize(p.get());
  }
  state.SetItemsProcessed(state.iterations());
}

void RandomAllocations(benchmark::State& state, cca::CUDAAllocator* alloc, size_t live) {
  bench::RandomChurn churn(live, 64 * kKiB);
  std::vector<c10::DataPtr> ptrs(live);
  for (c10::DataPtr& p : ptrs) p = alloc->allocate(churn.NextSize());
  for (auto _ : state) {
    c10::DataPtr& slot = churn.NextVictimSlot(ptrs);
    slot.clear();  // the free
    slot = alloc->allocate(churn.NextSize());
  }
  state.SetItemsProcessed(2 * static_cast<int64_t>(state.iterations()));
  state.counters["per_op"] = PerOp(2);
  ptrs.clear();
  alloc->emptyCache();
}

void MultiStreamRecordStream(benchmark::State& state, cca::CUDAAllocator* alloc, size_t size) {
  const c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool();
  for (auto _ : state) {
    c10::DataPtr p = alloc->allocate(size);
    alloc->recordStream(p, side);
  }
  state.SetItemsProcessed(state.iterations());
  side.synchronize();
  alloc->emptyCache();
}

void Replay(const std::vector<TraceOp>& ops, cca::CUDAAllocator* alloc,
            std::vector<c10::DataPtr>& ptrs) {
  for (const TraceOp& op : ops) {
    if (op.alloc) {
      ptrs[op.id] = alloc->allocate(op.size);
    } else {
      ptrs[op.id].clear();
    }
  }
}

void TraceReplay(benchmark::State& state, cca::CUDAAllocator* alloc, const std::string& path,
                 bool cold) {
  const std::vector<TraceOp> ops = LoadTrace(path);
  if (ops.empty()) {
    state.SkipWithError(("no operations in " + path).c_str());
    return;
  }
  std::vector<c10::DataPtr> ptrs(MaxTraceId(ops) + 1);
  alloc->emptyCache();
  if (!cold) {
    // The cache a replay leaves, as the previous training step leaves it.
    Replay(ops, alloc, ptrs);
    for (c10::DataPtr& p : ptrs) p.clear();
  }
  double fragmentation = 0;
  for (auto _ : state) {
    state.PauseTiming();
    if (cold) alloc->emptyCache();
    alloc->resetPeakStats(0);
    state.ResumeTiming();
    Replay(ops, alloc, ptrs);
    state.PauseTiming();
    const auto stats = alloc->getDeviceStats(0);
    fragmentation = 1.0 - static_cast<double>(stats.allocated_bytes[0].peak) /
                              static_cast<double>(stats.reserved_bytes[0].peak);
    for (c10::DataPtr& p : ptrs) p.clear();
    state.ResumeTiming();
  }
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations() * ops.size()));
  state.counters["per_op"] = PerOp(static_cast<double>(ops.size()));
  state.counters["fragmentation"] = fragmentation;
  for (c10::DataPtr& p : ptrs) p.clear();
  alloc->emptyCache();
}

// A host function enqueued on a stream holds the stream until it returns.
void CUDART_CB HoldTheStream(void* /*unused*/) {
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
}

// True when a 1 MiB block freed after record_stream on a busy side stream is not the block the
// next 1 MiB allocation gets while the side stream is still busy.
bool RecordStreamHoldsReuse(const std::string& name, cca::CUDAAllocator* alloc) {
  const c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool();
  c10::DataPtr x = alloc->allocate(size_t{1} << 20);
  const void* const first = x.get();
  if (cudaLaunchHostFunc(side.stream(), HoldTheStream, nullptr) != cudaSuccess) {
    std::fprintf(stderr, "record_stream check (%s): cudaLaunchHostFunc failed\n", name.c_str());
    return false;
  }
  alloc->recordStream(x, side);
  x.clear();  // the free, while the side stream is busy
  c10::DataPtr y = alloc->allocate(size_t{1} << 20);
  const bool held = y.get() != first;
  const bool busy = cudaStreamQuery(side.stream()) == cudaErrorNotReady;
  (void)cudaGetLastError();  // "not ready" is an answer, not an error
  side.synchronize();
  std::fprintf(stderr, "record_stream check (%s): %s (side stream still busy at the check: %s)\n",
               name.c_str(), held ? "held back" : "REUSED WHILE IN USE", busy ? "yes" : "no");
  y.clear();
  alloc->emptyCache();
  return held;
}

// Registers each case for both allocators in turn (see the top of the file).
void RegisterAll(cca::CUDAAllocator* native, cca::CUDAAllocator* ours) {
  const auto both = [&](const std::string& label, const std::string& arg, auto&& register_one) {
    for (const auto& [name, alloc] :
         {std::pair<std::string, cca::CUDAAllocator*>{"native", native},
          std::pair<std::string, cca::CUDAAllocator*>{"spillway", ours}}) {
      auto* const b = register_one(label + "/" + name + "/" + arg, alloc);
      b->Repetitions(kRepetitions)->ReportAggregatesOnly(true);
    }
  };
  both("CachedMallocFree", "4KiB", [](const std::string& n, cca::CUDAAllocator* a) {
    return benchmark::RegisterBenchmark(n.c_str(), CachedMallocFree, a, 4 * kKiB);
  });
  for (size_t live : {size_t{1000}, size_t{10000}, size_t{100000}}) {
    both("RandomAllocations", std::to_string(live),
         [&](const std::string& n, cca::CUDAAllocator* a) {
           return benchmark::RegisterBenchmark(n.c_str(), RandomAllocations, a, live);
         });
  }
  both("MultiStreamRecordStream", "64KiB", [](const std::string& n, cca::CUDAAllocator* a) {
    return benchmark::RegisterBenchmark(n.c_str(), MultiStreamRecordStream, a, 64 * kKiB);
  });
  for (const char* trace : {"tiny_lm_no_offload", "tiny_lm_eager"}) {
    const std::string path = std::string(SPILLWAY_TRACE_DIR) + "/" + trace + ".trace";
    for (const bool cold : {true, false}) {
      both("TraceReplay", std::string(trace) + (cold ? "/cold" : "/warm"),
           [&](const std::string& n, cca::CUDAAllocator* a) {
             return benchmark::RegisterBenchmark(n.c_str(), TraceReplay, a, path, cold)
                 ->Unit(benchmark::kMicrosecond);
           });
    }
  }
}

}  // namespace
}  // namespace spillway

int main(int argc, char** argv) {
  namespace cca = c10::cuda::CUDACachingAllocator;
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  const int devices = c10::cuda::device_count();
  if (devices == 0) {
    std::fprintf(stderr, "native_compare_bench: no CUDA device\n");
    return 1;
  }
  // PyTorch's own allocator, as installed at start-up; nothing here replaces it. A C++ program
  // that links only c10 has no lazy CUDA init, so initialize both allocators here.
  cca::CUDAAllocator* native = cca::get();
  if (!native->initialized()) native->init(devices);
  spillway::Config config;
  config.device = spillway::DeviceKind::kCuda;
  spillway::ConfigureProcessAllocator(config);
  auto* ours = dynamic_cast<cca::CUDAAllocator*>(
      spillway::torch_layer::CudaAllocatorAdapter(spillway::ProcessAllocator()));
  ours->init(devices);
  spillway::RecordStreamHoldsReuse("native", native);  // the control
  const bool ours_ok = spillway::RecordStreamHoldsReuse("spillway", ours);
  spillway::RegisterAll(native, ours);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return ours_ok ? 0 : 1;
}
