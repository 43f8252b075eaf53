#include "allocator/speculative.h"

namespace spillway {
namespace {

thread_local bool speculative = false;

}  // namespace

SpeculativeAllocations::SpeculativeAllocations() : enclosing_(speculative) { speculative = true; }

SpeculativeAllocations::~SpeculativeAllocations() { speculative = enclosing_; }

bool SpeculativeAllocations::Active() { return speculative; }

}  // namespace spillway
