// The C ABI as PyTorch's CUDAPluggableAllocator uses it: dlopen the shared library and call the
// exported symbols, on the simulated device selected through SPILLWAY_ALLOC_CONF.
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <string>

namespace {

class CApiTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    // Read once, at the library's first allocation.
    setenv("SPILLWAY_ALLOC_CONF", "device:sim,capacity_mb:64", 1);
    handle_ = dlopen(SPILLWAY_C_API_LIB, RTLD_NOW | RTLD_LOCAL);
    ASSERT_NE(handle_, nullptr) << dlerror();
  }
  template <typename Fn>
  static Fn Get(const char* name) {
    void* symbol = dlsym(handle_, name);
    EXPECT_NE(symbol, nullptr) << name;
    return reinterpret_cast<Fn>(symbol);
  }
  static inline void* handle_ = nullptr;

  using MallocFn = void* (*)(size_t, int, void*);
  using FreeFn = void (*)(void*, size_t, int, void*);
  using StatFn = int (*)(int, const char*, long long*);
  using ErrorFn = const char* (*)();
  using FractionFn = void (*)(double, int);
  using EmptyFn = void (*)();
};

TEST_F(CApiTest, MallocFreeAndStatsThroughTheAbi) {
  auto malloc_fn = Get<MallocFn>("spillway_malloc");
  auto free_fn = Get<FreeFn>("spillway_free");
  auto stat_fn = Get<StatFn>("spillway_get_stat");
  void* p = malloc_fn(1 << 20, 0, nullptr);
  ASSERT_NE(p, nullptr);
  std::memset(p, 1, 1 << 20);
  long long value = -1;
  ASSERT_EQ(stat_fn(0, "allocated_bytes.all.current", &value), 0);
  EXPECT_EQ(value, 1 << 20);
  free_fn(p, 1 << 20, 0, nullptr);
  ASSERT_EQ(stat_fn(0, "allocated_bytes.all.current", &value), 0);
  EXPECT_EQ(value, 0);
  Get<EmptyFn>("spillway_empty_cache")();
  ASSERT_EQ(stat_fn(0, "reserved_bytes.all.current", &value), 0);
  EXPECT_EQ(value, 0);
}

// PyTorch's set_per_process_memory_fraction reaches a pluggable allocator here: 0 allows no new
// memory, as in PyTorch (it used to remove the limit), and 1 the whole device again.
TEST_F(CApiTest, AFractionOfZeroAllowsNoNewMemory) {
  auto malloc_fn = Get<MallocFn>("spillway_malloc");
  auto free_fn = Get<FreeFn>("spillway_free");
  auto fraction_fn = Get<FractionFn>("spillway_set_memory_fraction");
  Get<EmptyFn>("spillway_empty_cache")();
  fraction_fn(0.0, 0);
  EXPECT_EQ(malloc_fn(1 << 20, 0, nullptr), nullptr);
  EXPECT_NE(std::string(Get<ErrorFn>("spillway_last_error")()).find("out of memory"),
            std::string::npos);
  fraction_fn(1.0, 0);
  void* p = malloc_fn(1 << 20, 0, nullptr);
  EXPECT_NE(p, nullptr);
  free_fn(p, 1 << 20, 0, nullptr);
}

TEST_F(CApiTest, ErrorsBecomeNullAndAMessageNeverACrash) {
  auto malloc_fn = Get<MallocFn>("spillway_malloc");
  auto free_fn = Get<FreeFn>("spillway_free");
  auto error_fn = Get<ErrorFn>("spillway_last_error");
  EXPECT_EQ(malloc_fn(static_cast<size_t>(-8), 0, nullptr), nullptr);  // ssize_t -8 from PyTorch
  EXPECT_NE(std::string(error_fn()).find("larger than any device"), std::string::npos);
  EXPECT_EQ(malloc_fn(64, 5, nullptr), nullptr);
  EXPECT_NE(std::string(error_fn()).find("device index 5"), std::string::npos);
  EXPECT_EQ(malloc_fn(size_t{200} << 20, 0, nullptr), nullptr);  // capacity is 64 MiB
  EXPECT_NE(std::string(error_fn()).find("out of memory"), std::string::npos);
  int local = 0;
  free_fn(&local, 4, 0, nullptr);
  EXPECT_NE(std::string(error_fn()).find("not allocated by Spillway"), std::string::npos);
  Get<FractionFn>("spillway_set_memory_fraction")(2.0, 0);
  EXPECT_NE(std::string(error_fn()).find("out of range"), std::string::npos);
  long long value = 0;
  EXPECT_EQ(Get<StatFn>("spillway_get_stat")(0, "no_such_stat", &value), -1);
  void* p = malloc_fn(64, 0, nullptr);  // still serving
  EXPECT_NE(p, nullptr);
  EXPECT_STREQ(error_fn(), "");
  free_fn(p, 64, 0, nullptr);
}

}  // namespace
