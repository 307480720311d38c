// Independent reference for NVFP4 (semantics §6, "NVFP4"), written from the format description in
// include/epmoe/nvfp4.hpp's header comment and never calling epmoe's conversions: e2m1 by a nearest-value search in
// double, e4m3 through quant_reference.hpp, float32 steps as double operations rounded to float (exact for one
// operation on floats), the swizzled layout from its 6-d (tile row, tile column, 32, 4, 4) decomposition.
#pragma once

#include <cstdint>
#include <vector>

namespace epmoe::test {

/// Value of an e2m1 code (low 4 bits): sign | 2 exponent bits | 1 mantissa bit.
double ref_e2m1_decode(std::uint8_t code);
/// Nearest e2m1 code to v, ties to the even code, magnitudes > 6 (and +-inf) saturating to +-6, zero and underflow
/// keep the sign, NaN -> 0x7.
std::uint8_t ref_e2m1_encode(double v);

/// Byte of scale (row, col) in a swizzled matrix with `col_tiles` tiles of 4 scales per 128 rows.
std::int64_t ref_swizzled_offset(std::int64_t row, std::int64_t col, std::int64_t col_tiles);

/// A tensor quantized as the format defines it, row-major.
struct RefNvfp4 {
  std::int64_t T = 0, H = 0;
  std::vector<std::uint8_t> q;        ///< [T, H / 2], channel 2i in the low nibble of byte i
  std::vector<std::uint8_t> scales;   ///< linear [T, H / 16] e4m3 codes
  std::vector<double> step;           ///< [T, H / 16]: float(float(sf) / gs), the dequantization factor
  std::vector<double> amax;           ///< [T, H / 16]: the block's max |x|
  std::vector<double> dequantized;    ///< [T, H]: e2m1 value * step, rounded to float
};
/// NVFP4 quantization of x [T, H] (values as floats) with global scale gs.
RefNvfp4 ref_quantize_nvfp4(const std::vector<float>& x, std::int64_t T, std::int64_t H, float gs);

/// The linear scales [T, H / 16] of `r` in the swizzled layout: [ceil(T / 128), (H / 64) * 512], padding 0.
std::vector<std::uint8_t> ref_swizzle(const std::vector<std::uint8_t>& linear, std::int64_t T, std::int64_t H);

/// A dense set of float bit patterns for an e2m1 sweep: every pattern within +-4096 ulps of each e2m1 value and
/// each midpoint (both signs), all patterns with stride 65536, subnormals, zeros, infinities and NaNs.
std::vector<std::uint32_t> e2m1_sweep_bits();

}  // namespace epmoe::test
