// Google Benchmark cases for the caching allocator, on the simulated backend and, when this build
// has CUDA and the machine a device, on CUDA. Names are `<Case>/<backend>[/<arg>]`, so
// `--benchmark_filter=/sim` or `--benchmark_filter=RandomAllocations/cuda` select by backend.
//
//  - CachedMallocFree/<backend>/<size>: a malloc+free pair served from the cache (one segment,
//    warmed before timing). Time is per pair; items = pairs.
//  - RandomAllocations/<backend>/<live>: RMM-style churn. `live` allocations of random sizes
//    (1 B .. 64 KiB) stay alive; each iteration frees a random one and allocates a new random
//    size in its place. items = operations (a free or a malloc), so `per_op` growing no faster
//    than log(live) from 1k to 100k is what the best-fit index promises.
//  - MultiStreamRecordStream/<backend>: malloc on stream A, record_stream on stream B, free; the
//    block becomes reusable once B's event has completed, which later mallocs poll for.
//  - TwoThreads/<backend>/<size>: CachedMallocFree from two threads at once on one allocator
//    (lock contention). Time is per pair per thread.
//  - FreeByPointer/sim/<n>devices: CachedMallocFree on the last of n devices, freed by pointer
//    alone, as PyTorch's c10 allocator interface frees (its deleter gets no device). Time is per
//    pair; against CachedMallocFree it shows what finding the owning device costs.
//  - HostMemoryLatency/<size>: no allocator; one dependent random load within a buffer of that
//    size. The RandomAllocations cases wait on memory once their metadata outgrows the caches,
//    so this machine's latency curve, measured in the same run, is what their 1k -> 100k growth
//    is read against.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <fstream>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "allocator/backend.h"
#include "allocator/caching_allocator.h"
#include "allocator/config.h"
#include "allocator/sim_backend.h"
#include "bench/random_churn.h"
#include "bench/trace_file.h"
#if defined(SPILLWAY_HAVE_CUDA)
#include "allocator/cuda_backend.h"
#endif

