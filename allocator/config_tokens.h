// The lexical layer of the `key:value` parser (allocator/config.cc): a configuration string split
// into items, each into its key and value, with PyTorch's grammar (comma-separated items, a value
// in brackets may hold commas, one trailing comma accepted). What keys and values mean is
// config.cc's. Internal to the allocator library; no state, no locks.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace spillway::config_tokens {

// One `key:value` item; every view points into the string given to Tokenize.
struct Item {
  size_t position;  // 1-based, so messages match how a person counts items.
  std::string_view text;
  std::string_view key;
  std::string_view value;
};

// The items of `config`, or an InvalidArgumentError naming the malformed item, its position and
// what is wrong with it (empty, no ':', an empty key, brackets unbalanced or nested).
absl::StatusOr<std::vector<Item>> Tokenize(std::string_view config);

// Splits on commas that are not inside brackets, so a list value stays in one piece.
std::vector<std::string_view> SplitOutsideBrackets(std::string_view text);

// Local helpers rather than absl::StripAsciiWhitespace / StrJoin: the system Abseil has its own
// absl::string_view, which does not convert from std::string_view.
std::string_view Strip(std::string_view text);
std::string Join(const std::vector<std::string_view>& parts, std::string_view separator);

}  // namespace spillway::config_tokens
