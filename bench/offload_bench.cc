// Offload engine benchmarks on the simulated device:
//  - SpillReloadRoundTrip/N: spill then reload one N-MiB storage through the engine (pinned pool,
//    copy streams, events, allocator); bytes_per_second counts the storage once per round trip.
//  - MemcpyRoundTrip/N: the same bytes moved by two plain memcpy (device -> host -> device), the
//    ceiling the engine is compared against (goal: >= 0.8x).
//  - EngineBookkeeping: registering and dropping one saved view of a storage with policy off:
//    the engine's per-entry overhead (goal: <= 1 us).
//  - SaveWithGraphAlive/N: the same under eager while N saves of one graph are alive (spilled),
//    the new storage still held by the program; UnpackWithGraphAlive/N: one unpack (Acquire)
//    while N resident saves are alive. Both should stay flat in N: what runs at every save or
//    unpack must not visit the whole graph.
#include <benchmark/benchmark.h>

#include <cstring>
#include <memory>
#include <vector>

#include "allocator/caching_allocator.h"
#include "allocator/sim_backend.h"
#include "offload/allocator_storage.h"
#include "offload/engine.h"

namespace spillway {
namespace {

constexpr size_t kMiB = size_t{1} << 20;

struct Rig {
  explicit Rig(OffloadPolicy policy, size_t prefetch_bytes = 0)
      : backend(std::make_shared<SimBackend>(SimBackend::Options{1, size_t{4} << 30})),
        allocator(backend, AllocatorConfig{}),
        stream(backend->default_stream(0)) {
    OffloadConfig config;
    config.policy = policy;
    config.min_bytes = 0;
    config.prefetch_bytes = prefetch_bytes;
    engine = std::make_unique<OffloadEngine>(allocator, config);
  }
  std::shared_ptr<SimBackend> backend;
  CachingAllocator allocator;
  StreamRef stream;
  std::unique_ptr<OffloadEngine> engine;
};

void SpillReloadRoundTrip(benchmark::State& state) {
  const size_t bytes = static_cast<size_t>(state.range(0)) * kMiB;
  Rig rig(OffloadPolicy::kEager);
  auto storage =
      std::make_shared<AllocatorStorage>(rig.allocator, bytes, rig.stream, /*holders=*/0);
  std::memset(storage->data(), 7, bytes);
  for (auto _ : state) {
    // One training step's life of a saved activation: saved (and spilled at once: eager, nothing
    // else holds it), reloaded for backward, dropped.
    const KeeperId id = *rig.engine->AddKeeper(
        storage.get(), [&] { return storage; }, ViewInfo{}, rig.stream);
    rig.engine->Acquire(id, rig.stream);
    rig.engine->WaitResident(id);
    rig.engine->RemoveKeeper(id);
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(bytes));
  const OffloadStats stats = rig.engine->stats();
  if (stats.num_spills != static_cast<int64_t>(state.iterations()) ||
      stats.num_reloads != stats.num_spills) {
    state.SkipWithError("the engine did not spill and reload once per iteration");
  }
}

void MemcpyRoundTrip(benchmark::State& state) {
  const size_t bytes = static_cast<size_t>(state.range(0)) * kMiB;
  std::vector<char> device(bytes, 7);
  std::vector<char> host(bytes);
  for (auto _ : state) {
    std::memcpy(host.data(), device.data(), bytes);
    std::memcpy(device.data(), host.data(), bytes);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(bytes));
}

void EngineBookkeeping(benchmark::State& state) {
  Rig rig(OffloadPolicy::kOff);
  auto storage = std::make_shared<AllocatorStorage>(rig.allocator, 4096, rig.stream, /*holders=*/0);
  const OffloadEngine::StorageFactory factory = [&] { return storage; };
  ViewInfo view;
  view.sizes = {1024};
  view.strides = {1};
  view.element_size = 4;
  for (auto _ : state) {
    const KeeperId id = *rig.engine->AddKeeper(storage.get(), factory, view, rig.stream);
    rig.engine->RemoveKeeper(id);
  }
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations()));
}

// A graph of `n` saved 4 KiB storages, only its saved views holding them.
struct Graph {
  Graph(Rig& rig, size_t n) {
    for (size_t i = 0; i < n; ++i) {
      storages.push_back(
          std::make_shared<AllocatorStorage>(rig.allocator, 4096, rig.stream, /*holders=*/0));
      const auto& s = storages.back();
      ids.push_back(*rig.engine->AddKeeper(
          s.get(), [&] { return s; }, View(), rig.stream));
    }
    rig.engine->Synchronize();
  }
  static ViewInfo View() {
    ViewInfo view;
    view.sizes = {1024};
    view.strides = {1};
    view.element_size = 4;
    return view;
  }
  std::vector<std::shared_ptr<AllocatorStorage>> storages;
  std::vector<KeeperId> ids;
};

void SaveWithGraphAlive(benchmark::State& state) {
  Rig rig(OffloadPolicy::kEager);
  const Graph graph(rig, static_cast<size_t>(state.range(0)));
  auto storage = std::make_shared<AllocatorStorage>(rig.allocator, 4096, rig.stream, /*holders=*/1);
  const OffloadEngine::StorageFactory factory = [&] { return storage; };
  for (auto _ : state) {
    const KeeperId id = *rig.engine->AddKeeper(storage.get(), factory, Graph::View(), rig.stream);
    rig.engine->RemoveKeeper(id);
  }
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations()));
}

void UnpackWithGraphAlive(benchmark::State& state) {
  Rig rig(OffloadPolicy::kOff, /*prefetch_bytes=*/size_t{256} << 20);
  const Graph graph(rig, static_cast<size_t>(state.range(0)));
  for (auto _ : state) benchmark::DoNotOptimize(rig.engine->Acquire(graph.ids.back(), rig.stream));
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations()));
}

BENCHMARK(SpillReloadRoundTrip)->Arg(4)->Arg(64)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(MemcpyRoundTrip)->Arg(4)->Arg(64)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(EngineBookkeeping)->Unit(benchmark::kNanosecond);
BENCHMARK(SaveWithGraphAlive)->Arg(1000)->Arg(10000)->Arg(50000)->Unit(benchmark::kNanosecond);
BENCHMARK(UnpackWithGraphAlive)->Arg(1000)->Arg(10000)->Arg(100000)->Unit(benchmark::kNanosecond);

}  // namespace
}  // namespace spillway

BENCHMARK_MAIN();
