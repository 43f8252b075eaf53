// spillway_churn_count LIVE PAIRS: the RandomAllocations workload without timing, for counting
// under valgrind (scripts/complexity). Keeps LIVE allocations of 1 B .. 64 KiB on the simulated
// device, churns 3 x LIVE free+malloc pairs to reach a steady state, then PAIRS more. Running it
// for two values of PAIRS and subtracting isolates the cost of the steady-state pairs.
#include <cstddef>
#include <cstdio>
#include <exception>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "allocator/caching_allocator.h"
#include "allocator/config.h"
#include "allocator/sim_backend.h"
#include "bench/random_churn.h"

namespace {

constexpr size_t kMaxSize = size_t{64} << 10;

size_t ParseCount(const char* text, const char* what) {
  // stoull would take "-1" as a huge count: digits only.
  if (text[0] < '0' || text[0] > '9') throw std::invalid_argument(what);
  size_t used = 0;
  const unsigned long long value = std::stoull(text, &used);
  if (used != std::string(text).size()) throw std::invalid_argument(what);
  return static_cast<size_t>(value);
}

void Churn(spillway::CachingAllocator& alloc, spillway::StreamRef stream,
           spillway::bench::RandomChurn& churn, std::vector<void*>& ptrs, size_t pairs) {
  for (size_t i = 0; i < pairs; ++i) {
    void*& slot = churn.NextVictimSlot(ptrs);
    alloc.Free(slot, 0);
    slot = alloc.Malloc(churn.NextSize(), 0, stream);
  }
}

}  // namespace

int main(int argc, char** argv) {
  size_t live = 0;
  size_t pairs = 0;
  try {
    if (argc != 3) throw std::invalid_argument("arguments");
    live = ParseCount(argv[1], "LIVE");
    pairs = ParseCount(argv[2], "PAIRS");
    if (live == 0) throw std::invalid_argument("LIVE");
  } catch (const std::exception&) {
    std::fprintf(stderr,
                 "usage: spillway_churn_count LIVE PAIRS\n"
                 "  LIVE: live allocations, an integer >= 1; PAIRS: counted free+malloc pairs, an "
                 "integer >= 0\n");
    return 2;
  }
  try {
    spillway::CachingAllocator alloc(
        std::make_shared<spillway::SimBackend>(
            spillway::SimBackend::Options{.devices = 1, .capacity_bytes = size_t{64} << 30}),
        spillway::AllocatorConfig{});
    const spillway::StreamRef stream = alloc.backend().default_stream(0);
    spillway::bench::RandomChurn churn(live, kMaxSize);
    std::vector<void*> ptrs(live);
    for (void*& p : ptrs) p = alloc.Malloc(churn.NextSize(), 0, stream);
    Churn(alloc, stream, churn, ptrs, 3 * live);
    Churn(alloc, stream, churn, ptrs, pairs);
    for (void* p : ptrs) alloc.Free(p, 0);
    std::printf("live %zu pairs %zu segments %lld\n", live, pairs,
                static_cast<long long>(alloc.stats(0).segment.all().current));
  } catch (const std::exception& error) {
    // Out of (simulated) memory for a huge LIVE, for one.
    std::fprintf(stderr, "spillway_churn_count: %s\n", error.what());
    return 1;
  }
  return 0;
}
