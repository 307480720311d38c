// Timeouts for every wait between ranks (semantics §11: no hang).
#pragma once

#include <chrono>
#include <string>
#include <string_view>

namespace epmoe {

/// The longest timeout, in seconds (about 31 years): a longer one (infinity included, "no timeout") waits this long,
/// since the clocks count nanoseconds in 64 bits and a longer deadline would wrap around to one already past.
inline constexpr double kMaxTimeoutS = 1e9;
/// `seconds` as a wait can use it: at most kMaxTimeoutS (NaN too).
inline double clamp_timeout_s(double seconds) { return seconds <= kMaxTimeoutS ? seconds : kMaxTimeoutS; }

/// Default timeout of a wait between ranks, in seconds. The environment variable EPMOE_TIMEOUT_S (a positive
/// number; `inf` for the longest, kMaxTimeoutS) overrides it process-wide, and a value it cannot use is named once
/// on stderr; Group::set_timeout_s overrides it per group.
double default_timeout_s();

/// A point in time after which a wait gives up (`seconds` clamped to kMaxTimeoutS).
class Deadline {
 public:
  explicit Deadline(double seconds)
      : end_(std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                                     std::chrono::duration<double>(clamp_timeout_s(seconds)))) {}
  bool expired() const { return std::chrono::steady_clock::now() >= end_; }
  std::chrono::steady_clock::time_point time_point() const { return end_; }

 private:
  std::chrono::steady_clock::time_point end_;
};

/// Throws ErrorCode::timeout: "rank R timed out after S s waiting for peer P in phase PHASE (DETAIL)".
/// `peer` < 0 means "one or more peers" and `detail` then lists them.
[[noreturn]] void throw_timeout(int rank, int peer, std::string_view phase, double seconds,
                                std::string_view detail = {});

}  // namespace epmoe
