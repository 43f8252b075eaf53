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
#include <utility>
#include <vector>

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

// A span that covers any allocation: the whole pattern.
inline constexpr size_t kWholePattern = SIZE_MAX / 4;

// The byte ranges of an n-byte allocation that carry its pattern: all of it, or its first and
// last `span` bytes when it is longer than twice that (under a sanitizer, patterns over hundreds
// of MiB take minutes).
inline std::vector<std::pair<size_t, size_t>> PatternRanges(size_t n, size_t span) {
  if (n <= 2 * span) return {{0, n}};
  return {{0, span}, {n - span, n}};
}

// Writes `tag`'s pattern over the ranges of an n-byte allocation.
inline void FillEnds(void* p, size_t n, uint64_t tag, size_t span) {
  const BytePattern pattern(tag);
  for (const auto& [begin, end] : PatternRanges(n, span)) pattern.Fill(p, begin, end);
}

// Offset of the first byte in those ranges that differs from `tag`'s pattern, or n.
inline size_t EndsMismatch(const void* p, size_t n, uint64_t tag, size_t span) {
  const BytePattern pattern(tag);
  for (const auto& [begin, end] : PatternRanges(n, span)) {
    if (const size_t bad = pattern.FirstMismatch(p, begin, end); bad != end) return bad;
  }
  return n;
}

}  // namespace spillway::testing
