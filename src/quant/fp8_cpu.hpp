// Branch-free float -> fp8 e4m3 for the CPU quantization loops.
//
// Produces the same bits as epmoe::float_to_fp8_e4m3 (round to nearest even, saturate to +-448,
// NaN -> 0x7f) for every float input, but with selects instead of branches so the compiler can
// vectorise a row loop. tests/quant checks the two agree over a dense sweep of all floats.
#pragma once

#include <epmoe/dtype.hpp>

#include <cstdint>

namespace epmoe::quant_detail {

inline std::uint8_t fp8_e4m3_from_float_vec(float y) {
  // Signed 32-bit arithmetic only (magnitudes fit in 31 bits): SSE2 has signed compares but no
  // unsigned ones, so this form vectorises on the x86-64 baseline.
  const auto u = static_cast<std::int32_t>(float_bits(y));
  const std::int32_t sign = (u >> 24) & 0x80;
  const std::int32_t a = u & 0x7fffffff;
  // Normal results (|y| >= 2^-6): round the mantissa to 3 bits, nearest even, on the bits; a carry
  // moves into the exponent as it should. Then rebias the exponent from 127 to 7 (120 << 3).
  // Clamping to 512 first keeps the sum from overflowing; everything >= 464 saturates anyway.
  const std::int32_t c = a < 0x44000000 ? a : 0x44000000;
  const std::int32_t normal = ((c + 0x7ffff + ((c >> 20) & 1)) >> 20) - (120 << 3);
  // Subnormal results (|y| < 2^-6, step 2^-9): adding 2^14, whose ulp is 2^-9, makes the FPU round
  // |y| to the step; the integer difference of the bit patterns is the code (8 = smallest normal).
  const std::int32_t sub =
      static_cast<std::int32_t>(float_bits(bits_float(static_cast<std::uint32_t>(c)) + 16384.0f)) - 0x46800000;
  std::int32_t r = a < 0x3c800000 ? sub : normal;
  r = r < 0x7e ? r : 0x7e;  // saturate finite values and infinities to 448
  r |= sign;
  return static_cast<std::uint8_t>(a > 0x7f800000 ? 0x7f : r);
}

}  // namespace epmoe::quant_detail
