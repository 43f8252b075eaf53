#include "allocator/config_tokens.h"

#include <optional>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_format.h"

namespace spillway::config_tokens {

std::string_view Strip(std::string_view text) {
  while (!text.empty() && absl::ascii_isspace(text.front())) text.remove_prefix(1);
  while (!text.empty() && absl::ascii_isspace(text.back())) text.remove_suffix(1);
  return text;
}

std::string Join(const std::vector<std::string_view>& parts, std::string_view separator) {
  std::string joined;
  for (size_t i = 0; i < parts.size(); ++i) {
    if (i > 0) joined.append(separator);
    joined.append(parts[i]);
  }
  return joined;
}

// Splits on commas that are not inside brackets, so a list value stays in one piece. Whether the
// brackets are well formed is checked per item afterwards, where the message can name the item.
std::vector<std::string_view> SplitOutsideBrackets(std::string_view text) {
  std::vector<std::string_view> parts;
  int depth = 0;
  size_t start = 0;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (c == '[') {
      ++depth;
    } else if (c == ']' && depth > 0) {
      --depth;
    } else if (c == ',' && depth == 0) {
      parts.push_back(text.substr(start, i - start));
      start = i + 1;
    }
  }
  parts.push_back(text.substr(start));
  return parts;
}

namespace {

absl::Status MalformedItem(std::string_view config, size_t position, std::string_view item,
                           std::string_view problem) {
  return absl::InvalidArgumentError(absl::StrFormat(
      "malformed item %d '%s' in allocator config \"%s\": %s", position, item, config, problem));
}

// Returns what is wrong with the item's brackets, if anything. Lists are one level deep.
std::optional<std::string_view> BracketProblem(std::string_view item) {
  bool open = false;
  for (const char c : item) {
    if (c == '[') {
      if (open) return "nested '[' (a list cannot contain a list)";
      open = true;
    } else if (c == ']') {
      if (!open) return "unbalanced ']' without a matching '['";
      open = false;
    }
  }
  if (open) return "unbalanced '[' is never closed with ']'";
  return std::nullopt;
}

absl::StatusOr<Item> ParseItem(std::string_view config, size_t position, std::string_view raw) {
  const std::string_view text = Strip(raw);
  if (text.empty()) {
    return MalformedItem(config, position, text, "empty item (leading comma or two in a row)");
  }
  if (const auto problem = BracketProblem(text)) {
    return MalformedItem(config, position, text, *problem);
  }
  const size_t colon = text.find(':');
  if (colon == std::string_view::npos) {
    return MalformedItem(config, position, text, "expected key:value");
  }
  const std::string_view key = Strip(text.substr(0, colon));
  if (key.empty()) return MalformedItem(config, position, text, "empty key before ':'");
  return Item{position, text, key, Strip(text.substr(colon + 1))};
}

}  // namespace

absl::StatusOr<std::vector<Item>> Tokenize(std::string_view config) {
  std::vector<Item> items;
  if (Strip(config).empty()) return items;
  std::vector<std::string_view> parts = SplitOutsideBrackets(config);
  // PyTorch's parser accepts one trailing comma; strings built by appending items often have one.
  if (parts.size() > 1 && Strip(parts.back()).empty()) parts.pop_back();
  for (size_t i = 0; i < parts.size(); ++i) {
    absl::StatusOr<Item> item = ParseItem(config, i + 1, parts[i]);
    if (!item.ok()) return item.status();
    items.push_back(*item);
  }
  return items;
}

}  // namespace spillway::config_tokens
