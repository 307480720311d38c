// Timeouts for every wait between ranks (semantics §11: no hang).
#pragma once

#include <chrono>
#include <string>
#include <string_view>

namespace epmoe {

/// Default timeout of a wait between ranks, in seconds. The environment variable EPMOE_TIMEOUT_S
/// overrides it process-wide; Group::set_timeout_s overrides it per group.
double default_timeout_s();

/// A point in time after which a wait gives up.
class Deadline {
 public:
  explicit Deadline(double seconds)
      : end_(std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                                     std::chrono::duration<double>(seconds))) {}
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