namespace spillway {
namespace {

constexpr size_t kKiB = size_t{1} << 10;
constexpr size_t kMiB = size_t{1} << 20;
// Simulated device memory is host memory that is only touched when written; the benchmarks never
// write it, so a large capacity costs nothing.
constexpr size_t kSimCapacity = size_t{8} << 30;

enum class Kind { kSim, kCuda };

const char* KindName(Kind kind) { return kind == Kind::kSim ? "sim" : "cuda"; }

std::shared_ptr<Backend> NewBackend(Kind kind) {
#if defined(SPILLWAY_HAVE_CUDA)
  if (kind == Kind::kCuda) return std::make_shared<CudaBackend>();
#endif
  (void)kind;
  return std::make_shared<SimBackend>(
      SimBackend::Options{.devices = 1, .capacity_bytes = kSimCapacity});
}

bool CudaAvailable() {
#if defined(SPILLWAY_HAVE_CUDA)
  return CudaBackend().device_count() > 0;
#else
  return false;
#endif
}

std::string SizeName(size_t size) {
  return size >= kMiB ? std::to_string(size / kMiB) + "MiB" : std::to_string(size / kKiB) + "KiB";
}

// Per-operation time as a counter: `ops` operations per iteration.
benchmark::Counter PerOp(double ops) {
  return benchmark::Counter(
      ops, benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
}

// Malloc+free pairs of one size on `device`, served from a segment cached before timing. With
// `by_pointer` the free names no device, as PyTorch's c10 deleter frees.
void CachedPairs(benchmark::State& state, CachingAllocator& alloc, int device, size_t size,
                 bool by_pointer) {
  const StreamRef stream = alloc.backend().default_stream(device);
  alloc.Free(alloc.Malloc(size, device, stream));  // the segment is cached from here on
  for (auto _ : state) {
    void* p = alloc.Malloc(size, device, stream);
    benchmark::DoNotOptimize(p);
    if (by_pointer) {
      alloc.Free(p);
    } else {
      alloc.Free(p, device);
    }
  }
  state.SetItemsProcessed(state.iterations());
  if (alloc.stats(device).num_device_alloc != 1) {
    state.SkipWithError("the cached path was not taken");
  }
}

void CachedMallocFree(benchmark::State& state, Kind kind, size_t size) {
  CachingAllocator alloc(NewBackend(kind), AllocatorConfig{});
  CachedPairs(state, alloc, 0, size, /*by_pointer=*/false);
}

void FreeByPointer(benchmark::State& state, int devices) {
  CachingAllocator alloc(std::make_shared<SimBackend>(SimBackend::Options{
                             .devices = devices, .capacity_bytes = kSimCapacity}),
                         AllocatorConfig{});
  CachedPairs(state, alloc, devices - 1, 4 * kKiB, /*by_pointer=*/true);
}

void RandomAllocations(benchmark::State& state, Kind kind, size_t live) {
  CachingAllocator alloc(NewBackend(kind), AllocatorConfig{});
  const StreamRef stream = alloc.backend().default_stream(0);
  bench::RandomChurn churn(live, 64 * kKiB);
  std::vector<void*> ptrs(live);
  for (void*& p : ptrs) p = alloc.Malloc(churn.NextSize(), 0, stream);

  for (auto _ : state) {
    void*& slot = churn.NextVictimSlot(ptrs);
    alloc.Free(slot, 0);
    slot = alloc.Malloc(churn.NextSize(), 0, stream);
  }
  state.SetItemsProcessed(2 * static_cast<int64_t>(state.iterations()));
  state.counters["per_op"] = PerOp(2);
  state.counters["segments"] = static_cast<double>(alloc.stats(0).segment.all().current);
  for (void* p : ptrs) alloc.Free(p, 0);
}

void MultiStreamRecordStream(benchmark::State& state, Kind kind, size_t size) {
  CachingAllocator alloc(NewBackend(kind), AllocatorConfig{});
  Backend& backend = alloc.backend();
  const StreamRef a = backend.create_stream(0);
  const StreamRef b = backend.create_stream(0);
  for (auto _ : state) {
    void* p = alloc.Malloc(size, 0, a);
    benchmark::DoNotOptimize(p);
    alloc.RecordStream(p, b);
    alloc.Free(p, 0);
  }
  state.SetItemsProcessed(state.iterations());
  backend.synchronize_stream(0, b.handle);
  alloc.ProcessEvents(0);
  // How many segments the events kept from being reused right away.
  state.counters["segments"] = static_cast<double>(alloc.stats(0).segment.all().current);
  alloc.EmptyCache();
  backend.destroy_stream(0, a.handle);
  backend.destroy_stream(0, b.handle);
}

// Shared by the threads of TwoThreads; created once per backend kind, lives until exit.
CachingAllocator& SharedAllocator(Kind kind) {
  static CachingAllocator* const sim = new CachingAllocator(NewBackend(Kind::kSim), {});
  if (kind == Kind::kSim) return *sim;
  static CachingAllocator* const cuda = new CachingAllocator(NewBackend(Kind::kCuda), {});
  return *cuda;
}

void TwoThreads(benchmark::State& state, Kind kind, size_t size) {
  CachingAllocator& alloc = SharedAllocator(kind);
  const StreamRef stream = alloc.backend().default_stream(0);
  for (auto _ : state) {
    void* p = alloc.Malloc(size, 0, stream);
    benchmark::DoNotOptimize(p);
    alloc.Free(p, 0);
  }
  state.SetItemsProcessed(state.iterations());
}

// Replays a recorded trace: time per operation, and fragmentation = 1 - peak allocated / peak
// reserved (the comparable figure for PyTorch's native allocator comes from the GPU script).
void TraceReplay(benchmark::State& state, Kind kind, const std::string& path) {
  const std::vector<TraceOp> ops = LoadTrace(path);
  if (ops.empty()) {
    state.SkipWithError(("no operations in " + path).c_str());
    return;
  }
  std::vector<void*> ptrs(MaxTraceId(ops) + 1, nullptr);
  double fragmentation = 0;
  for (auto _ : state) {
    state.PauseTiming();
    CachingAllocator alloc(NewBackend(kind), AllocatorConfig{});
    const StreamRef stream = alloc.backend().default_stream(0);
    state.ResumeTiming();
    for (const TraceOp& op : ops) {
      if (op.alloc) {
        ptrs[op.id] = alloc.Malloc(op.size, 0, stream);
      } else {
        alloc.Free(ptrs[op.id], 0);
        ptrs[op.id] = nullptr;
      }
    }
    state.PauseTiming();
    const DeviceStats stats = alloc.stats(0);
    fragmentation = 1.0 - static_cast<double>(stats.allocated_bytes.all().peak) /
                              static_cast<double>(stats.reserved_bytes.all().peak);
    for (void*& p : ptrs) {
      if (p != nullptr) alloc.Free(p, 0);
      p = nullptr;
    }
    state.ResumeTiming();
  }
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations() * ops.size()));
  state.counters["ops"] = static_cast<double>(ops.size());
  state.counters["fragmentation"] = fragmentation;
}

// Pointer chasing through one random cycle over the buffer's cache lines (Sattolo's shuffle: a
// single cycle, so every line is visited and no prefetcher can guess the next one).
void HostMemoryLatency(benchmark::State& state, size_t bytes) {
  constexpr size_t kWordsPerLine = 64 / sizeof(size_t);
  constexpr int64_t kLoadsPerIteration = 1024;
  const size_t lines = bytes / 64;
  std::vector<size_t> order(lines);
  std::iota(order.begin(), order.end(), size_t{0});
  std::mt19937_64 random(42);
  for (size_t i = lines - 1; i > 0; --i) {
    std::swap(order[i], order[std::uniform_int_distribution<size_t>(0, i - 1)(random)]);
  }
  std::vector<size_t> next(lines * kWordsPerLine);
  for (size_t i = 0; i < lines; ++i) {
    next[order[i] * kWordsPerLine] = order[(i + 1) % lines] * kWordsPerLine;
  }
  size_t at = 0;
  for (auto _ : state) {
    for (int64_t i = 0; i < kLoadsPerIteration; ++i) at = next[at];
    benchmark::DoNotOptimize(at);
  }
  state.SetItemsProcessed(state.iterations() * kLoadsPerIteration);
  state.counters["per_load"] = PerOp(kLoadsPerIteration);
}

void RegisterAll(Kind kind) {
  const std::string backend = KindName(kind);
  for (size_t size : {4 * kKiB, kMiB}) {
    benchmark::RegisterBenchmark(("CachedMallocFree/" + backend + "/" + SizeName(size)).c_str(),
                                 CachedMallocFree, kind, size);
  }
  for (size_t live : {size_t{1000}, size_t{10000}, size_t{100000}}) {
    // With --benchmark_repetitions, "min" joins mean/median/stddev: the 100k case is bound by
    // memory latency, which neighbours on a shared host inflate at random; the best repetition
    // is the allocator's own cost.
    benchmark::RegisterBenchmark(
        ("RandomAllocations/" + backend + "/" + std::to_string(live)).c_str(), RandomAllocations,
        kind, live)
        ->ComputeStatistics("min", [](const std::vector<double>& v) {
          return *std::min_element(v.begin(), v.end());
        });
  }
  benchmark::RegisterBenchmark(("MultiStreamRecordStream/" + backend + "/64KiB").c_str(),
                               MultiStreamRecordStream, kind, 64 * kKiB);
  benchmark::RegisterBenchmark(("TwoThreads/" + backend + "/4KiB").c_str(), TwoThreads, kind,
                               4 * kKiB)
      ->Threads(2)
      ->UseRealTime();
  for (const char* name : {"tiny_lm_no_offload", "tiny_lm_eager"}) {
    const std::string path = std::string(SPILLWAY_TRACE_DIR) + "/" + name + ".trace";
    benchmark::RegisterBenchmark(("TraceReplay/" + backend + "/" + name).c_str(), TraceReplay, kind,
                                 path)
        ->Unit(benchmark::kMicrosecond);
  }
}

// Cases that need the simulator's device count, or no allocator at all: registered once.
void RegisterOnce() {
  for (int devices : {1, 8}) {
    benchmark::RegisterBenchmark(
        ("FreeByPointer/sim/" + std::to_string(devices) + "devices").c_str(), FreeByPointer,
        devices);
  }
  // The sizes bracket the RandomAllocations metadata: about 0.1, 0.7 and 7 MiB touched at 1k,
  // 10k and 100k live allocations.
  for (size_t size : {kMiB, 4 * kMiB, 8 * kMiB, 12 * kMiB, 16 * kMiB}) {
    benchmark::RegisterBenchmark(("HostMemoryLatency/" + SizeName(size)).c_str(), HostMemoryLatency,
                                 size);
  }
}

}  // namespace
}  // namespace spillway

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  spillway::RegisterAll(spillway::Kind::kSim);
  spillway::RegisterOnce();
  // CUDA cases exist only where a device does: a CPU-only machine runs the simulated set alone.
  if (spillway::CudaAvailable()) spillway::RegisterAll(spillway::Kind::kCuda);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
