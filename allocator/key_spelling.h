// Suggestions for mistyped configuration keys ("did you mean ...?").
#pragma once

#include <cstddef>
#include <optional>
#include <string_view>
#include <vector>

namespace spillway {

// Edit distance (insertions, deletions, substitutions) between two short keys.
size_t EditDistance(std::string_view a, std::string_view b);

// The key among `keys` that `key` most likely misspells: the nearest within two edits, never
// `key` itself, and none for keys under four characters (where two edits make anything out of
// anything).
std::optional<std::string_view> Misspelled(std::string_view key,
                                           const std::vector<std::string_view>& keys);

}  // namespace spillway
