// Allocation traces recorded from the training-step benchmark (bench/traces/*.trace, written by
// train_step.py --trace): `a ID SIZE STREAM` allocates, `f ID` frees. Shared by the benchmarks
// that replay them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

namespace spillway {

struct TraceOp {
  bool alloc;
  size_t id;
  size_t size;
};

inline std::vector<TraceOp> LoadTrace(const std::string& path) {
  std::ifstream in(path);
  std::vector<TraceOp> ops;
  std::string kind;
  while (in >> kind) {
    TraceOp op{kind == "a", 0, 0};
    in >> op.id;
    if (op.alloc) {
      uint64_t stream = 0;
      in >> op.size >> stream;  // recorded stream ids are the recording process's: replay on one
    }
    ops.push_back(op);
  }
  return ops;
}

inline size_t MaxTraceId(const std::vector<TraceOp>& ops) {
  size_t max_id = 0;
  for (const TraceOp& op : ops) max_id = op.id > max_id ? op.id : max_id;
  return max_id;
}

}  // namespace spillway
