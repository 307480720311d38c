// The packed record of an out-of-range id (CUDA sources only), written by the kernels of the layout and moe
// stages into the per-device words layout/ keeps (layout_detail::bad_id_flag) and read by cuda::check_invalid_ids.
//
// One 64-bit key per flag: t (31 bits) | k (9 bits) | value + 2^23 (24 bits, saturated). atomicMin keeps
// the smallest (t, k), the first offender in row-major order, as the CPU reports it; all ones = clear.
#pragma once

#include <cstdint>
#include <string>

namespace epmoe::cuda_util {

inline constexpr std::int64_t kBadValueBias = std::int64_t{1} << 23;

__device__ __forceinline__ void flag_bad_id(unsigned long long* flag, std::int64_t t, std::int64_t k,
                                            std::int64_t value) {
  const auto tt = static_cast<unsigned long long>(t < 0x7fffffff ? t : 0x7fffffff);
  const auto kk = static_cast<unsigned long long>(k < 511 ? k : 511);
  std::int64_t v = value < -kBadValueBias ? -kBadValueBias : value;
  v = v > kBadValueBias - 1 ? kBadValueBias - 1 : v;
  const auto vv = static_cast<unsigned long long>(v + kBadValueBias);
  atomicMin(flag, (tt << 33) | (kk << 24) | vv);
}

struct BadId {
  std::int64_t t, k, value;
  bool saturated_low, saturated_high;
  std::string value_text() const {
    if (saturated_low) return "a value <= " + std::to_string(value);
    if (saturated_high) return "a value >= " + std::to_string(value);
    return std::to_string(value);
  }
};

inline BadId decode_bad_id(unsigned long long key) {
  BadId b{};
  b.t = static_cast<std::int64_t>(key >> 33);
  b.k = static_cast<std::int64_t>((key >> 24) & 511u);
  b.value = static_cast<std::int64_t>(key & 0xffffffu) - kBadValueBias;
  b.saturated_low = b.value == -kBadValueBias;
  b.saturated_high = b.value == kBadValueBias - 1;
  return b;
}

}  // namespace epmoe::cuda_util
