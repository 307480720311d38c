#include "core/check.hpp"
#include <epmoe/error.hpp>
#include <epmoe/timeout.hpp>

#include <cstdio>
#include <cstdlib>

namespace epmoe {

double default_timeout_s() {
  static const double value = [] {
    constexpr double kDefault = 100.0;  // semantics §11
    if (const char* s = std::getenv("EPMOE_TIMEOUT_S")) {
      char* end = nullptr;
      const double v = std::strtod(s, &end);
      if (end != s && *end == '\0' && v > 0) return clamp_timeout_s(v);
      std::fprintf(stderr, "epmoe: EPMOE_TIMEOUT_S='%s' is not a positive number of seconds; using %g\n", s, kDefault);
    }
    return kDefault;
  }();
  return value;
}

void throw_timeout(int rank, int peer, std::string_view phase, double seconds, std::string_view detail) {
  const std::string who = peer >= 0 ? fmt::format("peer {}", peer) : std::string("peers");
  throw Error(ErrorCode::timeout,
              fmt::format("epmoe: rank {} timed out after {:g} s waiting for {} in phase '{}'{}{}", rank, seconds,
                          who, phase, detail.empty() ? "" : ": ", detail));
}

}  // namespace epmoe
