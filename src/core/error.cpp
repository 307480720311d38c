#include <epmoe/error.hpp>

#include "core/check.hpp"

namespace epmoe {

std::string_view error_code_name(ErrorCode code) {
  switch (code) {
    case ErrorCode::invalid_argument: return "invalid_argument";
    case ErrorCode::rank_mismatch: return "rank_mismatch";
    case ErrorCode::timeout: return "timeout";
    case ErrorCode::stale_handle: return "stale_handle";
    case ErrorCode::unusable: return "unusable";
    case ErrorCode::out_of_memory: return "out_of_memory";
    case ErrorCode::unsupported: return "unsupported";
    case ErrorCode::internal: return "internal";
  }
  return "?";
}

void throw_invalid_argument(std::string_view argument, std::string_view expected, std::string_view actual) {
  throw Error(ErrorCode::invalid_argument,
              fmt::format("epmoe: invalid argument '{}': expected {}, got {}", argument, expected, actual));
}

std::string naming_argument(std::string_view message, std::string_view name, std::string_view as) {
  const std::string head = fmt::format("epmoe: invalid argument '{}", name);
  if (message.size() <= head.size() || message.substr(0, head.size()) != head) return std::string(message);
  const char next = message[head.size()];
  if (next != '\'' && next != ' ' && next != ':') return std::string(message);  // another argument ('x' of 'x2')
  return fmt::format("epmoe: invalid argument '{}{}", as, message.substr(head.size()));
}

void throw_wrong_dtype(std::string_view argument, std::string_view takes, std::string_view actual) {
  throw_invalid_argument(argument, fmt::format("dtype {}", takes), actual);
}

void throw_assertion(const char* condition, const char* file, int line) {
  throw Error(ErrorCode::internal, fmt::format("epmoe: internal error: {} failed at {}:{}", condition, file, line));
}

void throw_cuda_error(int error, const char* error_string, const char* expr, const char* file, int line) {
  throw Error(ErrorCode::internal,
              fmt::format("epmoe: CUDA call {} failed: {} (error {}) at {}:{}", expr, error_string, error, file, line));
}

}  // namespace epmoe
