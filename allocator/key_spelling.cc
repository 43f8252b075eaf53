#include "allocator/key_spelling.h"

#include <algorithm>

namespace spillway {

size_t EditDistance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

std::optional<std::string_view> Misspelled(std::string_view key,
                                           const std::vector<std::string_view>& keys) {
  if (key.size() < 4) return std::nullopt;
  std::optional<std::string_view> best;
  size_t best_distance = 3;
  for (std::string_view candidate : keys) {
    const size_t d = EditDistance(key, candidate);
    if (d > 0 && d < best_distance) {
      best = candidate;
      best_distance = d;
    }
  }
  return best;
}

}  // namespace spillway
