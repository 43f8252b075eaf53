// What the torch layer stores in the allocator's type-erased trace contexts (TraceContext).
// Every context it records points at a TorchTraceContext, so each reader (Spillway's snapshot,
// the c10 adapter's snapshot) can cast back safely whichever recorder made it.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "allocator/history.h"

namespace spillway::torch_layer {

struct PythonFrame {
  std::string filename;
  int line = 0;
  std::string name;
};

// Plain C++ data, no Python objects: a trace entry may be destroyed on any thread, with or
// without the GIL.
struct TorchTraceContext {
  // Innermost first; gathered by spillway.record_history(stacks="python").
  std::vector<PythonFrame> frames;
  // A c10::GatheredContext made by torch's own recorder (torch.cuda.memory._record_memory_history
  // through the c10 adapter); type-erased so this header needs no torch 2.x.
  std::shared_ptr<void> torch_context;
};

inline const TorchTraceContext* AsTorchContext(const TraceContext& context) {
  return static_cast<const TorchTraceContext*>(context.get());
}

}  // namespace spillway::torch_layer
