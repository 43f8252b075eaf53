// BytePattern: a 4 KiB template unique to a tag, repeated over an allocation (byte i of the
// allocation is byte i % 4096 of the template). The allocator tests write one per allocation and
// check it later: a block handed out twice, or written by a copy that ran too late, shows as a
// mismatch.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "bench/random_churn.h"

namespace spillway::testing {

class BytePattern {
 public:
  static constexpr size_t kBytes = 4096;

  explicit BytePattern(uint64_t tag) {
    for (size_t i = 0; i < words_.size(); ++i) {
      words_[i] = bench::SplitMix64(tag * words_.size() + i);
    }
  }

  // Writes bytes [begin, end) of the pattern to base + begin.
  void Fill(void* base, size_t begin, size_t end) const {
    auto* out = static_cast<unsigned char*>(base);
    for (size_t off = begin; off < end;) {
      const size_t in_template = off % kBytes;
      const size_t len = std::min(kBytes - in_template, end - off);
      std::memcpy(out + off, bytes() + in_template, len);
      off += len;
    }
  }

  // Offset of the first byte in [begin, end) of base that differs from the pattern, or `end`.
  size_t FirstMismatch(const void* base, size_t begin, size_t end) const {
    const auto* in = static_cast<const unsigned char*>(base);
    for (size_t off = begin; off < end;) {
      const size_t in_template = off % kBytes;
      const size_t len = std::min(kBytes - in_template, end - off);
      if (std::memcmp(in + off, bytes() + in_template, len) != 0) {
        for (size_t i = 0; i < len; ++i) {
          if (in[off + i] != bytes()[in_template + i]) return off + i;
        }
      }
      off += len;
    }
    return end;
  }

 private:
  const unsigned char* bytes() const {
    return reinterpret_cast<const unsigned char*>(words_.data());
  }
  std::array<uint64_t, kBytes / sizeof(uint64_t)> words_;
};

}  // namespace spillway::testing
