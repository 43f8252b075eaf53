// Which sanitizer a test binary is built with, for tests that must do less (or skip a check)
// under one. One definition for every suite.
#pragma once

#if defined(__SANITIZE_THREAD__)
#define SPILLWAY_UNDER_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define SPILLWAY_UNDER_TSAN 1
#endif
#endif

namespace spillway::testing {

#if defined(SPILLWAY_UNDER_TSAN)
inline constexpr bool kThreadSanitizer = true;
#else
inline constexpr bool kThreadSanitizer = false;
#endif

}  // namespace spillway::testing
