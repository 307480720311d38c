// Formatting helpers for raising errors from CPU sources (CUDA sources use core/cuda_check.hpp,
// because nvcc cannot evaluate fmt's compile-time format checks).
#pragma once

#include <epmoe/error.hpp>
#include <epmoe/tensor.hpp>
#include <fmt/format.h>

namespace epmoe {

/// Throws `code` with the message "epmoe: " + formatted text.
template <class... Args>
[[noreturn]] void raise(ErrorCode code, fmt::format_string<Args...> f, Args&&... args) {
  throw Error(code, "epmoe: " + fmt::format(f, std::forward<Args>(args)...));
}

}  // namespace epmoe

template <> struct fmt::formatter<epmoe::Shape> : fmt::formatter<std::string> {
  auto format(const epmoe::Shape& s, format_context& ctx) const {
    return fmt::formatter<std::string>::format(epmoe::to_string(s), ctx);
  }
};

/// Checks an argument condition; on failure throws invalid_argument naming the argument, what was
/// expected and what came. `expected` and `actual` are fmt-formattable and only evaluated on failure.
#define EPMOE_CHECK_ARG(cond, argument, expected, actual)                                      \
  do {                                                                                         \
    if (!(cond))                                                                               \
      ::epmoe::throw_invalid_argument((argument), fmt::format("{}", expected), fmt::format("{}", actual)); \
  } while (0)

namespace epmoe {

/// Checks the dtype of a topk_idx argument: expert ids are read as int64 or int32. Every call that takes topk_idx says
/// a wrong one in these words (throw_wrong_dtype's): "invalid argument 'topk_idx': expected dtype int64 or int32, got
/// int16[4, 2] cpu".
inline void check_topk_idx_dtype(const TensorView& topk_idx) {
  if (topk_idx.dtype != DType::int64 && topk_idx.dtype != DType::int32)
    throw_wrong_dtype("topk_idx", "int64 or int32", describe(topk_idx));
}

}  // namespace epmoe
