#include "capi/c_api.h"

#include <cstring>
#include <exception>
#include <string>

#include "allocator/config.h"
#include "allocator/errors.h"
#include "capi/process_allocator.h"

namespace {

thread_local std::string last_error;

spillway::CachingAllocator& Global() { return spillway::ProcessAllocator(); }

// Runs `fn`, turning any exception into `fallback` plus a thread-local message.
template <typename Fn, typename T>
T Guard(Fn fn, T fallback) {
  try {
    last_error.clear();
    return fn();
  } catch (const std::exception& e) {
    last_error = e.what();
  } catch (...) {
    last_error = "unknown error";
  }
  return fallback;
}

}  // namespace

extern "C" {

void* spillway_malloc(size_t size, int device, spillway_stream_t stream) {
  return Guard([&] { return Global().Malloc(size, device, stream); }, static_cast<void*>(nullptr));
}

void spillway_free(void* ptr, size_t /*size*/, int device, spillway_stream_t /*stream*/) {
  Guard(
      [&] {
        Global().Free(ptr, device);
        return 0;
      },
      0);
}

void spillway_record_stream(void* ptr, spillway_stream_t stream) {
  Guard(
      [&] {
        spillway::CachingAllocator& allocator = Global();
        const auto info = allocator.Lookup(ptr);
        if (!info) {
          throw spillway::InvalidArgumentError(
              "spillway_record_stream: pointer is not a live Spillway allocation");
        }
        allocator.RecordStream(ptr, allocator.backend().resolve_stream(info->device, stream));
        return 0;
      },
      0);
}

void spillway_empty_cache(void) {
  Guard(
      [] {
        Global().EmptyCache();
        return 0;
      },
      0);
}

void spillway_set_memory_fraction(double fraction, int device) {
  Guard(
      [&] {
        Global().SetMemoryFraction(fraction, device);
        return 0;
      },
      0);
}

int spillway_get_stat(int device, const char* name, long long* value) {
  return Guard(
      [&] {
        if (name == nullptr || value == nullptr) {
          throw spillway::InvalidArgumentError(
              "spillway_get_stat: name and value must not be NULL");
        }
        const auto stats = Global().FlatStats(device);
        const auto it = stats.find(name);
        if (it == stats.end()) {
          throw spillway::InvalidArgumentError(
              std::string("spillway_get_stat: unknown statistic '") + name + "'");
        }
        *value = it->second;
        return 0;
      },
      -1);
}

const char* spillway_last_error(void) { return last_error.c_str(); }

int spillway_split_config(const char* text, char* spillway_out, size_t spillway_capacity,
                          char* pytorch_out, size_t pytorch_capacity) {
  return Guard(
      [&] {
        if (text == nullptr || spillway_out == nullptr || pytorch_out == nullptr) {
          throw spillway::InvalidArgumentError("spillway_split_config: arguments must not be NULL");
        }
        absl::StatusOr<spillway::SplitConfig> split = spillway::SplitPytorchConfig(text);
        if (!split.ok())
          throw spillway::InvalidArgumentError(std::string(split.status().message()));
        if (split->spillway_only.size() >= spillway_capacity ||
            split->pytorch.size() >= pytorch_capacity) {
          return -2;
        }
        std::memcpy(spillway_out, split->spillway_only.c_str(), split->spillway_only.size() + 1);
        std::memcpy(pytorch_out, split->pytorch.c_str(), split->pytorch.size() + 1);
        return 0;
      },
      -1);
}

}  // extern "C"
